"""Capacity search with the simulator: for each candidate the smallest replica count k such that
one replica meets the SLO at its share rate x (1 + headroom) / k of the Poisson arrivals, by
bisection over the only rates that change the answer; candidates in branch-and-bound order."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
import math

from engine.config import ModelConfig
from engine.errors import InputError
from planner.costmodel.fitted import FittedModel, Pessimism
from planner.metrics import RunSummary
from planner.search.cache import RunCache, simulate_cached
from planner.search.executors import Runner
from planner.search.screen import MAX_REPLICAS, Screen
from planner.search.space import Candidate
from planner.specs import SLO, Deployment, HardwareProfile
from planner.workload import PoissonArrivals, Workload

# Candidates per scheduling round. Fixed, not the worker count, so that which candidates get
# pruned (and hence the result) is the same on a laptop and on a cluster.
BATCH_SIZE = 4
# A candidate that still misses the SLO at 1/LIGHT_LOAD_FACTOR of its first probe's load is
# latency-bound: more replicas will not help, and slower probes would only cost time.
LIGHT_LOAD_FACTOR = 8
# A probe must last long enough for an overloaded replica to show it: with room for
# max_num_seqs requests, a short burst is simply admitted and the backlog that would build up
# in steady state never forms (70B on 2 x MI300X passes 22 req/s with 300 requests and fails
# it with 1,200; its steady capacity is ~18). So each probe has at least this many times
# max_num_seqs requests.
PROBE_SEQS_MULTIPLE = 3


def probe_requests(requests_per_probe: int, dep: Deployment, workload: Workload) -> int:
    """Requests in one probe of `dep`: enough to fill its batch several times over. A conversation's
    turns run one after another, so the batch fills with conversations: a multi-turn probe holds
    PROBE_SEQS_MULTIPLE x max_num_seqs of them (with fewer, any rate only replays the same few
    conversations at once, and no backlog forms however fast they start)."""
    max_num_seqs = dep.knobs.choices.max_num_seqs  # the search's deployments are resolved (space.py)
    return max(requests_per_probe, math.ceil(PROBE_SEQS_MULTIPLE * max_num_seqs * workload.requests_per_arrival))


def probe_workload(workload: Workload, rate_per_s: float, num_requests: int) -> Workload:
    """The workload with Poisson arrivals at `rate_per_s`; its seed keeps every draw the same."""
    return Workload.model_validate(
        {**workload.model_dump(), "arrival": PoissonArrivals(rate_per_s=rate_per_s).model_dump(), "num_requests": num_requests}
    )


@dataclass(frozen=True)
class Question:
    """The plan's question, checked: what every capacity search of it shares."""

    model: ModelConfig
    workload: Workload
    rate_per_s: float
    headroom: float
    slo: SLO
    budget_usd_per_hour: float | None
    requests_per_probe: int
    runs: RunCache | None
    pessimism: Pessimism | None = None  # sizing at a confidence
    fit: FittedModel | None = None  # None: the public GPU fit, if made
    # Probes stop once they have missed the SLO for certain (same verdicts; the probe a never-passing
    # search reports runs whole). False runs every probe to its end.
    stop_once_missed: bool = True
    # Size every hardware's own cheapest candidate (each hardware's answer simulated); False prunes
    # against the cheapest answer on any hardware as well: the same recommendation, far fewer simulations.
    every_hardware: bool = True

    @property
    def sizing_slo(self) -> SLO:
        """The targets candidates are probed against: the SLO, tightened when sizing at a confidence."""
        return self.pessimism.slo if self.pessimism else self.slo

    @property
    def sized_rate_per_s(self) -> float:
        return self.rate_per_s * (1 + self.headroom) * (self.pessimism.rate_factor if self.pessimism else 1.0)


