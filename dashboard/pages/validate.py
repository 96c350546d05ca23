"""Validate: the simulator against the real engine on this machine (a ValidationReport from
`serveplan validate --json`) and against published GPU runs (a PublicValidation from
`serveplan validate --public --json`)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import choice_input, upload_bytes
from dashboard.state import PageState
from engine.errors import EXCERPT_CHARS, InputError
from planner.public.calibration import carried_group_bands

DEFAULT_REPORT = "validation.json"
PUBLIC_REPORT = "validation-public.json"
HEADLINE = ["ttft_ms.mean", "ttft_ms.p99", "tpot_ms.mean", "e2e_ms.mean", "throughput.output_tokens_per_s"]


def render() -> None:
    state = PageState("validate")
    st.title("Validate")
    engine_tab, public_tab = st.tabs(["Engine vs simulator, this machine", "Published GPU runs"])
    with public_tab:  # first: it never stops the page, the engine tab may (a malformed report)
        render_public()
    with engine_tab:
        render_engine(state)


def render_public() -> None:
    st.caption("Every published GPU benchmark figure in the project's data, replayed as it was run and predicted by "
               "a fit that never saw its source (leave-one-source-out); stricter still, its whole publisher left out.")
    if PUBLIC_REPORT not in compute.project_reports():
        st.info("No public validation in docs/ yet. Make one (it simulates every published run: minutes):\n\n"
                "```bash\n.venv/bin/serveplan validate --public --report docs/validation-public.md --json "
                "> docs/validation-public.json\n```")
        return
    try:
        v = compute.public_validation(compute.project_report(PUBLIC_REPORT))
    except InputError as exc:
        st.error(f"{PUBLIC_REPORT} is not a public validation: {exc}")
        return
    met = all(v.met.values())
    (st.success if met else st.warning)(
        f"{v.figures:,} figures, {v.runs} runs, {v.sources} sources: held-out median |error| "
        + ", ".join(f"{g.group} {g.held_out_median_abs_pct:.1f} % (target {v.targets_pct.get(g.group, 0):g} %)"
                    for g in v.by_metric_family))
    families = pd.DataFrame([{"metric family": g.group, "figures": g.figures,
                              "held out, median |error| %": g.held_out_median_abs_pct,
                              "held out, median signed %": g.held_out_median_signed_pct,
                              "publisher held out, median |error| %": g.held_out_publisher_median_abs_pct,
                              "in sample, median |error| %": g.in_sample_median_abs_pct,
                              "target %": v.targets_pct.get(g.group), "met": v.met.get(g.group)}
                             for g in v.by_metric_family])
    ui.table(families, "By metric family", key="validate.public.families")
    if v.scatter_floors:
        held_out = {g.group: g.held_out_median_abs_pct for g in v.by_metric_family}
        floors = pd.DataFrame([{"metric family": f.family, "held out, median |error| %": held_out[f.family],
                                **{f"left, one factor per {g} %": left for g, left in f.left_pct.items()}}
                               for f in v.scatter_floors])
        ui.table(floors, "Where the error lies", key="validate.public.scatter",
                 caption="The median |error| left once each figure's prediction is divided by its group's median "
                         "held-out ratio, taken from the very figures scored: a floor for any term constant over the "
                         "group. The fit's figures are per GPU family and engine; a kind of run is how the client offered "
                         "the requests, the model's architecture and whether the lengths varied; a run leaves only "
                         "the spread of the metrics within one benchmark run.")
    bands = pd.DataFrame([{"band of": engine, "metric family": name, "P10 measured/predicted": b.interval()[0],
                           "P90 measured/predicted": b.interval()[1], "held-out coverage": b.held_out_coverage,
                           "figures": b.figures}
                          for engine, table in (("all engines", v.bands), *v.engine_bands.items(),
                                                *carried_group_bands(v.group_bands))
                          for name, b in table.items()])
    ui.table(bands, "Prediction bands every simulated GPU run carries", key="validate.public.bands",
             caption="Held-out coverage is measured: each source's band was built from the other sources only. A run "
                     "carries the band of runs whose requests arrived as its did (online: over time; offline: all at "
                     "once) where there is one, else that of runs of its model's architecture (dense or MoE), else "
                     "its engine's, else the all-engines band.")
    figures = pd.DataFrame([{"run": f.run_key, "metric": f.metric, "family": f.family, "engine": f.engine,
                             "measured": f.measured, "held-out prediction": f.held_out,
                             "error (%)": 100 * (f.held_out / f.measured - 1)} for f in v.figure_errors])
    st.markdown("**Held-out prediction against measurement**")
    st.altair_chart(charts.predicted_vs_measured(figures), width="stretch")
    for title, groups in (("By benchmark client", v.by_client), ("By model architecture", v.by_architecture),
                          ("By engine", v.by_engine), ("By GPU", v.by_gpu),
                          ("By source", v.by_source)):
        table = pd.DataFrame([{"group": g.group, "figures": g.figures, "held out, median |error| %": g.held_out_median_abs_pct,
                               "held out, median signed %": g.held_out_median_signed_pct,
                               "in sample, median |error| %": g.in_sample_median_abs_pct} for g in groups])
        ui.table(table, title, key=f"validate.public.{title}")
    ui.table(figures, "Every figure", key="validate.public.figures")


def render_engine(state: PageState) -> None:
    st.caption("The same seeded requests through the real engine and the calibrated simulator; the error is the "
               "simulator's, signed: (simulator − engine) / engine × 100.")
    reports = compute.project_reports()
    with st.sidebar:
        name = choice_input(state, "report", "Report in docs/", reports,
                            DEFAULT_REPORT if DEFAULT_REPORT in reports else (reports[0] if reports else None),
                            help="A ValidationReport JSON in the project's docs/ folder") if reports else None
        upload = state.attempt(lambda: upload_bytes("Or upload a report (JSON)", ["json"],
                                                    help="A ValidationReport from `serveplan validate --json`"))
    state.sync_url()
    if upload is not None:
        source, data = upload
    elif name is not None:
        source, data = name, state.attempt(lambda: compute.project_report(name))
    else:
        st.info("No validation report in docs/ yet. Produce one on the machine to validate "
                "(it runs the real engine), then reload, or upload one in the sidebar:\n\n"
                "```bash\n.venv/bin/serveplan calibrate --threads 1\n"
                ".venv/bin/serveplan validate --calibration hwprofiles/calibrations/<device>__smollm2-135m__fp32.json "
                "--json > docs/validation.json\n```")
        return
    try:
        report = compute.validation_report(data)
    except InputError as exc:
        ui.stop_with(f"{source[:EXCERPT_CHARS]} is not a ValidationReport: {exc}")

    (st.success if report.passed else st.error)(
        f"{report.model} on {report.hardware_profile}: every headline median |error| within its bound"
        if report.passed else f"{report.model} on {report.hardware_profile}: a headline error is out of bounds")
    st.caption(f"Calibration {report.calibration}; calibration fit residual (median |error|) "
               f"{report.fit_median_abs_error_pct:.1f} %, reported apart from the validation error.")
    bounds = pd.DataFrame([{"metric": m, "median |error| (%)": report.median_abs_error_pct.get(m), "bound (%)": b,
                            "within": (report.median_abs_error_pct.get(m) or 0.0) <= b}
                           for m, b in report.bounds_pct.items()])
    ui.table(bounds, "Headline errors against their bounds", key="validate.bounds")

    errors = pd.DataFrame([{"scenario": r.scenario, "description": r.description, **r.error_pct} for r in report.rows])
    shown = [m for m in HEADLINE if m in errors.columns]
    if shown:
        long = errors.melt(id_vars="scenario", value_vars=shown, var_name="metric", value_name="error (%)").dropna()
        st.markdown("**Simulator error by scenario (%)**")
        st.altair_chart(charts.grouped_bars(long, "scenario", "error (%)", "metric", "error (%)"), width="stretch")
    ui.table(errors, "Signed error by scenario (%)", key="validate.errors")
    values = pd.DataFrame([{"scenario": r.scenario, "metric": m, "engine": r.engine.figure(m),
                            "simulator": r.simulator.figure(m)} for r in report.rows for m in shown])
    ui.table(values, "Engine and simulator values", key="validate.values",
             caption="Latencies in ms, throughput in output tokens/s.")
    ui.json_download("Validation report (JSON)", report, "validation.json", key="validate.json")


render()
