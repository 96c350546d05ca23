"""Cached calls into the planner: the dashboard's only path to results.

Each function takes plain values and pydantic specs (hashed by their JSON, so equal specs hit
the same cache entry), calls the planner's public API and returns what the pages draw. Errors
propagate as InputError / ValidationError for `ui.attempt` to show; Streamlit never caches a
raised call, so a corrected input is computed afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
import math
from pathlib import Path
import tempfile
from typing import Any, TypeVar

import pandas as pd
from pydantic import BaseModel, ValidationError
import streamlit as st

from engine.catalog import catalog, resolve_model
from engine.config import EngineKnobs, ModelConfig
from engine.errors import InputError, from_validation_error, unknown_name_error
from engine.files import read_bytes
from planner.compare import Comparison, compare, simulate_side
from planner.costmodel import CostModel
from planner.hardware import hardware_catalog, load_profile_file
from planner.memory import MemoryPlan, plan_memory
from planner.metrics import PricedStep, RunSummary
from planner.playback import Replay
from planner.public.report import PublicValidation
from planner import search
from planner.search import CandidatePlan, PlanResult
from planner.search.cache import RunCache
from planner.sim import RouterName, simulate
from planner.tiers import kv_tiers
from planner.specs import SLO, Deployment, HardwareProfile
from planner.validate import ValidationReport
from planner.workload import Workload, workload_from_trace


def _json(model: BaseModel) -> str:
    return model.model_dump_json()


# Streamlit matches hash_funcs by exact type, so each spec type is listed (typed as st.cache_data takes them).
SPEC_HASH: dict[str | type[Any], Callable[[Any], Any]] = {
    cls: _json for cls in (Deployment, EngineKnobs, Workload, SLO, HardwareProfile)}


def _catalog_model(name: str) -> ModelConfig:
    """A catalog model by name: the dashboard never turns a name it was sent into a path."""
    if name not in catalog():
        raise unknown_name_error("model", name, catalog())
    return resolve_model(name)


def _catalog_profile(name: str) -> HardwareProfile:
    """A catalog profile by name, for the same reason."""
    profiles = hardware_catalog()
    if name not in profiles:
        raise unknown_name_error("hardware", name, profiles)
    return profiles[name]


def _slo(text: str) -> SLO | None:
    return SLO.parse(text) if text.strip() else None


def _replay(workload: Workload | None, trace_name: str | None, trace_bytes: bytes | None, vocab_size: int,
            max_model_len: int) -> Replay:
    """The requests to simulate; one longer than `max_model_len` is refused before any token id is drawn."""
    if workload is not None:
        return Replay.of(workload, vocab_size=vocab_size, max_model_len=max_model_len)
    if trace_name is None or trace_bytes is None:
        raise InputError("workload", None, "choose a preset or upload a trace")
    with uploaded_file(trace_name, trace_bytes) as path:
        return Replay.from_trace(path, vocab_size=vocab_size, max_model_len=max_model_len)


@contextmanager
def uploaded_file(name: str, data: bytes) -> Iterator[Path]:
    """An upload as a file of its own name (its last part only) in a private temporary folder: the
    planner's readers take a path, pick the format by suffix and apply a file's checks and limits."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(name).name
        path.write_bytes(data)
        yield path


@st.cache_data(show_spinner=False, max_entries=8)
def trace_workload(name: str, data: bytes, max_model_len: int) -> Workload:
    """An uploaded trace summarised for planning (planner.workload.workload_from_trace)."""
    with uploaded_file(name, data) as path:
        return workload_from_trace(path, max_model_len=max_model_len)


# --------------------------------------------------------------------------- simulate


@dataclass(frozen=True)
class SimView:
    """One simulation, reduced to what the Simulate page draws (picklable, for st.cache_data)."""

    summary: RunSummary
    memory: MemoryPlan
    requests: pd.DataFrame  # one row per finished request, latencies in ms
    samples: pd.DataFrame  # one row per engine step per replica (full resolution)
    breakdown: pd.DataFrame  # phase, operator, ms: the cost model's step time split by operator
    breakdown_basis: list[str]


