"""Plan: the cheapest deployment that serves a workload within an SLO (planner.search.plan)."""

from __future__ import annotations

import itertools

import pandas as pd
import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import DTYPES, KV_DTYPES, model_input, slo_input, workload_inputs
from dashboard.state import PageState
from engine.config import EngineKnobs
from planner.hardware import hardware_catalog
from planner.search import CandidatePlan, PlanResult

# Small enough that the default plan finishes in well under a minute on a laptop CPU.
DEFAULT_CANDIDATES = ["h100-sxm", "l40s", "a100-80gb-sxm"]


def _candidates_frame(plans: list[CandidatePlan]) -> pd.DataFrame:
    return pd.DataFrame([{
        "candidate": p.label, "verdict": p.verdict, "replicas": p.replicas, "GPUs": p.gpus,
        "US$/h": p.usd_per_hour, "US$ per 1M output tokens": p.usd_per_million_output_tokens,
        "TTFT P99 (ms)": p.ttft_p99_ms, "TPOT P99 (ms)": p.tpot_p99_ms,
        "sustained (req/s per replica)": p.sustained_rate_per_s, "simulations": p.probes, "reason": p.reason,
    } for p in plans])


def _why_not(plans: list[CandidatePlan]) -> pd.DataFrame:
    return pd.DataFrame([{
        "candidate": p.label, "verdict": p.verdict, "reason": p.reason, "US$/h": p.usd_per_hour,
        "observed / limit": p.slo_miss_ratio, "memory short (GiB per GPU)": p.memory_shortfall_gib,
    } for p in plans])


def _show(result: PlanResult) -> None:
    rec = result.recommended
    if rec is None:
        st.warning(f"No recommendation: {result.nearest_miss}")
    else:
        st.subheader(f"Recommended: {rec.replicas} × {rec.label}")
        cols = st.columns(5)
        cols[0].metric("GPUs", rec.gpus)
        cols[1].metric("Cost (US$/h)", f"{rec.usd_per_hour:,.2f}")
        cols[2].metric("US$ per 1M output tokens", f"{rec.usd_per_million_output_tokens:,.3f}")
        if result.verification is not None:
            v = result.verification
            cols[3].metric("TTFT P99 (ms), verified", f"{v.ttft_ms.p99:,.1f}")
            cols[4].metric("TPOT P99 (ms), verified", f"{v.tpot_ms.p99:,.1f}")
            st.caption(f"Verification: all {rec.replicas} replicas behind round robin at {result.rate_per_s:g} req/s "
                       f"(no headroom), {v.num_requests} requests; SLO met: {v.goodput.slo_met}, goodput "
                       f"{v.goodput.share:.1%}. Cost basis: {v.cost.basis}.")
    st.caption(f"{result.candidates} candidates, {result.simulated_candidates} simulated, {result.probes} simulations.")

    if result.ranked:
        st.markdown("**Cost vs latency of the candidates that meet the SLO**")
        st.altair_chart(charts.pareto(result.ranked, result.pareto, result.pareto_metric), width="stretch")
        ui.table(_candidates_frame(result.ranked), "Candidates that meet the SLO", key="plan.ranked",
                 caption="By US$/h; latencies at the per-replica load each was sized for (with headroom).")
    ui.table(_why_not(result.rejected), "Why not: rejected candidates", key="plan.rejected",
             caption="Every other candidate with the reason it lost (memory, SLO, cost or budget).")
    ui.json_download("Whole plan (JSON)", result, "plan.json", key="plan.json")
    ui.assumptions("plan", result.assumptions)


def render() -> None:
    state = PageState("plan")
    st.title("Plan")
    st.caption("The cheapest deployment that serves the workload at the target rate within the SLO: "
               "memory check, analytic screen, then simulated capacity search (docs/planning.md). "
               "Traces are not planned yet (a planner limit); simulate one on the Simulate page.")
    catalog = hardware_catalog()
    priced = sorted(name for name, hw in catalog.items() if hw.price_usd_per_hour is not None)
    with st.sidebar.form("plan.form"):
        model = model_input(state)
        work = workload_inputs(state, allow_trace=False, default_requests=100,
                               requests_help="Requests per simulated probe (at least 3 × max running requests are used)")
        slo = slo_input(state)
        hardware = st.multiselect("Candidate hardware", priced, key=state.bind("hw", DEFAULT_CANDIDATES),
                                  help="Profiles with a price; each is tried at every TP size that fits")
        with st.expander("Prices (US$ per GPU-hour)"):
            prices = {name: st.number_input(name, 0.01, 1000.0, key=state.bind(f"price.{name}",
                                                                                 catalog[name].price_usd_per_hour),
                                             help=f"Profile price: US${catalog[name].price_usd_per_hour:.2f}")
                      for name in hardware}
        max_gpus = st.number_input("Max GPUs per replica", 1, 72, key=state.bind("max_gpus", 1),
                                   help="Tensor parallelism is tried in powers of two up to this")
        weights = st.multiselect("Weight dtypes", DTYPES, key=state.bind("weight_dtypes", ["bf16"]))
        kvs = st.multiselect("KV-cache dtypes", KV_DTYPES, key=state.bind("kv_dtypes", ["bf16"]))
        mbts = st.multiselect("Token budgets per step (tokens)", [2048, 4096, 8192, 16384],
                              key=state.bind("mbt", [8192]), help="max_num_batched_tokens values to try")
        seqs = st.multiselect("Max running requests", [32, 64, 128, 256, 512], key=state.bind("seqs", [64]),
                              help="max_num_seqs values to try; a probe has at least 3 × this many requests")
        budget = st.number_input("Budget (US$/h, 0: none)", 0.0, 1e6, key=state.bind("budget", 0.0))
        headroom = st.number_input("Headroom (share)", 0.0, 10.0, step=0.05, key=state.bind("headroom", 0.1),
                                   help="Replicas are sized for rate × (1 + headroom)")
        submitted = st.form_submit_button("Run plan", type="primary", icon=":material/play_arrow:")
    # A shared link carries run=true, so the recipient sees the plan without pressing the button.
    state.bind("run", False)
    if submitted:
        state.set("run", True)
    state.sync_url()
    if not state.get("run"):
        st.info("Set the question in the sidebar and press **Run plan**. Results are cached: asking again is instant.")
        return
    workload = ui.attempt(work.workload)
    profiles = tuple(catalog[name].model_copy(update={"price_usd_per_hour": prices[name]}) for name in hardware)
    knobs = tuple(EngineKnobs(max_num_batched_tokens=t, max_num_seqs=s) for t, s in itertools.product(mbts, seqs))
    if not knobs:
        ui.stop_with("engine knobs: choose at least one token budget and one max running requests value")
    result = ui.attempt(lambda: compute.plan_result(
        model, workload, work.rate_per_s, slo, profiles, max_gpus, budget or None,
        tuple(weights), tuple(kvs), knobs, headroom, work.requests))
    _show(result)


render()
