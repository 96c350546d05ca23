"""Sidebar inputs shared by several pages, each bound to the URL and labelled with its unit.

They only collect values and build the planner's own specs (Deployment, EngineKnobs, Workload);
validation is the specs' and the planner's, shown in place by `ui.attempt`. Call them inside
`with st.sidebar:` (or a sidebar form).
"""

from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from dashboard.state import PageState
from engine.catalog import catalog
from engine.config import EngineKnobs
from engine.errors import InputError
from planner.hardware import hardware_catalog
from planner.sim.router import ROUTERS
from planner.specs import Deployment
from planner.workload import PRESETS, Workload, get_workload

# Cheap defaults so every page renders in seconds on a laptop CPU.
DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_HARDWARE = "h100-sxm"
DEFAULT_RATE_PER_S = 6.0
DEFAULT_REQUESTS = 400
DEFAULT_SLO = "ttft_p99_ms<=500,tpot_p99_ms<=50"
DTYPES = ["bf16", "fp16", "fp32", "fp8", "int8", "int4", "fp4"]
KV_DTYPES = ["bf16", "fp16", "fp32", "fp8", "int8"]
SLO_HELP = (
    "Comma-separated targets, e.g. ttft_p99_ms<=500,tpot_p99_ms<=50,goodput_share>=0.99. "
    "Fields: ttft_p99_ms, ttft_p50_ms, tpot_p99_ms, tpot_p50_ms, itl_p99_ms, e2e_p99_ms (ms), goodput_share (0-1)."
)
TRACE = "upload a trace"


def model_input(state: PageState) -> str:
    names = sorted(catalog())
    return st.selectbox("Model", names, key=state.bind("model", DEFAULT_MODEL),
                        help="Catalog model (`serveplan models list`); its HF config sets layers, heads and sizes")


def hardware_input(state: PageState, *, name: str = "hw", label: str = "Hardware") -> str:
    return st.selectbox(label, sorted(hardware_catalog()), key=state.bind(name, DEFAULT_HARDWARE),
                        help="Hardware profile (`serveplan hw list`): datasheet peaks, bandwidth, links, price")


def deployment_inputs(state: PageState) -> Deployment:
    """One deployment: hardware, parallelism, precision and the engine knobs that change serving."""
    hw = hardware_input(state)
    tp = st.number_input("Tensor parallel (GPUs per replica)", 1, 64, key=state.bind("tp", 1),
                         help="GPUs one layer is split across; must divide the attention heads")
    pp = st.number_input("Pipeline stages", 1, 16, key=state.bind("pp", 1), help="Layers split into sequential stages")
    replicas = st.number_input("Replicas", 1, 256, key=state.bind("replicas", 1),
                               help="Data-parallel copies behind the router")
    weight = st.selectbox("Weight dtype", DTYPES, key=state.bind("weight_dtype", "bf16"),
                          help="Storage format of the weights (fp8/fp4 compute natively where the chip has a peak for it)")
    kv = st.selectbox("KV-cache dtype", KV_DTYPES, key=state.bind("kv_dtype", "bf16"), help="Storage format of the KV cache")
    with st.expander("Engine knobs"):
        knobs = EngineKnobs(
            max_num_batched_tokens=st.number_input(
                "Token budget per step (tokens)", 16, 131072, step=256, key=state.bind("mbt", 8192),
                help="max_num_batched_tokens: prefill chunk + decode tokens per engine step"),
            max_num_seqs=st.number_input("Max running requests", 1, 4096, key=state.bind("seqs", 256),
                                         help="max_num_seqs: most requests in one batch"),
            enable_chunked_prefill=st.checkbox("Chunked prefill", key=state.bind("chunked", True),
                                               help="Split long prompts across steps to fit the token budget"),
            enable_prefix_caching=st.checkbox("Prefix caching", key=state.bind("prefix_caching", True),
                                              help="Share KV blocks of equal prefixes across requests"),
            gpu_memory_utilization=st.slider("GPU memory utilisation (share)", 0.5, 1.0, step=0.01,
                                             key=state.bind("gpu_mem", 0.9),
                                             help="Share of device memory for weights, activations and KV cache"),
            enforce_eager=st.checkbox("Eager only (no CUDA graphs)", key=state.bind("eager", False),
                                      help="enforce_eager: launch every kernel of every step; otherwise decode batches "
                                           "of up to 512 requests replay a captured graph on GPUs that support it"),
        )
    return Deployment(hardware=hw, tensor_parallel=tp, pipeline_parallel=pp, replicas=replicas,
                      weight_dtype=weight, kv_dtype=kv, knobs=knobs)


