"""Compare: what-if variants of a deployment on the same requests, with deltas (planner.compare)."""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd
from pydantic import ValidationError
import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import DEPLOYMENT, KNOBS, model_input, slo_input, upload_bytes, workload_inputs
from dashboard.state import PageState
from engine.config import EngineKnobs, SpeculativeSettings
from engine.errors import InputError, from_validation_error, unknown_name_error
from planner.compare import Comparison
from planner.hardware import hardware_catalog
from planner.specs import Deployment, HardwareProfile

COLUMNS = ["name", "hardware", "tp", "weight_dtype", "kv_dtype", "prefix_caching", "token_budget", "speculative_tokens",
           "draft_acceptance"]
DEFAULT_VARIANTS = [
    {"name": "A: bf16", "hardware": "h100-sxm", "tp": 1, "weight_dtype": "bf16", "kv_dtype": "bf16",
     "prefix_caching": True, "token_budget": 8192, "speculative_tokens": 0, "draft_acceptance": None},
    {"name": "B: fp8", "hardware": "h100-sxm", "tp": 1, "weight_dtype": "fp8", "kv_dtype": "fp8",
     "prefix_caching": True, "token_budget": 8192, "speculative_tokens": 0, "draft_acceptance": None},
]
# Each variant is a whole simulation: a link can ask for this many at most (docs/security.md).
MAX_VARIANTS = 8
MAX_NAME_CHARS = 64
# The figures worth a chart; the table has every metric planner.compare reports.
CHARTED = ["TTFT P99, ms", "TPOT P99, ms", "E2E P99, ms", "output tokens/s, steady state",
           "capacity within the SLO, requests/s", "US$ per 1M output tokens at capacity"]

TP = DEPLOYMENT["tensor_parallel"]
SPEC_TOKENS_LABEL, ACCEPTANCE_LABEL = "speculative tokens", "draft acceptance"
BUDGET = next(s for s in KNOBS if s.name == "max_num_batched_tokens")


def _deployment(row: dict[str, Any], hardware: dict[str, HardwareProfile]) -> Deployment:
    """A variant row as a Deployment, checked by the same declarations as the CLI's flags; its
    hardware is one of `hardware` by name, never a path."""
    name = str(row.get("name"))[:MAX_NAME_CHARS]
    try:
        if row.get("hardware") not in hardware:
            raise unknown_name_error("hardware", str(row.get("hardware")), hardware)
        return Deployment(hardware=row["hardware"], tensor_parallel=row.get("tp"), weight_dtype=row.get("weight_dtype"),
                          kv_dtype=row.get("kv_dtype"),
                          knobs=EngineKnobs(max_num_batched_tokens=row.get("token_budget"),
                                            enable_prefix_caching=bool(row.get("prefix_caching")),
                                            speculative=_speculative(row)))
    except InputError as exc:
        raise InputError(f"variant {name!r}: {exc.field}", exc.value, exc.allowed) from None
    except ValidationError as exc:
        problem = from_validation_error(exc)
        raise InputError(f"variant {name!r}: {problem.field}", problem.value, problem.allowed) from None


def _cell(row: dict[str, Any], column: str) -> Any:
    """A cell's value; None for an empty one (the editor leaves NaN in an emptied number cell)."""
    value = row.get(column)
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _speculative(row: dict[str, Any]) -> SpeculativeSettings | None:
    """n-gram speculation with k drafts accepted per position at the row's rate; None for k = 0."""
    k, acceptance = _cell(row, "speculative_tokens"), _cell(row, "draft_acceptance")
    if k is None or k == 0:
        return None
    if acceptance is None:
        raise InputError(ACCEPTANCE_LABEL, None, "a variant with speculative tokens needs the probability that each "
                         "draft is accepted, in (0, 1] (docs/speculative.md: measured as llm.spec_stats)")
    try:
        return SpeculativeSettings(method="ngram", num_speculative_tokens=k, acceptance_rate=acceptance)
    except ValidationError as exc:
        problem = from_validation_error(exc)
        label = {"num_speculative_tokens": SPEC_TOKENS_LABEL, "acceptance_rate": ACCEPTANCE_LABEL}.get(problem.field)
        raise InputError(label or problem.field, problem.value, problem.allowed) from None


