"""A fleet of replicas over a day of traffic: requests stream in, a router spreads them over the
ready replicas, and an autoscaler (planner/sim/autoscaler.py) adds and drains replicas.

Each replica is the simulator's ordinary one (the engine's own scheduler and step loop on SimPy
time) with its own API server in front, as independent deployments have. Nothing is kept per
request or per step: each finished request is judged against the SLO's per-request limits and
counted in the hour it arrived, and the replicas billed (loading, ready or draining) are
integrated hour by hour, so memory follows the live requests and replicas, not the day.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol

import numpy as np
import simpy
from simpy.events import ProcessGenerator

from engine.core import Request, RequestMetrics, SamplingParams
from planner.sim.autoscaler import Autoscaler, ScalingRule
from planner.sim.collector import fewer_collections
from planner.sim.events import play
from planner.sim.frontend import FrontEnd
from planner.sim.replica import Replica
from planner.sim.router import ROUTERS, RouterName
from planner.sim.simulator import ReplicaTemplate
from planner.specs import SLO
from planner.workload import CumulativeRate, WorkloadRequest

HOUR_S = 3600.0


@dataclass
class HourTally:
    """One hour of the day: its arrivals and how they were served, and the replicas it paid for."""

    # Counts are requests, each weighing what it stands for: 1 in a fleet simulated whole, the
    # fleet's replicas per stand-in in a sampled one (SampledFleet).
    arrived: float = 0.0
    good: float = 0.0  # finished within every per-request limit of the SLO
    replica_s: float = 0.0  # replica-seconds billed within the hour
    most_ready: int = 0  # most replicas ready at once
    ttft_s: float = 0.0  # sum over the hour's requests, for the mean
    e2e_s: float = 0.0


@dataclass(frozen=True)
class FleetRun:
    hours: list[HourTally]
    duration_s: float
    finished: int  # requests simulated (all of them, or the stand-ins')
    actions: list[tuple[float, int]]  # (time, replicas added (+) or retired (-)) by the autoscaler
    ready: list[tuple[float, int]]  # (time, replicas ready from then on), at every change
    replica_s: float  # billed over the day, all hours

    @property
    def replica_hours(self) -> float:
        return self.replica_s / HOUR_S


@dataclass(eq=False)
class _Member:
    """A ready (or draining) replica and its API server."""

    replica: Replica
    api: FrontEnd
    in_api: int = 0  # accepted, still in the API server

    @property
    def in_flight(self) -> int:
        return self.in_api + self.replica.outstanding_requests

    def deliver(self, request: Request) -> None:
        self.in_api -= 1
        self.replica.submit(request)


@dataclass
class _Billing:
    """Replicas billed, integrated over time into the hours, until end_s."""

    hours: list[HourTally]
    end_s: float
    count: int = 0
    since_s: float = 0.0
    total_s: float = 0.0

    def change(self, now: float, delta: int) -> None:
        t, end = self.since_s, min(now, self.end_s)
        while t < end:
            hour = int(t // HOUR_S)
            upto = min(end, (hour + 1) * HOUR_S)
            self.hours[hour].replica_s += self.count * (upto - t)
            t = upto
        self.total_s += self.count * max(0.0, end - self.since_s)
        self.count += delta
        self.since_s = max(now, self.since_s)


@dataclass
class Fleet:
    """Ready, loading and draining replicas of one template; the autoscaler's ScalableFleet."""

    env: simpy.Environment
    template: ReplicaTemplate
    rule: ScalingRule
    router: RouterName
    billing: _Billing
    on_finished: Callable[[Request], None]
    seed: int = 0
    ready: list[_Member] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, replicas ready from then on)
    _replicas: list[Replica] = field(default_factory=list)  # ready ones, as the router sees them
    _loading: list[simpy.Process] = field(default_factory=list)
    _made: int = 0  # replicas built so far: each one's index

    def __post_init__(self) -> None:
        self._route = ROUTERS[self.router]()
        self._decode_token = self.template.decode_token(bulk_decodes=True)
        self._front_end_s = self.template.cost_model.front_end_s
        self._api_latency_s = self.template.cost_model.params.api_latency_s
        self._api_release = self.template.cost_model.api_release

    @property
    def num_ready(self) -> int:
        return len(self.ready)

    @property
    def num_active(self) -> int:
        return len(self.ready) + len(self._loading)

    def in_flight(self) -> float:
        return sum(m.in_flight for m in self.ready)

    def waiting(self) -> float:
        return sum(m.replica.scheduler.num_waiting for m in self.ready)

    def submit(self, request: Request) -> None:
        member = self.ready[self._route.choose(request, self._replicas)]
        member.in_api += 1
        member.api.forward(request, member.deliver)

    def start(self, n: int) -> None:
        """n replicas ready at once: the fleet as the day finds it."""
        self.billing.change(self.env.now, n)
        for _ in range(n):
            self._ready_one()

    def provision(self, n: int) -> None:
        """n replicas billed from now, serving once loaded."""
        self.billing.change(self.env.now, n)
        for _ in range(n):
            self._loading.append(self.env.process(self._load()))

    def retire(self, n: int) -> None:
        """n fewer: loads in progress cancelled first (newest first), then the least busy ready
        replicas drained; never fewer than one ready."""
        for _ in range(min(self._cancel_loads(n), len(self.ready) - 1)):
            i = min(range(len(self.ready)), key=lambda i: self.ready[i].in_flight)
            member = self.ready.pop(i)
            self._replicas.pop(i)
            self.env.process(self._drain(member))
        self._changed()

    def _cancel_loads(self, n: int) -> int:
        """Cancel up to n loads in progress, newest first; how many of n are left to retire."""
        while n and self._loading:
            self._loading.pop().interrupt()
            self.billing.change(self.env.now, -1)
            n -= 1
        return n

    def _new_member(self) -> _Member:
        replica, _ = self.template.replica(self.env, self._made, self.on_finished, None, None, self._decode_token, self.seed)
        self._made += 1
        self.ready.append(_Member(replica, FrontEnd(self.env, self._front_end_s, self._api_latency_s, self._api_release)))
        self._replicas.append(replica)
        return self.ready[-1]

    def _ready_one(self) -> None:
        self._new_member()
        self._changed()

    def _changed(self) -> None:
        """Record the ready count, in the timeline and in the hour's most."""
        ready = self.num_ready
        tally = self.billing.hours[min(int(self.env.now // HOUR_S), len(self.billing.hours) - 1)]
        tally.most_ready = max(tally.most_ready, ready)
        if self.timeline and self.timeline[-1][0] == self.env.now:
            self.timeline.pop()  # several changes at one moment: the last one stands
        if not self.timeline or self.timeline[-1][1] != ready:
            self.timeline.append((self.env.now, ready))

    def _load(self) -> ProcessGenerator:
        try:
            yield self.env.timeout(self.rule.load_s)
        except simpy.Interrupt:
            return  # cancelled while loading: it never accepted a request
        loaded = self.env.active_process
        assert loaded is not None  # this generator runs as a SimPy process
        self._loading.remove(loaded)
        self._ready_one()

    def _drain(self, member: _Member) -> ProcessGenerator:
        """Serve everything accepted, then stop billing: a retired replica drops nothing."""
        while True:
            if member.in_api:
                # Its last request reaches the engine once handled (free_at) and then forwarded (latency_s);
                # waiting only for free_at would spin at this instant while one is on its way.
                yield self.env.timeout(max(member.api.free_at + member.api.latency_s - self.env.now, 0.0))
            elif member.replica.scheduler.has_unfinished_requests():
                yield member.replica.idle()
            else:
                break
        self.billing.change(self.env.now, -1)


class StandInTraffic(Protocol):
    """What a sampled fleet's stand-ins draw from (planner.traffic.TrafficDay)."""

    @property
    def seed(self) -> int: ...
    @property
    def duration_s(self) -> float: ...
    def cumulative_rate(self) -> CumulativeRate: ...
    def stand_in_requests(self, stand_in: int, vocab_size: int | None = None,
                          max_model_len: int | None = None) -> Iterator[WorkloadRequest]: ...
    def stand_in_gaps(self, stand_in: int) -> np.random.Generator: ...


def _sent(wr: WorkloadRequest, now: float) -> Request:
    """The request a client sends for `wr` at `now`: its prompt, its output length to the token."""
    return Request(wr.request_id, list(wr.prompt_token_ids),
                   SamplingParams(max_tokens=wr.output_tokens, ignore_eos=True), arrival_time=now)


@dataclass(eq=False)
class SampledFleet(Fleet):
    """A round-robin fleet of `num_ready` replicas simulated as a few stand-ins (`ready`).

    Behind round robin, replicas are exchangeable: with n ready, each takes every n-th arrival, so
    on the scale of expected arrivals (the cumulative rate) its own arrivals are a renewal process
    with Gamma(n, 1) gaps, and, a day's requests being independent of one another, what a replica
    serves does not depend on which replica it is. Each stand-in therefore draws its arrivals with
    Gamma(n) gaps at the fleet's n of the moment (the first one at a random place in the round) and
    its requests from a stream of its own, and serves them in its own API server and engine. Each
    of its requests stands for n / stand-ins of the fleet's in the hours' tallies; the in-flight
    and queued requests the autoscaler reads are the stand-ins' scaled by the same factor.

    For a fleet of fixed size this is exact in distribution, replica by replica. When the fleet
    scales, every stand-in takes its new share at once, where a real fleet's new replica starts
    empty (and its prefix cache cold) and a retired one drains: a replica retired is billed until
    the moment it is retired, not until it has drained (at most one request's E2E per retirement).
    """

    _: KW_ONLY
    traffic: StandInTraffic
    stand_ins: int
    vocab_size: int | None
    tallies: _Tallies
    _count: int = 0  # replicas ready, stand-ins included

    @property
    def num_ready(self) -> int:
        return self._count

    @property
    def num_active(self) -> int:
        return self._count + len(self._loading)

    def in_flight(self) -> float:  # an estimate: the stand-ins' scaled
        return super().in_flight() * self._scale()

    def waiting(self) -> float:
        return super().waiting() * self._scale()

    def start(self, n: int) -> None:
        self.billing.change(self.env.now, n)
        self._count = n
        rate = self.traffic.cumulative_rate()
        for j in range(self.stand_ins):
            member = self._new_member()
            requests = self.traffic.stand_in_requests(j, self.vocab_size, self.template.max_len)
            self._arrivals(member, requests, rate, self.traffic.stand_in_gaps(j))
        self._changed()

    def retire(self, n: int) -> None:
        """n fewer: loads in progress cancelled first, then ready replicas, at once; never fewer than one ready."""
        gone = min(self._cancel_loads(n), self._count - 1)
        self._count -= gone
        self.billing.change(self.env.now, -gone)
        self._changed()

    def _ready_one(self) -> None:
        self._count += 1
        self._changed()

    def _scale(self) -> float:
        return self._count / len(self.ready)

    def _arrivals(self, member: _Member, requests: Iterator[WorkloadRequest], rate: CumulativeRate,
                  gaps: np.random.Generator) -> None:
        """The stand-in's share of the stream: every n-th arrival (n the fleet's replicas per stand-in
        as it is at the previous arrival), starting at a random replica's place in the first round."""
        def times() -> Iterator[float]:
            expected = gaps.gamma(gaps.integers(1, self._count + 1))
            while (t := rate.time_of(expected)) < self.billing.end_s:
                yield t
                expected += gaps.gamma(self._count)

        def arrive(_t: float) -> None:
            request = _sent(next(requests), self.env.now)
            self.tallies.arrive(request, self._scale())
            member.in_api += 1
            member.api.forward(request, member.deliver)

        play(self.env, times(), lambda t: t, arrive)


@dataclass
class _Tallies:
    """The day's hours: each request counted in the hour it arrived, judged by the SLO's
    per-request limits when it finishes."""

    hours: list[HourTally]
    limits_ms: dict[str, float]
    on_finished: Callable[[Request], None] | None
    arrived: int = 0
    finished: int = 0
    _weights: dict[str, float] = field(default_factory=dict)  # requests in flight that weigh other than 1

    def hour(self, t_s: float) -> HourTally:
        return self.hours[min(int(t_s // HOUR_S), len(self.hours) - 1)]

    def arrive(self, request: Request, weight: float = 1.0) -> None:
        self.arrived += 1
        self.hour(request.arrival_time).arrived += weight
        if weight != 1.0:
            self._weights[request.request_id] = weight

    def finish(self, request: Request) -> None:
        self.finished += 1
        weight = self._weights.pop(request.request_id, 1.0)
        m = RequestMetrics.from_request(request)
        tally = self.hour(m.arrival_time)
        tally.ttft_s += weight * m.ttft_s
        tally.e2e_s += weight * m.e2e_s
        observed_ms = {"ttft": m.ttft_s * 1e3, "tpot": m.tpot_s * 1e3, "e2e": m.e2e_s * 1e3}
        tally.good += weight * all(observed_ms[m] <= limit for m, limit in self.limits_ms.items())
        if self.on_finished is not None:
            self.on_finished(request)


def simulate_fleet(template: ReplicaTemplate, requests: Iterable[WorkloadRequest], duration_s: float, rule: ScalingRule,
                   slo: SLO | None = None, *, router: RouterName = "round_robin", seed: int = 0,
                   on_finished: Callable[[Request], None] | None = None,
                   on_hour: Callable[[float], None] | None = None) -> FleetRun:
    """Play `requests` (in arrival order, all within duration_s) against a fleet that starts with
    rule.initial_replicas ready and scales by `rule` until duration_s; then every request in flight
    is served to the end. Billing covers 0..duration_s. `on_finished` sees each request as it
    finishes (tests); `on_hour(hours)` hears the simulated hours done (a progress bar)."""
    env = simpy.Environment()
    tallies, billing = _day(duration_s, slo, on_finished)
    fleet = Fleet(env, template, rule, router, billing, tallies.finish, seed)

    def arrival_s(wr: WorkloadRequest) -> float:
        assert wr.arrival_s is not None
        return wr.arrival_s

    def submit(wr: WorkloadRequest) -> None:
        request = _sent(wr, env.now)
        tallies.arrive(request)
        fleet.submit(request)

    play(env, requests, arrival_s, submit)
    return _play(env, fleet, rule, tallies, billing, on_hour)


def simulate_sampled_fleet(template: ReplicaTemplate, traffic: StandInTraffic, rule: ScalingRule, slo: SLO | None = None,
                           *, stand_ins: int, vocab_size: int | None = None,
                           on_finished: Callable[[Request], None] | None = None,
                           on_hour: Callable[[float], None] | None = None) -> FleetRun:
    """The day of `traffic` against a round-robin fleet scaled by `rule`, simulated as `stand_ins`
    replicas (SampledFleet): the hours' counts are estimates for the whole fleet, `finished` the
    stand-ins' requests. Its cost follows stand_ins, not the fleet."""
    env = simpy.Environment()
    tallies, billing = _day(traffic.duration_s, slo, on_finished)
    fleet = SampledFleet(env, template, rule, "round_robin", billing, tallies.finish, traffic.seed, traffic=traffic,
                         stand_ins=stand_ins, vocab_size=vocab_size, tallies=tallies)
    return _play(env, fleet, rule, tallies, billing, on_hour)


def _day(duration_s: float, slo: SLO | None, on_finished: Callable[[Request], None] | None) -> tuple[_Tallies, _Billing]:
    hours = [HourTally() for _ in range(max(1, -int(-duration_s // HOUR_S)))]
    return _Tallies(hours, slo.request_limits_ms() if slo is not None else {}, on_finished), _Billing(hours, duration_s)


@fewer_collections()
def _play(env: simpy.Environment, fleet: Fleet, rule: ScalingRule, tallies: _Tallies, billing: _Billing,
          on_hour: Callable[[float], None] | None) -> FleetRun:
    """Start the fleet, its autoscaler and the hours, and run until every request has been served."""
    duration_s, hours = billing.end_s, tallies.hours
    fleet.start(rule.initial_replicas)
    autoscaler = Autoscaler(env, fleet, rule, duration_s)  # pinned (min = max): it decides, and never acts

    def hourly() -> ProcessGenerator:
        for h, tally in enumerate(hours):  # the replicas an hour starts with; more ready later are counted as they come
            tally.most_ready = max(tally.most_ready, fleet.num_ready)
            yield env.timeout(min(HOUR_S, duration_s - h * HOUR_S))
            if on_hour is not None:
                on_hour(min(h + 1, duration_s / HOUR_S))

    env.process(hourly())
    env.run()  # the arrivals and the autoscaler end with the day; replicas then serve what is left
    if tallies.finished != tallies.arrived:
        raise RuntimeError(f"{tallies.arrived - tallies.finished} of {tallies.arrived} accepted requests never "
                           "finished: simulator bug")
    billing.change(env.now, 0)  # close the billing (at the day's end: nothing later is billed)
    return FleetRun(hours=hours, duration_s=duration_s, finished=tallies.finished,
                    actions=autoscaler.actions, ready=fleet.timeline, replica_s=billing.total_s)
