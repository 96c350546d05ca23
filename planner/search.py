"""The planner: the cheapest deployment that serves a workload at a rate within an SLO.

Search, in four passes over candidate deployments (hardware x GPUs per replica x weight and
KV dtypes x engine knobs, one replica each):

1. **Memory** (`plan_memory` at the workload's longest request): what does not fit is out.
2. **Analytic screen** from the cost model, no simulation: a candidate that misses the SLO even
   unloaded (prefill of its prompt, one decode step at batch 1) is out; for the rest an upper
   bound on the rate one replica can sustain (prefill at full-chunk efficiency plus decode at the
   largest batch the KV cache, `max_num_seqs` and the TPOT limit allow) gives a lower bound on
   the replicas, hence on the cost.
3. **Capacity search** with the simulator, cheapest lower bound first (branch and bound): the
   smallest replica count k such that one replica meets the SLO at its share
   rate x (1 + headroom) / k of the Poisson arrivals — a bisection on the per-replica rate over
   the only rates that change the answer. A candidate whose lower bound is not below the best
   cost found so far cannot win and is not simulated. Candidates run in fixed-size batches and
   the best cost is updated between batches only, so the result does not depend on the number
   of workers or on which finishes first.
4. **Verification**: the recommended deployment, all replicas behind a round-robin router, at
   the target rate.

Every simulation is cached on disk under the SHA-256 of its full input (model config, hardware
profile, deployment, workload with its seed and rate, SLO, router and a hash of the planner's
own source), so asking again is instant and a code change never serves a stale answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from functools import cache
import hashlib
import itertools
import json
import math
import os
from pathlib import Path
import tempfile
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.catalog import resolve_model
from engine.config import EngineKnobs, ModelConfig
from engine.errors import InputError
from planner.costmodel import CostModel
from planner.hardware import get_hardware, hardware_catalog
from planner.memory import GIB, MemoryPlan, plan_memory
from planner.metrics import RunSummary
from planner.playback import Replay, request_lengths
from planner.sim import simulate
from planner.specs import SLO, Deployment, Dtype, HardwareProfile
from planner.workload import PoissonArrivals, Workload, get_workload

Executor = Literal["process", "serial", "ray"]
EXECUTORS: tuple[str, ...] = ("process", "serial", "ray")
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "serveplan"
DEFAULT_KV_DTYPES: tuple[Dtype, ...] = ("bf16", "fp8")
# (max_num_batched_tokens, max_num_seqs): a small chunk favours TTFT of queued requests and
# TPOT of running ones; a large one prefills faster. Chunked prefill and prefix caching stay on.
DEFAULT_KNOBS_GRID: tuple[EngineKnobs, ...] = tuple(
    EngineKnobs(max_num_batched_tokens=tokens, max_num_seqs=seqs) for tokens in (2048, 8192) for seqs in (64, 256)
)
# Candidates per scheduling round. Fixed, not the worker count, so that which candidates get
# pruned (and hence the result) is the same on a laptop and on a cluster.
BATCH_SIZE = 4
# The analytic capacity is a roofline estimate, not a proof: mixed prefill/decode steps share
# weight reads that it charges twice, so a replica can beat it slightly. It is inflated by this
# factor before it is used to bound replicas and cost, so that pruning never drops a winner.
CAPACITY_SLACK = 1.5
# A candidate that still misses the SLO at 1/LIGHT_LOAD_FACTOR of its first probe's load is
# latency-bound: more replicas will not help, and slower probes would only cost time.
LIGHT_LOAD_FACTOR = 8
MAX_REPLICAS = 4096
# A probe must last long enough for an overloaded replica to show it: with room for
# max_num_seqs requests, a short burst is simply admitted and the backlog that would build up
# in steady state never forms (70B on 2 x MI300X passes 22 req/s with 300 requests and fails
# it with 1,200; its steady capacity is ~18). So each probe has at least this many times
# max_num_seqs requests.
PROBE_SEQS_MULTIPLE = 3
VERIFY_MAX_REQUESTS = 3000


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Verdict = Literal["recommended", "memory", "slo", "cost", "budget"]


class CandidatePlan(_Out):
    """One deployment considered, what the search learnt about it, and why it lost (if it did)."""

    label: str = Field(description="Short human id: hardware, parallelism, dtypes, knobs")
    deployment: Deployment = Field(description="The deployment; replicas as needed when known, else 1")
    gpus_per_replica: int
    price_usd_per_gpu_hour: float
    capacity_bound_per_s: float | None = Field(
        None, description="Analytic estimate of the most requests/s one replica can serve (cost model, no queueing)"
    )
    sustained_rate_per_s: float | None = Field(
        None, description="Highest per-replica Poisson rate probed at which one replica met the SLO"
    )
    failed_rate_per_s: float | None = Field(
        None, description="Lowest per-replica Poisson rate probed at which one replica missed the SLO"
    )
    replicas: int | None = Field(None, description="Replicas for the target rate with headroom")
    gpus: int | None = None
    usd_per_hour: float | None = None
    usd_per_million_output_tokens: float | None = Field(None, description="At the target rate")
    ttft_p50_ms: float | None = Field(None, description="At the per-replica load it was sized for (with headroom)")
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    probes: int = Field(0, description="Simulations run for this candidate")
    verdict: Verdict
    reason: str = Field(description="Why it lost, prefixed by the verdict; empty for the recommendation")
    slo_miss_ratio: float | None = Field(
        None, description="Worst observed / limit at the lightest load tried (or unloaded, analytically); > 1 is a miss"
    )
    memory_shortfall_gib: float | None = Field(None, description="Per-GPU memory missing for one longest request")


class PlanResult(_Out):
    """`serveplan plan --json`: the recommendation, the ranking, the Pareto front and every rejection."""

    model: str
    workload: str
    rate_per_s: float = Field(description="Target Poisson arrival rate, requests/s")
    headroom: float = Field(description="Replicas are sized for rate_per_s x (1 + headroom)")
    slo: SLO
    budget_usd_per_hour: float | None
    requests_per_probe: int
    recommended: CandidatePlan | None
    verification: RunSummary | None = Field(
        description="The recommended deployment, all replicas behind round robin, simulated at rate_per_s"
    )
    ranked: list[CandidatePlan] = Field(description="Candidates that meet the SLO, by US$/h (ties: lower P99 TTFT)")
    pareto_metric: str = Field(description="Latency of the cost-vs-latency front")
    pareto: list[CandidatePlan] = Field(description="Feasible candidates no other beats on both cost and latency")
    rejected: list[CandidatePlan] = Field(description="Every other candidate with the reason it lost")
    nearest_miss: str | None = Field(description="When nothing is recommended: the closest candidate and by how much")
    candidates: int
    simulated_candidates: int
    probes: int
    assumptions: list[str]


# --------------------------------------------------------------------------- the workload's shape


@dataclass(frozen=True)
class _Shape:
    """What the analytic screen needs to know about the drawn requests."""

    longest_tokens: int  # prompt + output of the longest request (its KV footprint)
    mean_prompt_tokens: float  # as submitted, follow-ups with their history
    mean_new_prompt_tokens: float  # excluding shared prefixes and history: the least prefill work
    mean_output_tokens: float
    new_prompt_tokens: np.ndarray
    prompt_tokens: np.ndarray

    @classmethod
    def of(cls, replay: Replay, workload: Workload) -> _Shape:
        lengths = request_lengths(replay)
        prefix = workload.shared_prefix.prefix_tokens if workload.shared_prefix else 0
        new = np.array([
            len(r.new_prompt_token_ids) if r.parent_id else len(r.prompt_token_ids) - (prefix if r.prefix_id is not None else 0)
            for r in replay.requests
        ])
        prompts = np.array([p for p, _ in lengths.values()])
        totals = np.array([t for _, t in lengths.values()])
        return cls(
            longest_tokens=int(totals.max()),
            mean_prompt_tokens=float(prompts.mean()),
            mean_new_prompt_tokens=float(new.mean()),
            mean_output_tokens=float((totals - prompts).mean()),
            new_prompt_tokens=new,
            prompt_tokens=prompts,
        )


def probe_requests(requests_per_probe: int, dep: Deployment) -> int:
    """Requests in one probe of `dep`: enough to fill its batch several times over."""
    return max(requests_per_probe, PROBE_SEQS_MULTIPLE * dep.knobs.max_num_seqs)


def probe_workload(workload: Workload, rate_per_s: float, num_requests: int) -> Workload:
    """The workload with Poisson arrivals at `rate_per_s`; its seed keeps every draw the same."""
    return Workload.model_validate(
        {**workload.model_dump(), "arrival": PoissonArrivals(rate_per_s=rate_per_s).model_dump(), "num_requests": num_requests}
    )


# --------------------------------------------------------------------------- cached simulation


@cache
def code_version() -> str:
    """Package version plus a hash of the source the results depend on, so edits invalidate the cache."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("planner/**/*.py"), *root.glob("engine/core/*.py"), root / "engine" / "config.py"]):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("serveplan")
    except PackageNotFoundError:
        package = "source"
    return f"{package}+{digest.hexdigest()[:16]}"


def cache_key(model: ModelConfig, hw: HardwareProfile, dep: Deployment, workload: Workload, slo: SLO) -> str:
    """SHA-256 of the canonical JSON of everything a simulation's result depends on."""
    payload = {
        "model": asdict(model),
        "hardware": hw.model_dump(mode="json"),
        "deployment": dep.model_dump(mode="json"),
        "workload": workload.model_dump(mode="json"),
        "slo": slo.model_dump(mode="json"),
        "router": "round_robin",
        "code": code_version(),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def simulate_cached(
    model: ModelConfig, hw: HardwareProfile, dep: Deployment, workload: Workload, slo: SLO, cache_dir: Path | None
) -> RunSummary:
    """simulate(...).summary, read from / written to `cache_dir` (None: no cache)."""
    path = None
    if cache_dir is not None:
        key = cache_key(model, hw, dep, workload, slo)
        path = cache_dir / "runs" / key[:2] / f"{key}.json"
        if path.exists():
            return RunSummary.model_validate_json(path.read_text())
    summary = simulate(model, hw, dep, workload, slo=slo, router="round_robin").summary
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename: parallel workers never see a half-written file.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(summary.model_dump_json())
        os.replace(f.name, path)
    return summary


# --------------------------------------------------------------------------- capacity search (workers)


@dataclass(frozen=True)
class _Task:
    model: ModelConfig
    hw: HardwareProfile
    dep: Deployment
    workload: Workload
    slo: SLO
    sized_rate_per_s: float  # target x (1 + headroom)
    requests_per_probe: int
    min_replicas: int  # fewer cannot suffice: the analytic bound
    max_replicas: int  # more cannot win (cost) or would not help (light load)
    cost_capped: bool  # max_replicas comes from the best cost so far
    cache_dir: Path | None


@dataclass(frozen=True)
class _Probe:
    replicas: int
    rate_per_s: float
    passed: bool
    summary: RunSummary


@dataclass(frozen=True)
class _Outcome:
    probes: tuple[_Probe, ...]
    replicas: int | None  # smallest count whose share one replica served within the SLO
    error: str | None = None


def _capacity_search(task: _Task) -> _Outcome:
    """Bisection over the per-replica rate sized_rate / k for the smallest k that passes."""
    probes: list[_Probe] = []

    def probe(k: int) -> bool:
        rate = task.sized_rate_per_s / k
        w = probe_workload(task.workload, rate, probe_requests(task.requests_per_probe, task.dep))
        summary = simulate_cached(task.model, task.hw, task.dep, w, task.slo, task.cache_dir)
        probes.append(_Probe(k, rate, bool(summary.goodput.slo_met), summary))
        return probes[-1].passed

    try:
        failed, passed, k = None, None, task.min_replicas
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
        return _Outcome(tuple(probes), None, str(exc))
    return _Outcome(tuple(probes), passed)


class _Runner:
    """Runs batches of capacity searches: in process, on a local process pool, or on Ray."""

    def __init__(self, executor: Executor, workers: int | None) -> None:
        self.executor, self.workers = executor, workers
        self._pool: ProcessPoolExecutor | None = None
        self._ray_search = None
        if executor == "ray":
            try:
                import ray  # optional extra: only this path needs it
            except ImportError:
                raise InputError("executor", "ray", "Ray is not installed; pip install 'serveplan[cluster]'") from None
            if not ray.is_initialized():
                ray.init(ignore_reinit_error=True, log_to_driver=False)  # RAY_ADDRESS selects a cluster
            self._ray = ray
            self._ray_search = ray.remote(_capacity_search)

    def __enter__(self) -> _Runner:
        if self.executor == "process":
            self._pool = ProcessPoolExecutor(max_workers=self.workers or os.cpu_count() or 1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def run(self, tasks: Sequence[_Task], done: Callable[[], None]) -> list[_Outcome]:
        """Outcomes in task order; `done` is called as each finishes."""
        if self._pool is not None:
            futures = {self._pool.submit(_capacity_search, t): i for i, t in enumerate(tasks)}
            results: list[_Outcome | None] = [None] * len(tasks)
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                done()
            return [r for r in results if r is not None]
        if self._ray_search is not None:
            refs = [self._ray_search.remote(t) for t in tasks]
            remaining = list(refs)
            while remaining:
                ready, remaining = self._ray.wait(remaining, num_returns=1)
                done()
            return list(self._ray.get(refs))
        outcomes = []
        for t in tasks:
            outcomes.append(_capacity_search(t))
            done()
        return outcomes


# --------------------------------------------------------------------------- candidates


@dataclass
class _Candidate:
    hw: HardwareProfile
    dep: Deployment
    memory: MemoryPlan | None
    verdict: Verdict | None = None  # None while still in the running
    reason: str = ""
    capacity_bound_per_s: float | None = None
    min_replicas: int = 1
    cost_bound_usd_per_hour: float = math.inf
    slo_miss_ratio: float | None = None
    memory_shortfall_gib: float | None = None
    cost_capped: bool = False  # its capacity search stopped where more replicas could no longer win
    outcome: _Outcome | None = None

    @property
    def label(self) -> str:
        d = self.dep
        par = f"tp{d.tensor_parallel}" + (f" pp{d.pipeline_parallel}" if d.pipeline_parallel > 1 else "") + (
            f" ep{d.expert_parallel}" if d.expert_parallel > 1 else "")
        return (f"{self.hw.name} {par} w:{d.weight_dtype} kv:{d.kv_dtype} "
                f"mbt{d.knobs.max_num_batched_tokens} seqs{d.knobs.max_num_seqs}")

    @property
    def price(self) -> float:
        assert self.hw.price_usd_per_hour is not None  # profiles without a price are refused up front
        return self.hw.price_usd_per_hour

    def usd_per_hour(self, replicas: int) -> float:
        return replicas * self.dep.gpus_per_replica * self.price


def _scale_up_domain(hw: HardwareProfile) -> int:
    if hw.scale_up is not None:
        return hw.scale_up.domain_size
    return hw.pcie.domain_size if hw.pcie is not None else 1


def _weight_dtypes(hw: HardwareProfile, requested: Sequence[str] | None) -> list[str]:
    if requested is not None:
        return list(requested)
    # fp8 only where the tensor units have it: elsewhere it is int8's bytes with extra dequantisation.
    return ["bf16", *(["fp8"] if hw.peak_tflops.fp8 else []), "int8", "int4"]


def _make_deployment(model: ModelConfig, hw: HardwareProfile, tp: int, pp: int, weight: str, kv: str,
                     knobs: EngineKnobs) -> Deployment:
    # Experts spread over the tensor-parallel ranks, as far as the expert count divides.
    ep = math.gcd(tp, model.moe.num_experts) if model.moe is not None else 1
    return Deployment(hardware=hw.name, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                      weight_dtype=weight, kv_dtype=kv, knobs=knobs)


def _enumerate(model: ModelConfig, profiles: Sequence[HardwareProfile], max_gpus: int, weight_dtypes: Sequence[str] | None,
               kv_dtypes: Sequence[str], knobs_grid: Sequence[EngineKnobs], context_tokens: int) -> Iterator[_Candidate]:
    """Every candidate with its memory plan; pipeline stages only where tensor parallelism alone does not fit."""
    for hw in profiles:
        domain = min(max_gpus, _scale_up_domain(hw))
        tps = []
        for tp in (2**i for i in range(11)):
            if tp > domain:
                break
            try:
                plan_memory(model, hw, _make_deployment(model, hw, tp, 1, "bf16", "bf16", EngineKnobs()), 1)
            except InputError:  # TP does not divide the heads
                continue
            tps.append(tp)
        for weight, kv, knobs in itertools.product(_weight_dtypes(hw, weight_dtypes), kv_dtypes, knobs_grid):
            tried = []
            for tp in tps:
                dep = _make_deployment(model, hw, tp, 1, weight, kv, knobs)
                tried.append(_Candidate(hw, dep, plan_memory(model, hw, dep, context_tokens)))
            if not any(c.memory.fits for c in tried if c.memory) and tps:
                for pp in (2, 4, 8, 16):
                    tp = max(t for t in tps if t * pp <= max_gpus) if any(t * pp <= max_gpus for t in tps) else None
                    if tp is None or pp > model.num_layers:
                        break
                    dep = _make_deployment(model, hw, tp, pp, weight, kv, knobs)
                    tried.append(_Candidate(hw, dep, plan_memory(model, hw, dep, context_tokens)))
                    if tried[-1].memory.fits:
                        break
            yield from tried


def _memory_verdict(c: _Candidate, context_tokens: int) -> None:
    m = c.memory
    assert m is not None
    # What one longest request lacks per GPU: the weights' overflow plus that request's KV.
    need = context_tokens * m.kv_bytes_per_token_per_gpu / GIB
    c.memory_shortfall_gib = max(0.0, need - max(m.kv_cache_gib, 0.0)) + max(0.0, -m.kv_cache_gib)
    c.verdict, c.reason = "memory", f"memory: {m.reason}"


def _slo_limits_ms(slo: SLO) -> dict[str, tuple[float, float]]:
    """metric -> (tightest per-request or percentile limit, quantile of requests it binds)."""
    limits = {}
    for metric in ("ttft", "tpot"):
        p99, p50 = getattr(slo, f"{metric}_p99_ms"), getattr(slo, f"{metric}_p50_ms")
        if p99 is not None or p50 is not None:
            limit = p99 if p99 is not None else p50
            limits[metric] = (limit, max(0.99 if p99 is not None else 0.5, slo.goodput_share))
    if slo.itl_p99_ms is not None:
        tpot = limits.get("tpot")
        limits["tpot"] = (min(slo.itl_p99_ms, tpot[0]) if tpot else slo.itl_p99_ms, 0.99)
    return limits


def _screen(c: _Candidate, model: ModelConfig, shape: _Shape, slo: SLO, sized_rate_per_s: float) -> None:
    """Analytic screen: drop what misses the SLO even unloaded; bound capacity, replicas and cost."""
    assert c.memory is not None
    try:
        cm = CostModel(model, c.hw, c.dep)
    except InputError as exc:  # e.g. pipeline stages beyond any interconnect of the profile
        c.verdict, c.reason = "memory", f"memory: fits only as tp={c.dep.tensor_parallel} x pp={c.dep.pipeline_parallel}, but {exc}"
        c.memory_shortfall_gib = 0.0
        return
    chunk = c.dep.knobs.max_num_batched_tokens
    limits = _slo_limits_ms(slo)

    # Unloaded latency is a floor: queueing and batching only add to it. Quantiles use the lower
    # order statistic and prompts without any cacheable prefix, so the floor stays a floor.
    worst = 0.0
    misses = []
    if "ttft" in limits:
        limit, q = limits["ttft"]
        tokens = int(np.quantile(shape.new_prompt_tokens, q, method="lower"))
        ttft_ms = 1e3 * sum(cm.prefill_time_s(min(chunk, tokens - done), done) for done in range(0, tokens, chunk))
        worst = max(worst, ttft_ms / limit)
        if ttft_ms > limit:
            misses.append(f"TTFT of the {q:.0%} request {ttft_ms:,.0f} ms > {limit:g}")
    if "tpot" in limits:
        limit, q = limits["tpot"]
        context = int(np.quantile(shape.prompt_tokens, q, method="lower"))
        tpot_ms = 1e3 * cm.decode_time_per_token_s(1, max(1, context))
        worst = max(worst, tpot_ms / limit)
        if tpot_ms > limit:
            misses.append(f"TPOT at batch 1 {tpot_ms:,.1f} ms > {limit:g}")
    if misses:
        c.verdict, c.slo_miss_ratio = "slo", worst
        c.reason = "SLO: misses even unloaded (cost model): " + "; ".join(misses)
        return

    # Capacity: each request costs its prefill at full-chunk efficiency plus its share of decode
    # steps at the largest batch that the KV cache, max_num_seqs and the TPOT limit allow.
    prefill_s_per_token = cm.prefill_time_s(chunk) / chunk
    context = max(1, int(shape.mean_prompt_tokens + shape.mean_output_tokens / 2))
    batch = max(1, min(c.dep.knobs.max_num_seqs,
                       c.memory.kv_cache_tokens // max(1, int(shape.mean_prompt_tokens + shape.mean_output_tokens))))
    if "tpot" in limits:
        limit_s = limits["tpot"][0] / 1e3
        lo, hi = 1, batch  # largest batch whose decode step fits the TPOT limit (monotone in batch)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cm.decode_time_per_token_s(mid, context) <= limit_s else (lo, mid - 1)
        batch = lo
    decode_s_per_token = cm.decode_time_per_token_s(batch, context) / batch
    seconds_per_request = shape.mean_new_prompt_tokens * prefill_s_per_token + shape.mean_output_tokens * decode_s_per_token
    c.capacity_bound_per_s = 1.0 / seconds_per_request
    c.min_replicas = max(1, math.ceil(sized_rate_per_s / (c.capacity_bound_per_s * CAPACITY_SLACK)))
    c.cost_bound_usd_per_hour = c.usd_per_hour(c.min_replicas)


# --------------------------------------------------------------------------- plan


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
    headroom: float = 0.1,
    requests_per_probe: int = 300,
    executor: Executor = "process",
    workers: int | None = None,
    cache_dir: str | Path | None = DEFAULT_CACHE_DIR,
    progress: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> PlanResult:
    """The cheapest deployment of `model` serving `workload` at `rate_per_s` within `slo`.

    `hardware` defaults to every catalog profile with a price. `cache_dir=None` disables the
    cache. `on_progress(done, total)` is called as each candidate is settled (simulated or
    pruned), for front ends that draw their own progress bar (the dashboard). Bad input raises
    InputError naming the argument (the CLI's flag names).
    """
    cfg = resolve_model(model) if isinstance(model, str) else model
    slo = SLO.parse(slo) if isinstance(slo, str) else slo
    base = get_workload(workload) if isinstance(workload, str) else workload
    if not rate_per_s > 0:
        raise InputError("--rate", rate_per_s, "must be > 0 requests/s")
    if max_gpus_per_replica < 1:
        raise InputError("--max-gpus", max_gpus_per_replica, "must be >= 1")
    if budget_usd_per_hour is not None and not budget_usd_per_hour > 0:
        raise InputError("--budget-usd-per-hour", budget_usd_per_hour, "must be > 0")
    if not headroom >= 0:
        raise InputError("--headroom", headroom, "must be >= 0")
    if requests_per_probe < 20:
        raise InputError("--requests-per-probe", requests_per_probe, "must be >= 20 (P99 needs a tail)")
    if executor not in EXECUTORS:
        raise InputError("--executor", executor, f"allowed: {', '.join(EXECUTORS)}")
    if workers is not None and workers < 1:
        raise InputError("--workers", workers, "must be >= 1")
    if weight_dtypes is not None:
        _check_dtypes("--weight-dtypes", "weight_dtype", weight_dtypes)
    kv_list = list(kv_dtypes) if kv_dtypes is not None else list(DEFAULT_KV_DTYPES)
    _check_dtypes("--kv-dtypes", "kv_dtype", kv_list)
    knobs_list = list(knobs_grid) if knobs_grid is not None else list(DEFAULT_KNOBS_GRID)
    profiles = _profiles(hardware)
    cache_path = Path(cache_dir).expanduser() if cache_dir is not None else None

    replay = Replay.of(probe_workload(base, rate_per_s, requests_per_probe), vocab_size=cfg.vocab_size)
    shape = _Shape.of(replay, base)
    if shape.longest_tokens > cfg.max_position_embeddings:
        raise InputError("--workload", base.name, f"its longest request ({shape.longest_tokens} tokens) exceeds "
                         f"{cfg.name}'s context of {cfg.max_position_embeddings}")
    sized_rate = rate_per_s * (1 + headroom)

    candidates = list(_enumerate(cfg, profiles, max_gpus_per_replica, weight_dtypes, kv_list, knobs_list, shape.longest_tokens))
    for c in candidates:
        if not c.memory.fits:
            _memory_verdict(c, shape.longest_tokens)
        else:
            _screen(c, cfg, shape, slo, sized_rate)
    # Cheapest bound first; among equal bounds, the cheapest estimate (the bound without slack)
    # first, so that a tight best cost is found early and prunes the rest.
    running = sorted((c for c in candidates if c.verdict is None),
                     key=lambda c: (c.cost_bound_usd_per_hour,
                                    c.usd_per_hour(math.ceil(sized_rate / (c.capacity_bound_per_s or 1e-9))), c.label))

    best: float | None = None
    with _Runner(executor, workers) as runner, _progress_bar(progress, len(running), on_progress) as advance:
        queue = iter(running)
        while True:
            batch: list[_Candidate] = []
            for c in queue:
                if best is not None and c.cost_bound_usd_per_hour >= best:
                    c.verdict = "cost"
                    c.reason = (f"cost: at least US${c.cost_bound_usd_per_hour:,.2f}/h even at its analytic capacity "
                                f"(≤ {c.capacity_bound_per_s * CAPACITY_SLACK:,.2f} req/s per replica), "
                                f"not below the best US${best:,.2f}/h")
                    advance()
                    continue
                batch.append(c)
                if len(batch) == BATCH_SIZE:
                    break
            if not batch:
                break
            tasks = [_task(c, cfg, base, slo, sized_rate, requests_per_probe, best, cache_path) for c in batch]
            for c, task, outcome in zip(batch, tasks, runner.run(tasks, advance), strict=True):
                c.outcome, c.cost_capped = outcome, task.cost_capped
                if outcome.replicas is not None:
                    cost = c.usd_per_hour(outcome.replicas)
                    best = cost if best is None else min(best, cost)
    return _assemble(cfg, base, rate_per_s, headroom, slo, budget_usd_per_hour, requests_per_probe, shape,
                     candidates, best, cache_path)


def _check_dtypes(flag: str, spec_field: str, dtypes: Sequence[str]) -> None:
    """Each dtype as the Deployment spec accepts it for `spec_field`; its message says what is allowed."""
    if not dtypes:
        raise InputError(flag, "", "needs at least one dtype")
    for d in dtypes:
        try:
            Deployment(hardware="check", **{spec_field: d})
        except ValidationError as exc:
            raise InputError(flag, d, exc.errors()[0]["msg"]) from None


def _profiles(hardware: Sequence[str | HardwareProfile] | None) -> list[HardwareProfile]:
    if hardware is None:
        return [hw for hw in hardware_catalog().values() if hw.price_usd_per_hour is not None]
    profiles = [get_hardware(h) if isinstance(h, str) else h for h in hardware]
    if not profiles:
        raise InputError("--hw", "", "needs at least one hardware profile")
    for hw in profiles:
        if hw.price_usd_per_hour is None:
            raise InputError("--hw", hw.name, "has no price_usd_per_hour to rank by; give a profile YAML with a price")
    return list({hw.name: hw for hw in profiles}.values())


def _task(c: _Candidate, model: ModelConfig, workload: Workload, slo: SLO, sized_rate: float, requests: int,
          best: float | None, cache_dir: Path | None) -> _Task:
    light_cap = c.min_replicas * LIGHT_LOAD_FACTOR
    # Only replica counts strictly cheaper than the best so far can change the answer.
    cost_cap = MAX_REPLICAS if best is None else math.ceil(best / c.usd_per_hour(1) - 1e-9) - 1
    return _Task(model, c.hw, c.dep, workload, slo, sized_rate, requests, c.min_replicas,
                 max(c.min_replicas, min(light_cap, cost_cap, MAX_REPLICAS)), cost_cap < light_cap, cache_dir)


class _progress_bar:  # noqa: N801 (used as a context manager, named like one)
    """A rich progress bar on stderr (or nothing), plus an optional callback; yields the function that advances both."""

    def __init__(self, enabled: bool, total: int, callback: Callable[[int, int], None] | None = None) -> None:
        self._bar = None
        self._callback, self._total, self._done = callback, total, 0
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("planning"), BarColumn(), MofNCompleteColumn(), TextColumn("candidates"),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task("plan", total=total)

    def __enter__(self) -> Callable[[], None]:
        if self._bar is not None:
            self._bar.__enter__()
        return self._advance

    def _advance(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
        if self._callback is not None:
            self._callback(self._done, self._total)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)


# --------------------------------------------------------------------------- results


def _slo_miss_ratio(summary: RunSummary) -> float:
    g = summary.goodput
    ratios = [k.observed_ms / k.limit_ms for k in g.checks]
    if g.required_share and g.share < g.required_share:
        ratios.append(g.required_share / max(g.share, 1e-9))
    return max(ratios, default=0.0)


def _assemble(model: ModelConfig, workload: Workload, rate_per_s: float, headroom: float, slo: SLO,
              budget: float | None, requests: int, shape: _Shape, candidates: list[_Candidate], best: float | None,
              cache_dir: Path | None) -> PlanResult:
    sized_rate = rate_per_s * (1 + headroom)
    per_million = 1e6 / (rate_per_s * shape.mean_output_tokens * 3600)
    plans: list[tuple[_Candidate, dict[str, object]]] = []
    for c in candidates:
        fields: dict[str, object] = {"capacity_bound_per_s": c.capacity_bound_per_s, "slo_miss_ratio": c.slo_miss_ratio,
                                     "memory_shortfall_gib": c.memory_shortfall_gib}
        out = c.outcome
        if out is not None:
            passed = [p for p in out.probes if p.passed]
            failed = [p for p in out.probes if not p.passed]
            fields["probes"] = len(out.probes)
            fields["failed_rate_per_s"] = min((p.rate_per_s for p in failed), default=None)
            if out.error is not None:
                c.verdict, c.reason = "memory", f"memory: {out.error}"
            elif out.replicas is not None:
                sized = next(p for p in passed if p.replicas == out.replicas)
                s = sized.summary
                cost = c.usd_per_hour(out.replicas)
                fields |= {
                    "sustained_rate_per_s": sized.rate_per_s, "replicas": out.replicas,
                    "gpus": out.replicas * c.dep.gpus_per_replica, "usd_per_hour": cost,
                    "usd_per_million_output_tokens": cost * per_million,
                    "ttft_p50_ms": s.ttft_ms.p50, "ttft_p99_ms": s.ttft_ms.p99,
                    "tpot_p50_ms": s.tpot_ms.p50, "tpot_p99_ms": s.tpot_ms.p99,
                }
                c.verdict = "cost"  # until ranked below
            else:
                lightest = failed[-1]
                c.slo_miss_ratio = fields["slo_miss_ratio"] = _slo_miss_ratio(lightest.summary)
                checks = ", ".join(f"{k.target} {k.observed_ms:,.0f} > {k.limit_ms:g}" for k in lightest.summary.goodput.checks
                                   if not k.met) or f"goodput {lightest.summary.goodput.share:.1%}"
                next_k = lightest.replicas + 1
                if c.cost_capped and best is not None:
                    c.verdict = "cost"
                    c.reason = (f"cost: misses the SLO at {lightest.rate_per_s:,.2f} req/s per replica ({checks}); "
                                f"{next_k}+ replicas = US${c.usd_per_hour(next_k):,.2f}/h or more vs the best US${best:,.2f}/h")
                else:
                    c.verdict = "slo"
                    c.reason = f"SLO: misses it even at {lightest.rate_per_s:,.2f} req/s per replica ({checks})"
        plans.append((c, fields))

    def to_plan(c: _Candidate, fields: dict[str, object]) -> CandidatePlan:
        replicas = fields.get("replicas")
        dep = c.dep.model_copy(update={"replicas": replicas}) if isinstance(replicas, int) else c.dep
        return CandidatePlan(label=c.label, deployment=dep, gpus_per_replica=c.dep.gpus_per_replica,
                             price_usd_per_gpu_hour=c.price, verdict=c.verdict or "cost", reason=c.reason,
                             **{k: v for k, v in fields.items() if v is not None})

    feasible = sorted((to_plan(c, f) for c, f in plans if "replicas" in f),
                      key=lambda p: (p.usd_per_hour, p.ttft_p99_ms, p.label))
    ranked: list[CandidatePlan] = []
    for i, p in enumerate(feasible):
        if budget is not None and p.usd_per_hour > budget:
            p = p.model_copy(update={"verdict": "budget",
                                     "reason": f"budget: US${p.usd_per_hour:,.2f}/h > US${budget:,.2f}/h"})
        elif i > 0:
            p = p.model_copy(update={"verdict": "cost", "reason": (
                f"cost: US${p.usd_per_hour:,.2f}/h vs the best US${feasible[0].usd_per_hour:,.2f}/h"
                if p.usd_per_hour > feasible[0].usd_per_hour else
                f"cost: ties the best US${p.usd_per_hour:,.2f}/h with a higher P99 TTFT")})
        else:
            p = p.model_copy(update={"verdict": "recommended", "reason": ""})
        ranked.append(p)
    recommended = ranked[0] if ranked and ranked[0].verdict == "recommended" else None
    others = [to_plan(c, f) for c, f in plans if "replicas" not in f]
    order = {"cost": 0, "budget": 1, "slo": 2, "memory": 3}
    rejected = [p for p in ranked if p.verdict != "recommended"] + sorted(
        others, key=lambda p: (order[p.verdict], p.slo_miss_ratio or 0.0, p.memory_shortfall_gib or 0.0, p.label))

    metric = "ttft_p99_ms" if (slo.ttft_p99_ms or slo.ttft_p50_ms or not (slo.tpot_p99_ms or slo.tpot_p50_ms)) else "tpot_p99_ms"
    pareto: list[CandidatePlan] = []
    for p in ranked:  # by cost: on the front when faster than everything cheaper
        if not pareto or getattr(p, metric) < getattr(pareto[-1], metric):
            pareto.append(p)

    verification = None
    if recommended is not None:
        dep = recommended.deployment
        hw = next(c.hw for c in candidates if c.hw.name == dep.hardware)
        w = probe_workload(workload, rate_per_s, min(VERIFY_MAX_REQUESTS, probe_requests(requests, dep) * dep.replicas))
        verification = simulate_cached(model, hw, dep, w, slo, cache_dir)

    simulated = [c for c in candidates if c.outcome is not None]
    return PlanResult(
        model=model.name, workload=workload.name, rate_per_s=rate_per_s, headroom=headroom, slo=slo,
        budget_usd_per_hour=budget, requests_per_probe=requests, recommended=recommended, verification=verification,
        ranked=ranked, pareto_metric=metric, pareto=pareto, rejected=rejected,
        nearest_miss=None if recommended is not None else _nearest_miss(ranked, others, budget),
        candidates=len(candidates), simulated_candidates=len(simulated),
        probes=sum(len(c.outcome.probes) for c in simulated if c.outcome is not None),
        assumptions=[
            f"Poisson arrivals; replicas sized for {rate_per_s:g} x (1 + {headroom:g}) = {sized_rate:g} req/s, "
            "each replica probed alone at its share of that rate",
            f"max({requests}, {PROBE_SEQS_MULTIPLE} x max_num_seqs) requests per probe drawn from workload "
            f"{workload.name!r} with seed {workload.seed}; a probe passes when the simulated run meets every SLO "
            "target and the goodput share",
            f"longest request {shape.longest_tokens} tokens: memory planned so that one fits; mean prompt "
            f"{shape.mean_prompt_tokens:.0f}, mean output {shape.mean_output_tokens:.0f} tokens",
            "cost = replicas x GPUs per replica x the profile's price per GPU-hour; per 1M output tokens at the target rate",
            f"analytic capacity bounds are inflated x{CAPACITY_SLACK:g} before pruning; a candidate that misses the SLO at "
            f"1/{LIGHT_LOAD_FACTOR} of its first probe's load is not probed further",
            "latencies of candidates are at the per-replica load they were sized for (with headroom); the "
            "verification run is the recommended deployment at the target rate behind round robin",
        ],
    )


def _nearest_miss(ranked: list[CandidatePlan], others: list[CandidatePlan], budget: float | None) -> str:
    if ranked:  # feasible, but none within the budget
        p = ranked[0]
        return (f"no deployment meets the SLO within US${budget:,.2f}/h; the cheapest that does is "
                f"{p.replicas} x {p.label}: {p.gpus} GPUs, US${p.usd_per_hour:,.2f}/h")
    slo_misses = [p for p in others if p.slo_miss_ratio is not None]
    if slo_misses:
        p = min(slo_misses, key=lambda p: (p.slo_miss_ratio, p.label))
        return (f"no candidate meets the SLO; the closest is {p.label}, {p.slo_miss_ratio:.2f}x the limit: "
                + p.reason.removeprefix("SLO: ").removeprefix("cost: "))
    memory = [p for p in others if p.memory_shortfall_gib is not None]
    if memory:
        p = min(memory, key=lambda p: (p.memory_shortfall_gib, p.label))
        return (f"the model fits on no candidate; the closest is {p.label}, {p.memory_shortfall_gib:,.1f} GiB per GPU "
                f"short: " + p.reason.removeprefix("memory: "))
    return "no candidate deployment: the hardware list and parallelism limits leave nothing to try"