def _rows(text: str, hardware: dict[str, HardwareProfile]) -> list[dict[str, Any]]:
    """The variants table from its URL JSON: a list of at most MAX_VARIANTS rows of COLUMNS,
    each a valid deployment."""
    try:
        rows = json.loads(text)
    except (ValueError, RecursionError):
        raise InputError("variants", text, "must be the variants table as JSON (a list of rows)") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise InputError("variants", text, "must be a JSON list of rows")
    if len(rows) > MAX_VARIANTS:
        raise InputError("variants", f"{len(rows)} rows", f"at most {MAX_VARIANTS} variants")
    for row in rows:
        if unknown := set(row) - set(COLUMNS):
            raise InputError("variants", sorted(unknown), f"unknown columns; the columns are {', '.join(COLUMNS)}")
        name = row.get("name")  # drawn in headings, tables and charts
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS or not name.isprintable():
            raise InputError("variants", text, f"each variant needs a name of 1..{MAX_NAME_CHARS} printable characters")
        try:
            _deployment(row, hardware)
        except InputError as exc:
            raise InputError("variants", text, exc.message()) from None
    return rows


def _detail(c: Comparison) -> pd.DataFrame:
    """One comparison's every figure: both sides, B - A, and where each would likely be measured
    (P10 and P90 as numbers of their own, formatted and sorted like the others, as the Simulate page's)."""
    a, b = c.a.path, c.b.path
    rows = []
    for m in c.metrics:
        row = {"metric": m.metric, a: m.a, b: m.b, "B − A": m.delta, "B − A (%)": m.delta_pct}
        for side, band in ((a, m.a_range), (b, m.b_range)):
            row[f"{side}: likely if measured, P10"], row[f"{side}: likely if measured, P90"] = band or (None, None)
        rows.append(row)
    return pd.DataFrame(rows).dropna(axis="columns", how="all").dropna(how="all", subset=[a, b])


def _uploaded_profiles() -> dict[str, HardwareProfile]:
    """Hardware profiles uploaded in the page, by name; a catalog name cannot be taken."""
    upload = upload_bytes("Own hardware profile (YAML)", ["yaml", "yml"], key="compare.hardware_upload",
                          help="A profile written against docs/schemas/HardwareProfile.schema.json; its name "
                               "becomes a hardware option in the table")
    if upload is None:
        return {}
    profile = compute.uploaded_profile(*upload)
    if profile.name in hardware_catalog():
        raise InputError("hardware upload: name", profile.name, "is a catalog profile's; give the upload its own name")
    return {profile.name: profile}


