"""Validation: the same seeded requests through the real engine and the calibrated simulator.

For each workload the engine replays it on the wall clock (`planner.engine_bench`) and the
simulator replays the identical request list on the calibrated local profile with the same
engine knobs and the same number of KV blocks; the report puts the two summaries side by side
with the simulator's signed error. The workloads are whole serving scenarios, disjoint from
calibration's single-step grid, so the error measures prediction, not fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
import statistics
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.catalog import resolve_model
from engine.config import EngineConfig
from engine.dtypes import ENGINE_DTYPE_OF
from engine.errors import InputError, unknown_name_error
from planner.calibrate import OWN_ENGINE_PROFILE, load_calibration
from planner.metrics import RunSummary
from planner.playback import Replay
from planner.sim import simulate
from planner.specs import Deployment, Disaggregation, EngineKnobs
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
GIB = 2**30
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
    "kv_transfer.total_ms.mean", "offload.host_hit_tokens", "offload.swapped_out_requests",
]  # a metric a run does not have (transfers without disaggregation) is left out of its row
GROUPS = ("base", "disaggregation and offload")


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    workload: Workload
    num_kv_blocks: int = 2048  # 32k tokens: room for every scenario except the overload one
    host_blocks: int = 0  # the host KV tier's blocks (0: none)
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    disaggregated: bool = False  # one prefill and one decode worker, each a process of its own
    group: str = GROUPS[0]


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
    return out + disaggregation_and_offload(quick, wl)


def disaggregation_and_offload(quick: bool, wl: Callable[..., Workload]) -> list[Scenario]:
    """One prefill and one decode process; swap instead of recompute; a host tier keeping the
    prefixes the device cache evicts, beside the same workload without it (docs/offload.md)."""
    n = 5 if quick else 8
    group = GROUPS[1]
    # Four 256-token prefixes (16 blocks each) in a 40-block cache: at most two stay on the device.
    agent = wl("agent", arrival=PoissonArrivals(rate_per_s=0.5), num_requests=2 * n,
               shared_prefix=SharedPrefix(num_prefixes=4, prefix_tokens=256, share=1.0),
               input_tokens=LognormalLength(median_tokens=24, sigma=0.4, min_tokens=8, max_tokens=64),
               output_tokens=FixedLength(tokens=8))
    return [
        Scenario("disagg-long-prompt", "disaggregated 1P1D: long prompts computed on one process, decoded on another",
                 wl("disagg-long-prompt", arrival=PoissonArrivals(rate_per_s=0.15), num_requests=n,
                    input_tokens=NormalLength(mean_tokens=400, std_tokens=100, min_tokens=200, max_tokens=600),
                    output_tokens=FixedLength(tokens=32)),
                 disaggregated=True, group=group),
        # The overload scenario's construction (everyone at once into 48 blocks), preempting by swap.
        Scenario("swap-overload", "everyone at once into a small KV cache, preempted requests swapped to host memory",
                 wl("swap-overload", arrival=ConstantArrivals(rate_per_s=1e6), num_requests=14,
                    input_tokens=FixedLength(tokens=96), output_tokens=FixedLength(tokens=48)),
                 num_kv_blocks=48, host_blocks=256, preemption_mode="swap", group=group),
        Scenario("agent-device-only", "agent prefixes that outgrow the device cache, no host tier",
                 agent.model_copy(update={"name": "agent-device-only"}), num_kv_blocks=40, group=group),
        Scenario("agent-host-tier", "the same agent requests with a 128-block host tier keeping evicted prefixes",
                 agent.model_copy(update={"name": "agent-host-tier"}), num_kv_blocks=40, host_blocks=128, group=group),
    ]


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
    median_abs_error_pct_by_group: dict[str, dict[str, float]] = Field(
        {}, description="The same medians over each group of scenarios (the base ones; disaggregation and offload)")
    bounds_pct: dict[str, float]
    passed: bool
    tensor_parallel: int = Field(1, description="Processes the engine ran as; the simulated deployment's TP")
    expert_parallel: int = Field(1, description="Ranks the experts were placed on; the simulated deployment's EP")


def compare(engine: RunSummary, sim: RunSummary) -> dict[str, float | None]:
    """metric -> signed error %; None where the engine's value is 0, absent where a run lacks it."""
    errors: dict[str, float | None] = {}
    for metric in COMPARED:
        e, s = engine.figure(metric), sim.figure(metric)
        if e is None or s is None:
            continue
        errors[metric] = (s - e) / e * 100 if e else None
    return errors


def medians(rows: list[ValidationRow]) -> dict[str, float]:
    """Median |error| of each headline metric across `rows`."""
    return {m: statistics.median(abs(err) for r in rows if (err := r.error_pct.get(m)) is not None)
            for m in HEADLINE_BOUNDS_PCT}


