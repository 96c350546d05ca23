"""The planner: the cheapest deployment that serves a workload at a rate within an SLO.

Candidates (`space`: hardware x TP/PP/EP x weight and KV dtypes x engine knobs) pass a memory
check and an analytic screen (`screen`), then a capacity search with the simulator in
branch-and-bound order (`capacity`), run in process, on a process pool or on Ray (`executors`),
every simulation cached on disk (`cache`). The recommendation is verified at the target rate,
and each candidate gets one verdict in the ranked result (`report`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import logging
import math
from pathlib import Path

from pydantic import ValidationError

from engine.catalog import resolve_model
from engine.config import EngineKnobs, ModelConfig
from engine.errors import InputError, from_validation_error
from planner.costmodel.fitted import pessimistic
from planner.engines import get_engine
from planner.metrics import RunSummary
from planner.playback import Replay
from planner.search.cache import DEFAULT_CACHE_DIR, RunCache, simulate_cached
from planner.search.capacity import (
    Question, Searched, branch_and_bound, capacity_search, probe_requests, probe_workload,
)
from planner.search.executors import EXECUTORS, Executor, Runner, progress_bar
from planner.search.report import CandidatePlan, PDComparison, PlanResult, Verdict, assemble
from planner.search.screen import Shape, screen_candidate
from planner.search.space import (
    DEFAULT_KNOBS_GRID, DEFAULT_KV_DTYPES, check_size, checked_dtypes, enumerate_candidates, priced_profiles, variants,
)
from planner.specs import DEFAULT_ENGINE, SLO, Deployment, HardwareProfile, PlanSettings
from planner.workload import Workload, get_workload

__all__ = ["DEFAULT_CACHE_DIR", "EXECUTORS", "CandidatePlan", "Executor", "PDComparison", "PlanResult", "Verdict", "plan",
           "probe_requests", "probe_workload"]

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
    max_gpus_per_replica: int = 8,
    budget_usd_per_hour: float | None = None,
    weight_dtypes: Sequence[str] | None = None,
    kv_dtypes: Sequence[str] | None = None,
    knobs_grid: Sequence[EngineKnobs] | None = None,
    engine: str = DEFAULT_ENGINE,
    headroom: float = 0.1,
    pd_ratios: str = "auto",
    offload: str = "auto",
    confidence: float | None = None,
    requests_per_probe: int = 300,
    executor: Executor = "process",
    workers: int | None = None,
    cache_dir: str | Path | None = DEFAULT_CACHE_DIR,
    progress: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> PlanResult:
    """The cheapest deployment of `model` serving `workload` at `rate_per_s` within `slo`.

    `hardware` defaults to every catalog profile with a price; `engine` is the engine profile every
    candidate runs (its defaults fill the knobs the grid leaves unset). `pd_ratios` and `offload`
    add disaggregated and host-KV-tier versions of the candidates (PlanSettings says when). `cache_dir=None`
    disables the cache. `confidence` sizes against the pessimistic bound of the public fit's held-out errors
    (planner/costmodel/fitted.py: tighter latency targets, a higher rate). `on_progress(done, total)` is
    called as each candidate is settled (simulated or pruned), for front ends that draw their own
    progress bar (the dashboard). Every input and limit is checked before any work; bad input raises InputError naming the field as front ends
    declare it (rate, hw, max_gpus, requests_per_probe, ...), for them to map to a flag or widget.
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
    try:
        settings = PlanSettings(pd_ratios=pd_ratios, offload=offload)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    runner = Runner(capacity_search, executor, workers)
    cfg = resolve_model(model) if isinstance(model, str) else model
    slo = SLO.parse(slo) if isinstance(slo, str) else slo
    margin = pessimistic(slo, confidence) if confidence is not None else None
    base = get_workload(workload) if isinstance(workload, str) else workload
    weights = checked_dtypes("weight_dtypes", "weight_dtype", weight_dtypes) if weight_dtypes is not None else None
    kvs = checked_dtypes("kv_dtypes", "kv_dtype", kv_dtypes if kv_dtypes is not None else DEFAULT_KV_DTYPES)
    knobs = list(knobs_grid) if knobs_grid is not None else list(DEFAULT_KNOBS_GRID)
    profiles = priced_profiles(hardware)
    check_size(profiles, weights, kvs, knobs)
    runs = RunCache.open(cache_dir) if cache_dir is not None else None

    shape = Shape.of(Replay.of(probe_workload(base, rate_per_s, requests_per_probe), vocab_size=cfg.vocab_size), base)
    if shape.longest_tokens > cfg.max_position_embeddings:
        raise InputError("workload", base.name, f"its longest request ({shape.longest_tokens} tokens) exceeds "
                         f"{cfg.name}'s context of {cfg.max_position_embeddings}")
    q = Question(cfg, base, rate_per_s, headroom, slo, budget_usd_per_hour, requests_per_probe, runs, margin)
    candidates = enumerate_candidates(cfg, profiles, max_gpus_per_replica, weights, kvs, knobs, shape.longest_tokens, engine)
    reuse = base.shared_prefix is not None or base.conversation is not None
    candidates += variants(candidates, knobs[0], settings.ratios(slo, shape.mean_prompt_tokens),
                           settings.offload == "always" or (settings.offload == "auto" and reuse))
    found = [Searched(c, screen_candidate(c, cfg, shape, q.sizing_slo, q.sized_rate_per_s)) for c in candidates]
    live = sum(s.screen.capacity_bound_per_s is not None for s in found)
    with runner, progress_bar(progress, live, on_progress) as advance:
        found = branch_and_bound(q, found, runner, advance)
    for note in (n for s in found if s.outcome is not None for n in s.outcome.notes):
        _log.warning(note)

    def verify(dep: Deployment) -> RunSummary:
        hw = next(c.hw for c in candidates if c.hw.name == dep.hardware)
        w = probe_workload(base, rate_per_s, min(VERIFY_MAX_REQUESTS, probe_requests(requests_per_probe, dep) * dep.replicas))
        summary, notes = simulate_cached(cfg, hw, dep, w, slo, runs)
        for note in notes:
            _log.warning(note)
        return summary

    return assemble(q, shape, found, verify)
