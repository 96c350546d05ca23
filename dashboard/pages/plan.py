"""Plan: the cheapest deployment that serves a workload within an SLO (planner.search.plan)."""

from __future__ import annotations

import itertools

import pandas as pd
import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import DEPLOYMENT, WORKLOAD, choices_input, model_input, setting_input, slo_input, workload_inputs
from dashboard.state import PageState
from engine.catalog import resolve_model
from engine.config import EngineKnobs
from engine.knobs import Setting, settings
from planner.hardware import hardware_catalog
from planner.search import CandidatePlan, PlanResult
from planner.search.space import DEFAULT_KNOBS_GRID, DEFAULT_KV_DTYPES, DEFAULT_WEIGHT_DTYPES, knobs_label
from planner.specs import DEFAULT_REQUESTS_PER_PROBE, HardwareProfile, PlanSettings

PRICE = Setting.of(HardwareProfile, "price_usd_per_hour")
PLAN = {s.name: s for s in settings(PlanSettings)}
KNOB = {s.name: s for s in settings(EngineKnobs)}
# The engine settings the page offers to try: the CLI's default grid (its default here too), then
# other token budget x max running requests pairs (any other value is for the CLI or a spec file).
KNOBS_OFFERED = {knobs_label(k): k for k in (*DEFAULT_KNOBS_GRID, *(
    EngineKnobs(max_num_batched_tokens=t, max_num_seqs=n) for t, n in itertools.product([2048, 4096, 8192, 16384],
                                                                                          [32, 64, 128, 256, 512])))}


def _candidates_frame(plans: list[CandidatePlan]) -> pd.DataFrame:
    return pd.DataFrame([{
        "candidate": p.label, "verdict": p.verdict, "replicas": p.replicas, "GPUs": p.gpus,
        "US$/h": p.usd_per_hour, "US$ per 1M output tokens": p.usd_per_million_output_tokens,
        "TTFT P99 (ms)": p.ttft_p99_ms, "TPOT P99 (ms)": p.tpot_p99_ms,
        "sustained (req/s per replica)": p.sustained_rate_per_s, "simulations": p.probes, "reason": p.reason,
    } for p in plans])


def _per_hardware(plans: list[CandidatePlan]) -> pd.DataFrame:
    return pd.DataFrame([{
        "hardware": p.deployment.hardware, "candidate": p.label, "replicas": p.replicas,
        "US$/h": p.usd_per_hour if p.usd_per_hour is not None else p.cost_bound_usd_per_hour,
        "verdict": p.verdict, "reason": p.reason or "the cheapest that meets the SLO",
    } for p in plans])


