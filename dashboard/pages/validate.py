"""Validate: the latest engine-vs-simulator results (a ValidationReport from `serveplan validate --json`)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from pydantic import ValidationError
import streamlit as st

from dashboard import charts, compute, ui
from dashboard.state import PageState

DEFAULT_REPORT = "docs/validation.json"
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
    with st.sidebar:
        report_path = st.text_input("Report file", key=state.bind("report", DEFAULT_REPORT),
                                    help="A ValidationReport JSON, relative to the repository root")
    state.sync_url()
    path = Path(report_path)
    if not path.is_absolute():
        path = Path(__file__).resolve().parents[2] / path
    if not path.is_file():
        st.info(f"No validation report at `{report_path}` yet. Produce one on the machine to validate "
                "(it runs the real engine), then reload:\n\n"
                "```bash\n.venv/bin/serveplan calibrate --threads 1\n"
                ".venv/bin/serveplan validate --calibration hwprofiles/calibrations/<device>__smollm2-135m__fp32.json "
                "--json > docs/validation.json\n```")
        return
    try:
        report = compute.validation_report(str(path), path.stat().st_mtime_ns)
    except ValidationError as exc:
        ui.stop_with(f"{report_path} is not a ValidationReport: {ui.validation_message(exc)}")

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
