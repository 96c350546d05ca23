"""A fleet of replicas over a day of traffic: requests stream in, a router spreads them over the
ready replicas, and an autoscaler (planner/sim/autoscaler.py) adds and drains replicas.

Each replica is the simulator's ordinary one (the engine's own scheduler and step loop on SimPy
time) with its own API server in front, as independent deployments have. Nothing is kept per
request or per step: each finished request is judged against the SLO's per-request limits and
counted in the hour it arrived, and the replicas billed (loading, ready or draining) are
integrated hour by hour, so memory follows the live requests and replicas, not the day.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import simpy

from engine.core import Request, RequestMetrics, SamplingParams
from planner.sim.autoscaler import Autoscaler, ScalingRule
from planner.sim.frontend import FrontEnd
from planner.sim.replica import Replica
from planner.sim.router import ROUTERS, RouterName
from planner.sim.simulator import ReplicaTemplate
from planner.specs import SLO
from planner.workload import WorkloadRequest

HOUR_S = 3600.0


@dataclass
class HourTally:
    """One hour of the day: its arrivals and how they were served, and the replicas it paid for."""

    arrived: int = 0
    good: int = 0  # finished within every per-request limit of the SLO
    replica_s: float = 0.0  # replica-seconds billed within the hour
    most_ready: int = 0  # most replicas ready at once
    ttft_s: float = 0.0  # sum over the hour's requests, for the mean
    e2e_s: float = 0.0


@dataclass(frozen=True)
class FleetRun:
    hours: list[HourTally]
    duration_s: float
    finished: int
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

    @property
    def num_ready(self) -> int:
        return len(self.ready)

    @property
    def num_active(self) -> int:
        return len(self.ready) + len(self._loading)

    def in_flight(self) -> int:
        return sum(m.in_flight for m in self.ready)

    def waiting(self) -> int:
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
        while n and self._loading:
            self._loading.pop().interrupt()
            self.billing.change(self.env.now, -1)
            n -= 1
        for _ in range(min(n, len(self.ready) - 1)):
            i = min(range(len(self.ready)), key=lambda i: self.ready[i].in_flight)
            member = self.ready.pop(i)
            self._replicas.pop(i)
            self.env.process(self._drain(member))
        self._changed()

    def _ready_one(self) -> None:
        replica, _ = self.template.replica(self.env, self._made, self.on_finished, None, None, self._decode_token, self.seed)
        self._made += 1
        self.ready.append(_Member(replica, FrontEnd(self.env, self._front_end_s, self._api_latency_s)))
        self._replicas.append(replica)
        tally = self.billing.hours[min(int(self.env.now // HOUR_S), len(self.billing.hours) - 1)]
        tally.most_ready = max(tally.most_ready, len(self.ready))
        self._changed()

    def _changed(self) -> None:
        if self.timeline and self.timeline[-1][0] == self.env.now:
            self.timeline.pop()  # several changes at one moment: the last one stands
        if not self.timeline or self.timeline[-1][1] != len(self.ready):
            self.timeline.append((self.env.now, len(self.ready)))

    def _load(self):  # noqa: ANN202 (a SimPy process generator)
        try:
            yield self.env.timeout(self.rule.load_s)
        except simpy.Interrupt:
            return  # cancelled while loading: it never accepted a request
        self._loading.remove(self.env.active_process)
        self._ready_one()

    def _drain(self, member: _Member):  # noqa: ANN202 (a SimPy process generator)
        """Serve everything accepted, then stop billing: a retired replica drops nothing."""
        while True:
            if member.in_api:
                yield self.env.timeout(max(member.api.free_at - self.env.now, 0.0))
            elif member.replica.scheduler.has_unfinished_requests():
                yield member.replica.idle()
            else:
                break
        self.billing.change(self.env.now, -1)


def simulate_fleet(template: ReplicaTemplate, requests: Iterable[WorkloadRequest], duration_s: float, rule: ScalingRule,
                   slo: SLO | None = None, *, router: RouterName = "round_robin", seed: int = 0,
                   on_finished: Callable[[Request], None] | None = None,
                   on_hour: Callable[[float], None] | None = None) -> FleetRun:
    """Play `requests` (in arrival order, all within duration_s) against a fleet that starts with
    rule.initial_replicas ready and scales by `rule` until duration_s; then every request in flight
    is served to the end. Billing covers 0..duration_s. `on_finished` sees each request as it
    finishes (tests); `on_hour(hours)` hears the simulated hours done (a progress bar)."""
    env = simpy.Environment()
    num_hours = max(1, -int(-duration_s // HOUR_S))
    hours = [HourTally() for _ in range(num_hours)]
    limits_ms = slo.request_limits_ms() if slo is not None else {}
    finished = 0

    def finish(request: Request) -> None:
        nonlocal finished
        finished += 1
        m = RequestMetrics.from_request(request)
        tally = hours[min(int(m.arrival_time // HOUR_S), num_hours - 1)]
        tally.ttft_s += m.ttft_s
        tally.e2e_s += m.e2e_s
        observed_ms = {"ttft": m.ttft_s * 1e3, "tpot": m.tpot_s * 1e3, "e2e": m.e2e_s * 1e3}
        tally.good += all(observed_ms[m] <= limit for m, limit in limits_ms.items())
        if on_finished is not None:
            on_finished(request)

    billing = _Billing(hours, duration_s)
    fleet = Fleet(env, template, rule, router, billing, finish, seed)
    fleet.start(rule.initial_replicas)
    autoscaler = Autoscaler(env, fleet, rule, duration_s)  # pinned (min = max): it decides, and never acts
    arrived = 0

    def hourly():  # noqa: ANN202 (a SimPy process generator)
        for h, tally in enumerate(hours):  # the replicas an hour starts with; more ready later are counted as they come
            tally.most_ready = max(tally.most_ready, fleet.num_ready)
            yield env.timeout(min(HOUR_S, duration_s - h * HOUR_S))
            if on_hour is not None:
                on_hour(min(h + 1, duration_s / HOUR_S))

    def arrivals():  # noqa: ANN202 (a SimPy process generator)
        nonlocal arrived
        for wr in requests:
            assert wr.arrival_s is not None
            if wr.arrival_s > env.now:
                yield env.timeout(wr.arrival_s - env.now)
            hours[min(int(env.now // HOUR_S), num_hours - 1)].arrived += 1
            arrived += 1
            fleet.submit(Request(wr.request_id, list(wr.prompt_token_ids),
                                 SamplingParams(max_tokens=wr.output_tokens, ignore_eos=True), arrival_time=env.now))

    env.process(arrivals())
    env.process(hourly())
    env.run()  # the arrivals and the autoscaler end with the day; replicas then serve what is left
    if finished != arrived:
        raise RuntimeError(f"{arrived - finished} of {arrived} accepted requests never finished: simulator bug")
    billing.change(env.now, 0)  # close the billing (at the day's end: nothing later is billed)
    return FleetRun(hours=hours, duration_s=duration_s, finished=finished,
                    actions=autoscaler.actions, ready=fleet.timeline, replica_s=billing.total_s)
