"""`serveplan`: one console command, one subcommand per capability.

Flags of declared settings (engine knobs, deployment, workload overrides) are generated from
their fields (engine/knobs.py). Bad input never produces a traceback: `main` is the one handler
that turns an InputError (whose field it names by the flag that sets it), an unreadable file or a
Ctrl-C into one line on stderr and exit status 2 (130 for Ctrl-C). Exit status 1 is an answer that
is "no": `memory` for a model that does not fit, `plan` when nothing is recommended.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
import json
import os
from pathlib import Path
import sys
import time
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.table import Table

from engine.catalog import catalog, resolve_model
from engine.cli import add_engine_commands, add_engine_flags, engine_settings
from engine.config import EngineConfig
from engine.cpu import default_threads
from engine.errors import InputError, excerpt, from_validation_error
from engine.files import output_file
from engine.knobs import Setting, add_flags, command, read_flags, settings, values
from planner.costmodel.fitted import FittedModel, load_fitted_model
from planner.engines import engine_catalog, get_engine
from planner.hardware import get_hardware, hardware_catalog
from planner.memory import MemoryPlan, plan_memory
from planner.validate_memory import MemoryValidation, validate_startup_logs
from planner.metrics import MIN_STEADY_REQUESTS, PricedStep, RunSummary, SteadyState
from planner.playback import Replay
from planner.sim import ROUTERS, context_length, simulate
from planner.specs import (
    DEFAULT_REQUESTS_PER_PROBE, SLO, Deployment, Disaggregation, EngineKnobs, HardwareProfile, MemoryQuery, PlanSettings,
    WorkloadOverrides,
)
from planner.workload import PRESETS, Workload, get_workload, workload_from_trace

if TYPE_CHECKING:
    from rich.progress import TaskID

    from planner.endpoint_bench import BenchReport
    from planner.public.fit import Progress
    from planner.search import CandidatePlan, PlanResult
    from planner.search.day import DayPlan, HourReport

DEPLOYMENT = settings(Deployment)
KNOBS = settings(EngineKnobs)
DISAGGREGATION = settings(Disaggregation)
WORKLOAD = settings(WorkloadOverrides)
TRACE_SUFFIXES = (".jsonl", ".csv")
# `engine bench` on a preset: a CPU serves a few requests per second at best, and a preset asks
# for thousands. A workload file or a trace keeps its own count.
BENCH_PRESET_REQUESTS = 16

# Piped output (scripts, CI logs) gets a wide fixed width instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 160)


# --------------------------------------------------------------------------- shared flags


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    """The deployment flags every planning subcommand shares (memory, simulate, ...)."""
    p.add_argument("--model", default="llama-3.1-8b", help="catalog name (see `serveplan models list`) or path to a config.json / checkpoint folder")
    p.add_argument("--hw", dest="hardware", default="h100-sxm", help="hardware profile name (see `serveplan hw list`) or a YAML file")
    add_flags(p, [*DEPLOYMENT, *KNOBS])
    # Not given: every instance does both prefill and decode.
    add_flags(p, DISAGGREGATION, **{s.name: None for s in DISAGGREGATION})


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    given = {name: v for name, v in values(args, DISAGGREGATION).items() if v is not None}
    return Deployment(hardware=args.hardware, **values(args, DEPLOYMENT), knobs=EngineKnobs(**values(args, KNOBS)),
                      disaggregation=Disaggregation(**given) if given else None)


def add_calibration_arg(p: argparse.ArgumentParser) -> None:
    """--calibration, for every command that simulates GPUs (simulate, plan, compare)."""
    p.add_argument("--calibration", metavar="FILE", help="a fit file (`serveplan calibrate --from-bench` or `--public`): "
                   "its GPU-family and engine figures replace the profiles' and its bands give the prediction "
                   "intervals (default: the public fit, if made)")


def fit_from_args(args: argparse.Namespace) -> FittedModel | None:
    """The fit --calibration names; None: the public fit, if made."""
    return load_fitted_model(args.calibration) if args.calibration else None


def print_json(model: BaseModel | list | dict) -> None:
    data = model.model_dump(mode="json") if isinstance(model, BaseModel) else model
    print(json.dumps(data, indent=2, sort_keys=False))


# --------------------------------------------------------------------------- memory


def cmd_memory(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    dep = deployment_from_args(args)
    plan = plan_memory(model, get_hardware(args.hardware), dep, args.context_tokens)
    if args.json:
        print_json(plan)
    else:
        render_memory(plan)
    if not plan.fits:
        raise SystemExit(1)


def render_memory(plan: MemoryPlan) -> None:
    title = (
        f"{plan.model} on {plan.hardware} with {plan.engine}  tp={plan.tensor_parallel} pp={plan.pipeline_parallel} "
        f"ep={plan.expert_parallel}  weights {plan.weight_dtype}, KV {plan.kv_dtype}, context {plan.context_tokens:,} tokens"
    )
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("per GPU (worst pipeline stage)")
    t.add_column("GiB", justify="right")
    t.add_column("rule")
    t.add_column("source", style="dim", overflow="fold")
    outside = False
    for line in plan.lines:
        if line.key == "kv":
            t.add_section()
        elif not line.in_budget and not outside and line.key not in ("device.reported", "budget"):
            t.add_section()
            t.add_row("[italic]outside the budget: must fit in what the engine leaves[/italic]", "", "", "")
            outside = True
        label = f"[bold]{line.label}[/bold]" if line.key == "kv" else line.label
        t.add_row(label, f"{line.gib:,.2f}", line.rule, line.source)
    console.print(t)
    kv = Table(show_header=False)
    kv.add_column("KV cache")
    kv.add_column("value", justify="right")
    kv.add_row("KV bytes per token (model, all layers)", f"{plan.kv_bytes_per_token_model:,}")
    kv.add_row("KV bytes per token per GPU", f"{plan.kv_bytes_per_token_per_gpu:,}")
    kv.add_row(f"KV bytes per block per GPU ({plan.block_size_tokens} tokens)", f"{plan.kv_bytes_per_block_per_gpu:,}")
    kv.add_row("KV blocks / tokens per replica", f"{plan.kv_cache_blocks:,} / {plan.kv_cache_tokens:,}")
    kv.add_row(f"max concurrent sequences of {plan.context_tokens:,} tokens", f"{plan.max_concurrent_sequences:,}")
    if plan.max_concurrent_sequences_window_aware is not None:
        kv.add_row("  ... if out-of-window blocks were freed", f"{plan.max_concurrent_sequences_window_aware:,}")
    kv.add_row("engine limit max_num_seqs", f"{plan.max_num_seqs:,}")
    console.print(kv)
    style = "bold green" if plan.fits else "bold red"
    console.print(plan.reason, style=style)
    console.print("Assumptions:", style="dim")
    for note in plan.assumptions:
        console.print(f"  - {note}", style="dim")


def render_memory_validation(report: MemoryValidation, as_json: bool) -> None:
    if as_json:
        print_json(report)
        return
    t = Table(title=f"Memory model vs {len(report.logs)} published engine start-up logs (GiB per GPU; "
                    "signed error of the prediction)")
    for col in ("log", "profile", "KV pred", "KV log", "KV err", "weights pred", "weights log", "weights err"):
        t.add_column(col, justify="left" if col in ("log", "profile") else "right", overflow="fold")

    def num(value: float | None, pct: bool = False) -> str:
        return "-" if value is None else (f"{value:+.1f} %" if pct else f"{value:,.2f}")

    for c in report.logs:
        name = c.id if c.counted else f"[dim]{c.id} (low confidence, not counted)[/dim]"
        t.add_row(name, c.engine_profile, num(c.kv_predicted_gib), num(c.kv_reported_gib), num(c.kv_error_pct, True),
                  num(c.weights_predicted_gib), num(c.weights_reported_gib), num(c.weights_error_pct, True))
    console.print(t)
    sources = ", ".join(f"{k} ({v} logs, KV {report.kv_median_abs_error_pct_by_source.get(k, 0):.1f} %)"
                        for k, v in report.sources.items())
    console.print(f"KV cache: median |error| {report.kv_median_abs_error_pct:.1f} % over {report.kv_logs} logs; "
                  f"weights: {report.weights_median_abs_error_pct:.2f} % over {report.weights_logs} logs; engines that "
                  f"refused to start and plans that do not fit: {report.refused_logs_agreeing}. Sources: {sources}.")


# --------------------------------------------------------------------------- catalogs


def cmd_hw_list(args: argparse.Namespace) -> None:
    _print_catalog(args, hardware_catalog(), "hardware profiles (dense peaks; * = derived or estimated, see `hw show`)",
                   ("name", "device", "memory GiB", "reported GiB", "bandwidth GB/s", "bf16 TFLOPS", "fp8 TFLOPS",
                    "scale-up GB/s", "US$/hour"), 2,
                   lambda p: (p.name, p.display_name, _fmt(p, "memory_gib", p.memory_gib),
                              _fmt(p, "memory_reported_gib", p.memory_reported_gib),
                              _fmt(p, "memory_bandwidth_gb_s", p.memory_bandwidth_gb_s),
                              _fmt(p, "peak_tflops.bf16", p.peak_tflops.bf16),
                              _fmt(p, "peak_tflops.fp8", p.peak_tflops.fp8),
                              _fmt(p, "scale_up.bandwidth_gb_s", p.scale_up.bandwidth_gb_s if p.scale_up else None),
                              _fmt(p, "price_usd_per_hour", p.price_usd_per_hour)))


def cmd_engines_list(args: argparse.Namespace) -> None:
    _print_catalog(args, engine_catalog(), "engine profiles (`engines show NAME`: every figure with its source)",
                   ("name", "engine", "releases", "batching", "chunked prefill", "host overlapped", "step overhead ms"), 6,
                   lambda p: (p.name, p.engine, p.versions, p.scheduling.batching,
                              str(p.scheduling.enable_chunked_prefill), str(p.execution.overlap_host),
                              f"{p.overheads.step_us / 1e3:.2f}"))


def _print_catalog(args: argparse.Namespace, profiles: dict[str, Any], what: str, columns: tuple[str, ...],
                   text_columns: int, row: Callable[[Any], tuple[str, ...]]) -> None:
    """A catalog as JSON (--json) or a table: its first `text_columns` columns left-aligned, figures right."""
    if args.json:
        print_json([p.model_dump(mode="json") for p in profiles.values()])
        return
    t = Table(title=f"{len(profiles)} {what}")
    for k, col in enumerate(columns):
        t.add_column(col, justify="left" if k < text_columns else "right", no_wrap=True)
    for p in profiles.values():
        t.add_row(*row(p))
    console.print(t)


def cmd_engines_show(args: argparse.Namespace) -> None:
    profile = get_engine(args.name)
    if args.json:
        print_json(profile)
        return
    _print_fields(f"{profile.display_name} ({profile.name}, releases {profile.versions})",
                  profile.model_dump(mode="json", exclude={"notes"}), "Notes", profile.notes)


def _print_fields(title: str, data: dict, list_title: str, items: Sequence[str],
                  provenance: dict[str, str] | None = None) -> None:
    """A profile as one row per field (with its provenance where the profile keeps one), then a list."""
    t = Table(title=title, show_header=False)
    t.add_column("field")
    t.add_column("value")
    if provenance is not None:
        t.add_column("provenance", style="dim")
    for field, value in _flatten(data):
        t.add_row(field, str(value), *([provenance.get(field, "")] if provenance is not None else []))
    console.print(t)
    console.print(f"{list_title}:", style="bold")
    for item in items:
        console.print(f"  - {item}")


def _fmt(p: HardwareProfile, field: str, value: float | None) -> str:
    if value is None:
        return "-"
    mark = "*" if field in p.provenance else ""
    return f"{value:,.4g}{mark}"


def cmd_hw_show(args: argparse.Namespace) -> None:
    profile = get_hardware(args.name)
    if args.json:
        print_json(profile)
        return
    _print_fields(f"{profile.display_name} ({profile.name})", profile.model_dump(exclude={"provenance", "sources"}),
                  "Sources", profile.sources, profile.provenance)


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.extend(_flatten(value, path + "."))
        elif value is not None:
            rows.append((path, value))
    return rows


def cmd_models_list(args: argparse.Namespace) -> None:
    rows = []
    for name in catalog():
        m = resolve_model(name)
        rows.append(
            {
                "name": name,
                "model_type": m.model_type,
                "layers": m.num_layers,
                "hidden": m.hidden_size,
                "heads": f"{m.num_attention_heads}/{m.num_kv_heads}",
                "total_params_b": round(m.total_params / 1e9, 3),
                "active_params_b": round(m.active_params / 1e9, 3),
                "kv_bytes_per_token_bf16": m.kv_bytes_per_token("bf16"),
                "max_context": m.max_position_embeddings,
            }
        )
    if args.json:
        print_json(rows)
        return
    t = Table(title=f"{len(rows)} catalog models (parameters counted from config.json)")
    for col in rows[0]:
        t.add_column(col, justify="left" if col in ("name", "model_type", "heads") else "right")
    for r in rows:
        t.add_row(*(f"{v:,}" if isinstance(v, int) else str(v) for v in r.values()))
    console.print(t)


def cmd_models_show(args: argparse.Namespace) -> None:
    m = resolve_model(args.name)
    entry = catalog().get(m.name)
    info = {
        "name": m.name,
        "model_type": m.model_type,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.intermediate_size,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "tie_word_embeddings": m.tie_word_embeddings,
        "moe": None if m.moe is None else vars(m.moe) | {"moe_layers": m.num_moe_layers},
        "mla": None if m.mla is None else vars(m.mla),
        "windowed_layers": sum(1 for w in m.layer_windows if w),
        "total_params": m.total_params,
        "active_params": m.active_params,
        "kv_bytes_per_token_bf16": m.kv_bytes_per_token("bf16"),
        "flops_per_token_at_4k_context": m.flops_per_token(4096),
    }
    if entry is not None:
        info |= {"hf_repo": entry.hf_repo, "published_total_params_b": entry.published_total_params_b, "config_source": entry.source}
    if args.json:
        print_json(info)
        return
    t = Table(title=m.name or args.name, show_header=False)
    t.add_column("field")
    t.add_column("value", justify="right")
    for key, value in info.items():
        t.add_row(key, f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value))
    console.print(t)


def cmd_schema(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError("out", args.out, "exists and is not a folder; schema writes one file per spec into a folder")
    out.mkdir(parents=True, exist_ok=True)
    from planner.traffic import TrafficDay

    for model in (HardwareProfile, Deployment, SLO, Workload, TrafficDay, MemoryPlan, RunSummary):
        path = out / f"{model.__name__}.schema.json"
        path.write_text(json.dumps(model.model_json_schema(), indent=2) + "\n")
        print(path)


# --------------------------------------------------------------------------- simulate


def add_workload_args(p: argparse.ArgumentParser, default: str = "chat") -> None:
    """The workload flags shared by `simulate`, `compare` and `engine bench`."""
    p.add_argument("--workload", default=default,
                   help=f"preset ({', '.join(PRESETS)}), a workload YAML/JSON file, or a JSONL/CSV trace")
    add_flags(p, WORKLOAD)


def workload_overrides(args: argparse.Namespace, declared: list[Setting] = WORKLOAD) -> dict[str, object]:
    """The Workload fields the flags replace (each flag already checked by its declaration)."""
    try:
        return WorkloadOverrides(**values(args, declared)).workload_fields()
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def replay_from_args(args: argparse.Namespace, vocab_size: int | None, max_model_len: int | None = None) -> Replay:
    """A Replay for the workload flags: a preset or workload file with the flags applied, or a trace.
    A request longer than `max_model_len` is refused before any token id is drawn."""
    overrides = workload_overrides(args)
    if args.workload.lower().endswith(TRACE_SUFFIXES):
        for name in ("rate_per_s", "concurrency", "num_requests", "input_tokens", "output_tokens", "prefix_tokens"):
            if getattr(args, name) is not None:
                raise InputError(name, getattr(args, name), "does not apply to a trace, which records its own requests")
        return Replay.from_trace(args.workload, vocab_size=vocab_size, seed=args.seed or 0, max_model_len=max_model_len)
    return Replay.of(get_workload(args.workload, **overrides), vocab_size, max_model_len)


def cmd_simulate(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    hw = get_hardware(args.hardware)
    dep = deployment_from_args(args)
    slo = SLO.parse(args.slo) if args.slo else None
    max_len = context_length(model, args.max_model_len)
    replay = replay_from_args(args, model.vocab_size, max_len)
    result = simulate(model, hw, dep, replay, slo=slo, router=args.router, fit=fit_from_args(args),
                      max_model_len=max_len)
    if args.json:
        print_json(result.summary)
    else:
        render_summary(result.summary, f"{dep.replicas} x (tp={dep.tensor_parallel}, pp={dep.pipeline_parallel}) "
                       f"{hw.name}, weights {dep.weight_dtype}, KV {dep.kv_dtype}")


def render_summary(s: RunSummary, deployment: str) -> None:
    """The human view of a RunSummary, shared by `simulate` and `engine bench`."""
    verb = "simulated" if s.source == "simulator" else "measured"
    t = Table(title=f"{s.model} on {deployment}: {s.workload}, {s.num_finished:,} of {s.num_requests:,} requests "
                    f"finished in {s.duration_s:,.1f} s ({verb})")
    t.add_column("latency, ms")
    for col in ("mean", "p50", "p90", "p95", "p99", "max"):
        t.add_column(col, justify="right")
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queueing_ms"):
        st = getattr(s, name)
        t.add_row(name.removesuffix("_ms").upper(), *(f"{getattr(st, c):,.1f}" for c in ("mean", "p50", "p90", "p95", "p99", "max")))
    console.print(t)
    tp, g, u, c = s.throughput, s.goodput, s.utilisation, s.cost
    lines = [
        f"throughput (first arrival to last finish, drain included): {tp.requests_per_s:,.2f} req/s, "
        f"{tp.input_tokens_per_s:,.0f} input + {tp.output_tokens_per_s:,.0f} output tokens/s",
        steady_line(s.steady_state) if s.steady_state is not None else
        f"steady state: none (fewer than {MIN_STEADY_REQUESTS} requests between the warm-up and the last admission)",
        f"prefix cache: {s.prefix_cache_hit_rate:.1%} of prompt tokens hit; preemptions: {s.preemptions:,}; "
        f"KV blocks: {s.kv_cache_blocks_total:,}; steps: {s.num_steps:,}",
    ]
    if (o := s.offload) is not None:
        lines.append(f"offload tiers: {o.host_hit_tokens:,} prompt tokens hit in host memory, {o.disk_hit_tokens:,} on disk; "
                     f"{o.stored_blocks:,} blocks stored, {o.loaded_host_blocks + o.loaded_disk_blocks:,} loaded; "
                     f"{o.swapped_out_requests:,} preemptions by swap ({o.swap_out_refusals:,} recomputed for lack of room)")
    if (x := s.kv_transfer) is not None:
        lines.append(f"KV transfers: {x.requests:,}, {x.mb_per_request_mean:,.1f} MB each per GPU on average; "
                     f"{x.total_ms.mean:,.2f} ms mean, {x.total_ms.p99:,.2f} ms P99 (send {x.send_ms.mean:,.2f} + "
                     f"wire {x.wire_ms.mean:,.2f} + load {x.load_ms.mean:,.2f} ms)")
    if g.slo_met is not None:
        checks = ", ".join(f"{k.target} {k.observed_ms:,.1f} {'<=' if k.met else '>'} {k.limit_ms:g}" for k in g.checks)
        lines.append(f"SLO {'MET' if g.slo_met else 'MISSED'}: goodput {g.requests_per_s:,.2f} req/s = {g.share:.1%} "
                     f"of requests (need {g.required_share:.0%}); {checks}")
    util = [f"busy {u.busy_share:.0%}"]
    if u.mfu is not None:
        util.append(f"MFU {u.mfu:.1%}")
    if u.bandwidth_utilisation is not None:
        util.append(f"bandwidth {u.bandwidth_utilisation:.1%}")
    lines.append("utilisation: " + ", ".join(util))
    if c.usd_per_hour is not None:
        lines.append(f"cost: US${c.usd_per_hour:,.2f}/h, ${c.usd_per_million_output_tokens or 0:,.3f} per 1M output tokens, "
                     f"${c.usd_per_million_input_tokens or 0:,.3f} per 1M input tokens, ${c.usd_per_request or 0:,.5f} per request")
    lines.append(f"assumed: {c.basis}")
    if (band := s.prediction_interval) is not None:
        r = band.ranges
        shown = [("TTFT P50", "ttft_ms.p50", "ms"), ("TTFT P99", "ttft_ms.p99", "ms"), ("TPOT P50", "tpot_ms.p50", "ms"),
                 ("TPOT P99", "tpot_ms.p99", "ms"), ("output", "throughput.output_tokens_per_s", "tok/s")]
        lines.append(f"if measured ({band.coverage:.0%} band, basis below): " + ", ".join(
            f"{label} {r[key][0]:,.1f}-{r[key][1]:,.1f} {unit}" for label, key, unit in shown if key in r))
        lines.append(f"band basis: {band.basis}")
        if (caution := s.band_caution()) is not None:
            lines.append(f"[bold yellow]caution:[/bold yellow] {caution}")
    for line in lines:
        console.print(line)
    if s.step_time:
        render_step_time(s.step_time)


def render_step_time(steps: list[PricedStep]) -> None:
    """Where a simulated step's time goes, operator by operator, in the steps that stand for the run."""
    t = Table(title="step time by operator, ms (the cost model the run was priced with)")
    t.add_column("operator")
    for step in steps:
        t.add_column(f"{step.kind}: {step.requests:,} x {step.tokens:,} tokens", justify="right")
    operators = sorted({op for step in steps for op in step.operators_ms},
                       key=lambda op: -max(step.operators_ms.get(op, 0.0) / step.total_ms for step in steps))
    for op in operators:
        t.add_row(op, *(_share(step.operators_ms.get(op, 0.0), step.total_ms) for step in steps))
    t.add_row("step", *(f"{step.total_ms:,.2f}" for step in steps))
    console.print(t)
    for step in steps:
        console.print(f"{step.kind} step: {step.basis}")