@dataclass(frozen=True)
class Task:
    question: Question
    hw: HardwareProfile
    dep: Deployment
    min_replicas: int  # fewer cannot suffice: the analytic bound
    max_replicas: int  # more cannot win (cost) or would not help (light load)
    cost_capped: bool  # max_replicas comes from the best cost so far


@dataclass(frozen=True)
class Probe:
    replicas: int
    rate_per_s: float
    passed: bool
    summary: RunSummary


@dataclass(frozen=True)
class Outcome:
    probes: tuple[Probe, ...]
    replicas: int | None  # smallest count whose share one replica served within the SLO
    cost_capped: bool  # the search stopped where more replicas could no longer win on cost
    max_replicas: int  # the most replicas it could probe (Task.max_replicas)
    error: str | None = None  # a probe could not run (e.g. a request larger than the KV cache)
    notes: tuple[str, ...] = ()  # bad cache entries met

    @property
    def sized(self) -> Probe | None:
        """The passing probe at the replica count chosen."""
        return next((p for p in self.probes if p.passed and p.replicas == self.replicas), None)

    @property
    def lightest_miss(self) -> Probe | None:
        return max((p for p in self.probes if not p.passed), key=lambda p: p.replicas, default=None)


def capacity_search(task: Task) -> Outcome:
    """Bisection over the per-replica rate sized_rate / k for the smallest k that passes."""
    q = task.question
    probes: list[Probe] = []
    notes: list[str] = []

    def probe(k: int) -> bool:
        rate = q.sized_rate_per_s / k
        w = probe_workload(q.workload, rate, probe_requests(q.requests_per_probe, task.dep, q.workload))
        # A search that never passes reports its probe at max_replicas, the lightest miss: that one runs whole.
        summary, bad = simulate_cached(q.model, task.hw, task.dep, w, q.sizing_slo, q.runs, q.fit,
                                       stop_once_missed=q.stop_once_missed and k < task.max_replicas)
        notes.extend(bad)
        probes.append(Probe(k, rate, bool(summary.goodput.slo_met), summary))
        return probes[-1].passed

    failed, passed, k, error = None, None, task.min_replicas, None
    try:
        while passed is None and (failed is None or failed < task.max_replicas):
            if probe(k):
                passed = k
            else:
                failed, k = k, min(2 * k, task.max_replicas)
        while passed is not None and failed is not None and passed - failed > 1:
            mid = (failed + passed) // 2
            if probe(mid):
                passed = mid
            else:
                failed = mid
    except InputError as exc:  # e.g. a request that needs more KV blocks than a replica holds
        passed, error = None, str(exc)
    return Outcome(tuple(probes), passed, task.cost_capped, task.max_replicas, error, tuple(notes))


@dataclass(frozen=True)
class Searched:
    """A candidate and what the search found: its screen, then its capacity search if it ran one."""

    candidate: Candidate
    screen: Screen
    outcome: Outcome | None = None  # None: out at the screen, or its bound could not beat the best
    # Replicas added beyond the count its probes sized, because the whole deployment missed the SLO
    # when verified at the target rate (planner/search/report.py, `verified`).
    added_replicas: int = 0

    @property
    def replicas(self) -> int | None:
        """Replicas it is planned with: the count its probes sized, plus any added when verified."""
        out = self.outcome
        return None if out is None or out.replicas is None else out.replicas + self.added_replicas

    @property
    def cost_bound_usd_per_hour(self) -> float | None:
        """The least it can cost from what is known; None when no replica count serves (memory, SLO)."""
        c, out = self.candidate, self.outcome
        if self.screen.capacity_bound_per_s is None or (out is not None and out.error is not None):
            return None
        if out is None:
            return c.usd_per_hour(self.screen.min_replicas)
        if self.replicas is not None:
            return c.usd_per_hour(self.replicas)
        miss = out.lightest_miss
        return c.usd_per_hour(miss.replicas + 1) if out.cost_capped and miss is not None else None


