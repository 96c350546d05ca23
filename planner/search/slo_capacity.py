"""Capacity: the highest Poisson arrival rate at which one deployment still meets the SLO, and
what a token costs when it runs there.

A run at the offered rate says whether that rate is served; capacity says how far the deployment
goes. Bracketing by doubling (or halving) from a start rate, then bisection on the rate's
logarithm until the highest pass and the lowest miss are within `tolerance`. Every probe draws
the same requests at a different rate (the seed fixes the draw; Poisson gaps scale with 1/rate),
and is long enough for an overloaded deployment to show it: a burst that fits the running batch
is simply admitted, so a probe holds PROBE_SEQS_MULTIPLE times the largest batch a replica can
run (max_num_seqs, or what its KV cache holds of the mean request if fewer).
"""

from __future__ import annotations

from dataclasses import dataclass
import logging
import math

from pydantic import BaseModel, ConfigDict, Field

from engine.config import ModelConfig
from engine.errors import InputError
from planner.costmodel.fitted import FittedModel
from planner.engines import resolve_deployment
from planner.memory import plan_memory
from planner.metrics import RunSummary
from planner.playback import Replay, request_lengths
from planner.search.cache import RunCache, simulate_cached
from planner.search.capacity import PROBE_SEQS_MULTIPLE, probe_workload
from planner.specs import MAX_RATE_PER_S, MIN_RATE_PER_S, SLO, Deployment, HardwareProfile
from planner.workload import Workload

_log = logging.getLogger("planner.search")
MAX_PROBES = 16  # doubling from 1e-3 to 1e6 req/s takes 30; a start near the answer takes a few