def _share(ms: float, total_ms: float) -> str:
    return f"{ms:,.2f} ({ms / total_ms:.0%})" if ms else "-"


def steady_line(steady: SteadyState) -> str:
    """The steady-state rates in one line, for `simulate`, `engine bench` and `plan`."""
    cost = ("" if steady.usd_per_million_output_tokens is None
            else f", US${steady.usd_per_million_output_tokens:,.3f} per 1M output tokens")
    return (f"steady state ({steady.window_start_s:,.1f}-{steady.window_end_s:,.1f} s; warm-up {steady.warmup_s:,.1f} s "
            f"and drain {steady.drain_s:,.1f} s left out): {steady.requests_per_s:,.2f} req/s, "
            f"{steady.output_tokens_per_s:,.0f} output tokens/s, mean batch "
            f"{_number(steady.mean_batch_requests, '.1f')} requests{cost}"
            + ("" if steady.kept_up else " (its queue grew: this is its capacity)"))


def cmd_engine_bench(args: argparse.Namespace) -> None:
    from engine.llm import LLM  # torch: only this command needs it
    from planner.engine_bench import bench_engine

    slo = SLO.parse(args.slo) if args.slo else None
    if args.num_requests is None and args.workload.lower() in PRESETS:
        args.num_requests = BENCH_PRESET_REQUESTS
    workload_overrides(args)  # bad flags are refused before the model loads
    llm = LLM(args.model, **engine_settings(args))
    replay = replay_from_args(args, llm.config.vocab_size, llm.max_model_len)
    summary, _ = bench_engine(llm, replay, model_name=args.model, slo=slo)
    if args.json:
        print_json(summary)
    else:
        render_summary(summary, summary.hardware)