def _task(q: Question, s: Searched, own_usd: float | None, overall_usd: float | None) -> Task:
    """The capacity search of candidate `s`, its replica counts capped where they can no longer matter:
    strictly cheaper than the best on its own hardware (`own_usd`), and no dearer than the best on any
    (`overall_usd`, None when every hardware is sized), which a tie on cost can still beat on P99 TTFT."""
    c, k = s.candidate, s.screen.min_replicas
    light_cap = k * LIGHT_LOAD_FACTOR
    per_replica = c.usd_per_hour(1)
    cost_cap = min(MAX_REPLICAS if own_usd is None else math.ceil(own_usd / per_replica - 1e-9) - 1,
                   MAX_REPLICAS if overall_usd is None else math.floor(overall_usd / per_replica + 1e-9))
    return Task(q, c.hw, c.dep, k, max(k, min(light_cap, cost_cap, MAX_REPLICAS)), cost_cap < light_cap)


def branch_and_bound(q: Question, found: list[Searched], runner: Runner, advance: Callable[[], None],
                     earlier: Sequence[Searched] = ()) -> list[Searched]:
    """`found` with an outcome for each candidate simulated. Cheapest lower bound first; a candidate
    is not simulated when its bound is not below the best cost so far on its own hardware (it cannot
    change that hardware's answer) or, unless `q.every_hardware`, is above the best cost so far on
    any hardware (it cannot change the recommendation; an equal bound on another hardware can still
    tie and win on P99 TTFT). The best costs are updated between batches only, so the result does
    not depend on the workers or their speed. `earlier` is `found` as searched before with the other
    `q.every_hardware`: a candidate whose search would probe the same replica counts takes its
    earlier outcome instead of simulating again, so the result is the same as without it."""
    found = list(found)

    def order(i: int) -> tuple[float, float, str]:
        # Among equal bounds, the cheapest estimate (the bound without slack) first, so that a
        # tight best cost is found early and prunes the rest.
        c, capacity = found[i].candidate, found[i].screen.capacity_bound_per_s
        assert capacity is not None
        return bound(i), c.usd_per_hour(math.ceil(q.sized_rate_per_s / capacity)), c.label

    def bound(i: int) -> float:
        return found[i].candidate.usd_per_hour(found[i].screen.min_replicas)

    def hardware(i: int) -> str:
        return found[i].candidate.hw.name

    def overall() -> float | None:
        return None if q.every_hardware else min(best.values(), default=None)

    def pruned(i: int) -> bool:
        own, lowest = best.get(hardware(i)), overall()
        return (own is not None and bound(i) >= own) or (lowest is not None and bound(i) > lowest)

    def searched_before(i: int, task: Task) -> Outcome | None:
        before = earlier[i].outcome if earlier else None
        same = before is not None and (before.max_replicas, before.cost_capped) == (task.max_replicas, task.cost_capped)
        return before if same else None

    pending = deque(sorted((i for i, s in enumerate(found) if s.screen.capacity_bound_per_s is not None), key=order))
    best: dict[str, float] = {}  # hardware -> its cheapest feasible cost so far
    while pending:
        batch: list[int] = []
        while pending and len(batch) < BATCH_SIZE:
            i = pending.popleft()
            if pruned(i):
                advance()
            else:
                batch.append(i)
        tasks = {i: _task(q, found[i], best.get(hardware(i)), overall()) for i in batch}
        outcomes = {i: o for i in batch if (o := searched_before(i, tasks[i])) is not None}
        for _ in outcomes:
            advance()
        todo = [i for i in batch if i not in outcomes]
        outcomes |= zip(todo, runner.run([tasks[i] for i in todo], advance), strict=True)
        for i in batch:
            found[i] = replace(found[i], outcome=outcomes[i])
            if (replicas := outcomes[i].replicas) is not None:
                cost = found[i].candidate.usd_per_hour(replicas)
                best[hardware(i)] = min(cost, best.get(hardware(i), cost))
    return found
