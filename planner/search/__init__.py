"""The planner: the cheapest deployment that serves a workload at a rate within an SLO.

Candidates (`space`: hardware x TP/PP/EP x weight and KV dtypes within a quality budget x engine
knobs) pass a memory check and an analytic screen (`screen`), then a capacity search with the
simulator in branch-and-bound order per hardware (`capacity`), run in process, on a process pool
or on Ray (`executors`), every simulation cached on disk (`cache`). The recommendation is verified
at the target rate and its capacity found; each candidate gets one verdict and each hardware its
answer in the result (`report`); a narrowed question nothing answers gets the widening that
would (`widen`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
import logging
import math
from pathlib import Path

from pydantic import ValidationError

from engine.catalog import resolve_model
from engine.config import EngineKnobs, ModelConfig
from engine.errors import InputError, from_validation_error
from planner.costmodel.fitted import FittedModel, RunKind, pessimistic
from planner.engines import get_engine
from planner.metrics import RunSummary
from planner.playback import Replay
from planner.search.cache import DEFAULT_CACHE_DIR, RunCache, simulate_cached
from planner.search.capacity import (
    Question, Searched, branch_and_bound, capacity_search, probe_requests, probe_workload,
)
from planner.search.executors import EXECUTORS, Executor, Runner, progress_bar
from planner.quality import DEFAULT_MAX_QUALITY_LOSS_PCT, NO_QUALITY_LIMIT_PCT, deployment_loss_pct, within_budget
from planner.search.report import (
    CandidatePlan, PDComparison, PlanResult, SearchSpace, Verdict, Widening, answer, assemble, verified,
)
from planner.search.screen import Shape, screen_candidate
from planner.search.ttft_bound import ProbeRequests
from planner.search.space import (
    DEFAULT_KNOBS_GRID, DEFAULT_KV_DTYPES, DEFAULT_MAX_GPUS_PER_REPLICA, Candidate, check_size, checked_dtypes,
    enumerate_candidates, knobs_label, priced_profiles, variants, weight_dtypes_for,
)
from planner.search.widen import narrower_than_default, what_to_widen, wider_space
from planner.search.slo_capacity import ReplicasCapacity, SLOCapacity, replicas_capacity
from planner.specs import DEFAULT_ENGINE, DEFAULT_REQUESTS_PER_PROBE, SLO, Deployment, HardwareProfile, PlanSettings
from planner.workload import Workload, get_workload

__all__ = ["DEFAULT_CACHE_DIR", "EXECUTORS", "CandidatePlan", "Executor", "PDComparison", "PlanResult", "SearchSpace",
           "Verdict", "Widening", "plan", "probe_requests", "probe_workload"]

# Each probe simulates this many requests (or 3 x max_num_seqs); P99 needs a tail, and memory and
# time grow with the count. A limit of the planner, not a setting.
MIN_REQUESTS_PER_PROBE, MAX_REQUESTS_PER_PROBE = 20, 20_000
MAX_GPUS_PER_REPLICA = 1024  # as Deployment allows per parallel dimension
VERIFY_MAX_REQUESTS = 3000
_log = logging.getLogger(__name__)  # bad cache entries: one line each on stderr unless a front end configures logging


def _check(field: str, value: object, ok: bool, allowed: str) -> None:
    if not ok:  # comparisons with NaN are false, so NaN is refused too
        raise InputError(field, value, allowed)


def plan(
    model: str | ModelConfig,
    workload: str | Workload,
    rate_per_s: float,
    slo: str | SLO,
    *,
    hardware: Sequence[str | HardwareProfile] | None = None,
    max_gpus_per_replica: int = DEFAULT_MAX_GPUS_PER_REPLICA,
    budget_usd_per_hour: float | None = None,
    weight_dtypes: Sequence[str] | None = None,
    kv_dtypes: Sequence[str] | None = None,
    knobs_grid: Sequence[EngineKnobs] | None = None,
    engine: str = DEFAULT_ENGINE,
    headroom: float = 0.1,
    pd_ratios: str = "auto",
    offload: str = "auto",
    confidence: float | None = None,
    max_quality_loss_pct: float = DEFAULT_MAX_QUALITY_LOSS_PCT,
    prefix_caching: bool | None = None,
    fit: FittedModel | None = None,
    widen: bool = False,
    requests_per_probe: int = DEFAULT_REQUESTS_PER_PROBE,
    executor: Executor = "process",
    workers: int | None = None,
    cache_dir: str | Path | None = DEFAULT_CACHE_DIR,
    progress: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
    stop_missed_probes: bool = True,
    ttft_queue_bound: bool = True,
    every_hardware: bool = True,
    on_answer: Callable[[CandidatePlan | None], None] | None = None,
) -> PlanResult:
    """The cheapest deployment of `model` serving `workload` at `rate_per_s` within `slo`.

    `hardware` defaults to every catalog profile with a price; `engine` is the engine profile every
    candidate runs (its defaults fill the knobs the grid leaves unset). `pd_ratios` and `offload`
    add disaggregated and host-KV-tier versions of the candidates (PlanSettings says when). `cache_dir=None`
    disables the cache. `confidence` sizes against the pessimistic bound of the public fit's held-out
    errors (planner/costmodel/fitted.py: tighter latency targets, a higher rate). Weight and KV formats
    whose published quality loss together exceeds `max_quality_loss_pct` (planner/quality.py; 100:
    no limit) are left out, and the result says which. When nothing is recommended and the space is
    narrower than the default one, `widen` searches the default space too and says what to widen
    (the front ends ask for it; it can cost a whole default search).
    `prefix_caching` switches the engine's prefix cache on or off in every candidate (None: the
    engine profile's default). `fit` (a team's own, from `serveplan calibrate --from-bench`) prices
    every candidate and gives the bands in place of the public GPU fit.
    `on_progress(done, total)` is called as each candidate is settled (simulated or
    pruned), for front ends that draw their own progress bar (the dashboard). Capacity probes stop
    once they have missed the SLO for certain (`stop_missed_probes`): the same answer and report in
    less time; False runs each to its end (a benchmark's peer). Under a TTFT target, candidates are
    also bounded by their prefill queue (`ttft_queue_bound`, planner/search/ttft_bound.py): the same
    answer with fewer candidates and probes simulated; False bounds them by the roofline alone.
    `every_hardware` sizes each hardware's own cheapest deployment; False does not simulate a
    candidate that cannot beat the cheapest answer on any hardware (the same recommendation, in a
    fraction of the simulations; a hardware that cannot win gets the least it would cost). With
    `every_hardware` and `on_answer`, the search finds the recommendation that faster way first,
    verifies it as the plan's own is verified (report.verified), and hands it to `on_answer` (None:
    nothing meets the SLO within the budget), then sizes every hardware.
    Every input and limit is checked before any work; bad input raises InputError naming the field
    as front ends declare it (rate, hw, max_gpus, requests_per_probe, ...), for them to map to a
    flag or widget.
    Ctrl-C raises KeyboardInterrupt after ending the workers; the cache stays whole.
    """
    _check("rate", rate_per_s, 0 < rate_per_s < math.inf, "must be > 0 requests/s and finite")
    get_engine(engine)  # an unknown name is refused before any work
    _check("max_gpus", max_gpus_per_replica, 1 <= max_gpus_per_replica <= MAX_GPUS_PER_REPLICA,
           f"must be between 1 and {MAX_GPUS_PER_REPLICA}")
    _check("budget_usd_per_hour", budget_usd_per_hour, budget_usd_per_hour is None or 0 < budget_usd_per_hour < math.inf,
           "must be > 0 and finite")
    _check("headroom", headroom, 0 <= headroom < math.inf, "must be >= 0 and finite")
    _check("requests_per_probe", requests_per_probe, MIN_REQUESTS_PER_PROBE <= requests_per_probe <= MAX_REQUESTS_PER_PROBE,
           f"must be between {MIN_REQUESTS_PER_PROBE} and {MAX_REQUESTS_PER_PROBE} (P99 needs a tail; the upper bound "
           "is a limit of the planner)")
    _check("confidence", confidence, confidence is None or 0.5 <= confidence <= 0.95, "must be between 0.5 and 0.95")
    _check("max_quality_loss_pct", max_quality_loss_pct, 0 <= max_quality_loss_pct <= NO_QUALITY_LIMIT_PCT,
           f"must be between 0 and {NO_QUALITY_LIMIT_PCT:g} (% of the 16-bit score; {NO_QUALITY_LIMIT_PCT:g}: no limit)")
    try:
        settings = PlanSettings(pd_ratios=pd_ratios, offload=offload)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    runner = Runner(capacity_search, executor, workers)
    cfg = resolve_model(model) if isinstance(model, str) else model
    slo = SLO.parse(slo) if isinstance(slo, str) else slo
    engine_profile = get_engine(engine)
    base = get_workload(workload) if isinstance(workload, str) else workload
    weights = checked_dtypes("weight_dtypes", "weight_dtype", weight_dtypes) if weight_dtypes is not None else None
    kvs = checked_dtypes("kv_dtypes", "kv_dtype", kv_dtypes if kv_dtypes is not None else DEFAULT_KV_DTYPES)
    knobs = list(knobs_grid) if knobs_grid is not None else list(DEFAULT_KNOBS_GRID)
    profiles = priced_profiles(hardware)
    check_size(profiles, weights, kvs, knobs)
    pairs = {(w, k) for hw in profiles for w in weight_dtypes_for(hw, weights) for k in kvs}
    kept = {pair for pair in pairs if within_budget(*pair, max_quality_loss_pct)}
    if not kept:
        losses = ", ".join(f"{w}/{k} {_loss_text(w, k)}" for w, k in sorted(pairs))
        raise InputError("max_quality_loss_pct", max_quality_loss_pct,
                         f"leaves no weight/KV format to try (their quality loss: {losses}); raise it or add formats")
    runs = RunCache.open(cache_dir) if cache_dir is not None else None

    # A request beyond the model's context is refused before its token ids are drawn.
    probe = Replay.of(probe_workload(base, rate_per_s, requests_per_probe), vocab_size=cfg.vocab_size,
                      max_model_len=cfg.max_position_embeddings)
    shape = Shape.of(probe, base)
    margin = None
    if confidence is not None:
        # Every probe and verification offers Poisson arrivals at a rate (capacity.py): online
        # requests, of the probes' lengths.
        margin = pessimistic(slo, confidence, RunKind.of(engine_profile, "online", probe.lengths, cfg), fit)
    q = Question(cfg, base, rate_per_s, headroom, slo, budget_usd_per_hour, requests_per_probe, runs, margin, fit,
                 stop_missed_probes, every_hardware)
    tried = knobs if prefix_caching is None else [k.model_copy(update={"enable_prefix_caching": prefix_caching})
                                                  for k in knobs]
    candidates = enumerate_candidates(cfg, profiles, max_gpus_per_replica, weights, kvs, tried, shape.longest_tokens, engine,
                                      lambda w, k: (w, k) in kept)
    reuse = base.shared_prefix is not None or base.conversation is not None
    candidates += variants(candidates, tried[0], settings.ratios(slo, shape.mean_prompt_tokens),
                           settings.offload == "always" or (settings.offload == "auto" and reuse))
    probes: dict[int, ProbeRequests | None] = {}  # by requests per probe: a candidate's depends on its max_num_seqs

    def probe_of(c: Candidate) -> ProbeRequests | None:
        if not ttft_queue_bound:
            return None
        n = probe_requests(requests_per_probe, c.dep, base)
        if n not in probes:
            unit_rate = Replay.of(probe_workload(base, 1.0, n), cfg.vocab_size, cfg.max_position_embeddings)
            probes[n] = ProbeRequests.of(unit_rate, base)
        return probes[n]

    found = [Searched(c, screen_candidate(c, cfg, shape, q.sizing_slo, q.sized_rate_per_s, fit, probe_of(c)))
             for c in candidates]
    live = sum(s.screen.capacity_bound_per_s is not None for s in found)

    verifications: dict[str, RunSummary] = {}  # the answer first and the plan verify the same deployments

    def verify(dep: Deployment) -> RunSummary:
        key = dep.model_dump_json()
        if key not in verifications:
            hw = next(c.hw for c in candidates if c.hw.name == dep.hardware)
            n = min(VERIFY_MAX_REQUESTS, probe_requests(requests_per_probe, dep, base) * dep.replicas)
            summary, notes = simulate_cached(cfg, hw, dep, probe_workload(base, rate_per_s, n), slo, runs, fit)
            for note in notes:
                _log.warning(note)
            verifications[key] = summary
        return verifications[key]

    def capacity_task(p: CandidatePlan) -> ReplicasCapacity:
        assert p.sustained_rate_per_s is not None and p.replicas is not None
        hw = next(c.hw for c in candidates if c.hw.name == p.deployment.hardware)
        return ReplicasCapacity(cfg, hw, p.deployment.model_copy(update={"replicas": 1}), p.replicas, base, slo,
                                p.sustained_rate_per_s, requests_per_probe, runs, fit, stop_missed_probes)

    space = SearchSpace(
        hardware=[hw.name for hw in profiles], max_gpus_per_replica=max_gpus_per_replica,
        weight_dtypes=sorted({w for w, _ in kept}), kv_dtypes=sorted({k for _, k in kept}),
        knobs=[knobs_label(k) for k in tried], engine=engine, max_quality_loss_pct=max_quality_loss_pct,
        excluded_for_quality=[f"{w} weights with {k} KV cache: {_loss_text(w, k)}" for w, k in sorted(pairs - kept)],
        narrower_than_default=narrower_than_default(profiles, max_gpus_per_replica, weights, kvs, knobs), outcomes={})
    with runner, progress_bar(progress, live, on_progress) as advance:
        first: list[Searched] = []
        if every_hardware and on_answer is not None:
            first = branch_and_bound(replace(q, every_hardware=False), found, runner, lambda: None)
            on_answer(answer(q, shape, verified(q, first, verify)[0]))
        found = branch_and_bound(q, found, runner, advance, first)
        for note in (n for s in found if s.outcome is not None for n in s.outcome.notes):
            _log.warning(note)
        # The recommendation's capacity search runs where the search ran, beside its verification here.
        rec = answer(q, shape, found)
        capacity_of = runner.later(replicas_capacity, capacity_task(rec)) if rec is not None else None

        def capacity(p: CandidatePlan) -> SLOCapacity:
            # The recommendation the search ended on, unless its verification added replicas or moved
            # on to another candidate (report.verified): that one's capacity is searched now.
            return capacity_of() if capacity_of is not None and p == rec else replicas_capacity(capacity_task(p))

        result = assemble(q, shape, found, space, verify, capacity)
    if result.recommended is None and widen and space.narrower_than_default:
        wider = plan(cfg, base, rate_per_s, slo, **wider_space(profiles, max_gpus_per_replica, weights, kvs, knobs),
                     budget_usd_per_hour=budget_usd_per_hour, engine=engine, headroom=headroom, confidence=confidence,
                     max_quality_loss_pct=max_quality_loss_pct, prefix_caching=prefix_caching, fit=fit, widen=False,
                     requests_per_probe=requests_per_probe, executor=executor, workers=workers, cache_dir=cache_dir,
                     progress=progress, on_progress=on_progress, stop_missed_probes=stop_missed_probes,
                     ttft_queue_bound=ttft_queue_bound, every_hardware=every_hardware)
        result = result.model_copy(update={"widening": what_to_widen(wider, space)})
    return result


def _loss_text(weight_dtype: str, kv_dtype: str) -> str:
    loss = deployment_loss_pct(weight_dtype, kv_dtype)
    return "no published figure" if loss is None else f"{loss:.2f} %"
