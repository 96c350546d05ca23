"""Hardware: the profile catalog and a roofline placing the model's prefill and decode on each chip."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import DTYPES, model_input
from dashboard.state import PageState
from planner.hardware import hardware_catalog

DEFAULT_CHIPS = ["h100-sxm", "h200", "b200", "mi300x", "l40s", "a100-80gb-sxm"]


def render() -> None:
    state = PageState("hardware")
    st.title("Hardware")
    st.caption("Every profile in hwprofiles/ (datasheet figures with their provenance: `serveplan hw show NAME`).")
    with st.sidebar:
        model = model_input(state)
        chips = st.multiselect("Chips on the roofline", sorted(hardware_catalog()), key=state.bind("chips", DEFAULT_CHIPS))
        weight = st.selectbox("Weight dtype", DTYPES, key=state.bind("weight_dtype", "bf16"),
                              help="Sets the GEMM peak each chip is held to (its fallback when it lacks the format)")
        batch = st.number_input("Decode batch (requests)", 1, 4096, key=state.bind("batch", 32))
        context = st.number_input("Decode context (tokens)", 1, 1_000_000, key=state.bind("context", 2048),
                                  help="Tokens already in the KV cache of each decoding request")
        prefill = st.number_input("Prefill chunk (tokens)", 1, 131072, key=state.bind("prefill", 2048))
    state.sync_url()

    ui.table(compute.hardware_table(), "Hardware catalog", key="hardware.catalog",
             caption="Dense peaks (no 2:4 sparsity); price is a typical on-demand cloud price per device-hour.")

    st.markdown(f"**Roofline: {model}, one decode step and one prefill chunk per chip (per GPU, TP 1)**")
    if not chips:
        st.info("Choose chips in the sidebar to place the model on their rooflines.")
        return
    points = ui.attempt(lambda: compute.roofline(model, tuple(chips), weight, batch, context, prefill))
    for line in points.skipped:
        st.warning(f"Left out {line}")
    if points.points.empty:
        return
    st.altair_chart(charts.roofline(points.roofs, points.points), width="stretch")
    ui.table(points.points, "Roofline points", key="hardware.points")
    ui.assumptions("roofline", [
        f"decode: one step of {batch} requests with {context} cached tokens each; prefill: one chunk of {prefill} "
        "tokens with nothing cached; FLOPs, bytes and seconds per GPU from planner/costmodel.py at TP 1 "
        "(whether the model fits one GPU is the Memory page's question)",
        "roof: min(GEMM peak of the compute dtype, intensity × memory bandwidth); 'achieved' is the step's FLOPs over "
        "its modelled time, overheads included, so points sit below the roof",
        f"weights {weight}, KV cache bf16; chips without a native peak for {weight} are held to the format they fall "
        "back to (column 'peak dtype')",
    ])


render()