@st.cache_data(show_spinner="Simulating…", hash_funcs=SPEC_HASH, max_entries=64)
def simulate_view(model_name: str, dep: Deployment, workload: Workload | None, trace_name: str | None,
                  trace_bytes: bytes | None, slo_text: str, router: RouterName) -> SimView:
    model = _catalog_model(model_name)
    hw = _catalog_profile(dep.hardware)
    slo = _slo(slo_text)
    replay = _replay(workload, trace_name, trace_bytes, model.vocab_size, model.max_position_embeddings)
    result = simulate(model, hw, dep, replay, slo=slo, router=router)
    reqs = pd.DataFrame([
        {"ttft_ms": r.ttft_s * 1e3, "tpot_ms": r.tpot_s * 1e3 if r.output_tokens > 1 else math.nan,
         "e2e_ms": r.e2e_s * 1e3, "queueing_ms": math.nan if r.queueing_s is None else r.queueing_s * 1e3,
         "prompt_tokens": r.prompt_tokens, "cached_prompt_tokens": r.cached_prompt_tokens,
         "output_tokens": r.output_tokens, "preemptions": r.num_preemptions}
        for r in result.record.requests
    ])
    samples = pd.DataFrame(result.record.samples, columns=["replica", "start_s", "end_s", "kv_cache_usage",
                                                           "num_running", "num_waiting", "num_batched_tokens"])
    steps = result.summary.step_time or []
    rows = [{"phase": _phase(step), "operator": op, "ms": ms} for step in steps for op, ms in step.operators_ms.items()]
    basis = [f"{step.kind}: {step.basis}" for step in steps]
    basis.append("milliseconds per operator from the cost model the simulator priced the run with (planner/costmodel/)")
    return SimView(result.summary, result.memory, reqs, samples, pd.DataFrame(rows, columns=["phase", "operator", "ms"]),
                   basis)


def _phase(step: PricedStep) -> str:
    if step.kind == "decode":
        return f"decode step (batch {step.requests}, context {step.tokens})"
    return f"prefill chunk ({step.tokens} tokens)"


# --------------------------------------------------------------------------- plan


@st.cache_data(show_spinner=False, hash_funcs=SPEC_HASH, max_entries=16)
def plan_result(model_name: str, workload: Workload, rate_per_s: float, slo_text: str, hardware: tuple[HardwareProfile, ...],
                max_gpus: int, budget: float | None, weight_dtypes: tuple[str, ...] | None, kv_dtypes: tuple[str, ...],
                knobs_grid: tuple[EngineKnobs, ...], headroom: float, max_quality_loss_pct: float,
                prefix_caching: bool | None, requests_per_probe: int, pd_ratios: str = "auto",
                offload: str = "auto", every_hardware: bool = True) -> PlanResult:
    # The bar is created inside the cached function so that Streamlit can replay it on a cache
    # hit (an element created outside could not be replayed); it is emptied once done.
    bar = st.progress(0.0, text="Planning: screening candidates…")

    first = st.empty()

    def on_progress(done: int, total: int) -> None:
        bar.progress(done / max(total, 1), text=f"Planning: {done} of {total} candidates settled")

    def on_answer(answer: CandidatePlan | None) -> None:
        """The recommendation as soon as it is known, while every hardware is sized for the comparison."""
        if answer is not None:
            first.info(f"Answer: {answer.replicas} × {answer.label}, US${answer.usd_per_hour:,.2f}/h; sizing every "
                       "hardware for the comparison…")

    # Serial: Streamlit serves from a threaded process, and a fork-based pool there is fragile.
    # The CLI's on-disk cache is shared (read at call time, so tests can point it elsewhere).
    result = search.plan(model_name, workload, rate_per_s, SLO.parse(slo_text), hardware=list(hardware),
                         max_gpus_per_replica=max_gpus, budget_usd_per_hour=budget,
                         weight_dtypes=None if weight_dtypes is None else list(weight_dtypes),
                         kv_dtypes=list(kv_dtypes), knobs_grid=list(knobs_grid), headroom=headroom,
                         max_quality_loss_pct=max_quality_loss_pct, prefix_caching=prefix_caching, widen=True,
                         pd_ratios=pd_ratios, offload=offload, every_hardware=every_hardware,
                         requests_per_probe=requests_per_probe, executor="serial",
                         cache_dir=search.DEFAULT_CACHE_DIR, progress=False, on_progress=on_progress,
                         on_answer=on_answer)
    bar.empty()
    first.empty()
    return result


