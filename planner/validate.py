"""Validation: the same seeded requests through the real engine and the calibrated simulator.

For each workload the engine replays it on the wall clock (`planner.engine_bench`) and the
simulator replays the identical request list on the calibrated local profile with the same
engine knobs and the same number of KV blocks; the report puts the two summaries side by side
with the simulator's signed error. The workloads are whole serving scenarios, disjoint from
calibration's single-step grid, so the error measures prediction, not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import statistics

from pydantic import BaseModel, ConfigDict, Field

from engine.catalog import resolve_model
from engine.config import EngineConfig
from engine.dtypes import ENGINE_DTYPE_OF
from engine.errors import InputError, unknown_name_error
from planner.calibrate import load_calibration
from planner.metrics import RunSummary
from planner.playback import Replay
from planner.sim import simulate
from planner.specs import Deployment, EngineKnobs
from planner.workload import (
    ClosedLoopArrivals,
    ConstantArrivals,
    FixedLength,
    LognormalLength,
    NormalLength,
    PoissonArrivals,
    SharedPrefix,
    Workload,
)

BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 512
MAX_NUM_SEQS = 16
# The headline metrics and the median-absolute-error bound each must meet across workloads.
HEADLINE_BOUNDS_PCT: dict[str, float] = {
    "ttft_ms.mean": 10.0,
    "tpot_ms.mean": 10.0,
    "e2e_ms.mean": 10.0,
    "throughput.output_tokens_per_s": 10.0,
    "ttft_ms.p99": 20.0,
}
COMPARED = [f"{m}.{s}" for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms") for s in ("mean", "p50", "p90", "p99")] + [
    "throughput.output_tokens_per_s", "throughput.requests_per_s", "prefix_cache_hit_rate", "preemptions",
]


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    workload: Workload
    num_kv_blocks: int = 2048  # 32k tokens: room for every scenario except the overload one


def scenarios(quick: bool) -> list[Scenario]:
    """Small enough for a 2-core CPU; each stresses one behaviour the simulator must get right."""
    n = 6 if quick else 14
    chat_in = LognormalLength(median_tokens=48, sigma=0.6, min_tokens=8, max_tokens=256)
    chat_out = LognormalLength(median_tokens=24, sigma=0.5, min_tokens=4, max_tokens=64)

    def wl(name: str, **spec: object) -> Workload:
        base = dict(name=name, input_tokens=chat_in, output_tokens=chat_out, num_requests=n, first_token_id=100,
                    vocab_size_tokens=30_000, seed=11)
        return Workload(**{**base, **spec})

    out = [
        Scenario("chat-low", "chat at low load: requests mostly alone", wl("chat-low", arrival=PoissonArrivals(rate_per_s=0.4))),
        Scenario("chat-high", "chat at high load: batches of several decodes with prefills",
                 wl("chat-high", arrival=PoissonArrivals(rate_per_s=4.0))),
        Scenario("long-prompt", "prefill-heavy: long prompts, a few output tokens",
                 wl("long-prompt", arrival=PoissonArrivals(rate_per_s=0.5), num_requests=max(4, n // 2),
                    input_tokens=NormalLength(mean_tokens=800, std_tokens=150, min_tokens=400, max_tokens=1200),
                    output_tokens=FixedLength(tokens=8))),
        Scenario("shared-prefix", "agent-style: a 512-token shared prefix, short own prompts",
                 wl("shared-prefix", arrival=PoissonArrivals(rate_per_s=1.0),
                    shared_prefix=SharedPrefix(num_prefixes=1, prefix_tokens=512, share=1.0),
                    input_tokens=LognormalLength(median_tokens=32, sigma=0.4, min_tokens=8, max_tokens=96),
                    output_tokens=FixedLength(tokens=16))),
        # Preemption by construction, not by timing: all 14 arrive within microseconds, before the
        # first step ends, so 8 prompts of 6 blocks are admitted together into 48 blocks and every
        # decode that grows into a 7th block forces a preemption, however fast the engine runs.
        Scenario("overload", "everyone at once into a small KV cache: queueing and preemptions",
                 wl("overload", arrival=ConstantArrivals(rate_per_s=1e6), num_requests=14,
                    input_tokens=FixedLength(tokens=96), output_tokens=FixedLength(tokens=48)),
                 num_kv_blocks=48),
    ]
    for users in (1, 4) if quick else (1, 4, 8):
        out.append(Scenario(f"closed-loop-{users}", f"closed loop, {users} concurrent user(s)",
                            wl(f"closed-loop-{users}", arrival=ClosedLoopArrivals(concurrency=users))))
    return out


class ValidationRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    scenario: str
    description: str
    engine: RunSummary
    simulator: RunSummary
    error_pct: dict[str, float | None] = Field(description="metric -> (simulator - engine) / engine x 100; None when the engine's is 0")


class ValidationReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    calibration: str
    hardware_profile: str
    fit_median_abs_error_pct: float = Field(description="Calibration residuals, reported apart from validation error")
    rows: list[ValidationRow]
    median_abs_error_pct: dict[str, float]
    bounds_pct: dict[str, float]
    passed: bool
    tensor_parallel: int = Field(1, description="Processes the engine ran as; the simulated deployment's TP")
    expert_parallel: int = Field(1, description="Ranks the experts were placed on; the simulated deployment's EP")


def compare(engine: RunSummary, sim: RunSummary) -> dict[str, float | None]:
    errors: dict[str, float | None] = {}
    for metric in COMPARED:
        e, s = engine.figure(metric), sim.figure(metric)
        errors[metric] = (s - e) / e * 100 if e and s is not None else None
    return errors


def validate(model_name: str, calibration_path: str | Path, *, random_weights: bool = False, quick: bool = False,
             only: list[str] | None = None, force: bool = False, progress: bool = True, tensor_parallel: int = 1,
             expert_parallel: int = 1) -> ValidationReport:
    """Every scenario through the engine and the simulator. With tensor_parallel or expert_parallel,
    the engine runs as that many processes (engine/parallel) and the simulator prices the same
    deployment: the single-process calibration plus the communication curves it measured."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from engine.llm import LLM
    from planner.engine_bench import bench_engine

    model = resolve_model(model_name)
    cal = load_calibration(calibration_path, model=model, force=force)
    hw = cal.profile
    if cal.device.kind == "cpu":
        torch.set_num_threads(cal.device.threads)  # the thread count the fit was measured with
    chosen = scenarios(quick)
    if only:
        known = {s.name: s for s in chosen}
        for name in only:
            if name not in known:
                raise unknown_name_error("workloads", name, known)
        chosen = [known[name] for name in only]

    parallel = EngineConfig(tensor_parallel=tensor_parallel, expert_parallel=expert_parallel)  # --ep N alone: N ranks
    if parallel.tensor_parallel > 1 and hw.scale_up is None:
        raise InputError("calibration", str(calibration_path), "holds no measurement of this machine's collectives "
                         "(made before they were measured); run serveplan calibrate again")
    rows = []
    engine_dtype = ENGINE_DTYPE_OF[cal.dtype]
    knobs = EngineKnobs(block_size_tokens=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                        max_num_seqs=MAX_NUM_SEQS)
    dep = Deployment(hardware=hw.name, tensor_parallel=parallel.tensor_parallel, expert_parallel=expert_parallel,
                     weight_dtype=cal.dtype, kv_dtype=cal.dtype, engine="serveplan", knobs=knobs)
    llm: LLM | None = None
    with Progress(console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task(f"validating {model_name}", total=len(chosen))
        for sc in chosen:
            # The weights load once; each scenario gets a fresh engine (scheduler, KV cache) over them.
            llm = LLM(model_name, device=cal.device.kind, dtype=engine_dtype, random_weights=random_weights,
                      num_kv_blocks=sc.num_kv_blocks, tensor_parallel=parallel.tensor_parallel,
                      expert_parallel=expert_parallel, threads=torch.get_num_threads(),
                      **knobs.model_dump()) if llm is None else llm.with_settings(num_kv_blocks=sc.num_kv_blocks)
            replay = Replay.of(sc.workload, vocab_size=model.vocab_size, max_model_len=llm.max_model_len)
            engine, _ = bench_engine(llm, replay, model_name=model.name or model_name)
            sim = simulate(model, hw, dep, replay, calibration=cal.cost_params(), kv_cache_blocks=sc.num_kv_blocks).summary
            rows.append(ValidationRow(scenario=sc.name, description=sc.description, engine=engine, simulator=sim,
                                      error_pct=compare(engine, sim)))
            bar.advance(task)

    medians = {m: statistics.median(abs(r.error_pct[m]) for r in rows if r.error_pct[m] is not None)
               for m in HEADLINE_BOUNDS_PCT}
    return ValidationReport(
        model=model.name or model_name,
        calibration=str(calibration_path),
        hardware_profile=hw.name,
        fit_median_abs_error_pct=cal.fit_median_abs_error_pct,
        rows=rows,
        median_abs_error_pct=medians,
        bounds_pct=HEADLINE_BOUNDS_PCT,
        passed=all(medians[m] <= bound for m, bound in HEADLINE_BOUNDS_PCT.items()),
        tensor_parallel=parallel.tensor_parallel,
        expert_parallel=expert_parallel,
    )


def markdown(report: ValidationReport, command: str) -> str:
    """The report as a markdown section for docs/validation.md."""
    lines = [
        f"### {report.model} on {report.hardware_profile}" + (
            f", tensor parallel {report.tensor_parallel}" + (f", expert parallel {report.expert_parallel}"
                                                             if report.expert_parallel > 1 else "")
            if report.tensor_parallel > 1 else ""),
        "",
        f"Command: `{command}`  ",
        f"Calibration: `{report.calibration}` (fit residual, single steps: median |error| "
        f"{report.fit_median_abs_error_pct:.1f} %)",
        "",
        "| workload | metric | engine | simulator | error % |",
        "|---|---|---:|---:|---:|",
    ]
    for row in report.rows:
        for metric in COMPARED:
            e, s, err = row.engine.figure(metric), row.simulator.figure(metric), row.error_pct[metric]
            lines.append(f"| {row.scenario} | {metric} | {e:,.2f} | {s:,.2f} | {'n/a' if err is None else f'{err:+.1f}'} |")
    if report.tensor_parallel > 1:
        lines += ["", "| workload | communication share of step time, engine (rank 0) % | simulator % |", "|---|---:|---:|"]
        for row in report.rows:
            shares = (row.engine.utilisation.communication_share, row.simulator.utilisation.communication_share)
            lines.append(f"| {row.scenario} | " + " | ".join("n/a" if v is None else f"{v * 100:.1f}" for v in shares) + " |")
    lines += ["", "| headline metric | median \\|error\\| % across workloads | bound % | |", "|---|---:|---:|---|"]
    for metric, bound in report.bounds_pct.items():
        value = report.median_abs_error_pct[metric]
        lines.append(f"| {metric} | {value:.1f} | {bound:g} | {'ok' if value <= bound else 'MISSED'} |")
    return "\n".join(lines) + "\n"

