"""Compare: what-if variants of a deployment on the same requests, with deltas (planner.compare)."""

from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import DTYPES, KV_DTYPES, model_input, slo_input, workload_inputs
from dashboard.state import PageState
from engine.config import EngineKnobs
from planner.hardware import hardware_catalog
from planner.specs import Deployment

COLUMNS = ["name", "hardware", "tp", "weight_dtype", "kv_dtype", "prefix_caching", "token_budget", "speculative_tokens"]
DEFAULT_VARIANTS = [
    {"name": "A: bf16", "hardware": "h100-sxm", "tp": 1, "weight_dtype": "bf16", "kv_dtype": "bf16",
     "prefix_caching": True, "token_budget": 8192, "speculative_tokens": 0},
    {"name": "B: fp8", "hardware": "h100-sxm", "tp": 1, "weight_dtype": "fp8", "kv_dtype": "fp8",
     "prefix_caching": True, "token_budget": 8192, "speculative_tokens": 0},
]
# The figures worth a chart; the table has every metric planner.compare reports.
CHARTED = ["TTFT P99, ms", "TPOT P99, ms", "E2E P99, ms", "output tokens/s", "US$/h", "US$ per 1M output tokens"]


def _deployment(row: dict) -> Deployment:
    return Deployment(hardware=row["hardware"], tensor_parallel=int(row["tp"]), weight_dtype=row["weight_dtype"],
                      kv_dtype=row["kv_dtype"],
                      knobs=EngineKnobs(max_num_batched_tokens=int(row["token_budget"]),
                                        enable_prefix_caching=bool(row["prefix_caching"])))


def render() -> None:
    state = PageState("compare")
    st.title("Compare")
    st.caption("Every variant serves the same drawn requests; each is compared with the first (B − A and %). "
               "Edit, add or remove rows in the table.")
    with st.sidebar:
        model = model_input(state)
        work = workload_inputs(state, allow_trace=False, default_requests=300)
        slo = slo_input(state)
    # The table lives in the URL as JSON, so a shared link reproduces the variants.
    key = state.bind("variants", json.dumps(DEFAULT_VARIANTS), parse=str)
    try:
        rows = pd.DataFrame(json.loads(st.session_state[key]), columns=COLUMNS)
    except (ValueError, TypeError) as exc:
        st.warning(f"URL parameter variants could not be read ({exc}); showing the defaults")
        rows = pd.DataFrame(DEFAULT_VARIANTS, columns=COLUMNS)
    edited = st.data_editor(rows, num_rows="dynamic", hide_index=True, width="stretch", column_config={
        "name": st.column_config.TextColumn("name", required=True),
        "hardware": st.column_config.SelectboxColumn("hardware", options=sorted(hardware_catalog()), required=True),
        "tp": st.column_config.NumberColumn("TP (GPUs)", min_value=1, max_value=64, step=1, required=True),
        "weight_dtype": st.column_config.SelectboxColumn("weights", options=DTYPES, required=True),
        "kv_dtype": st.column_config.SelectboxColumn("KV cache", options=KV_DTYPES, required=True),
        "prefix_caching": st.column_config.CheckboxColumn("prefix caching"),
        "token_budget": st.column_config.NumberColumn("chunk / token budget (tokens)", min_value=16, step=256,
                                                      required=True),
        "speculative_tokens": st.column_config.NumberColumn("speculative tokens", min_value=0, max_value=16, step=1),
    })
    records = edited.dropna(subset=["name", "hardware"]).to_dict("records")
    state.set("variants", json.dumps(records, default=str))
    state.sync_url()

    speculative = [r["name"] for r in records if (r.get("speculative_tokens") or 0) > 0]
    if speculative:
        st.warning(f"Not simulated: {', '.join(speculative)}. Speculative decoding is not modelled by the simulator "
                   "yet (docs/simulate.md, Known limits); set its speculative tokens to 0 to include it.")
    records = [r for r in records if r["name"] not in speculative]
    if len(records) < 2:
        ui.stop_with("compare needs at least two variants without speculative decoding")
    if len({r["name"] for r in records}) != len(records):
        ui.stop_with("variant names must be unique")
    variants = tuple((str(r["name"]), ui.attempt(lambda r=r: _deployment(r))) for r in records)
    workload = ui.attempt(work.workload)
    results = ui.attempt(lambda: compute.comparisons(model, workload, slo, variants))

    base = results[0].a
    wide = pd.DataFrame({"metric": [m.metric for m in results[0].metrics], base.path: [m.a for m in results[0].metrics]})
    for c in results:
        wide[c.b.path] = [m.b for m in c.metrics]
        wide[f"{c.b.path} vs A (%)"] = [m.delta_pct for m in c.metrics]
    ui.table(wide, "Variants side by side", key="compare.wide",
             caption=f"{model}, workload {workload.name} at {work.rate_per_s:g} req/s, {workload.num_requests} requests; "
                     "% = (variant − first) / first × 100.")
    deltas = pd.DataFrame([{"variant": c.b.path, "metric": m.metric, "change vs A (%)": m.delta_pct}
                           for c in results for m in c.metrics if m.metric in CHARTED and m.delta_pct is not None])
    if not deltas.empty:
        st.markdown(f"**Change against {base.path} (%)**")
        st.altair_chart(charts.grouped_bars(deltas, "metric", "change vs A (%)", "variant", "change vs A (%)"),
                        width="stretch")
    for c in results:
        detail = pd.DataFrame([m.model_dump() for m in c.metrics]).rename(
            columns={"a": base.path, "b": c.b.path, "delta": "B − A", "delta_pct": "B − A (%)"})
        ui.table(detail, f"{c.b.path} vs {base.path}", key=f"compare.{c.b.path}")
    ui.json_download("Comparisons (JSON, as serveplan compare --json)", [c.model_dump(mode="json") for c in results],
                     "comparisons.json", key="compare.json")
    ui.assumptions("comparison", [f"{side.path}: {side.summary.cost.basis}" for side in [base, *(c.b for c in results)]],
                   base.summary.assumptions)


render()
