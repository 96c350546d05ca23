"""Memory: the per-GPU memory plan of one deployment and its concurrency by context (planner.memory)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import deployment_inputs, model_input, setting_input
from dashboard.state import PageState
from engine.catalog import resolve_model
from engine.knobs import Setting
from planner.specs import MemoryQuery

CONTEXT = Setting.of(MemoryQuery, "context_tokens")


def render() -> None:
    state = PageState("memory")
    st.title("Memory")
    st.caption("Does the model fit, and how many sequences of a given length can the KV cache hold at once? "
               "The simulator sizes its KV cache from this same plan.")
    with st.sidebar:
        model = model_input(state)
        dep = state.attempt(lambda: deployment_inputs(state))
        context = setting_input(state, CONTEXT, step=1024)
    state.sync_url()
    max_context = state.attempt(lambda: resolve_model(model)).max_position_embeddings
    # The curve: powers of two from 256 tokens to the model's context, plus the chosen length.
    contexts = sorted({*(2**i for i in range(8, 40) if 2**i <= max_context), max_context, context})
    plans = state.attempt(lambda: compute.memory_plans(model, dep, tuple(contexts)))
    plan = plans[contexts.index(context)]

    (st.success if plan.fits else st.error)(plan.reason)
    cols = st.columns(4)
    cols[0].metric("Weights per GPU (GiB)", f"{plan.weights.total_gib:,.2f}")
    cols[1].metric("KV cache per GPU (GiB)", f"{plan.kv_cache_gib:,.2f}")
    cols[2].metric("KV-cache tokens per replica", f"{plan.kv_cache_tokens:,}",
                   help=f"{plan.kv_cache_blocks:,} blocks of {plan.block_size_tokens} tokens")
    cols[3].metric(f"Sequences of {context:,} tokens at once", f"{plan.max_concurrent_sequences:,}",
                   help=f"the engine runs at most max_num_seqs = {plan.max_num_seqs}")

    parts = charts.memory_parts(plan)
    st.markdown(f"**Per-GPU memory of {plan.hardware} as {plan.engine} sizes it** ({plan.device_memory_gib:,.1f} GiB "
                f"marketed, {plan.device_memory_reported_gib:,.2f} GiB reported; dashed line: marketed memory)")
    st.altair_chart(charts.memory_bar(parts, plan.device_memory_gib), width="stretch")
    ui.table(parts, "Per-GPU memory (GiB)", key="memory.parts")
    ui.table(charts.memory_lines(plan), "How each figure is computed", key="memory.lines",
             caption="The engine's rule for its KV cache: every line it counts is subtracted from what it may use; "
                     "the others must fit in what it leaves.")

    curve = pd.DataFrame({"context (tokens)": contexts,
                          "max concurrent sequences": [p.max_concurrent_sequences for p in plans]})
    st.markdown("**Max concurrent sequences vs context length**")
    st.altair_chart(charts.concurrency_curve(curve), width="stretch")
    ui.table(curve, "Max concurrency by context", key="memory.curve")
    if plan.fits:
        tiers = state.attempt(lambda: compute.kv_tier_table(dep, plan))
        st.markdown("**Where KV blocks live**: the device cache, then the offload tiers (host memory, local disk) "
                    "set by the host and disk KV tier knobs")
        ui.table(tiers, "KV tiers per replica", key="memory.tiers",
                 caption="Evicted prefix-cache blocks move to host memory (LRU), then to disk; swapped-out requests "
                         "wait in host memory. Rates are the profile's, per GPU (docs/offload.md).")
    ui.json_download("Memory plan (JSON, as serveplan memory --json)", plan, "memory-plan.json", key="memory.json")
    ui.assumptions("memory plan", plan.assumptions)


render()