# --------------------------------------------------------------------------- bench --url


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="play a workload against a live OpenAI-compatible endpoint; same summary as "
                                     "simulate, measured from the stream (docs/serving.md)")
    p.add_argument("--url", required=True, help="the endpoint's base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the model name the endpoint serves")
    p.add_argument("--workload", default="chat",
                   help=f"preset ({', '.join(PRESETS)}), a workload YAML/JSON file, or a JSONL/CSV trace")
    # --rate and --concurrency take comma lists (a sweep); each point goes through the declarations.
    add_flags(p, [s for s in WORKLOAD if s.name not in ("rate_per_s", "concurrency")], num_requests=64)
    p.add_argument("--rate", dest="rates", help="Poisson arrival rate, requests/s; a comma list sweeps it, e.g. 1,2,4")
    p.add_argument("--concurrency", dest="concurrencies",
                   help="closed loop: users each sending on a reply; a comma list sweeps it, e.g. 1,8,32")
    p.add_argument("--max-concurrency", type=int, help="with --rate: most requests in flight (vllm bench serve's cap)")
    p.add_argument("--vocab-size", type=int, help="the served model's vocabulary: prompt token ids stay below it "
                                                  "(default: the workload's id range)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent with every request")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take before it counts as failed")
    p.add_argument("--slo", help="latency targets for goodput, e.g. 'ttft_p99_ms<=500,tpot_p99_ms<=50'")
    p.add_argument("--json", action="store_true", help="the BenchReport: summaries plus every request's timings")
    command(p, cmd_bench)


def _points(flag: str, text: str | None, kind: type) -> list:
    if text is None:
        return []
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(flag, text, f"must be a comma-separated list of {kind.__name__}s") from None


def cmd_bench(args: argparse.Namespace) -> None:
    from planner.endpoint_bench import EndpointError, bench_endpoint, report

    rates, concurrencies = _points("--rate", args.rates, float), _points("--concurrency", args.concurrencies, int)
    if rates and concurrencies:
        raise InputError("--rate", args.rates, "give either --rate (open loop) or --concurrency (closed loop), not both")
    if args.max_concurrency is not None and concurrencies:
        raise InputError("--max-concurrency", args.max_concurrency, "applies to --rate; closed loop has --concurrency")
    if not args.url.startswith(("http://", "https://")):
        raise InputError("--url", args.url, "must be an http:// or https:// base URL, e.g. http://127.0.0.1:8000/v1")
    if not args.timeout > 0:
        raise InputError("--timeout", args.timeout, "must be > 0 seconds")
    slo = SLO.parse(args.slo) if args.slo else None
    sweep: Literal["rate", "concurrency"] | None = "rate" if rates else "concurrency" if concurrencies else None
    points: list[float | None] = list(rates or concurrencies) or [None]
    runs = []
    for point in points:
        flags = argparse.Namespace(**{**vars(args), "rate_per_s": point if sweep == "rate" else None,
                                      "concurrency": point if sweep == "concurrency" else None})
        replay = replay_from_args(flags, args.vocab_size)
        arrival, rate = _arrival(args.workload, flags)
        try:
            run = bench_endpoint(args.url, args.model, replay, slo=slo, rate_per_s=rate,
                                 max_concurrency=args.max_concurrency, arrival=arrival,
                                 temperature=args.temperature, timeout_s=args.timeout)
        except EndpointError as exc:
            raise InputError("--url", args.url, str(exc)) from None
        failed = [r for r in run.requests if r.error is not None]
        if run.summary is None:
            raise InputError("--url", args.url, f"no request finished; the first failed with HTTP "
                             f"{failed[0].http_status}: {failed[0].error}")
        if failed:
            print(f"serveplan: {len(failed)} of {len(run.requests)} requests failed; the first with HTTP "
                  f"{failed[0].http_status}: {failed[0].error}", file=sys.stderr)
        runs.append(run)
        if not args.json and run.summary is not None:
            render_summary(run.summary, f"{args.url}" + (f" at {sweep} {point:g}" if sweep else ""))
    result = report(runs, sweep, points, slo)
    if args.json:
        print_json(result)
    elif len(runs) > 1:
        render_sweep(result)


