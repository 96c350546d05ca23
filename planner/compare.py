"""What-if comparisons: two deployments (or one under two workloads) simulated side by side."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.catalog import resolve_model
from engine.errors import InputError, from_validation_error
from engine.files import load_yaml
from planner.costmodel.fitted import FittedModel
from planner.hardware import get_hardware
from planner.metrics import RunSummary
from planner.playback import Replay
from planner.sim import simulate
from planner.specs import SLO, Deployment
from planner.workload import Workload, get_workload

# (label, path into RunSummary): the figures a what-if question is usually about.
METRICS: tuple[tuple[str, str], ...] = (
    ("TTFT P50, ms", "ttft_ms.p50"),
    ("TTFT P99, ms", "ttft_ms.p99"),
    ("TPOT P50, ms", "tpot_ms.p50"),
    ("TPOT P99, ms", "tpot_ms.p99"),
    ("ITL P99, ms", "itl_ms.p99"),
    ("E2E P99, ms", "e2e_ms.p99"),
    ("requests/s", "throughput.requests_per_s"),
    ("output tokens/s", "throughput.output_tokens_per_s"),
    ("goodput share", "goodput.share"),
    ("prefix-cache hit rate", "prefix_cache_hit_rate"),
    ("preemptions", "preemptions"),
    ("KV blocks", "kv_cache_blocks_total"),
    ("busy share", "utilisation.busy_share"),
    ("US$/h", "cost.usd_per_hour"),
    ("US$ per 1M output tokens", "cost.usd_per_million_output_tokens"),
)


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Side(_Out):
    """One side of a comparison as read from its YAML file."""

    path: str
    model: str
    workload: str
    deployment: Deployment
    summary: RunSummary


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
              slo: SLO | None, router: str = "round_robin", fit: FittedModel | None = None) -> Side:
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
    hw = get_hardware(dep.hardware)
    replay = Replay.of(workload, model.vocab_size, model.max_position_embeddings)
    summary = simulate(model, hw, dep, replay, slo=slo, router=router, fit=fit).summary
    return Side(path=str(path), model=model.name, workload=workload.name, deployment=dep, summary=summary)


def compare(a: Side, b: Side) -> Comparison:
    rows = []
    for label, path in METRICS:
        va, vb = a.summary.figure(path), b.summary.figure(path)
        delta = None if va is None or vb is None else vb - va
        pct = None if delta is None or not va else 100.0 * delta / va
        rows.append(MetricDelta(metric=label, a=va, b=vb, delta=delta, delta_pct=pct,
                                a_range=_range(a.summary, path), b_range=_range(b.summary, path)))
    return Comparison(a=a, b=b, metrics=rows)


def _range(summary: RunSummary, path: str) -> tuple[float, float] | None:
    band = summary.prediction_interval
    return None if band is None else band.ranges.get(path)
