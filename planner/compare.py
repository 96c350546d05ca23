"""What-if comparisons: two deployments (or one under two workloads) simulated side by side.

Rates are compared where they describe the server rather than the run: over each run's steady
window (warm-up and drain left out, `RunSummary.steady_state`) and, with an SLO, at each side's
capacity (the highest Poisson rate still meeting it, `planner.search.slo_capacity`). A short run's
whole-run throughput includes its drain tail, so two deployments that both serve everything would
differ by how long their last requests took; those figures stay in each side's summary.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.catalog import resolve_model
from engine.config import ModelConfig
from engine.errors import InputError, from_validation_error
from engine.files import load_yaml
from planner.costmodel.fitted import FittedModel
from planner.hardware import get_hardware
from planner.metrics import RunSummary
from planner.playback import Replay
from planner.search.cache import RunCache
from planner.search.slo_capacity import SLOCapacity, slo_capacity
from planner.sim import RouterName, simulate
from planner.specs import MAX_RATE_PER_S, MIN_RATE_PER_S, SLO, Deployment, HardwareProfile
from planner.workload import PoissonArrivals, Workload, get_workload

# (label, path into RunSummary): the figures a what-if question is usually about.
METRICS: tuple[tuple[str, str], ...] = (
    ("TTFT P50, ms", "ttft_ms.p50"),
    ("TTFT P99, ms", "ttft_ms.p99"),
    ("TPOT P50, ms", "tpot_ms.p50"),
    ("TPOT P99, ms", "tpot_ms.p99"),
    ("ITL P99, ms", "itl_ms.p99"),
    ("E2E P99, ms", "e2e_ms.p99"),
    ("requests/s, steady state", "steady_state.requests_per_s"),
    ("output tokens/s, steady state", "steady_state.output_tokens_per_s"),
    ("mean batch (requests), steady state", "steady_state.mean_batch_requests"),
    ("capacity within the SLO, requests/s", "capacity.requests_per_s"),
    ("goodput share", "goodput.share"),
    ("prefix-cache hit rate", "prefix_cache_hit_rate"),
    ("preemptions", "preemptions"),
    ("KV blocks", "kv_cache_blocks_total"),
    ("busy share", "utilisation.busy_share"),
    ("US$/h", "cost.usd_per_hour"),
    ("US$ per 1M output tokens, steady state", "steady_state.usd_per_million_output_tokens"),
    ("US$ per 1M output tokens at capacity", "capacity.usd_per_million_output_tokens"),
)


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Side(_Out):
    """One side of a comparison: its run, and its capacity within the SLO when one was given."""

    path: str
    model: str
    workload: str
    deployment: Deployment
    summary: RunSummary
    capacity: SLOCapacity | None = Field(None, description="Highest Poisson rate meeting the SLO; None without an SLO")

    def figure(self, path: str) -> float | None:
        """A figure of the run ('ttft_ms.p99') or of its capacity ('capacity.requests_per_s')."""
        if path.startswith("capacity."):
            value = None if self.capacity is None else getattr(self.capacity, path.removeprefix("capacity."))
            return None if value is None else float(value)
        return self.summary.figure(path)


class MetricDelta(_Out):
    metric: str
    a: float | None
    b: float | None
    delta: float | None = Field(description="b - a")
    delta_pct: float | None = Field(description="(b - a) / a x 100; None when a is 0 or missing")
    a_range: tuple[float, float] | None = Field(None, description="A's prediction interval (simulated GPU runs)")
    b_range: tuple[float, float] | None = Field(None, description="B's prediction interval (simulated GPU runs)")


class Comparison(_Out):
    """`serveplan compare --json`."""

    a: Side
    b: Side
    metrics: list[MetricDelta]


def load_side(path: str | Path, default_model: str, default_workload: str, overrides: dict[str, object],
              slo: SLO | None, router: RouterName = "round_robin", fit: FittedModel | None = None) -> Side:
    """Simulate the deployment in `path`: Deployment fields, plus optional `model:` (a catalog name or
    config path) and `workload:` (a preset name, a workload file or an inline workload mapping).
    `overrides` (arrival, num_requests, seed) apply to the workload either way; `fit` stands in for
    the public GPU fit (simulate's)."""
    path = Path(path)
    data = load_yaml(path, "deployment file")
    if not isinstance(data, dict):
        raise InputError("deployment file", str(path), "must be a mapping of Deployment fields")
    model = resolve_model(str(data.pop("model", default_model)))
    spec = data.pop("workload", default_workload)
    if isinstance(spec, dict):
        try:
            workload = Workload.model_validate({**spec, **overrides})
        except ValidationError as exc:
            raise from_validation_error(exc, f"{path.name}: workload") from None
    else:
        workload = get_workload(str(spec), **overrides)
    try:
        dep = Deployment.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, path.name) from None
    replay = Replay.of(workload, model.vocab_size, model.max_position_embeddings)
    return simulate_side(str(path), model, get_hardware(dep.hardware), dep, workload, replay, slo, router, fit=fit)


def simulate_side(name: str, model: ModelConfig, hw: HardwareProfile, dep: Deployment, workload: Workload,
                  replay: Replay, slo: SLO | None, router: RouterName = "round_robin", *, capacity: bool = True,
                  runs: RunCache | None = None, fit: FittedModel | None = None) -> Side:
    """`dep` serving `replay` (drawn from `workload`), and with an SLO and `capacity` its capacity on
    `workload`'s requests, searched from the rate the run served (probes cached in `runs`): a search
    of simulations each long enough to fill the batch several times, so it costs tens of runs. `fit`
    stands in for the public GPU fit in both."""
    summary = simulate(model, hw, dep, replay, slo=slo, router=router, fit=fit).summary
    found = None
    if slo is not None and capacity:
        steady = summary.steady_state
        start = (workload.arrival.offered_rate_per_s if isinstance(workload.arrival, PoissonArrivals)
                 else steady.requests_per_s if steady is not None else summary.throughput.requests_per_s)
        found = slo_capacity(model, hw, dep, workload, slo, start_rate_per_s=min(max(start, MIN_RATE_PER_S), MAX_RATE_PER_S),
                             requests_per_probe=workload.num_requests, runs=runs, fit=fit)
    return Side(path=name, model=model.name, workload=workload.name, deployment=dep, summary=summary, capacity=found)


def compare(a: Side, b: Side) -> Comparison:
    rows = []
    for label, path in METRICS:
        va, vb = a.figure(path), b.figure(path)
        delta = None if va is None or vb is None else vb - va
        pct = None if delta is None or not va else 100.0 * delta / va
        rows.append(MetricDelta(metric=label, a=va, b=vb, delta=delta, delta_pct=pct,
                                a_range=_range(a.summary, path), b_range=_range(b.summary, path)))
    return Comparison(a=a, b=b, metrics=rows)


def _range(summary: RunSummary, path: str) -> tuple[float, float] | None:
    band = summary.prediction_interval
    return None if band is None else band.ranges.get(path)