def _show_space(result: PlanResult) -> None:
    space = result.space
    if space is None:
        return
    st.caption(f"Searched: {', '.join(space.hardware)}; up to {space.max_gpus_per_replica} GPUs per replica; weights "
               f"{', '.join(space.weight_dtypes)}; KV cache {', '.join(space.kv_dtypes)}; engine {space.engine} with "
               f"{'; '.join(space.knobs)}. Settled: " + ", ".join(f"{n:,} {what}" for what, n in space.outcomes.items())
               + ".")
    for line in space.excluded_for_quality:
        st.caption(f"Left out for quality (max quality loss {space.max_quality_loss_pct:g} %): {line}")
    if space.narrower_than_default:
        st.info("Narrower than the CLI's default search: " + "; ".join(space.narrower_than_default))
    if result.widening is not None:
        line = result.widening.summary
        st.warning(line[0].upper() + line[1:])


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
    for step in result.stepped_up:  # the verifications that missed on the way to the answer below
        st.info(f"Stepped up: {step}.")
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
            if result.verification_missed is not None:
                st.warning(f"The verification missed the SLO: {result.verification_missed}.")
            if result.band_misses is not None:
                st.warning(f"Measured, it could miss the SLO: {result.band_misses}.")
            if (steady := v.steady_state) is not None:
                st.caption(f"Steady state: {steady.requests_per_s:,.2f} req/s, {steady.output_tokens_per_s:,.0f} output "
                           f"tokens/s, mean batch {steady.mean_batch_requests or 0:,.1f} requests ({steady.basis}).")
        if (cap := result.capacity) is not None and cap.requests_per_s is not None:
            st.caption(f"Capacity within the SLO: {cap.requests_per_s:,.2f} req/s"
                       + (f", US${cap.usd_per_million_output_tokens:,.3f} per 1M output tokens there"
                          if cap.usd_per_million_output_tokens is not None else "") + f" ({cap.basis}).")
        if result.quality is not None:
            st.caption(f"Quality: {result.quality}.")
    st.caption(f"{result.candidates:,} candidates, {result.simulated_candidates:,} simulated, {result.probes:,} simulations.")
    _show_space(result)
    ui.table(_per_hardware(result.per_hardware), "Each hardware's answer", key="plan.per_hardware",
             caption="Its cheapest candidate that meets the SLO, else its closest (lowest cost bound, least SLO miss, "
                     "least memory shortfall).")

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
               "memory check, analytic screen, then simulated capacity search (docs/planning.md). A trace is "
               "planned as its lengths, shared prefixes and mean rate; the Simulate page replays one as recorded.")
    catalog = hardware_catalog()
    priced = sorted(name for name, hw in catalog.items() if hw.price_usd_per_hour is not None)
    with st.sidebar.form("plan.form"):
        model = model_input(state)
        work = state.attempt(lambda: workload_inputs(
            state, default_requests=DEFAULT_REQUESTS_PER_PROBE,
            requests_help="Requests per simulated probe (at least 3 × max running requests are used)"))
        # The planner names the probe size by its parameter; on this page the Requests input sets it.
        if "num_requests" in state.labels:  # not drawn for a trace
            state.labels["requests_per_probe"] = state.labels["num_requests"]
        slo = slo_input(state)
        hardware = choices_input(state, "hw", "Candidate hardware", priced, priced, field="hardware",
                                 help="Profiles with a price (default: all, as the CLI); each is tried at every TP "
                                      "size that fits")
        with st.expander(f"Prices ({PRICE.knob.unit})"):
            prices = {name: setting_input(state, PRICE, name=f"price.{name}", label=name,
                                          default=catalog[name].price_usd_per_hour,
                                          help=f"Profile price: US${catalog[name].price_usd_per_hour:.2f}")
                      for name in hardware}
        max_gpus = setting_input(state, PLAN["max_gpus_per_replica"])
        weight_dtypes, kv_dtypes = DEPLOYMENT["weight_dtype"].choices, DEPLOYMENT["kv_dtype"].choices
        assert weight_dtypes is not None and kv_dtypes is not None  # Literal fields: their values are the choices
        weights = choices_input(state, "weight_dtypes", "Weight dtypes", weight_dtypes,
                                list(DEFAULT_WEIGHT_DTYPES), field="weight_dtypes",
                                help="fp8 is tried only where the hardware has it natively")
        kvs = choices_input(state, "kv_dtypes", "KV-cache dtypes", kv_dtypes,
                            list(DEFAULT_KV_DTYPES), field="kv_dtypes")
        quality_loss = setting_input(state, PLAN["max_quality_loss_pct"], step=0.5)
        knob_labels = choices_input(state, "knobs", "Engine settings to try", list(KNOBS_OFFERED),
                                    [knobs_label(k) for k in DEFAULT_KNOBS_GRID], field="knobs_grid",
                                    help="mbt: max tokens per step; seqs: max running requests (a probe has at least "
                                         "3 × this many requests); 'engine defaults': the engine profile's own")
        prefix_caching = setting_input(state, KNOB["enable_prefix_caching"])
        budget = setting_input(state, PLAN["budget_usd_per_hour"], placeholder="no budget")
        headroom = setting_input(state, PLAN["headroom"], step=0.05)
        pd_ratios = setting_input(state, PLAN["pd_ratios"])
        offload = setting_input(state, PLAN["offload"])
        every_hardware = setting_input(state, PLAN["every_hardware"])
        submitted = st.form_submit_button("Run plan", type="primary", icon=":material/play_arrow:")
    # A shared link carries run=true, so the recipient sees the plan without pressing the button.
    state.bind("run", False)
    if submitted:
        state.set("run", True)
    state.sync_url()
    if not state.get("run"):
        st.info("Set the question in the sidebar and press **Run plan**. Results are cached: asking again is instant.")
        return
    rate, requests = work.rate_per_s, work.requests
    if work.preset is None:  # a trace: planned as its lengths, shared prefixes and mean rate
        trace_name, trace_bytes = work.trace_name, work.trace_bytes
        if trace_name is None or trace_bytes is None:  # an upload sets both
            st.info("Upload a trace in the sidebar to plan for it.")
            return
        workload = state.attempt(lambda: compute.trace_workload(
            trace_name, trace_bytes, resolve_model(model).max_position_embeddings))
        rate, requests = workload.arrival.offered_rate_per_s, DEFAULT_REQUESTS_PER_PROBE
        assert rate is not None  # workload_from_trace: Poisson arrivals at the trace's mean rate
        st.caption(f"Planned for the {workload.description}; {requests} requests per probe.")
    else:
        if rate is None:
            ui.stop_with(f"{WORKLOAD['rate_per_s'].label}: a plan needs a value")
        if requests is None:
            ui.stop_with(f"{WORKLOAD['num_requests'].label}: a plan needs a value")
        preset = state.attempt(work.workload)
        assert preset is not None  # work.preset is set
        workload = preset
    profiles = tuple(catalog[name].model_copy(update={"price_usd_per_hour": prices[name]}) for name in hardware)
    knobs = tuple(KNOBS_OFFERED[label] for label in knob_labels)
    if not knobs:
        ui.stop_with("Engine settings to try: choose at least one")
    result = state.attempt(lambda: compute.plan_result(
        model, workload, rate, slo, profiles, max_gpus, budget,
        # The default formats as the CLI's default: fp8 weights only where the hardware has them.
        None if set(weights) == set(DEFAULT_WEIGHT_DTYPES) else tuple(weights), tuple(kvs), knobs, headroom,
        quality_loss, prefix_caching, requests, pd_ratios, offload, every_hardware))
    _show(result)


render()
