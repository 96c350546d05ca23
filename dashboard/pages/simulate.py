"""Simulate: one deployment serving one workload (planner.sim.simulate)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import deployment_inputs, model_input, router_input, slo_input, workload_inputs
from dashboard.state import PageState
from planner.metrics import RunSummary

LATENCIES = {"ttft_ms": "TTFT", "itl_ms": "ITL", "tpot_ms": "TPOT", "e2e_ms": "E2E", "queueing_ms": "queueing"}


def _percentiles(s: RunSummary) -> pd.DataFrame:
    rows = []
    for field, label in LATENCIES.items():
        stats = getattr(s, field)
        rows.append({"metric": f"{label} (ms)", "count": stats.count, "mean": stats.mean, "P50": stats.p50,
                     "P90": stats.p90, "P95": stats.p95, "P99": stats.p99, "max": stats.max})
    return pd.DataFrame(rows)


def _headline(s: RunSummary) -> None:
    row = st.columns(4)
    row[0].metric("TTFT P99 (ms)", f"{s.ttft_ms.p99:,.1f}", help=f"P50 {s.ttft_ms.p50:,.1f} ms")
    row[1].metric("TPOT P99 (ms)", f"{s.tpot_ms.p99:,.1f}", help=f"P50 {s.tpot_ms.p50:,.1f} ms")
    row[2].metric("E2E P99 (ms)", f"{s.e2e_ms.p99:,.0f}", help=f"P50 {s.e2e_ms.p50:,.0f} ms")
    steady, whole = s.steady_state, (f"first arrival to last finish, drain included: {s.throughput.output_tokens_per_s:,.0f} "
                                     f"output tokens/s, {s.throughput.requests_per_s:,.2f} requests/s over {s.duration_s:,.1f} s")
    if steady is None:
        row[3].metric("Throughput (output tokens/s)", f"{s.throughput.output_tokens_per_s:,.0f}",
                      help=f"No steady window (too few requests between warm-up and drain); {whole}")
    else:
        row[3].metric("Steady output (tokens/s)", f"{steady.output_tokens_per_s:,.0f}",
                      help=f"{steady.requests_per_s:,.2f} requests/s, mean batch "
                           f"{steady.mean_batch_requests or 0:,.1f} requests; {steady.basis}. Whole run, {whole}")
    row = st.columns(4)
    g = s.goodput
    row[0].metric("Goodput (requests/s)", f"{g.requests_per_s:,.2f}",
                  help="Requests within every per-request limit" if g.slo_met is not None else "No SLO: every request")
    row[1].metric("SLO", "no SLO set" if g.slo_met is None else ("met" if g.slo_met else "missed"),
                  help=f"goodput share {g.share:.1%} (required {g.required_share})" if g.required_share else None)
    row[2].metric("Prefix-cache hit rate", f"{s.prefix_cache_hit_rate:.1%}",
                  help=f"{s.prefix_cache_hit_tokens:,} prompt tokens served from the cache; {s.preemptions} preemptions")
    c = s.cost
    row[3].metric("Cost (US$/h)", "no price" if c.usd_per_hour is None else f"{c.usd_per_hour:,.2f}",
                  help=None if c.usd_per_million_output_tokens is None else
                  f"US${c.usd_per_million_output_tokens:,.3f} per 1M output tokens at the whole run's throughput"
                  + ("" if steady is None or steady.usd_per_million_output_tokens is None else
                     f", US${steady.usd_per_million_output_tokens:,.3f} at the steady one"))
    st.caption(f"Cost basis: {c.basis}. Utilisation: busy {s.utilisation.busy_share:.0%}"
               + (f", MFU {s.utilisation.mfu:.1%}" if s.utilisation.mfu is not None else "")
               + (f", bandwidth {s.utilisation.bandwidth_utilisation:.1%}"
                  if s.utilisation.bandwidth_utilisation is not None else "") + ".")


def _steady_caption(s: RunSummary) -> None:
    if (steady := s.steady_state) is not None:
        st.caption(f"Steady state: {steady.requests_per_s:,.2f} requests/s, {steady.output_tokens_per_s:,.0f} output "
                   f"tokens/s, mean batch {steady.mean_batch_requests or 0:,.1f} requests ({steady.basis}).")


def _bands(s: RunSummary) -> pd.DataFrame:
    """One row per banded figure: the prediction and where a measurement would likely fall."""
    assert s.prediction_interval is not None
    rows = []
    for name, (low, high) in s.prediction_interval.ranges.items():
        predicted = s.figure(name)
        assert predicted  # banded figures are set and positive on a finished run
        rows.append({"figure": name, "predicted": predicted, "low": low, "high": high,
                     "low / predicted": low / predicted, "high / predicted": high / predicted})
    return pd.DataFrame(rows)


def _if_measured(s: RunSummary) -> None:
    band = s.prediction_interval
    if band is None:
        return
    st.markdown(f"**If measured on the GPU** (the P10-P90 of published runs each predicted without its source: "
                f"about {band.coverage:.0%} of measurements fall inside)")
    data = _bands(s)
    st.altair_chart(charts.prediction_bands(data), width="stretch")
    ui.table(data[["figure", "predicted", "low", "high"]], "Prediction intervals", key="sim.bands",
             caption=band.basis)
    if (caution := s.band_caution()) is not None:
        st.warning(f"Measured, it could miss the SLO: {caution}.")


def render() -> None:
    state = PageState("simulate")
    st.title("Simulate")
    st.caption("The engine's own scheduler and KV-cache manager on simulated time, with the roofline cost "
               "model in place of the forward pass (docs/simulate.md).")
    with st.sidebar:
        model = model_input(state)
        dep = state.attempt(lambda: deployment_inputs(state))
        router = router_input(state)
        work = state.attempt(lambda: workload_inputs(state))
        slo = slo_input(state)
    state.sync_url()
    workload = state.attempt(work.workload)
    if workload is None and work.trace_bytes is None:
        st.info("Upload a trace in the sidebar to simulate it.")
        return
    view = state.attempt(lambda: compute.simulate_view(model, dep, workload, work.trace_name, work.trace_bytes, slo, router))
    s = view.summary
    st.subheader(f"{model} on {dep.replicas} × {dep.gpus_per_replica} {dep.hardware} "
                 f"(TP {dep.tensor_parallel}, PP {dep.pipeline_parallel}), weights {dep.weight_dtype}, KV {dep.kv_dtype}")
    st.caption(f"{s.num_finished:,} of {s.num_requests:,} requests finished, workload {s.workload}; "
               f"{s.kv_cache_blocks_total:,} KV blocks in all.")
    _headline(s)
    _steady_caption(s)
    _if_measured(s)

    st.markdown("**Latency CDFs**")
    st.altair_chart(charts.latency_cdf(view.requests, {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_ms": "E2E"}),
                    width="stretch")
    ui.table(_percentiles(s), "Latency percentiles", key="sim.percentiles",
             caption="Percentiles interpolate linearly; ITL counts every gap between tokens, TPOT one value per request.")

    st.markdown("**Over time** (every engine step of every replica)")
    for column, title in (("num_waiting", "queue depth (requests)"), ("num_running", "batch size (requests)"),
                          ("kv_cache_usage", "KV cache used (share)")):
        st.altair_chart(charts.step_series(view.samples, column, title), width="stretch")

    st.markdown("**Step time by operator** (cost model)")
    st.altair_chart(charts.operator_breakdown(view.breakdown), width="stretch")
    ui.table(view.breakdown, "Step time by operator (ms)", key="sim.breakdown")

    with st.expander("Per-request and per-step data"):
        ui.table(view.requests, "Requests", key="sim.requests")
        ui.table(view.samples, "Engine steps", key="sim.samples")
    ui.json_download("Run summary (JSON, as serveplan simulate --json)", s, "run-summary.json", key="sim.json")
    ui.assumptions("step-time breakdown", view.breakdown_basis)
    ui.assumptions("simulation (cost model, engine knobs, workload)", [f"Cost: {s.cost.basis}"], s.assumptions)


render()