# --------------------------------------------------------------------------- compare


@st.cache_data(show_spinner="Simulating variants…", hash_funcs=SPEC_HASH, max_entries=16)
def comparisons(model_name: str, workload: Workload, slo_text: str,
                variants: tuple[tuple[str, Deployment, HardwareProfile], ...], capacity: bool) -> list[Comparison]:
    """Each variant after the first against the first (planner.compare: B - A and %), with each one's
    capacity within the SLO if `capacity`. Each comes with its hardware profile: a name in a variant
    is never resolved here, so never read as a path."""
    model = _catalog_model(model_name)
    slo = _slo(slo_text)
    # One draw (every variant serves the same requests), none of them beyond the model's context.
    replay = Replay.of(workload, vocab_size=model.vocab_size, max_model_len=model.max_position_embeddings)
    runs = RunCache.open(search.DEFAULT_CACHE_DIR)  # capacity probes, shared with the Plan page's
    sides = []
    for name, dep, hw in variants:
        try:
            sides.append(simulate_side(name, model, hw, dep, workload, replay, slo, capacity=capacity, runs=runs))
        except InputError as exc:
            raise InputError(f"variant {name!r}: {exc.field}", exc.value, exc.allowed) from None
    return [compare(sides[0], b) for b in sides[1:]]


def uploaded_profile(name: str, data: bytes) -> HardwareProfile:
    """A hardware profile uploaded in the page, read as a profile file is (same checks)."""
    with uploaded_file(name, data) as path:
        return load_profile_file(path)


# --------------------------------------------------------------------------- memory and hardware


@st.cache_data(show_spinner=False, hash_funcs=SPEC_HASH, max_entries=64)
def memory_plans(model_name: str, dep: Deployment, contexts: tuple[int, ...]) -> list[MemoryPlan]:
    model = _catalog_model(model_name)
    hw = _catalog_profile(dep.hardware)
    return [plan_memory(model, hw, dep, c) for c in contexts]


def kv_tier_table(dep: Deployment, memory: MemoryPlan) -> pd.DataFrame:
    """The device KV cache and the offload tiers of one engine instance (planner.tiers)."""
    rows = kv_tiers(_catalog_profile(dep.hardware), dep, memory)
    return pd.DataFrame([{
        "tier": r.tier, "medium": r.medium, "GiB per replica": r.gib_per_replica, "blocks": r.blocks, "tokens": r.tokens,
        "listed GiB per replica": r.capacity_gib_per_replica, "write GB/s per GPU": r.write_gb_s,
        "read GB/s per GPU": r.read_gb_s} for r in rows])


