"""Hardware: the profile catalog and a roofline placing the model's prefill and decode on each chip."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import DEPLOYMENT, RooflineQuery, choices_input, model_input, setting_input
from dashboard.state import PageState
from engine.knobs import settings
from planner.hardware import hardware_catalog

DEFAULT_CHIPS = ["h100-sxm", "h200", "b200", "mi300x", "l40s", "a100-80gb-sxm"]


def render() -> None:
    state = PageState("hardware")
    st.title("Hardware")
    st.caption("Every profile in hwprofiles/ (datasheet figures with their provenance: `serveplan hw show NAME`).")
    with st.sidebar:
        model = model_input(state)
        chips = choices_input(state, "chips", "Chips on the roofline", sorted(hardware_catalog()), DEFAULT_CHIPS)
        weight = setting_input(state, DEPLOYMENT["weight_dtype"],
                               help="Sets the GEMM peak each chip is held to (its fallback when it lacks the format)")
        batch, context, prefill = (setting_input(state, s) for s in settings(RooflineQuery))
    state.sync_url()

    ui.table(compute.hardware_table(), "Hardware catalog", key="hardware.catalog",
             caption="Dense peaks (no 2:4 sparsity); price is a typical on-demand cloud price per device-hour.")

    st.markdown(f"**Roofline: {model}, one decode step and one prefill chunk per chip (per GPU, TP 1)**")
    if not chips:
        st.info("Choose chips in the sidebar to place the model on their rooflines.")
        return
    points = state.attempt(lambda: compute.roofline(model, tuple(chips), weight, batch, context, prefill))
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