def _arrival(workload: str, flags: argparse.Namespace) -> tuple[str, float | None]:
    """The arrival kind and rate the client used, for the bench file."""
    if flags.rate_per_s is not None:
        return "poisson", flags.rate_per_s
    if flags.concurrency is not None:
        return "closed_loop", None
    if workload.lower().endswith((".jsonl", ".csv")):
        return "trace", None
    arrival = get_workload(workload).arrival
    return arrival.kind, getattr(arrival, "rate_per_s", None)


def render_sweep(result: BenchReport) -> None:
    t = Table(title=f"latency-throughput curve over {result.sweep} (client-side, ms)")
    for col in (result.sweep or "", "finished", "req/s", "output tok/s", "TTFT P50", "TTFT P99", "TPOT P50",
                "TPOT P99", "ITL P99", "goodput req/s", "SLO"):
        t.add_column(col, justify="right")
    for run in result.runs:
        s = run.summary
        point = run.client.rate_per_s if result.sweep == "rate" else run.client.concurrency
        if s is None:
            t.add_row(f"{point:g}", "0", *["-"] * 9)
            continue
        t.add_row(f"{point:g}", f"{s.num_finished}/{s.num_requests}", f"{s.throughput.requests_per_s:,.2f}",
                  f"{s.throughput.output_tokens_per_s:,.1f}", f"{s.ttft_ms.p50:,.1f}", f"{s.ttft_ms.p99:,.1f}",
                  f"{s.tpot_ms.p50:,.1f}", f"{s.tpot_ms.p99:,.1f}", f"{s.itl_ms.p99:,.1f}",
                  f"{s.goodput.requests_per_s:,.2f}", {True: "met", False: "missed", None: "-"}[s.goodput.slo_met])
    console.print(t)
    console.print(f"max goodput: {result.max_goodput_requests_per_s:,.2f} req/s at {result.sweep} "
                  f"{result.max_goodput_point:g}" + ("" if result.slo else " (no --slo: goodput is throughput)"))


# --------------------------------------------------------------------------- calibrate


# The flags each mode of calibrate and validate reads, per command: the two share flag names
# (--model, --quick, --workers) but not what they read with them (validate runs the engine at
# --tp, a CPU calibration measures one process). A flag the chosen mode does not read is refused
# when given, not dropped.
_MODE_FLAGS: dict[str, dict[str, tuple[str, ...]]] = {
    "calibrate": {
        "cpu": ("model", "device", "dtype", "threads", "random_weights", "quick", "write_profile", "tensor_parallel",
                "expert_parallel"),
        "public": ("rounds", "workers", "public_report", "checkpoint", "fresh", "bands_only", "only", "only_for"),
        "from_bench": ("model", "rounds", "workers", "hardware", "max_model_len",
                       *(s.name for s in (*DEPLOYMENT, *KNOBS, *DISAGGREGATION))),
    },
    "validate": {
        "cpu": ("model", "random_weights", "quick", "workloads", "force", "tensor_parallel", "expert_parallel",
                "calibration", "report"),
        "public": ("workers", "calibration", "report"),
        "memory": (),
    },
}
_MODE_NAMES = {"cpu": "a CPU calibration (without --public)", "public": "--public", "memory": "--memory",
               "from_bench": "--from-bench"}


def _check_mode(args: argparse.Namespace) -> None:
    chosen = [m for m, on in (("public", args.public), ("memory", getattr(args, "memory", False)),
                              ("from_bench", getattr(args, "from_bench", None))) if on]
    if len(chosen) > 1:
        raise UsageError(f"{' and '.join(_MODE_NAMES[m] for m in chosen)} are two different modes: give one")
    mode = chosen[0] if chosen else "cpu"
    modes = _MODE_FLAGS[args.command]
    for name, default in args.mode_defaults.items():
        if name not in modes[mode] and getattr(args, name) != default:
            readers = " or ".join(_MODE_NAMES[m] for m, flags in modes.items() if name in flags)
            raise UsageError(f"{args.flags.get(name, name)} does not apply to {_MODE_NAMES[mode]}; "
                             f"{args.command} reads it with {readers} only")