@st.cache_data(show_spinner=False)
def hardware_table() -> pd.DataFrame:
    rows = []
    for hw in hardware_catalog().values():
        peaks = hw.peak_tflops
        rows.append({
            "name": hw.name, "product": hw.display_name, "vendor": hw.vendor, "kind": hw.kind,
            "memory (GiB)": hw.memory_gib, "bandwidth (GB/s)": hw.memory_bandwidth_gb_s,
            "BF16 (TFLOPS)": peaks.bf16, "FP8 (TFLOPS)": peaks.fp8, "INT8 (TOPS)": peaks.int8, "FP4 (TFLOPS)": peaks.fp4,
            "scale-up link": hw.scale_up.name if hw.scale_up else None,
            "scale-up (GB/s)": hw.scale_up.bandwidth_gb_s if hw.scale_up else None,
            "power (W)": hw.power_w, "price (US$/GPU-h)": hw.price_usd_per_hour,
        })
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class RooflinePoints:
    roofs: pd.DataFrame  # chip, intensity (FLOP/byte), attainable (TFLOP/s)
    points: pd.DataFrame  # chip, phase, intensity, achieved TFLOP/s, step ms
    skipped: list[str]  # chips left out, with why


@st.cache_data(show_spinner=False)
def roofline(model_name: str, chips: tuple[str, ...], weight_dtype: str, decode_batch: int, decode_context: int,
             prefill_tokens: int) -> RooflinePoints:
    """Each chip's roof (its GEMM peak for this weight dtype, its bandwidth) and where one decode
    step and one prefill step of the model land on it, per GPU at TP 1 (the cost model's FLOPs and bytes)."""
    model = _catalog_model(model_name)
    roofs, points, skipped = [], [], []
    for name in chips:
        hw = _catalog_profile(name)
        try:
            cm = CostModel(model, hw, Deployment(hardware=name, weight_dtype=weight_dtype, kv_dtype="bf16"))
        except InputError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        peak, dtype = hw.peak_flops(cm.gemm_dtype)
        bw = hw.memory_bandwidth_gb_s * 1e9
        ridge = peak / bw
        for intensity in (0.1, ridge, 1e5):  # a roofline is two straight lines on log-log axes
            roofs.append({"chip": name, "intensity (FLOP/byte)": intensity,
                          "attainable (TFLOP/s)": min(peak, intensity * bw) / 1e12, "peak dtype": dtype})
        for phase, cost in (("decode", cm.decode_cost(decode_batch, decode_context)),
                            ("prefill", cm.prefill_cost(prefill_tokens))):
            points.append({"chip": name, "phase": phase, "intensity (FLOP/byte)": cost.flops / cost.bytes,
                           "achieved (TFLOP/s)": cost.flops / cost.seconds / 1e12, "step (ms)": cost.seconds * 1e3,
                           "peak dtype": dtype})
    return RooflinePoints(pd.DataFrame(roofs), pd.DataFrame(points), skipped)


# --------------------------------------------------------------------------- validate


# The only folder whose files the dashboard reads by a name it was sent (validation reports).
REPORTS_DIR = Path(__file__).resolve().parents[1] / "docs"


def project_reports() -> list[str]:
    """Names of the JSON reports in docs/: regular files, links that stay inside it."""
    root = REPORTS_DIR.resolve()
    return sorted(p.name for p in REPORTS_DIR.glob("*.json") if p.is_file() and p.resolve().parent == root)


def project_report(name: str) -> bytes:
    """The bytes of report `name` in docs/, by name only, read as any user file is (a regular
    file, opened without blocking, size checked on the opened file: engine.files)."""
    if name not in project_reports():
        raise unknown_name_error("report", name, project_reports())
    return read_bytes(REPORTS_DIR / name, "report", "MAX_JSON_BYTES")


Report = TypeVar("Report", bound=BaseModel)


def _report(model: type[Report], text: bytes) -> Report:
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


@st.cache_data(show_spinner=False, max_entries=4)
def public_validation(text: bytes) -> PublicValidation:
    """A PublicValidation (`serveplan validate --public --json`) from the bytes of a file under docs/."""
    return _report(PublicValidation, text)


@st.cache_data(show_spinner=False, max_entries=8)
def validation_report(text: bytes) -> ValidationReport:
    """A ValidationReport from the bytes of a file under docs/ or an upload (never a path from a URL)."""
    return _report(ValidationReport, text)
