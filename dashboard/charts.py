"""Altair charts of planner results; axis titles carry units."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from planner.memory import MemoryPlan
from planner.search import CandidatePlan

STEP_SERIES_HEIGHT_PX = 280
FRONT, DOMINATED = "on the Pareto front", "dominated (costs more and is slower)"


def latency_cdf(requests: pd.DataFrame, columns: dict[str, str]) -> alt.Chart:
    """Empirical CDFs, one line per metric (column -> label), on a log latency axis."""
    frames = []
    for column, label in columns.items():
        values = np.sort(requests[column].dropna().to_numpy())
        if values.size:
            frames.append(pd.DataFrame({"metric": label, "latency (ms)": values,
                                        "share of requests": np.arange(1, values.size + 1) / values.size}))
    data = pd.concat(frames, ignore_index=True)
    return alt.Chart(data).mark_line(interpolate="step-after").encode(
        x=alt.X("latency (ms):Q", scale=alt.Scale(type="log")),
        y=alt.Y("share of requests:Q", axis=alt.Axis(format="%")),
        color=alt.Color("metric:N", title=None),
        tooltip=["metric", alt.Tooltip("latency (ms):Q", format=",.1f"), alt.Tooltip("share of requests:Q", format=".1%")],
    ).properties(height=280)


# Streamlit draws a chart in exactly its declared height, title, axes and legends included, and
# cuts what does not fit: a legend beside a short chart lost its last entries. So a chart with many
# legend entries puts them below the plot in columns, whole (Vega shortens labels past 160 px with
# an ellipsis by default), and is made tall enough for them. Pixels measured in Streamlit's theme
# (tests/dashboard/test_browser.py checks the result): the x axis, its title and the legend's
# padding take about AXIS_PX, each legend row LEGEND_ROW_PX.
AXIS_PX, LEGEND_ROW_PX = 100, 24


def legend_below(entries: int, columns: int, plot_px: int) -> tuple[alt.Legend, int]:
    """A legend of `entries` labels in `columns` below a plot of `plot_px`, and the chart height
    that shows both."""
    rows = -(-entries // columns)
    return (alt.Legend(orient="bottom", direction="horizontal", columns=columns, labelLimit=0, title=None),
            plot_px + AXIS_PX + LEGEND_ROW_PX * rows)


def step_series(samples: pd.DataFrame, column: str, title: str) -> alt.Chart:
    """One engine-step state over simulated time, one line per replica (full resolution). A share
    reads 0-100 %; a count gets whole-number ticks from 0, and a unit range when it never leaves 0
    (Vega's domain [0, 0] labels its one tick NaN)."""
    data = samples[["replica", "start_s", column]].rename(columns={"start_s": "time (s)", column: title})
    share = "share" in title
    top = 1.0 if share else max(1.0, float(data[title].max()) if len(data) else 1.0)
    axis = alt.Axis(format="%") if share else alt.Axis(format=",d", tickMinStep=1)
    return alt.Chart(data).mark_line(strokeWidth=1, interpolate="step-after").encode(
        x=alt.X("time (s):Q"),
        # The title goes above the chart: a y-axis title this long would be clipped.
        y=alt.Y(f"{title}:Q", title=None, axis=axis, scale=alt.Scale(domain=[0, top])),
        color=alt.Color("replica:N"),
    ).properties(height=STEP_SERIES_HEIGHT_PX, title=title)


def operator_breakdown(breakdown: pd.DataFrame) -> alt.Chart:
    data = breakdown[breakdown.ms > 0]
    legend, height = legend_below(data.operator.nunique(), 4, 40 * data.phase.nunique())
    return alt.Chart(data).mark_bar().encode(
        x=alt.X("ms:Q", title="step time (ms)"),
        y=alt.Y("phase:N", title=None),
        color=alt.Color("operator:N", legend=legend),
        order=alt.Order("operator:N"),
        tooltip=["phase", "operator", alt.Tooltip("ms:Q", format=",.3f")],
    ).properties(height=height)


def pareto(candidates: list[CandidatePlan], front: list[CandidatePlan], metric: str) -> alt.Chart:
    """Cost against latency for every candidate that meets the SLO; the front joined by a line.
    Equal costs (one hardware at one size) would collapse the cost axis to one tick, so the axis
    always spans at least ±10 % of the cost."""
    latency_title = metric.replace("_p99_ms", " P99 (ms)").replace("ttft", "TTFT").replace("tpot", "TPOT")
    on_front = {p.label for p in front}
    data = pd.DataFrame([{"candidate": p.label, "US$/h": p.usd_per_hour, latency_title: getattr(p, metric),
                          "replicas": p.replicas, "GPUs": p.gpus,
                          "candidate kind": FRONT if p.label in on_front else DOMINATED} for p in candidates])
    low, high = float(data["US$/h"].min()), float(data["US$/h"].max())
    pad = max(0.1 * high, (high - low) * 0.05)
    base = alt.Chart(data).encode(
        x=alt.X("US$/h:Q", title="cost (US$/h)", scale=alt.Scale(domain=[max(0.0, low - pad), high + pad], zero=False)),
        y=alt.Y(f"{latency_title}:Q"))
    points = base.mark_circle(size=90).encode(
        color=alt.Color("candidate kind:N", legend=alt.Legend(title=None, labelLimit=0),
                        scale=alt.Scale(domain=[FRONT, DOMINATED], range=["#d62728", "#9e9e9e"])),
        tooltip=["candidate", "replicas", "GPUs", alt.Tooltip("US$/h:Q", format=",.2f"),
                 alt.Tooltip(f"{latency_title}:Q", format=",.1f")],
    )
    line = base.transform_filter(alt.datum["candidate kind"] == FRONT).mark_line(color="#d62728")
    return (line + points).properties(height=320)


def memory_parts(plan: MemoryPlan) -> pd.DataFrame:
    """Per-GPU GiB of every line the engine subtracts, then the KV cache (what is left, negative when nothing
    is), what the engine leaves unused and what the driver keeps back: together the marketed memory."""
    counted = [(line.label, line.gib) for line in plan.lines
               if line.in_budget and line.key not in ("device.reported", "budget", "kv")]
    return pd.DataFrame(counted + [
        ("KV cache", plan.kv_cache_gib),
        ("left by the engine (context, graphs, ...)", plan.device_memory_reported_gib - plan.usable_memory_gib),
        ("kept by the driver (marketed - reported)", plan.device_memory_gib - plan.device_memory_reported_gib),
    ], columns=["part", "GiB"])


def memory_lines(plan: MemoryPlan) -> pd.DataFrame:
    """Every figure of the plan with its rule and source, as `serveplan memory` prints them."""
    return pd.DataFrame([{"line": line.label, "GiB": round(line.gib, 3),
                          "counted by the engine": line.in_budget and line.key not in ("device.reported", "budget"),
                          "rule": line.rule, "source": line.source} for line in plan.lines])


def memory_bar(parts: pd.DataFrame, device_gib: float) -> alt.Chart:
    data = parts.assign(order=range(len(parts)), gpu="per GPU")
    legend, height = legend_below(int((data.GiB > 0).sum()), 2, 60)
    bar = alt.Chart(data[data.GiB > 0]).mark_bar().encode(
        x=alt.X("GiB:Q", title="memory per GPU (GiB)", scale=alt.Scale(domain=[0, max(device_gib, data.GiB.clip(0).sum())])),
        y=alt.Y("gpu:N", title=None),
        color=alt.Color("part:N", sort=list(parts.part), legend=legend),
        order=alt.Order("order:Q"),
        tooltip=["part", alt.Tooltip("GiB:Q", format=",.2f")],
    )
    rule = alt.Chart(pd.DataFrame({"GiB": [device_gib]})).mark_rule(color="black", strokeDash=[4, 2]).encode(x="GiB:Q")
    return (bar + rule).properties(height=height)


def concurrency_curve(data: pd.DataFrame) -> alt.Chart:
    """Both axes logarithmic: concurrency falls roughly as 1 / context, which a linear axis flattens
    to zero past a few thousand tokens. A context at which nothing fits (0) has no place on a log
    axis; the table beside the chart lists it."""
    return alt.Chart(data[data["max concurrent sequences"] > 0]).mark_line(point=True).encode(
        x=alt.X("context (tokens):Q", scale=alt.Scale(type="log", base=2), axis=alt.Axis(format=",d")),
        y=alt.Y("max concurrent sequences:Q", scale=alt.Scale(type="log"), axis=alt.Axis(format="~s")),
        tooltip=[alt.Tooltip("context (tokens):Q", format=","), alt.Tooltip("max concurrent sequences:Q", format=",")],
    ).properties(height=260)


def roofline(roofs: pd.DataFrame, points: pd.DataFrame) -> alt.Chart:
    x = alt.X("intensity (FLOP/byte):Q", scale=alt.Scale(type="log"))
    lines = alt.Chart(roofs).mark_line().encode(
        x=x, y=alt.Y("attainable (TFLOP/s):Q", scale=alt.Scale(type="log"), title="TFLOP/s per GPU"),
        color=alt.Color("chip:N"))
    dots = alt.Chart(points).mark_point(size=110, filled=True).encode(
        x=x, y=alt.Y("achieved (TFLOP/s):Q", scale=alt.Scale(type="log")),
        color=alt.Color("chip:N"), shape=alt.Shape("phase:N"),
        tooltip=["chip", "phase", alt.Tooltip("intensity (FLOP/byte):Q", format=",.1f"),
                 alt.Tooltip("achieved (TFLOP/s):Q", format=",.1f"), alt.Tooltip("step (ms):Q", format=",.2f"),
                 "peak dtype"])
    return (lines + dots).properties(height=380)


def grouped_bars(data: pd.DataFrame, x: str, y: str, color: str, title: str) -> alt.Chart:
    """Horizontal bars of `y` per `x`, one per `color` within each: the `x` names (metrics,
    scenarios) are read whole on the left rather than cut or turned on end under the bars."""
    groups, per_group = data[x].nunique(), data[color].nunique()
    legend, height = legend_below(per_group, 2, max(120, 28 * groups * per_group))
    return alt.Chart(data).mark_bar().encode(
        y=alt.Y(f"{x}:N", title=None, sort=None, axis=alt.Axis(labelLimit=0)), yOffset=f"{color}:N",
        x=alt.X(f"{y}:Q", title=title), color=alt.Color(f"{color}:N", legend=legend),
        tooltip=[x, color, alt.Tooltip(f"{y}:Q", format=",.2f")],
    ).properties(height=height)


def predicted_vs_measured(figures: pd.DataFrame) -> alt.Chart:
    """Held-out predicted against measured, log-log, faceted by metric family, with the y = x line."""
    base = alt.Chart(figures).encode(
        x=alt.X("measured:Q", scale=alt.Scale(type="log"), title="measured"),
        y=alt.Y("held-out prediction:Q", scale=alt.Scale(type="log"), title="predicted, source held out"),
    )
    points = base.mark_circle(size=18, opacity=0.5).encode(
        color=alt.Color("engine:N", legend=alt.Legend(orient="bottom", columns=4, labelLimit=0)),
        tooltip=["run", "metric", "measured", "held-out prediction", "error (%)"])
    line = base.mark_line(color="black", strokeWidth=0.8).encode(x="measured:Q", y="measured:Q")
    return (line + points).properties(width=260, height=240).facet(facet=alt.Facet("family:N", title=None), columns=4)


def prediction_bands(bands: pd.DataFrame) -> alt.Chart:
    """Each simulated figure's likely measured range as a share of the prediction (1 = as predicted):
    a rule from the band's low to its high end, a tick at the prediction."""
    base = alt.Chart(bands).encode(y=alt.Y("figure:N", title=None, sort=None, axis=alt.Axis(labelLimit=0)))
    rule = base.mark_rule(strokeWidth=3, opacity=0.6).encode(
        x=alt.X("low / predicted:Q", title="measured / predicted, likely range", scale=alt.Scale(type="log")),
        x2="high / predicted:Q",
        tooltip=["figure", alt.Tooltip("predicted:Q", format=",.2f"), alt.Tooltip("low:Q", format=",.2f"),
                 alt.Tooltip("high:Q", format=",.2f")])
    tick = base.mark_tick(color="black", thickness=2).encode(x=alt.datum(1.0))
    return (rule + tick).properties(height=24 * len(bands) + AXIS_PX)  # every figure's row named