def router_input(state: PageState) -> str:
    return st.selectbox("Router", list(ROUTERS), key=state.bind("router", "round_robin"),
                        help="How requests are spread over replicas (see docs/simulate.md)")


@dataclass(frozen=True)
class WorkloadInput:
    """A preset with overrides, or an uploaded trace (its bytes: uploads cannot travel in a URL)."""

    preset: str | None
    rate_per_s: float = 0.0
    requests: int = 0
    input_tokens: int = 0  # 0: the preset's distribution
    output_tokens: int = 0
    seed: int = 0
    trace_name: str | None = None
    trace_bytes: bytes | None = None

    def workload(self) -> Workload | None:
        """The preset with its overrides (None for a trace); InputError names a bad value."""
        if self.preset is None:
            return None
        if not self.rate_per_s > 0:  # the CLI's --rate check, same wording
            raise InputError("rate", self.rate_per_s, "must be > 0 requests/s")
        overrides: dict[str, object] = {"arrival": {"kind": "poisson", "rate_per_s": self.rate_per_s},
                                        "num_requests": self.requests, "seed": self.seed}
        if self.input_tokens:
            overrides["input_tokens"] = self.input_tokens
        if self.output_tokens:
            overrides["output_tokens"] = self.output_tokens
        return get_workload(self.preset, **overrides)


def workload_inputs(state: PageState, *, allow_trace: bool = True, default_requests: int = DEFAULT_REQUESTS,
                    requests_help: str = "Requests drawn from the workload (follow-up turns included)") -> WorkloadInput:
    options = [*PRESETS, *([TRACE] if allow_trace else [])]
    preset = st.selectbox("Workload", options, key=state.bind("workload", "chat"),
                          help="; ".join(f"{k}: {w.description}" for k, w in PRESETS.items()))
    if preset == TRACE:
        upload = st.file_uploader("Trace (JSONL or CSV)", type=["jsonl", "csv"],
                                  help="Columns arrival_s, input_tokens, output_tokens, optional prefix_id, "
                                       "conversation_id (docs/workloads.md). Replayed at its recorded times.")
        if upload is None:
            return WorkloadInput(None)
        return WorkloadInput(None, trace_name=upload.name, trace_bytes=upload.getvalue())
    rate = st.number_input("Arrival rate (requests/s)", 0.0, 10000.0, step=1.0, key=state.bind("rate", DEFAULT_RATE_PER_S),
                           help="Poisson arrivals; replaces the preset's arrival process. Must be > 0")
    requests = st.number_input("Requests", 1, 100000, step=100, key=state.bind("requests", default_requests),
                               help=requests_help)
    with st.expander("Lengths and seed"):
        input_tokens = st.number_input("Prompt tokens (0: the preset's distribution)", 0, 1_000_000,
                                       key=state.bind("input_tokens", 0), help="A fixed prompt length, tokens")
        output_tokens = st.number_input("Output tokens (0: the preset's distribution)", 0, 1_000_000,
                                        key=state.bind("output_tokens", 0), help="A fixed reply length, tokens")
        seed = st.number_input("Seed", 0, 2**31 - 1, key=state.bind("seed", 0), help="Seed of every random draw")
    return WorkloadInput(preset, rate, requests, input_tokens, output_tokens, seed)


def slo_input(state: PageState, default: str = DEFAULT_SLO) -> str:
    return st.text_input("SLO", key=state.bind("slo", default), help=SLO_HELP)