def validate(model_name: str, calibration_path: str | Path, *, random_weights: bool = False, quick: bool = False,
             only: list[str] | None = None, force: bool = False, progress: bool = True, tensor_parallel: int = 1,
             expert_parallel: int = 1) -> ValidationReport:
    """Every scenario through the engine and the simulator. With tensor_parallel or expert_parallel,
    the engine runs as that many processes (engine/parallel) and the simulator prices the same
    deployment: the single-process calibration plus the communication curves it measured."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from engine.disagg import DisaggregatedLLM
    from engine.llm import LLM
    from planner.engine_bench import bench_disaggregated, bench_engine

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
    if parallel.tensor_parallel > 1:
        # Offload tiers and disaggregated workers run in one process each: a parallel run validates the rest.
        single = [sc.name for sc in chosen if sc.disaggregated or sc.host_blocks]
        if only and single:
            raise InputError("workloads", single[0], "runs in one process (offload tiers or disaggregated workers): "
                             "validate it without --tp/--ep")
        chosen = [sc for sc in chosen if sc.name not in single]
    if parallel.tensor_parallel > 1 and hw.scale_up is None:
        raise InputError("calibration", str(calibration_path), "holds no measurement of this machine's collectives "
                         "(made before they were measured); run serveplan calibrate again")
    rows = []
    engine_dtype = ENGINE_DTYPE_OF[cal.dtype]
    knobs = EngineKnobs(block_size_tokens=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                        max_num_seqs=MAX_NUM_SEQS)
    if any(sc.disaggregated or sc.host_blocks for sc in chosen) and cal.microbenchmarks.kv_copies is None:
        raise InputError("calibration", str(calibration_path), "predates the KV copy benchmarks that the "
                         "disaggregation and offload scenarios need; run serveplan calibrate again")
    block_bytes = model.kv_bytes_per_token(cal.dtype) * BLOCK_SIZE
    llm: LLM | None = None
    groups: dict[str, list[ValidationRow]] = {}
    with Progress(console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task(f"validating {model_name}", total=len(chosen))
        for sc in chosen:
            host_gib = sc.host_blocks * block_bytes / GIB
            engine_knobs = knobs.model_copy(update={"kv_offload_host_gib": host_gib, "preemption_mode": sc.preemption_mode})
            replay = Replay.of(sc.workload, vocab_size=model.vocab_size, max_model_len=model.max_position_embeddings)
            if sc.disaggregated:
                settings = {"device": cal.device.kind, "dtype": engine_dtype, "random_weights": random_weights,
                            "threads": cal.device.threads, "num_kv_blocks": sc.num_kv_blocks, **engine_knobs.model_dump()}
                with DisaggregatedLLM(model_name, **settings) as workers:
                    engine, _ = bench_disaggregated(workers, replay, model_name=model.name or model_name)
            else:
                # The weights load once; each scenario gets a fresh engine (scheduler, KV cache) over them.
                changes = {"num_kv_blocks": sc.num_kv_blocks, "kv_offload_host_gib": host_gib,
                           "preemption_mode": sc.preemption_mode}
                llm = LLM(model_name, device=cal.device.kind, dtype=engine_dtype, random_weights=random_weights,
                          tensor_parallel=parallel.tensor_parallel, expert_parallel=expert_parallel,
                          threads=torch.get_num_threads(), **{**knobs.model_dump(), **changes}
                          ) if llm is None else llm.with_settings(**changes)
                engine, _ = bench_engine(llm, replay, model_name=model.name or model_name)
            dep = Deployment(hardware=hw.name, tensor_parallel=parallel.tensor_parallel, expert_parallel=expert_parallel,
                             weight_dtype=cal.dtype, kv_dtype=cal.dtype, engine=OWN_ENGINE_PROFILE, knobs=engine_knobs,
                             disaggregation=Disaggregation() if sc.disaggregated else None)
            sim = simulate(model, hw, dep, replay, calibration=cal.cost_params(), kv_cache_blocks=sc.num_kv_blocks).summary
            rows.append(ValidationRow(scenario=sc.name, description=sc.description, engine=engine, simulator=sim,
                                      error_pct=compare(engine, sim)))
            groups.setdefault(sc.group, []).append(rows[-1])
            bar.advance(task)

    overall = medians(rows)
    by_group = {group: medians(group_rows) for group, group_rows in groups.items()}
    return ValidationReport(
        model=model.name or model_name,
        calibration=str(calibration_path),
        hardware_profile=hw.name,
        fit_median_abs_error_pct=cal.fit_median_abs_error_pct,
        rows=rows,
        median_abs_error_pct=overall,
        median_abs_error_pct_by_group=by_group,
        bounds_pct=HEADLINE_BOUNDS_PCT,
        passed=all(values[m] <= bound for values in (overall, *by_group.values()) for m, bound in HEADLINE_BOUNDS_PCT.items()),
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
            if metric not in row.error_pct:
                continue
            e, s, err = row.engine.figure(metric), row.simulator.figure(metric), row.error_pct[metric]
            lines.append(f"| {row.scenario} | {metric} | {e:,.2f} | {s:,.2f} | {'n/a' if err is None else f'{err:+.1f}'} |")
    if report.tensor_parallel > 1:
        lines += ["", "| workload | communication share of step time, engine (rank 0) % | simulator % |", "|---|---:|---:|"]
        for row in report.rows:
            shares = (row.engine.utilisation.communication_share, row.simulator.utilisation.communication_share)
            lines.append(f"| {row.scenario} | " + " | ".join("n/a" if v is None else f"{v * 100:.1f}" for v in shares) + " |")
    groups = {"all workloads": report.median_abs_error_pct, **report.median_abs_error_pct_by_group}
    for group, values in groups.items():
        lines += ["", f"| headline metric | median \\|error\\| %, {group} | bound % | |", "|---|---:|---:|---|"]
        for metric, bound in report.bounds_pct.items():
            value = values[metric]
            lines.append(f"| {metric} | {value:.1f} | {bound:g} | {'ok' if value <= bound else 'MISSED'} |")
    return "\n".join(lines) + "\n"