class SLOCapacity(BaseModel):
    """`capacity` in `serveplan plan --json` (the recommendation's) and in each side of `compare --json` (with an SLO)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rate_per_s: float | None = Field(description="Highest Poisson rate probed at which the deployment met the SLO "
                                                 "(requests/s; conversation starts/s in a multi-turn workload); None: "
                                                 "it missed even at the lowest rate probed")
    failed_rate_per_s: float | None = Field(description="Lowest rate probed at which it missed; None: none missed")
    requests_per_s: float | None = Field(description="rate_per_s in requests: times the requests each arrival brings "
                                                     "(a conversation's turns; the same figure for single requests)")
    output_tokens_per_s: float | None = Field(description="Output tokens per second served at rate_per_s")
    usd_per_million_output_tokens: float | None = Field(description="Hourly cost over the output-token rate at capacity")
    probes: int = Field(description="Simulations run")
    requests_per_probe: int
    tolerance: float = Field(description="The pass and the miss are within this share of each other")
    basis: str


def slo_capacity(model: ModelConfig, hw: HardwareProfile, dep: Deployment, workload: Workload, slo: SLO, *,
                 start_rate_per_s: float, requests_per_probe: int, tolerance: float = 0.1,
                 runs: RunCache | None = None, fit: FittedModel | None = None,
                 stop_once_missed: bool = True) -> SLOCapacity:
    """The capacity of `dep` (all its replicas, round robin) on `workload`'s requests within `slo`.
    `stop_once_missed`: a probe stops once it has missed the SLO for certain (same verdicts; only the
    passing probes' figures are used); False runs every probe to its end."""
    if not 0.01 <= tolerance <= 1:
        raise InputError("tolerance", tolerance, "must be between 0.01 and 1")
    if not MIN_RATE_PER_S <= start_rate_per_s <= MAX_RATE_PER_S:
        raise InputError("start_rate_per_s", start_rate_per_s, f"must be in {MIN_RATE_PER_S:g}..{MAX_RATE_PER_S:g}")
    n = _probe_requests(model, hw, dep, probe_workload(workload, start_rate_per_s, requests_per_probe)) * dep.replicas
    # Every probe draws these requests (only the gaps scale with the rate); an arrival is a
    # conversation's start in a multi-turn workload, so it brings all its turns' output.
    drawn = Replay.of(probe_workload(workload, start_rate_per_s, n), model.vocab_size, model.max_position_embeddings).requests
    arrivals = sum(r.parent_id is None for r in drawn)
    output_per_arrival = sum(r.output_tokens for r in drawn) / arrivals
    passed: dict[float, RunSummary] = {}
    failed: set[float] = set()

    def probe(rate: float) -> bool:
        summary, notes = simulate_cached(model, hw, dep, probe_workload(workload, rate, n), slo, runs, fit,
                                         stop_once_missed=stop_once_missed)
        for note in notes:  # a bad cache entry met here is named like the search's own
            _log.warning(note)
        if summary.goodput.slo_met:
            passed[rate] = summary
            return True
        failed.add(rate)
        return False

    rate = start_rate_per_s
    if probe(rate):
        while rate * 2 <= MAX_RATE_PER_S and len(passed) + len(failed) < MAX_PROBES and probe(rate * 2):
            rate *= 2
    else:
        while rate / 2 >= MIN_RATE_PER_S and len(passed) + len(failed) < MAX_PROBES and not probe(rate / 2):
            rate /= 2
    while passed and failed and len(passed) + len(failed) < MAX_PROBES:
        lo, hi = max(passed), min(failed)
        if hi / lo <= 1 + tolerance:
            break
        probe(math.sqrt(lo * hi))

    best = max(passed) if passed else None
    at = passed.get(best) if best is not None else None
    usd = at.cost.usd_per_hour if at is not None else None
    # At capacity every request is served: the request and token rates are the arrival rate times what each brings.
    requests = best * len(drawn) / arrivals if best is not None else None
    tokens = best * output_per_arrival if best is not None else None
    miss = min(failed) if failed else None
    unit = "req/s" if arrivals == len(drawn) else "conversations/s"
    return SLOCapacity(
        rate_per_s=best, failed_rate_per_s=miss, requests_per_s=requests, output_tokens_per_s=tokens,
        usd_per_million_output_tokens=usd / (tokens * 3600) * 1e6 if usd is not None and tokens else None,
        probes=len(passed) + len(failed), requests_per_probe=n, tolerance=tolerance,
        basis=(f"Poisson arrivals, {n:,} requests of workload {workload.name!r} (seed {workload.seed}) per probe"
               + (f" in {arrivals:,} conversations, whose starts the rate counts" if arrivals < len(drawn) else "") + "; "
               + (f"no rate probed met the SLO, down to {miss:,.3g} {unit}" if best is None else
                  "highest rate that met the SLO" + (f", {miss:,.3g} {unit} missed it" if miss is not None else
                                                     ", no rate probed missed it (the search stopped at its limit)")
                  + "; cost per token at that rate")),
    )


@dataclass(frozen=True)
class ReplicasCapacity:
    """The capacity of `replicas` copies of `one` (a single replica) behind round robin: a task a
    search's runner can take (planner/search/executors.py), so it can run beside other work."""

    model: ModelConfig
    hw: HardwareProfile
    one: Deployment
    replicas: int
    workload: Workload
    slo: SLO
    start_rate_per_s: float  # one replica's
    requests_per_probe: int
    runs: RunCache | None
    fit: FittedModel | None
    stop_once_missed: bool


def replicas_capacity(task: ReplicasCapacity) -> SLOCapacity:
    """One replica's capacity (as the search probes it), times the replicas behind round robin."""
    c = slo_capacity(task.model, task.hw, task.one, task.workload, task.slo, start_rate_per_s=task.start_rate_per_s,
                     requests_per_probe=task.requests_per_probe, runs=task.runs, fit=task.fit,
                     stop_once_missed=task.stop_once_missed)
    k = task.replicas
    return c.model_copy(update={
        "rate_per_s": None if c.rate_per_s is None else c.rate_per_s * k,
        "failed_rate_per_s": None if c.failed_rate_per_s is None else c.failed_rate_per_s * k,
        "output_tokens_per_s": None if c.output_tokens_per_s is None else c.output_tokens_per_s * k,
        "basis": c.basis + f"; one replica probed alone, times {k} replicas behind round robin"})


def _probe_requests(model: ModelConfig, hw: HardwareProfile, dep: Deployment, sample: Workload) -> int:
    """Requests per replica in a probe: `sample`'s count, and at least PROBE_SEQS_MULTIPLE largest batches
    (of conversations in a multi-turn workload: capacity.probe_requests says why)."""
    lengths = request_lengths(Replay.of(sample, model.vocab_size, model.max_position_embeddings))
    mean_tokens = sum(total for _, total in lengths.values()) / len(lengths)
    resolved = resolve_deployment(dep, hw, max_model_len=model.max_position_embeddings)
    kv_tokens = plan_memory(model, hw, resolved, model.max_position_embeddings).kv_cache_tokens
    batch = min(resolved.knobs.choices.max_num_seqs, max(1, int(kv_tokens / mean_tokens)))
    return max(sample.num_requests, math.ceil(PROBE_SEQS_MULTIPLE * batch * sample.requests_per_arrival))