def render() -> None:
    state = PageState("compare")
    st.title("Compare")
    st.caption("Every variant serves the same drawn requests; each is compared with the first (B − A and %). "
               "Edit, add or remove rows in the table.")
    with st.sidebar:
        model = model_input(state)
        work = state.attempt(lambda: workload_inputs(state, allow_trace=False, default_requests=300))
        slo = slo_input(state)
        capacity = st.checkbox("Capacity within the SLO", key=state.bind("capacity", False),
                               help="Each variant's highest Poisson rate that still meets the SLO, and its cost per "
                                    "token there: a search of a few tens of simulations per variant (slower)")
        hardware = {**hardware_catalog(), **state.attempt(_uploaded_profiles)}
    # The table lives in the URL as JSON, so a shared link reproduces the variants.
    key = state.bind("variants", json.dumps(DEFAULT_VARIANTS), parse=lambda text: json.dumps(_rows(text, hardware)))
    rows = pd.DataFrame(json.loads(st.session_state[key]), columns=COLUMNS)
    edited = st.data_editor(rows, num_rows="dynamic", hide_index=True, width="stretch", column_config={
        "name": st.column_config.TextColumn("name", required=True, max_chars=MAX_NAME_CHARS),
        "hardware": st.column_config.SelectboxColumn("hardware", options=sorted(hardware), required=True),
        "tp": st.column_config.NumberColumn(TP.label, min_value=1, max_value=TP.bound("max")[0], step=1, required=True),
        "weight_dtype": st.column_config.SelectboxColumn("weights", options=DEPLOYMENT["weight_dtype"].choices,
                                                         required=True),
        "kv_dtype": st.column_config.SelectboxColumn("KV cache", options=DEPLOYMENT["kv_dtype"].choices, required=True),
        "prefix_caching": st.column_config.CheckboxColumn("prefix caching"),
        "token_budget": st.column_config.NumberColumn(BUDGET.label, min_value=1, max_value=BUDGET.bound("max")[0],
                                                      step=256, required=True),
        "speculative_tokens": st.column_config.NumberColumn(SPEC_TOKENS_LABEL, min_value=0, max_value=16, step=1),
        "draft_acceptance": st.column_config.NumberColumn(ACCEPTANCE_LABEL, min_value=0.0, max_value=1.0, step=0.05,
                                                          format="%.2f"),
    })
    st.caption("Speculative decoding is simulated as n-gram drafting (no draft model to run): each decode step "
               "verifies the speculative tokens, each accepted with the draft acceptance given the ones before it "
               "were (docs/speculative.md).")
    records = edited.dropna(subset=["name", "hardware"]).to_dict("records")
    state.set("variants", json.dumps(records, default=str))
    state.sync_url()

    if len(records) < 2:
        ui.stop_with("Compare needs at least two variants: add a row to the table")
    if len(records) > MAX_VARIANTS:
        ui.stop_with(f"compare runs at most {MAX_VARIANTS} variants; remove {len(records) - MAX_VARIANTS}")
    if len({r["name"] for r in records}) != len(records):
        ui.stop_with("variant names must be unique")
    variants = tuple((str(r["name"]), dep, hardware[dep.hardware])
                     for r in records for dep in [state.attempt(lambda: _deployment(r, hardware))])  # called at once
    workload = state.attempt(work.workload)
    assert workload is not None  # a preset: the page offers no trace
    results = state.attempt(lambda: compute.comparisons(model, workload, slo, variants, capacity))

    base = results[0].a
    wide = pd.DataFrame({"metric": [m.metric for m in results[0].metrics], base.path: [m.a for m in results[0].metrics]})
    for c in results:
        wide[c.b.path] = [m.b for m in c.metrics]
        wide[f"{c.b.path} vs A (%)"] = [m.delta_pct for m in c.metrics]
    # Figures no variant has (capacity when not asked for) are left out rather than shown as empty rows.
    wide = wide.dropna(how="all", subset=list(wide.columns[1:]))
    ui.table(wide, "Variants side by side", key="compare.wide",
             caption=f"{model}, workload {workload.name}, {workload.num_requests} requests; "
                     "% = (variant − first) / first × 100. Rates are over each run's steady window (warm-up and "
                     "drain left out)" + (", capacities within the SLO by a search of simulations." if capacity and
                                          slo.strip() else "; tick 'Capacity within the SLO' (with an SLO) for "
                                          "each variant's capacity and its cost per token there."))
    for side in [base, *(c.b for c in results)]:
        if side.capacity is not None:  # as the CLI prints it: how it was searched, or why there is none
            st.caption(f"Capacity of {side.path}: {side.capacity.basis}.")
        if (caution := side.summary.band_caution()) is not None:
            st.warning(f"Measured, {side.path} could miss the SLO: {caution}.")
    deltas = pd.DataFrame([{"variant": c.b.path, "metric": m.metric, "change vs A (%)": m.delta_pct}
                           for c in results for m in c.metrics if m.metric in CHARTED and m.delta_pct is not None])
    if not deltas.empty:
        st.markdown(f"**Change against {base.path} (%)**")
        st.altair_chart(charts.grouped_bars(deltas, "metric", "change vs A (%)", "variant", "change vs A (%)"),
                        width="stretch")
    for c in results:
        ui.table(_detail(c), f"{c.b.path} vs {base.path}", key=f"compare.{c.b.path}")
    ui.json_download("Comparisons (JSON: a list, each as serveplan compare --json prints one)",
                     [c.model_dump(mode="json") for c in results], "comparisons.json", key="compare.json")
    ui.assumptions("comparison", [f"{side.path}: {side.summary.cost.basis}" for side in [base, *(c.b for c in results)]],
                   base.summary.assumptions)


render()
