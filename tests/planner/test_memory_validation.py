"""The memory model against published engine start-up logs (planner/data/startup_logs.json): what
`serveplan validate --memory` reports, held to the errors measured when the rules were written."""

import json

import pytest

from planner.cli import main
from planner.validate_memory import validate_startup_logs


@pytest.fixture(scope="module")
def report():
    return validate_startup_logs()


def test_kv_cache_within_the_issue_target_over_the_published_logs(report) -> None:
    # Issue 23's target is 5 %; the rules measured 1.0 % over 18 logs from five publications.
    assert report.kv_logs >= 18 and len(report.sources) >= 5
    assert report.kv_median_abs_error_pct < 1.5


def test_weights_within_two_percent_every_one(report) -> None:
    assert report.weights_logs >= 18 and report.weights_median_abs_error_pct < 0.3
    worst = max(abs(c.weights_error_pct) for c in report.logs if c.counted and c.weights_error_pct is not None)
    assert worst < 2.5  # gpt-oss-120b: a later vLLM's MXFP4 layout (docs/memory.md)


def test_engines_that_refused_to_start_have_plans_that_do_not_fit(report) -> None:
    refused = [c for c in report.logs if c.engine_started is False]
    assert refused and all(not c.fits_predicted for c in refused)


def test_the_profiling_peak_matches_the_logged_one_where_it_is_printed(report) -> None:
    # vLLM prints the torch peak of its profiling pass only at debug level: the llm-d logs and PR 10511.
    checked = [c for c in report.logs if c.activation_reported_gib is not None]
    assert len(checked) >= 10
    assert all(c.activation_predicted_gib == pytest.approx(c.activation_reported_gib, rel=0.05) for c in checked)


def test_logs_stating_their_sampler_use_it(report) -> None:
    stated = {c.id: c.sampler for c in report.logs if c.sampler is not None}
    assert stated["dennislee22-vllm-benchmarking-qwen2-7b-a100-40gb-tp2-2nodes-gmu0.5"] == "torch_sort"
    assert stated["dennislee22-vllm-benchmarking-qwen2-7b-a100-80gb-tp1-gmu0.25"] == "flashinfer"


def test_low_confidence_logs_are_shown_but_not_counted(report) -> None:
    low = [c for c in report.logs if not c.counted]
    assert low and all(c.id.endswith("-readme") or "defaults" in c.id for c in low)


def test_cli_prints_the_table_and_the_json_is_the_report(capsys, report) -> None:
    assert main(["validate", "--memory"]) == 0
    out = capsys.readouterr().out
    assert "median |error|" in out and "llm-d-benchmark-empirical-vllm-memory-llama-3.1-8b-tp1" in out
    assert main(["validate", "--memory", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_median_abs_error_pct"] == pytest.approx(report.kv_median_abs_error_pct)
    assert len(data["logs"]) == len(report.logs)


def test_the_docs_table_is_generated_from_the_report() -> None:
    from planner.validate_memory import DOC, regenerate

    text = DOC.read_text()
    assert regenerate(text) == text, "run: python -m planner.validate_memory"
