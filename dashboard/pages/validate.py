"""Validate: the latest engine-vs-simulator results (a ValidationReport from `serveplan validate --json`)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, compute, ui
from dashboard.inputs import choice_input, upload_bytes
from dashboard.state import PageState
from engine.errors import EXCERPT_CHARS, InputError

DEFAULT_REPORT = "validation.json"
HEADLINE = ["ttft_ms.mean", "ttft_ms.p99", "tpot_ms.mean", "e2e_ms.mean", "throughput.output_tokens_per_s"]


def _value(summary: object, path: str) -> float:
    for part in path.split("."):
        summary = getattr(summary, part)
    return float(summary)  # type: ignore[arg-type]


def render() -> None:
    state = PageState("validate")
    st.title("Validate")
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
    if upload is None and name is None:
        st.info("No validation report in docs/ yet. Produce one on the machine to validate "
                "(it runs the real engine), then reload, or upload one in the sidebar:\n\n"
                "```bash\n.venv/bin/serveplan calibrate --threads 1\n"
                ".venv/bin/serveplan validate --calibration hwprofiles/calibrations/<device>__smollm2-135m__fp32.json "
                "--json > docs/validation.json\n```")
        return
    source, data = upload if upload is not None else (name, state.attempt(lambda: compute.project_report(name)))
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
    values = pd.DataFrame([{"scenario": r.scenario, "metric": m, "engine": _value(r.engine, m),
                            "simulator": _value(r.simulator, m)} for r in report.rows for m in shown])
    ui.table(values, "Engine and simulator values", key="validate.values",
             caption="Latencies in ms, throughput in output tokens/s.")
    ui.json_download("Validation report (JSON)", report, "validation.json", key="validate.json")


render()
