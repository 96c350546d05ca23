"""Plan: the cheapest deployment that serves a workload within an SLO (planner.search.plan)."""

from __future__ import annotations

import itertools

import pandas as pd
import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import DEPLOYMENT, WORKLOAD, choices_input, model_input, setting_input, slo_input, workload_inputs
from dashboard.state import PageState
from engine.config import EngineKnobs
from engine.knobs import Setting, settings
from planner.hardware import hardware_catalog
from planner.search import CandidatePlan, PlanResult
from planner.specs import HardwareProfile, PlanSettings

# Small enough that the default plan finishes in well under a minute on a laptop CPU.
DEFAULT_CANDIDATES = ["h100-sxm", "l40s", "a100-80gb-sxm"]
PRICE = Setting.of(HardwareProfile, "price_usd_per_hour")
PLAN = {s.name: s for s in settings(PlanSettings)}
KNOB = {s.name: s for s in settings(EngineKnobs)}
# Engine knob values the Plan page offers to try (any other value is for the CLI or a spec file).
TOKEN_BUDGETS = [2048, 4096, 8192, 16384]
MAX_SEQS = [32, 64, 128, 256, 512]


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


def _pd_comparison(result: PlanResult) -> pd.DataFrame:
    return pd.DataFrame([{
        "hardware": c.hardware, "winner": c.winner,
        "colocated": c.colocated.label if c.colocated else None,
        "colocated US$/h": c.colocated.usd_per_hour if c.colocated else None,
        "disaggregated": c.disaggregated.label if c.disaggregated else None,
        "disaggregated US$/h": c.disaggregated.usd_per_hour if c.disaggregated else None,
        "why": c.reason,
    } for c in result.pd_comparison])


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
    if result.pd_comparison:
        ui.table(_pd_comparison(result), "Prefill/decode disaggregation vs colocated", key="plan.pd",
                 caption="Per hardware: the best colocated and the best disaggregated (xPyD) candidate, and why the "
                         "winner won (docs/disaggregation.md).")
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
        work = state.attempt(lambda: workload_inputs(
            state, allow_trace=False, default_requests=100,
            requests_help="Requests per simulated probe (at least 3 × max running requests are used)"))
        slo = slo_input(state)
        hardware = choices_input(state, "hw", "Candidate hardware", priced, DEFAULT_CANDIDATES, field="hardware",
                                 help="Profiles with a price; each is tried at every TP size that fits")
        with st.expander(f"Prices ({PRICE.knob.unit})"):
            prices = {name: setting_input(state, PRICE, name=f"price.{name}", label=name,
                                          default=catalog[name].price_usd_per_hour,
                                          help=f"Profile price: US${catalog[name].price_usd_per_hour:.2f}")
                      for name in hardware}
        max_gpus = setting_input(state, PLAN["max_gpus_per_replica"], default=1)
        weights = choices_input(state, "weight_dtypes", "Weight dtypes", DEPLOYMENT["weight_dtype"].choices, ["bf16"],
                                field="weight_dtypes")
        kvs = choices_input(state, "kv_dtypes", "KV-cache dtypes", DEPLOYMENT["kv_dtype"].choices, ["bf16"],
                            field="kv_dtypes")
        mbts = choices_input(state, "max_num_batched_tokens", f"{KNOB['max_num_batched_tokens'].label} to try",
                             TOKEN_BUDGETS, [8192], help=KNOB["max_num_batched_tokens"].help)
        seqs = choices_input(state, "max_num_seqs", f"{KNOB['max_num_seqs'].label} to try", MAX_SEQS, [64],
                             help=KNOB["max_num_seqs"].help + "; a probe has at least 3 × this many requests")
        budget = setting_input(state, PLAN["budget_usd_per_hour"])
        headroom = setting_input(state, PLAN["headroom"], step=0.05)
        pd_ratios = setting_input(state, PLAN["pd_ratios"])
        offload = setting_input(state, PLAN["offload"])
        submitted = st.form_submit_button("Run plan", type="primary", icon=":material/play_arrow:")
    # A shared link carries run=true, so the recipient sees the plan without pressing the button.
    state.bind("run", False)
    if submitted:
        state.set("run", True)
    state.sync_url()
    if not state.get("run"):
        st.info("Set the question in the sidebar and press **Run plan**. Results are cached: asking again is instant.")
        return
    for name, value in (("rate_per_s", work.rate_per_s), ("num_requests", work.requests)):
        if value is None:
            ui.stop_with(f"{WORKLOAD[name].label}: a plan needs a value")
    workload = state.attempt(work.workload)
    profiles = tuple(catalog[name].model_copy(update={"price_usd_per_hour": prices[name]}) for name in hardware)
    knobs = tuple(EngineKnobs(max_num_batched_tokens=t, max_num_seqs=s) for t, s in itertools.product(mbts, seqs))
    if not knobs:
        ui.stop_with("engine knobs: choose at least one token budget and one max running requests value")
    result = state.attempt(lambda: compute.plan_result(
        model, workload, work.rate_per_s, slo, profiles, max_gpus, budget,
        tuple(weights), tuple(kvs), knobs, headroom, work.requests, pd_ratios, offload))
    _show(result)


render()