@contextmanager
def stages() -> Iterator[Progress]:
    """A progress display of successive stages for planner/public: one bar each, on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bars

    with Bars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              console=Console(stderr=True)) as bars:
        current: list[TaskID] = []

        def stage(what: str, total: int | None) -> Callable[[], None]:
            if current:  # the previous stage is over, even one whose length was unknown
                done = bars.tasks[-1].completed
                bars.update(current[-1], total=max(done, 1), completed=max(done, 1))
            current.append(bars.add_task(what, total=total))
            return lambda: bars.advance(current[-1])

        yield stage


def cmd_calibrate_public(args: argparse.Namespace) -> None:
    from planner.costmodel.fitted import PUBLIC_FIT_FILE
    from planner.public.calibration import (PUBLIC_ROUNDS, Stage, calibrate_public, prepare_all, rebanded, run_groups,
                                            write_fit)
    from planner.public.data import public_runs
    from planner.public.report import (
        TARGETS_PCT, check_report_path, client_setups, group_errors, load_fit, predict_again, set_aside_summary,
        validation_of, write_report,
    )

    command = "serveplan calibrate " + " ".join(sys.argv[2:])
    out = Path(args.out) if args.out else PUBLIC_FIT_FILE
    if args.bands_only:
        for name in ("rounds", "checkpoint", "fresh", "public_report", "only", "only_for"):
            if getattr(args, name) != args.mode_defaults[name]:
                raise UsageError(f"{args.flags.get(name, name)} does not apply to --bands-only: nothing is fitted")
        fit = load_fit(out)
        with stages() as progress:
            figures, skipped, groups = predict_again(fit, out, workers=args.workers or default_threads(),
                                                     progress=progress)
        path = write_fit(rebanded(fit, command, figures, skipped, groups), out)
        console.print(f"wrote {path}: its {len(figures)} held-out figures predicted again and its bands made from them")
        return
    stage = None
    if args.only_for and not args.only:
        raise UsageError("--only-for scopes the figures of --only: give --only too")
    if args.only:
        for name in ("checkpoint", "fresh"):
            if getattr(args, name) != args.mode_defaults[name]:
                raise UsageError(f"{args.flags.get(name, name)} does not apply to --only: it stages on the fit in --out")
        owners = frozenset(o.strip() for o in args.only_for.split(",") if o.strip()) if args.only_for else None
        stage = Stage(tuple(p.strip() for p in args.only.split(",") if p.strip()), load_fit(out), out.name, owners)
    if args.public_report:
        check_report_path(args.public_report, out, "public_report")  # before hours of fitting, not after
    with stages() as progress:
        result = calibrate_public(command=command, rounds=args.rounds or PUBLIC_ROUNDS, workers=args.workers or default_threads(),
                                  progress=progress, checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                                  previous=None if args.fresh else out, stage=stage)
    path = write_fit(result, out)
    if args.public_report:
        # The fit's own predictions are the validation's: the same figures, folds and simulator.
        runs = public_runs()
        write_report(validation_of(result.figures, result.skipped, path, client_setups(runs),
                                   run_groups(prepare_all(runs)[0])),
                     result, command, args.public_report)
    t = Table(title=f"public fit: {len(result.figures)} figures, {len(result.folds['source'])} sources, "
                    f"{len(result.folds['publisher'])} publishers, {set_aside_summary(result.skipped)}")
    for col in ("metric family", "figures", "held-out median |error| %", "in-sample median |error| %", "target %"):
        t.add_column(col, justify="left" if col == "metric family" else "right")
    for g in group_errors(result.figures, lambda r: r.family):
        t.add_row(g.group, str(g.figures), f"{g.held_out_median_abs_pct:.1f}", f"{g.in_sample_median_abs_pct:.1f}",
                  f"{TARGETS_PCT.get(g.group, float('nan')):g}")
    console.print(t)
    console.print(f"wrote {path}; `serveplan validate --public` reports it in full")


def cmd_calibrate_from_bench(args: argparse.Namespace) -> None:
    from planner.bench_fit import (BENCH_ROUNDS, calibrate_from_bench, default_path, load_bench, prepare_bench,
                                   write_bench_fit)
    from planner.engines import get_engine

    if args.hardware is None:
        raise UsageError("--from-bench needs --hw: the hardware profile the endpoint runs on")
    model_name = args.model or load_bench(args.from_bench[0]).runs[0].model
    model, hw, engine = resolve_model(model_name), get_hardware(args.hardware), get_engine(args.engine)
    dep = deployment_from_args(args)
    max_model_len = args.max_model_len or model.max_position_embeddings
    runs = prepare_bench(args.from_bench, model, hw, engine, dep, max_model_len)
    with stages() as progress:
        fit = calibrate_from_bench(runs, command="serveplan calibrate " + " ".join(sys.argv[2:]), model_name=model_name,
                                   rounds=args.rounds or BENCH_ROUNDS, workers=args.workers or 1, progress=progress)
    path = write_bench_fit(fit, Path(args.out) if args.out else default_path(hw, engine))
    t = Table(title=f"{len(fit.runs)} bench runs on {hw.name} with {engine.name}: measured vs predicted "
                    "(held out: fitted on the other runs)")
    for col in ("run", "figure", "measured", "in sample", "held out", "held-out error %"):
        t.add_column(col, justify="left" if col in ("run", "figure") else "right")
    for f in fit.figures:
        t.add_row(f.run_key, f.metric, f"{f.measured:,.2f}", f"{f.in_sample:,.2f}", f"{f.held_out:,.2f}",
                  f"{(f.held_out / f.measured - 1) * 100:+.1f}")
    console.print(t)
    console.print(f"held-out median |error| {fit.held_out_median_abs_error_pct:.1f} % (leave-one-run-out), in sample "
                  f"{fit.in_sample_median_abs_error_pct:.1f} %")
    console.print("fitted: " + ", ".join(f"{k}={v:.4g}" for table in (fit.model.families, fit.model.engines)
                                         for values in table.values() for k, v in values.items()))
    console.print(f"wrote {path}; use it with `serveplan simulate --calibration {path}`")


def cmd_calibrate(args: argparse.Namespace) -> None:
    from planner.calibrate import calibrate

    _check_mode(args)
    if args.out:  # every mode writes it after minutes of work: checked first
        output_file(args.out, "out")
    if args.public:
        cmd_calibrate_public(args)
        return
    if args.from_bench:
        cmd_calibrate_from_bench(args)
        return

    cal, path = calibrate(args.model or "smollm2-135m", device=args.device, dtype=args.dtype, quick=args.quick, out=args.out,
                          random_weights=args.random_weights, threads=args.threads or default_threads(),
                          write_profile=args.write_profile, tensor_parallel=args.tensor_parallel,
                          expert_parallel=args.expert_parallel)
    t = Table(title=f"{cal.model} on {cal.device.name} ({cal.hardware_profile}): "
                    f"fit median |error| {cal.fit_median_abs_error_pct:.1f} %, max {cal.fit_max_abs_error_pct:.1f} %")
    for col in ("grid step", "measured ms", "predicted ms", "error %"):
        t.add_column(col, justify="left" if col == "grid step" else "right")
    for s in cal.steps:
        ranks = f" (EP {s.expert_parallel})" if s.expert_parallel > 1 else f" (TP {s.tensor_parallel})" if s.tensor_parallel > 1 else ""
        t.add_row(s.label + ranks, f"{s.measured_s * 1e3:,.1f}", f"{s.predicted_s * 1e3:,.1f}",
                  f"{(s.predicted_s / s.measured_s - 1) * 100:+.1f}")
    console.print(t)
    m = cal.microbenchmarks
    console.print(f"memory bandwidth {m.memory_bandwidth_gb_s:,.1f} GB/s; best matmul "
                  f"{max(m.matmul_tflops.values()) * 1e3:,.1f} GFLOPS ({cal.dtype})")
    console.print("fitted: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in cal.params.items()))
    console.print(f"wrote {path} (hardware profile: {cal.hardware_profile})")


# --------------------------------------------------------------------------- plan and compare


# The workload flags plan reads: the rate it sizes for, the seed of its draws, a shared prefix.
PLAN_WORKLOAD = [s for s in WORKLOAD if s.name in ("rate_per_s", "seed", "prefix_tokens", "num_prefixes", "prefix_share")]


def _csv(text: str | None) -> list[str] | None:
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def cmd_plan(args: argparse.Namespace) -> None:
    from planner.search import plan  # keeps `serveplan simulate` start-up lean

    if args.traffic is not None:
        cmd_plan_day(args)
        return
    is_trace = workload_name(args).lower().endswith(TRACE_SUFFIXES)
    if args.rate_per_s is None and not is_trace:  # a preset's own rate is an example, not the user's load
        raise InputError("rate", None, "required: the arrival rate to plan for, requests/s (a trace's own mean rate "
                         "is its default; --traffic DAY.yaml plans a day)")
    slo = SLO.parse(args.slo)
    workload = plan_workload(args)
    rate = args.rate_per_s if args.rate_per_s is not None else workload.arrival.offered_rate_per_s
    if rate is None:
        raise InputError("rate", None, "required: this trace records no arrival times to take a mean rate from")
    if is_trace and not args.json:
        console.print(f"planned for the {workload.description}")
    started = time.perf_counter()
    result = plan(args.model, workload, rate, slo, pd_ratios=args.pd_ratios, **_search_args(args, started))
    if args.json:
        print_json(result)
    else:
        render_plan(result, time.perf_counter() - started)
    if result.recommended is None:  # an answer that is "no", as `memory` gives for a model that does not fit
        raise SystemExit(1)


def plan_workload(args: argparse.Namespace) -> Workload:
    """The workload `plan` sizes for: a preset or workload file with --seed and the shared-prefix
    flags applied, or a trace summarised into one (planner.workload.workload_from_trace)."""
    overrides = workload_overrides(args, PLAN_WORKLOAD)
    name = workload_name(args)
    if name.lower().endswith(TRACE_SUFFIXES):
        if "shared_prefix" in overrides:
            raise InputError("prefix_tokens", args.prefix_tokens, "does not apply to a trace, which records its own prefixes")
        return workload_from_trace(name, seed=args.seed or 0)
    return get_workload(name, **overrides)


def workload_name(args: argparse.Namespace) -> str:
    """`plan`'s --workload, which has no argparse default so that --traffic can refuse it when given."""
    return args.workload or "chat"


