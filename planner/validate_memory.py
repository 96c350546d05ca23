"""The memory model against published engine start-up logs (planner/data/startup_logs.json): for each
log, the plan of the deployment as launched (engine release line, hardware, parallelism, precision,
flags) beside what the engine printed, and the median absolute error over the logs.

The logs are data to check the rules against, never to fit them: no figure of planner.memory is
derived from a log's KV-cache size. Logs of low confidence (launch flags unknown) are shown and left
out of the medians. `python -m planner.validate_memory` rewrites the table of docs/memory.md.
"""

from __future__ import annotations

from pathlib import Path
import re
import statistics

from pydantic import Field

from engine.catalog import resolve_model
from planner.engines import engine_for_release, get_engine, knobs_from_flags
from planner.hardware import get_hardware
from planner.memory.plan import MemoryPlan, Report, plan_memory
from planner.public.data import StartupLog, startup_logs
from planner.specs import Deployment

COMMAND = "serveplan validate --memory"
DOC = Path(__file__).resolve().parents[1] / "docs" / "memory.md"


class LogCheck(Report):
    id: str
    source_key: str
    source_url: str
    engine_profile: str
    profile_note: str | None = Field(None, description="How the log's engine version mapped to a profile, when not exactly")
    sampler: str | None = Field(None, description="The profiling pass's sampler, when the log states it")
    kv_predicted_gib: float
    kv_reported_gib: float | None
    kv_error_pct: float | None = Field(None, description="(predicted - reported) / reported, logs with room for a KV cache")
    weights_predicted_gib: float
    weights_reported_gib: float | None
    weights_error_pct: float | None
    activation_predicted_gib: float
    activation_reported_gib: float | None
    non_torch_predicted_gib: float
    non_torch_reported_gib: float | None
    fits_predicted: bool
    engine_started: bool | None = Field(None, description="False where the log shows the engine refusing to start")
    counted: bool = Field(description="In the medians (logs of low confidence are not)")


class MemoryValidation(Report):
    command: str
    logs: list[LogCheck]
    kv_logs: int = Field(description="Logs with a positive KV-cache figure")
    kv_median_abs_error_pct: float
    weights_logs: int
    weights_median_abs_error_pct: float
    sources: dict[str, int] = Field(description="Logs counted, per publication")
    kv_median_abs_error_pct_by_source: dict[str, float] = Field(description="The KV median of each publication's logs")
    refused_logs_agreeing: str = Field(description="Logs where the engine refused to start and the plan does not fit")


def validate_startup_logs() -> MemoryValidation:
    checks = [check_log(log) for log in startup_logs()]
    counted = [c for c in checks if c.counted]
    kv = [abs(c.kv_error_pct) for c in counted if c.kv_error_pct is not None]
    weights = [abs(c.weights_error_pct) for c in counted if c.weights_error_pct is not None]
    refused = [c for c in counted if c.engine_started is False]
    sources: dict[str, int] = {}
    by_source: dict[str, list[float]] = {}
    for c in counted:
        sources[c.source_key] = sources.get(c.source_key, 0) + 1
        if c.kv_error_pct is not None:
            by_source.setdefault(c.source_key, []).append(abs(c.kv_error_pct))
    return MemoryValidation(
        command=COMMAND, logs=checks, kv_logs=len(kv), kv_median_abs_error_pct=statistics.median(kv),
        weights_logs=len(weights), weights_median_abs_error_pct=statistics.median(weights), sources=sources,
        kv_median_abs_error_pct_by_source={k: statistics.median(v) for k, v in by_source.items()},
        refused_logs_agreeing=f"{sum(not c.fits_predicted for c in refused)} of {len(refused)}",
    )


def check_log(log: StartupLog) -> LogCheck:
    d, args, reported = log.deployment, log.engine.args, log.reported
    engine, note = engine_for_release(log.engine.engine, log.engine.version)
    model = resolve_model(d.model)
    knobs = knobs_from_flags(args)
    sampler = log.engine.profile_sampler
    dep = Deployment(hardware=d.hardware, tensor_parallel=d.tensor_parallel, pipeline_parallel=d.pipeline_parallel,
                     weight_dtype=d.weight_dtype, kv_dtype=d.kv_dtype, engine=engine, knobs=knobs,
                     profile_sampler=sampler)
    context = int(args.get("max_model_len", model.max_position_embeddings))
    plan = plan_memory(model, get_hardware(d.hardware), dep, context)
    kv_rep = reported.kv_cache_gib
    started = None if kv_rep is None else kv_rep > 0
    return LogCheck(
        id=log.id, source_key=log.source_key, source_url=log.source_url, engine_profile=get_engine(engine).name,
        profile_note=note, sampler=sampler,
        kv_predicted_gib=plan.kv_cache_gib, kv_reported_gib=kv_rep,
        kv_error_pct=_error(plan.kv_cache_gib, kv_rep) if started else None,
        weights_predicted_gib=plan.weights.total_gib, weights_reported_gib=reported.weights_gib,
        weights_error_pct=_error(plan.weights.total_gib, reported.weights_gib),
        activation_predicted_gib=plan.activation_reserve_gib, activation_reported_gib=reported.activation_peak_gib,
        non_torch_predicted_gib=_non_torch(plan), non_torch_reported_gib=reported.non_torch_gib,
        fits_predicted=plan.fits, engine_started=started, counted=log.confidence != "low",
    )


def _non_torch(plan: MemoryPlan) -> float:
    return sum(line.gib for line in plan.lines if line.key in ("runtime.modules", "runtime.nccl") and line.in_budget)


def _error(predicted: float, reported: float | None) -> float | None:
    return None if reported is None else (predicted - reported) / abs(reported) * 100


def markdown(report: MemoryValidation) -> str:
    """The validation table of docs/memory.md (between its <!-- validation --> markers)."""

    def num(value: float | None, pct: bool = False) -> str:
        return "-" if value is None else (f"{value:+.1f} %" if pct else f"{value:.2f}")

    rows = ["| log | profile | KV predicted | KV logged | KV error | weights predicted | weights logged | weights error |",
            "|---|---|---|---|---|---|---|---|"]
    for c in report.logs:
        name = f"[{c.id}]({c.source_url})" + ("" if c.counted else " (low confidence, not counted)")
        rows.append(f"| {name} | {c.engine_profile} | {num(c.kv_predicted_gib)} | {num(c.kv_reported_gib)} | "
                    f"{num(c.kv_error_pct, True)} | {num(c.weights_predicted_gib)} | {num(c.weights_reported_gib)} | "
                    f"{num(c.weights_error_pct, True)} |")
    sources = ", ".join(f"{k} ({v} logs, KV median {report.kv_median_abs_error_pct_by_source.get(k, 0):.1f} %)"
                        for k, v in report.sources.items())
    rows += ["", f"KV cache: median |error| **{report.kv_median_abs_error_pct:.1f} %** over {report.kv_logs} logs; "
                 f"weights: median |error| **{report.weights_median_abs_error_pct:.2f} %** over {report.weights_logs} "
                 f"logs; engines that refused to start whose plan does not fit: {report.refused_logs_agreeing}. "
                 f"Per source: {sources}."]
    return "\n".join(rows)


def regenerate(text: str) -> str:
    block = f"<!-- validation -->\n{markdown(validate_startup_logs())}\n<!-- /validation -->"
    return re.sub(r"<!-- validation -->\n.*?<!-- /validation -->", lambda _: block, text, flags=re.S)


if __name__ == "__main__":
    DOC.write_text(regenerate(DOC.read_text()))
