"""Sidebar inputs, each bound to a URL parameter and read through the check its widget makes.

A declared setting (engine/knobs.py: an EngineKnobs, Deployment, WorkloadOverrides or
PlanSettings field) becomes its widget here: label and unit, help, bounds and choices all come
from the declaration, and the URL parameter (the CLI flag without dashes: `--tp` -> `tp`) is
checked by the same field the CLI checks. Inputs over a catalog (model, hardware, preset) accept
only catalog names. Nothing here validates on its own; the specs and the planner do, and
`PageState.attempt` shows what they refuse in place. Call these inside `with st.sidebar:` (or a
sidebar form).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationError
import streamlit as st

from dashboard.state import PageState, parse_list
from engine.catalog import catalog
from engine.errors import InputError, from_validation_error, unknown_name_error
from engine.knobs import Knob, Setting, settings
from planner.hardware import hardware_catalog
from planner.sim.router import ROUTERS, RouterName
from planner.specs import Deployment, Disaggregation, EngineKnobs, WorkloadOverrides
from planner.workload import PRESETS, Workload, get_workload

# Cheap defaults so every page renders in seconds on a laptop CPU.
DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_HARDWARE = "h100-sxm"
DEFAULT_RATE_PER_S = 6.0
DEFAULT_REQUESTS = 400
DEFAULT_SLO = "ttft_p99_ms<=500,tpot_p99_ms<=50"
SLO_HELP = (
    "Comma-separated targets, e.g. ttft_p99_ms<=500,tpot_p99_ms<=50,goodput_share>=0.99. "
    "Fields: ttft_p99_ms, ttft_p50_ms, tpot_p99_ms, tpot_p50_ms, itl_p99_ms, e2e_p99_ms (ms), goodput_share (0-1)."
)
TRACE = "upload a trace"
# Uploads are held in memory: each is refused above this size before it is read (docs/security.md).
MAX_UPLOAD_BYTES = 32 * 2**20

DEPLOYMENT = {s.name: s for s in settings(Deployment)}
KNOBS = settings(EngineKnobs)
DISAGGREGATION = settings(Disaggregation)
WORKLOAD = {s.name: s for s in settings(WorkloadOverrides)}


# --------------------------------------------------------------------------- widgets


def setting_input(state: PageState, setting: Setting, *, default: Any = None, name: str | None = None,
                  label: str | None = None, help: str | None = None, **widget: Any) -> Any:
    """The widget of a declared setting, bound to URL parameter `name` (default: the setting's)
    and read through the setting's field; `default`, `label` and `help` replace the declared ones."""
    label, help = label or setting.label, help or setting.help
    value = setting.default if default is None else default
    key = state.bind(name or setting.url_name, value, parse=setting.check, label=label, field=setting.name)
    if setting.optional and (setting.kind is bool or setting.choices is not None):
        # Unset is the serving engine's own default for the device (an engine knob), not a value.
        # Streamlit draws a None selection as its placeholder ("Choose an option" unless told).
        options = [None, *(setting.choices or (True, False))]
        return st.selectbox(label, options, key=key, help=help, format_func=_optional_text,
                            placeholder=_optional_text(None))
    if setting.kind is bool:
        return st.checkbox(label, key=key, help=help)
    if setting.choices is not None:
        return st.selectbox(label, setting.choices, key=key, help=help)
    if setting.kind is str:  # free text: its consumer checks it through the field, inside ui.attempt
        return st.text_input(label, key=key, help=help)
    # Inclusive bounds become the widget's; an exclusive one (gt=0) is left to the field's check.
    kind = setting.kind
    (lo, lo_in), (hi, hi_in) = setting.bound("min"), setting.bound("max")
    if setting.optional:
        widget.setdefault("placeholder", "engine default")
    return st.number_input(label, min_value=kind(lo) if lo is not None and lo_in else None,
                           max_value=kind(hi) if hi is not None and hi_in else None, key=key,
                           help=help, **widget)


def _optional_text(value: Any) -> str:
    if value is None:
        return "engine default"
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def one_of(field: str, options: Sequence[Any]) -> Any:
    """A URL parser that accepts one of `options` (their text) and suggests near names otherwise."""
    by_text = {str(o): o for o in options}

    def parse(text: str) -> Any:
        if text not in by_text:
            raise unknown_name_error(field, text, by_text)
        return by_text[text]

    return parse


def choice_input(state: PageState, name: str, label: str, options: Sequence[Any], default: Any, *,
                 help: str | None = None, field: str | None = None) -> Any:
    key = state.bind(name, default, parse=one_of(name, options), label=label, field=field)
    return st.selectbox(label, options, key=key, help=help)


def choices_input(state: PageState, name: str, label: str, options: Sequence[Any], default: list[Any], *,
                  help: str | None = None, field: str | None = None) -> list[Any]:
    one = one_of(name, options)
    key = state.bind(name, default, parse=lambda text: [one(part) for part in parse_list(text)], label=label,
                     field=field)
    return st.multiselect(label, options, key=key, help=help)


def upload_bytes(label: str, types: list[str], *, help: str | None = None, key: str | None = None) -> tuple[str, bytes] | None:
    """(name, bytes) of a file uploaded in the page, refused above MAX_UPLOAD_BYTES before it is read."""
    upload = st.file_uploader(label, type=types, help=help, key=key)
    if upload is None:
        return None
    if upload.size > MAX_UPLOAD_BYTES:
        raise InputError("upload", upload.name, f"is {upload.size:,} bytes; the limit is {MAX_UPLOAD_BYTES:,}")
    return upload.name, upload.getvalue()


# --------------------------------------------------------------------------- shared inputs


def model_input(state: PageState) -> str:
    return choice_input(state, "model", "Model", sorted(catalog()), DEFAULT_MODEL,
                        help="Catalog model (`serveplan models list`); its HF config sets layers, heads and sizes")


def hardware_input(state: PageState, *, name: str = "hw", label: str = "Hardware") -> str:
    return choice_input(state, name, label, sorted(hardware_catalog()), DEFAULT_HARDWARE, field="hardware",
                        help="Hardware profile (`serveplan hw list`): datasheet peaks, bandwidth, links, price")


def deployment_inputs(state: PageState) -> Deployment:
    """One deployment: hardware, parallelism, precision and the engine knobs that change serving."""
    hw = hardware_input(state)
    layout = {name: setting_input(state, DEPLOYMENT[name])
              for name in ("tensor_parallel", "pipeline_parallel", "replicas", "weight_dtype", "kv_dtype")}
    with st.expander("Engine knobs"):
        knobs = {s.name: setting_input(state, s) for s in KNOBS}
        attention_kernel = setting_input(state, DEPLOYMENT["attention_kernel"])
    with st.expander("Prefill/decode disaggregation"):
        split = st.checkbox("Separate prefill and decode instances", key=state.bind("disaggregate", False),
                            help="Each replica becomes x prefill and y decode instances; a prompt's KV moves between them")
        disagg = {s.name: setting_input(state, s) for s in DISAGGREGATION}
    return Deployment(hardware=hw, **layout, knobs=EngineKnobs(**knobs), attention_kernel=attention_kernel,
                      disaggregation=Disaggregation(**disagg) if split else None)


def router_input(state: PageState) -> RouterName:
    return choice_input(state, "router", "Router", list(ROUTERS), "round_robin",
                        help="How requests are spread over replicas (see docs/simulate.md)")


@dataclass(frozen=True)
class WorkloadInput:
    """A preset with overrides, or an uploaded trace (its bytes: uploads cannot travel in a URL)."""

    preset: str | None
    overrides: WorkloadOverrides = WorkloadOverrides()
    trace_name: str | None = None
    trace_bytes: bytes | None = None

    @property
    def rate_per_s(self) -> float | None:
        return self.overrides.rate_per_s

    @property
    def requests(self) -> int | None:
        return self.overrides.num_requests

    def workload(self) -> Workload | None:
        """The preset with its overrides (None for a trace); InputError names a bad value."""
        if self.preset is None:
            return None
        return get_workload(self.preset, **self.overrides.workload_fields())


def workload_inputs(state: PageState, *, allow_trace: bool = True, default_requests: int = DEFAULT_REQUESTS,
                    requests_help: str | None = None) -> WorkloadInput:
    options = [*PRESETS, *([TRACE] if allow_trace else [])]
    preset = choice_input(state, "workload", "Workload", options, "chat",
                          help="; ".join(f"{k}: {w.description}" for k, w in PRESETS.items()))
    if preset == TRACE:
        upload = state.attempt(lambda: upload_bytes(
            "Trace (JSONL or CSV)", ["jsonl", "csv"], help="Columns arrival_s, input_tokens, output_tokens, optional "
            "prefix_id, conversation_id (docs/workloads.md). Replayed at its recorded times."))
        return WorkloadInput(None) if upload is None else WorkloadInput(None, trace_name=upload[0], trace_bytes=upload[1])
    values = {
        "rate_per_s": setting_input(state, WORKLOAD["rate_per_s"], default=DEFAULT_RATE_PER_S, step=1.0),
        "num_requests": setting_input(state, WORKLOAD["num_requests"], default=default_requests, step=100,
                                      help=requests_help),
    }
    with st.expander("Lengths and seed"):
        for name in ("input_tokens", "output_tokens"):
            values[name] = setting_input(state, WORKLOAD[name])
        values["seed"] = setting_input(state, WORKLOAD["seed"], default=0)
    with st.expander("Shared prefix"):
        for name, unset in (("prefix_tokens", "the workload's"), ("num_prefixes", "1"), ("prefix_share", "1")):
            values[name] = setting_input(state, WORKLOAD[name], placeholder=unset)
    try:
        overrides = WorkloadOverrides(**values)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    return WorkloadInput(preset, overrides)


class RooflineQuery(BaseModel):
    """The two steps the Hardware page places on each chip's roofline."""

    decode_batch: Annotated[int, Knob("--batch", "Decode batch", "requests")] = Field(
        32, ge=1, le=4096, description="Requests in one decode step")
    decode_context: Annotated[int, Knob("--context", "Decode context", "tokens")] = Field(
        2048, ge=1, le=1_000_000, description="Tokens already in the KV cache of each decoding request")
    prefill_tokens: Annotated[int, Knob("--prefill", "Prefill chunk", "tokens")] = Field(
        2048, ge=1, le=131072, description="Prompt tokens in one prefill step, nothing cached")


def slo_input(state: PageState, default: str = DEFAULT_SLO) -> str:
    return st.text_input("SLO", key=state.bind("slo", default, label="SLO"), help=SLO_HELP)