def _search_args(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """The search's settings as `plan` and `plan --traffic` both read them from the flags; without
    --json, the recommendation is printed as soon as it is known (time counted from `started`)."""
    from planner.search import DEFAULT_CACHE_DIR

    def first(answer: CandidatePlan | None) -> None:
        found = ("nothing meets the SLO" + (" within the budget" if args.budget_usd_per_hour else "") if answer is None
                 else f"{answer.replicas} x {answer.label}, US${answer.usd_per_hour:,.2f}/h")
        console.print(f"[bold]answer[/bold] after {time.perf_counter() - started:.1f} s: {found}; now sizing every "
                      "hardware (--no-every-hardware skips it)")

    return dict(
        hardware=_csv(args.hardware), max_gpus_per_replica=args.max_gpus_per_replica,
        budget_usd_per_hour=args.budget_usd_per_hour, weight_dtypes=_csv(args.weight_dtypes),
        kv_dtypes=_csv(args.kv_dtypes), engine=args.engine, headroom=args.headroom, confidence=args.confidence,
        max_quality_loss_pct=args.max_quality_loss_pct, offload=args.offload, prefix_caching=args.enable_prefix_caching,
        every_hardware=args.every_hardware,
        fit=fit_from_args(args), widen=True, requests_per_probe=args.requests_per_probe, executor=args.executor, workers=args.workers,
        cache_dir=None if args.no_cache else (args.cache_dir or DEFAULT_CACHE_DIR), progress=True,
        on_answer=None if args.json else first)


def cmd_plan_day(args: argparse.Namespace) -> None:
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bars

    from planner.search.day import plan_day
    from planner.traffic import load_traffic

    for flag in ("workload", *(setting.name for setting in PLAN_WORKLOAD)):
        if (given := getattr(args, flag)) is not None:
            raise InputError(flag, given, "not with --traffic: the traffic file sets the workload, rates and seed")
    if args.pd_ratios not in ("auto", "none"):
        raise InputError("pd_ratios", args.pd_ratios, "not with --traffic: each fleet replica is one colocated instance")
    day = load_traffic(args.traffic)
    slo = SLO.parse(args.slo)
    started = time.perf_counter()
    with Bars(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} h"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def on_hour(fleet: str, hours: float) -> None:
            if fleet not in tasks:
                tasks[fleet] = bar.add_task(f"{fleet} fleet, simulated hours", total=day.duration_s / 3600)
            bar.update(tasks[fleet], completed=hours)

        result, day_plan = plan_day(args.model, day, slo, on_hour=on_hour, **_search_args(args, started))
    if args.json:
        print_json({"search": result.model_dump(mode="json"), "day": None if day_plan is None else
                    day_plan.model_dump(mode="json")})
    elif day_plan is None:
        render_plan(result, time.perf_counter() - started)
    else:
        render_day_plan(day_plan, time.perf_counter() - started)
    if day_plan is None:
        raise SystemExit(1)


def render_day_plan(d: DayPlan, wall_s: float) -> None:
    slo = ", ".join(f"{k}<={v:g}" for k, v in d.slo.targets.items()) or "no latency target"
    dep = d.deployment
    console.print(f"[bold]{d.model}[/bold], traffic {d.traffic!r} (peak {d.peak_rate_per_s:g} req/s), SLO {slo} "
                  f"(goodput >= {d.slo.goodput_share:.0%})")
    console.print(f"  replica: hardware={dep.hardware} tp={dep.tensor_parallel} pp={dep.pipeline_parallel} "
                  f"weights={dep.weight_dtype} kv={dep.kv_dtype} engine={dep.engine}")
    t = Table(title="per hour: offered rate, replicas billed (mean over the hour), SLO attainment (share of the hour's "
                    "requests within every per-request limit)")
    for col in ("hour", "req/s", "fixed replicas", "fixed SLO", "autoscaled replicas", "most ready", "autoscaled SLO",
                "autoscaled mean TTFT ms"):
        t.add_column(col, justify="right")

    def share(h: HourReport) -> str:
        if h.slo_attainment is None:
            return "-"
        return f"{h.slo_attainment:.1%}" + ("" if h.slo_met else " [red]miss[/red]")

    for f, a in zip(d.fixed.hours, d.autoscaled.hours):
        t.add_row(str(f.hour), f"{f.offered_rate_per_s:,.2f}", f"{f.replicas:,.2f}", share(f), f"{a.replicas:,.2f}",
                  str(a.most_ready_replicas), share(a), _number(a.mean_ttft_ms, ",.0f"))
    console.print(t)
    t = Table(title="the day")
    for col in ("fleet", "replica-hours", "GPU-hours", "US$/day", "SLO attainment", "hours meeting the SLO",
                "scaling actions"):
        t.add_column(col, justify="left" if col == "fleet" else "right")
    for r in (d.fixed, d.autoscaled):
        label = f"fixed ({d.fixed_replicas} replicas)" if r.fleet == "fixed" else "autoscaled"
        t.add_row(label, f"{r.replica_hours:,.1f}", f"{r.gpu_hours:,.1f}", _number(r.usd_per_day, ",.2f"),
                  f"{r.slo_attainment:.2%}", f"{r.hours_meeting_slo}/{r.hours_with_traffic}", str(r.scaling_actions))
    console.print(t)
    if d.saving_usd_per_day is not None:
        console.print(f"autoscaling saves US${d.saving_usd_per_day:,.2f} per day "
                      f"({d.saving_usd_per_day / d.fixed.usd_per_day:.0%} of the fixed fleet's cost)"
                      if d.fixed.usd_per_day else "")
    console.print("Assumptions:", style="dim")
    for key, note in d.assumptions.items():
        console.print(f"  {key}: {note}", style="dim")
    console.print(f"planned in {wall_s:,.0f} s", style="dim")


def render_plan(r: PlanResult, wall_s: float) -> None:
    slo = ", ".join(f"{k}<={v:g}" for k, v in r.slo.targets.items()) or "no latency target"
    console.print(f"[bold]{r.model}[/bold], workload {r.workload} at {r.rate_per_s:g} req/s, SLO {slo} "
                  f"(goodput >= {r.slo.goodput_share:.0%})")
    rec, v = r.recommended, r.verification
    for step in r.stepped_up:  # the verifications that missed on the way to the answer below
        console.print(f"[yellow]stepped up:[/yellow] {step}")
    if rec is not None and v is not None:
        d = rec.deployment
        console.print(f"[bold green]recommended:[/bold green] {rec.replicas} x {rec.label}: {rec.gpus} GPUs, "
                      f"US${rec.usd_per_hour:,.2f}/h, US${rec.usd_per_million_output_tokens:,.3f} per 1M output tokens")
        console.print(f"  deployment: hardware={d.hardware} tp={d.tensor_parallel} pp={d.pipeline_parallel} "
                      f"ep={d.expert_parallel} replicas={d.replicas} weights={d.weight_dtype} kv={d.kv_dtype} "
                      f"max_num_batched_tokens={d.knobs.max_num_batched_tokens} max_num_seqs={d.knobs.max_num_seqs}")
        console.print(f"  at {r.rate_per_s:g} req/s (verification run, round robin over {d.replicas}): "
                      f"TTFT P50 {v.ttft_ms.p50:,.0f} / P99 {v.ttft_ms.p99:,.0f} ms, "
                      f"TPOT P50 {v.tpot_ms.p50:,.1f} / P99 {v.tpot_ms.p99:,.1f} ms, "
                      f"goodput {v.goodput.share:.1%}, SLO {'MET' if v.goodput.slo_met else 'MISSED'}")
        if r.verification_missed is not None:
            console.print(f"  [bold red]warning:[/bold red] {r.verification_missed}")
        if (band := v.prediction_interval) is not None:
            shown = [(label, band.ranges[key]) for label, key in (("TTFT P99", "ttft_ms.p99"), ("TPOT P99", "tpot_ms.p99"))
                     if key in band.ranges]
            console.print(f"  if measured ({band.coverage:.0%} band of held-out errors): "
                          + ", ".join(f"{label} {low:,.1f}-{high:,.1f} ms" for label, (low, high) in shown))
        if r.band_misses is not None:
            console.print(f"  [bold yellow]caution:[/bold yellow] {r.band_misses}")
        if v.steady_state is not None:
            console.print(f"  {steady_line(v.steady_state)}")
        if (cap := r.capacity) is not None:
            console.print(f"  capacity within the SLO: {_number(cap.requests_per_s, ',.2f')} req/s "
                          f"({_number(cap.output_tokens_per_s, ',.0f')} output tokens/s, US$"
                          f"{_number(cap.usd_per_million_output_tokens, ',.3f')} per 1M output tokens at capacity); "
                          f"{cap.basis}")
        if r.quality is not None:
            console.print(f"  {r.quality}")
    else:
        console.print(f"[bold red]no recommendation:[/bold red] {r.nearest_miss}")
    if r.widening is not None:
        console.print(f"[bold yellow]{r.widening.summary}[/bold yellow]")

    def table(title: str, plans: list[CandidatePlan]) -> None:
        t = Table(title=title)
        for col in ("candidate", "replicas", "GPUs", "US$/h", "US$/1M out", "req/s per replica",
                    "TTFT P50", "TTFT P99", "TPOT P50", "TPOT P99"):
            t.add_column(col, justify="left" if col == "candidate" else "right")
        for p in plans:
            t.add_row(p.label, str(p.replicas), str(p.gpus), f"{p.usd_per_hour:,.2f}", f"{p.usd_per_million_output_tokens:,.3f}",
                      f"{p.sustained_rate_per_s:,.2f}", *(f"{getattr(p, k):,.1f}" for k in
                                                          ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")))
        console.print(t)

    if r.ranked:
        table(f"top {min(10, len(r.ranked))} of {len(r.ranked)} candidates that meet the SLO (latency ms at the "
              "per-replica load sized with headroom)", r.ranked[:10])
        table(f"cost vs {r.pareto_metric} Pareto front", r.pareto)
    if r.pd_comparison:
        t = Table(title="prefill/decode disaggregation vs colocated, per hardware")
        for col in ("hardware", "winner", "why"):
            t.add_column(col)
        for c in r.pd_comparison:
            t.add_row(c.hardware, c.winner, c.reason)
        console.print(t)
    t = Table(title="each hardware's answer: its cheapest candidate that meets the SLO, else its closest (all in --json)")
    for col in ("hardware", "candidate", "US$/h", "verdict"):
        t.add_column(col, justify="right" if col == "US$/h" else "left")
    for p in r.per_hardware:
        cost = p.usd_per_hour if p.usd_per_hour is not None else p.cost_bound_usd_per_hour
        t.add_row(p.deployment.hardware, p.label, "-" if cost is None else f"{cost:,.2f}",
                  "recommended" if p.verdict == "recommended" else p.reason)
    console.print(t)
    if (space := r.space) is not None:
        console.print(f"searched: {', '.join(space.hardware)}; up to {space.max_gpus_per_replica} GPUs per replica; "
                      f"weights {', '.join(space.weight_dtypes)}; KV cache {', '.join(space.kv_dtypes)}; engine "
                      f"{space.engine} with {'; '.join(space.knobs)}")
        for line in space.excluded_for_quality:
            console.print(f"left out for quality (--max-quality-loss {space.max_quality_loss_pct:g} %): {line}")
        for line in space.narrower_than_default:
            console.print(f"narrower than the default search: {line}")
        console.print("settled: " + ", ".join(f"{n:,} {what}" for what, n in space.outcomes.items()))
    console.print(f"searched {r.candidates:,} candidates: {r.simulated_candidates} simulated in {r.probes} probes, "
                  f"the rest pruned by memory, the analytic screen or cost; {wall_s:,.1f} s")
    for line in r.assumptions:
        console.print(f"assumed: {line}")


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def cmd_compare(args: argparse.Namespace) -> None:
    from planner.compare import compare, load_side

    slo = SLO.parse(args.slo) if args.slo else None
    overrides = workload_overrides(args)
    fit = fit_from_args(args)
    a, b = (load_side(path, args.model, args.workload, overrides, slo, args.router, fit) for path in (args.a, args.b))
    result = compare(a, b)
    if args.json:
        print_json(result)
        return
    t = Table(title=f"A = {a.path} ({a.model}, {a.workload}) vs B = {b.path} ({b.model}, {b.workload})")
    banded = any(m.a_range or m.b_range for m in result.metrics)
    for col in ("metric", "A", "B", "B - A", "%", *(("A if measured", "B if measured") if banded else ())):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for m in result.metrics:
        ranges = [f"{r[0]:,.1f}-{r[1]:,.1f}" if r else "-" for r in (m.a_range, m.b_range)] if banded else []
        t.add_row(m.metric, *(f"{v:,.3f}" if v is not None else "-" for v in (m.a, m.b, m.delta)),
                  f"{m.delta_pct:+.1f}%" if m.delta_pct is not None else "-", *ranges)
    console.print(t)
    console.print("rates over each run's steady window (warm-up and drain left out)"
                  + ("" if slo is None else " and at its capacity within the SLO"))
    for side in (a, b):
        if side.capacity is not None:
            console.print(f"capacity of {side.path}: {side.capacity.basis}")
        if (caution := side.summary.band_caution()) is not None:
            console.print(f"[bold yellow]caution:[/bold yellow] {side.path}: {caution}")
    if banded:
        console.print("'if measured': the P10-P90 band of the fit's held-out errors around each prediction (both sides "
                      "share the simulator's biases, so their difference is surer than either band suggests)")


def cmd_validate_public(args: argparse.Namespace) -> None:
    from planner.costmodel.fitted import PUBLIC_FIT_FILE
    from planner.public.calibration import carried_group_bands
    from planner.public.report import check_report_path, validate_public, write_report

    path = args.calibration or PUBLIC_FIT_FILE
    if args.report:  # checked before the minutes of work, not after; the plot and JSON go beside it
        check_report_path(args.report, path, "report")
    with stages() as progress:
        report, fit = validate_public(path, workers=args.workers or default_threads(), progress=progress)
    if args.report:
        write_report(report, fit, "serveplan validate " + " ".join(sys.argv[2:]), args.report)
    if args.json:
        print_json(report)
    else:
        t = Table(title=f"simulator vs {report.figures} published figures ({report.runs} runs, {report.sources} "
                        f"sources); held out = fitted without the figure's source")
        for col in ("metric family", "figures", "held-out median |error| %", "signed %", "in-sample %", "target %", ""):
            t.add_column(col, justify="left" if col == "metric family" else "right")
        for g in report.by_metric_family:
            t.add_row(g.group, str(g.figures), f"{g.held_out_median_abs_pct:.1f}", f"{g.held_out_median_signed_pct:+.1f}",
                      f"{g.in_sample_median_abs_pct:.1f}", f"{report.targets_pct.get(g.group, float('nan')):g}",
                      "met" if report.met.get(g.group) else "MISSED")
        console.print(t)
        for whose, table in (("all engines", report.bands), *report.engine_bands.items(),
                             *carried_group_bands(report.group_bands)):
            for name, b in table.items():
                low, high = b.interval()
                console.print(f"band {name} ({whose}): measured / predicted P10..P90 x{low:.2f}..x{high:.2f}, "
                              f"held-out coverage {b.held_out_coverage:.0%} (nominal 80%)")
    if not all(report.met.values()):
        raise SystemExit(1)


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{share * 100:.1f} %"


def cmd_validate(args: argparse.Namespace) -> None:
    from planner.validate import markdown, validate

    _check_mode(args)
    if args.memory:
        render_memory_validation(validate_startup_logs(), args.json)
        return
    if args.public:
        cmd_validate_public(args)
        return
    if args.calibration is None:
        raise UsageError("--calibration is required (a file written by `serveplan calibrate`), or give --public or --memory")
    if args.report:  # checked before the engine runs, not after
        output_file(args.report, "report")
    report = validate(args.model, args.calibration, random_weights=args.random_weights, quick=args.quick,
                      only=args.workloads, force=args.force, tensor_parallel=args.tensor_parallel,
                      expert_parallel=args.expert_parallel)
    if args.report:
        Path(args.report).write_text(markdown(report, "serveplan validate " + " ".join(sys.argv[2:])))
    if args.json:
        print_json(report)
        return
    t = Table(title=f"{report.model}: simulator vs engine on {report.hardware_profile} "
                    f"(signed error %, calibration fit residual {report.fit_median_abs_error_pct:.1f} %)")
    columns = ["ttft_ms.mean", "ttft_ms.p99", "tpot_ms.mean", "itl_ms.p99", "e2e_ms.mean",
               "throughput.output_tokens_per_s", "prefix_cache_hit_rate", "preemptions", "kv_transfer.total_ms.mean"]
    t.add_column("workload")
    for col in columns:
        t.add_column(col.replace("throughput.", "").replace("kv_transfer.total_ms", "transfer").replace("_ms", ""),
                     justify="right")
    for row in report.rows:
        t.add_row(row.scenario, *("-" if c not in row.error_pct else "n/a" if row.error_pct[c] is None
                                  else f"{row.error_pct[c]:+.1f}" for c in columns))
    console.print(t)
    if report.tensor_parallel > 1:
        console.print("communication share of step time, engine rank 0 vs simulator: " + ", ".join(
            f"{r.scenario} {_pct(r.engine.utilisation.communication_share)} vs "
            f"{_pct(r.simulator.utilisation.communication_share)}" for r in report.rows))
    for group, values in {"all workloads": report.median_abs_error_pct, **report.median_abs_error_pct_by_group}.items():
        for metric, bound in report.bounds_pct.items():
            value = values[metric]
            console.print(f"median |error| {metric}, {group}: {value:.1f} % (bound {bound:g} %) "
                          f"{'ok' if value <= bound else 'MISSED'}")
    if not report.passed:
        raise SystemExit(1)


# --------------------------------------------------------------------------- entry point


class UsageError(Exception):
    """A command line argparse cannot parse (unknown flag, missing argument)."""


class Parser(argparse.ArgumentParser):
    """argparse, with its own errors reported like every other bad input: one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _at_least_one(text: str) -> int:
    value = int(text) if text.strip().lstrip("+").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is invalid: a whole number >= 1 is allowed")
    return value


def _add_public_flags(p: argparse.ArgumentParser, command: str, what: str) -> None:
    """--public and its flags; called last, it records `command`'s defaults for _check_mode."""
    p.add_argument("--public", action="store_true", help=what)
    p.add_argument("--workers", type=_at_least_one, help="--public: simulation processes (default: CPU count)")
    moded = {name for flags in _MODE_FLAGS[command].values() for name in flags}
    p.set_defaults(mode_defaults={a.dest: a.default for a in p._actions if a.dest in moded})


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="serveplan", description="Capacity planning for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("memory", help="does a model fit: per-GPU memory breakdown and KV-cache capacity")
    add_deployment_args(p)
    add_flags(p, settings(MemoryQuery))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    command(p, cmd_memory)

    for catalog, what, shown, metavar, name_help, list_cmd, show_cmd in (
        ("hw", "hardware profile", "one profile with the provenance of each figure", "hardware",
         "profile name or YAML file", cmd_hw_list, cmd_hw_show),
        ("models", "model", "one model's architecture and derived sizes", "model",
         "catalog name or path to a config.json / checkpoint folder", cmd_models_list, cmd_models_show),
        ("engines", "engine profile", "one engine profile: scheduling, execution, overheads, memory and streaming "
         "rules with their sources", "engine", "profile name, e.g. vllm-0.11", cmd_engines_list, cmd_engines_show),
    ):
        actions = sub.add_parser(catalog, help=f"{what} catalog").add_subparsers(
            dest=f"{catalog}_command", required=True, metavar="ACTION")
        p = actions.add_parser("list", help=f"every {what} in the catalog")
        p.add_argument("--json", action="store_true")
        command(p, list_cmd)
        p = actions.add_parser("show", help=shown)
        p.add_argument("name", metavar=metavar, help=name_help)
        p.add_argument("--json", action="store_true")
        command(p, show_cmd)

    p = sub.add_parser("simulate", help="predict latency, throughput, goodput and cost of a deployment under a workload")
    add_deployment_args(p)
    add_workload_args(p)
    p.add_argument("--slo", help="latency targets, e.g. 'ttft_p99_ms<=500,tpot_p99_ms<=50' (goodput_share>=0.99 by default)")
    p.add_argument("--router", default="round_robin", choices=list(ROUTERS), help="how replicas share requests")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output per request (default: the model's context)")
    add_calibration_arg(p)
    p.add_argument("--json", action="store_true", help="the full result in the stable schema of docs/simulate.md")
    command(p, cmd_simulate)

    p = sub.add_parser("plan", help="the cheapest deployment that serves a workload at a rate within an SLO; with "
                                    "--traffic, that deployment over a day, autoscaled and fixed")
    p.add_argument("--model", default="llama-3.1-8b", help="catalog name or path to a config.json / checkpoint folder")
    p.add_argument("--workload", help=f"preset ({', '.join(PRESETS)}), a workload YAML/JSON file, or a JSONL/CSV trace "
                   "(planned as its lengths, shared prefixes and mean rate: docs/planning.md; default: chat)")
    add_flags(p, PLAN_WORKLOAD)
    p.add_argument("--traffic", metavar="DAY.yaml", help="a day of traffic (rate through the hours, workload, autoscaling; "
                   "docs/autoscaling.md) instead of --workload and --rate: replicas per hour, cost per day and SLO "
                   "attainment per hour, autoscaled against a fixed fleet sized for the peak")
    p.add_argument("--slo", required=True, help="latency targets, e.g. 'ttft_p99_ms<=500,tpot_p99_ms<=50'")
    p.add_argument("--hw", dest="hardware", help="comma-separated profiles or YAML files (default: every catalog profile with a price)")
    add_flags(p, settings(PlanSettings))
    add_flags(p, [s for s in DEPLOYMENT if s.name == "engine"])
    add_flags(p, [s for s in settings(EngineKnobs) if s.name == "enable_prefix_caching"])
    p.add_argument("--weight-dtypes", help="comma-separated weight formats (default: bf16, fp8 where native, int8, int4)")
    p.add_argument("--kv-dtypes", help="comma-separated KV-cache formats (default: bf16,fp8)")
    p.add_argument("--requests-per-probe", type=int, default=DEFAULT_REQUESTS_PER_PROBE,
                   help="requests per simulation (at least 3 x max_num_seqs)")
    add_calibration_arg(p)
    p.add_argument("--executor", default="process", choices=["process", "serial", "ray"],
                   help="local process pool, in-process, or a Ray cluster (pip install 'serveplan[cluster]')")
    p.add_argument("--workers", type=int, help="processes of the local pool (default: CPU count)")
    p.add_argument("--cache-dir", help="where simulation results are cached (default: ~/.cache/serveplan)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write cached results")
    p.add_argument("--json", action="store_true", help="the PlanResult (recommendation, ranking, Pareto front, rejections)")
    command(p, cmd_plan)

    p = sub.add_parser("compare", help="two deployment YAML files simulated side by side, with deltas")
    p.add_argument("a", help="deployment YAML (Deployment fields, optional model: and workload:)")
    p.add_argument("b", help="deployment YAML to compare against A")
    p.add_argument("--model", default="llama-3.1-8b", help="model for a file without model:")
    add_workload_args(p)
    p.add_argument("--slo", help="latency targets for goodput, e.g. 'ttft_p99_ms<=500'")
    p.add_argument("--router", default="round_robin", choices=list(ROUTERS), help="how replicas share requests")
    add_calibration_arg(p)
    p.add_argument("--json", action="store_true", help="both summaries and the deltas")
    command(p, cmd_compare)

    engine = add_engine_commands(sub)
    p = engine.add_parser("bench", help="play a workload against the real engine in real time; same summary as simulate")
    p.add_argument("--model", default="smollm2-135m", help="catalog name, checkpoint folder or .gguf file")
    add_workload_args(p)
    add_engine_flags(p)
    p.add_argument("--slo", help="latency targets, e.g. 'ttft_p99_ms<=500,tpot_p99_ms<=100'")
    p.add_argument("--json", action="store_true", help="the RunSummary schema of docs/simulate.md (source: engine)")
    command(p, cmd_engine_bench)

    add_bench_command(sub)

    # The engine settings that decide a calibration or a validation: the same declarations.
    engine_flags = {s.name: s for s in settings(EngineConfig)}
    p = sub.add_parser("calibrate", help="measure this machine and real engine steps; fit the cost model "
                                         "(or fit it to bench --url runs: --from-bench)")
    p.add_argument("--model", help="catalog name, checkpoint folder or .gguf file (default: smollm2-135m; with "
                                   "--from-bench, the model name the first bench file records)")
    add_flags(p, [engine_flags[n] for n in ("random_weights", "device", "dtype", "threads")])
    p.add_argument("--quick", action="store_true", help="a smaller grid and fewer repeats")
    p.add_argument("--write-profile", action="store_true",
                   help="also write the measured device profile to hwprofiles/<device>.yaml when none exists, so that "
                        "--hw <device> finds it (default: only the calibration file is written)")
    p.add_argument("--out", help="calibration file (default: hwprofiles/calibrations/<device>__<model>__<dtype>.json; "
                                 "with --public, hwprofiles/calibrations/public-gpu.json)")
    p.add_argument("--rounds", type=_at_least_one,
                   help="--public, --from-bench: trace-and-fit rounds at most, fewer once the figures settle (default: "
                        "3 with --public, 12 with --from-bench)")
    p.add_argument("--from-bench", nargs="+", metavar="RUN.json",
                   help="instead, fit the GPU-family and engine figures to files of `serveplan bench --url --json` "
                        "(each run held out in turn; docs/serving.md); with --hw, --engine and the deployment's flags")
    p.add_argument("--hw", dest="hardware", help="--from-bench: the hardware profile the endpoint runs on")
    p.add_argument("--max-model-len", type=int, help="--from-bench: the endpoint's longest prompt + output "
                                                     "(default: the model's context)")
    add_flags(p, [*DEPLOYMENT, *KNOBS])
    add_flags(p, DISAGGREGATION, **{s.name: None for s in DISAGGREGATION})
    p.add_argument("--checkpoint", metavar="FOLDER",
                   help="--public: keep the traced rounds and each held-out fold in this folder (yours only: it holds "
                        "pickles) as they complete, and resume from them; a full run takes hours on 2 cores")
    p.add_argument("--fresh", action="store_true",
                   help="--public: start the all-data fit from the profiles' estimates only (default: also from the "
                        "fit the new one replaces, keeping the lower cost)")
    p.add_argument("--bands-only", action="store_true",
                   help="--public: predict the held-out figures of the fit file (--out) again with today's simulator, "
                        "from the folds it stores, and make its prediction intervals from them; nothing is fitted "
                        "(minutes)")
    p.add_argument("--only", metavar="PARAM[,PARAM]",
                   help="--public: a staged fit: fit only these figures (e.g. a term the cost model gained), every other "
                        "held at the fit in --out, each held-out fold's at that fold's (minutes, not hours)")
    p.add_argument("--only-for", metavar="NAME[,NAME]",
                   help="--public --only: fit those figures of these GPU families or engine profiles only (e.g. ampere), "
                        "the others' held too (default: every family's and engine's)")
    p.add_argument("--report", dest="public_report",
                   help="--public: also write the validation of the fit's own predictions (markdown, with a plot and "
                        "the JSON the dashboard reads beside it), as `serveplan validate --public --report` would")
    _add_public_flags(p, "calibrate", "instead, fit the GPU-family and engine figures to published measurements "
                                      "(slow: minutes to hours; see docs/validation-public.md)")
    command(p, cmd_calibrate)

    p = sub.add_parser("validate", help="run the same workloads through the engine and the calibrated simulator")
    p.add_argument("--model", default="smollm2-135m", help="catalog name, checkpoint folder or .gguf file")
    add_flags(p, [engine_flags[n] for n in ("random_weights", "tensor_parallel", "expert_parallel")])
    p.add_argument("--calibration", help="a file written by `serveplan calibrate` (its thread count is used); with "
                                         "--public, a public fit (default: hwprofiles/calibrations/public-gpu.json)")
    p.add_argument("--memory", action="store_true",
                   help="instead: the memory model against published engine start-up logs (KV cache and weights GiB)")
    p.add_argument("--workloads", nargs="+", help="validate only these scenarios (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer requests per workload")
    p.add_argument("--force", action="store_true", help="apply a calibration made for another model or device")
    p.add_argument("--report", help="also write the comparison as markdown to this file (with --public, a plot and the JSON "
                        "the dashboard reads beside it)")
    p.add_argument("--json", action="store_true")
    _add_public_flags(p, "validate", "instead, predict every published GPU figure with the public fit, each source held out")
    command(p, cmd_validate)

    p = sub.add_parser("schema", help="export the JSON Schema of the specs")
    p.add_argument("--out", default="docs/schemas", help="output folder")
    command(p, cmd_schema)
    return parser


def error_line(exc: BaseException, flags: dict[str, str]) -> str | None:
    """The one line a bad input, an unreadable file or a too-deep input gets; None for a bug.
    An InputError's field is named by the flag that sets it, where one does."""
    if isinstance(exc, ValidationError):
        exc = from_validation_error(exc)
    if isinstance(exc, InputError):
        name = flags.get(exc.field) or ("" if ":" in exc.field else flags.get(exc.field.rsplit(".", 1)[-1]))
        return exc.message(name)
    if isinstance(exc, UsageError):
        return str(exc)
    if isinstance(exc, UnicodeDecodeError):  # its text holds only the offending byte, never the file
        return f"input is not {exc.encoding} text (byte {exc.start}: {exc.reason}); is it a binary file?"
    if isinstance(exc, OSError):  # the name as an excerpt: a 5,000-character path is an input too
        what = excerpt(exc.filename) if exc.filename is not None else "input/output"
        return f"{what}: {exc.strerror or type(exc).__name__}"
    if isinstance(exc, RecursionError):
        return "the input is nested too deeply to read (beyond Python's recursion limit)"
    if isinstance(exc, MemoryError):
        return "out of memory: some input is larger than a limit that should have refused it; please report it"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        read_flags(args)
        args.func(args)
    except SystemExit as exc:  # --help, or an answer that is "no" (memory: does not fit)
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print("serveplan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `serveplan ... --json | head`: the reader left; not an error of ours
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (interpreter shutdown flushes and closes it)
        return 0
    except Exception as exc:
        line = error_line(exc, getattr(args, "flags", {}))
        if line is None:
            raise
        print(f"serveplan: error: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
