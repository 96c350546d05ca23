"""The dashboard, headless (streamlit.testing.v1.AppTest): every page runs, reads its inputs from
the URL, shows results that come from the planner, and turns bad input into an in-page error,
never an exception. Inputs are small so the file runs in well under a minute on a laptop CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.costmodel import fitted
from planner.costmodel.fitted import Band, FittedModel

pytest.importorskip("streamlit", reason="the dashboard extra is not installed: pip install -e '.[dashboard]'")
from streamlit.testing.v1 import AppTest  # noqa: E402 (after the skip check)

from tests.dashboard.apptest import open_page  # noqa: E402

from dashboard import compute  # noqa: E402
from engine.catalog import resolve_model  # noqa: E402
from engine.errors import InputError  # noqa: E402
from planner.hardware import get_hardware, hardware_catalog  # noqa: E402
from planner.sim import simulate  # noqa: E402
from planner.specs import Deployment  # noqa: E402
from planner.validate import ValidationReport, ValidationRow  # noqa: E402
from planner.workload import get_workload  # noqa: E402

SMALL = {"requests": "60", "rate": "4"}  # a few seconds of simulated chat on an H100


def errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


# --------------------------------------------------------------------------- Plan


# The page's defaults are the CLI's whole search; one narrowed through the URL keeps the test short.
NARROW_PLAN = {"hw": "h100-sxm", "requests": "40", "max_gpus": "1", "weight_dtypes": "bf16", "kv_dtypes": "bf16",
               "knobs": "mbt2048 seqs64"}


def test_plan_waits_for_the_button_then_recommends_from_the_url():
    at = open_page("plan", **NARROW_PLAN)
    assert not at.exception
    assert "Run plan" in at.info[0].value
    at.button[0].click().run()
    assert not at.exception and not errors(at)
    assert at.subheader[0].value.startswith("Recommended:") and "h100-sxm" in at.subheader[0].value
    assert float(metric(at, "Cost (US$/h)")) > 0
    assert at.query_params["run"] == "true"  # a shared link re-runs the plan
    assert any("Why not" in m.value for m in at.markdown)
    assert any("Each hardware's answer" in m.value for m in at.markdown)
    # The page says where its search is narrower than the CLI's default one.
    assert any("Narrower than the CLI's default search" in i.value and "max GPUs per replica: 1" in i.value
               for i in at.info)


def test_plan_shows_each_step_up_of_its_verification(monkeypatch: pytest.MonkeyPatch):
    """A plan whose cheapest deployment missed the SLO when verified whole says, above its metrics, what
    missed and with how many replicas it was ranked again (PlanResult.stepped_up)."""
    plan = compute.search.plan
    step = "1 x h100-sxm tp1 missed the SLO when verified at 3 req/s (ttft_p99_ms 2,000 ms > 1,000); with 2 replicas"

    def stepped(*args: object, **kwargs: object):
        return plan(*args, **kwargs).model_copy(update={"stepped_up": [step]})

    monkeypatch.setattr(compute.search, "plan", stepped)
    at = open_page("plan", **NARROW_PLAN, rate="3", run="true")
    assert not at.exception and not errors(at)
    assert any(i.value == f"Stepped up: {step}." for i in at.info)


def test_plan_page_defaults_are_the_clis():
    """One question, one answer: left at their defaults, the page asks what `serveplan plan` asks:
    every priced profile, and each declared plan setting, prefix caching and the probe size at the
    CLI's value (probes of 100 against 300 sized Qwen3-30B-A3B at 30 req/s differently: H200 with
    bf16 KV on the page, fp8 KV at the CLI, and another US$ per token)."""
    from engine.knobs import settings
    from planner.cli import build_parser
    from planner.specs import PlanSettings

    cli = vars(build_parser().parse_args(["plan", "--slo", "ttft_p99_ms<=500"]))
    at = open_page("plan")
    shown = {w.key: w.value for w in [*at.sidebar.number_input, *at.sidebar.selectbox, *at.sidebar.text_input,
                                      *at.sidebar.checkbox]}
    drawn = [s for s in settings(PlanSettings) if f"plan.{s.url_name}" in shown]
    assert {s.name for s in drawn} >= {"max_gpus_per_replica", "budget_usd_per_hour", "headroom", "pd_ratios", "offload",
                                       "max_quality_loss_pct", "every_hardware"}
    assert {s.name: shown[f"plan.{s.url_name}"] for s in drawn} == {s.name: cli[s.name] for s in drawn}
    assert shown["plan.prefix_caching"] == cli["enable_prefix_caching"]
    assert shown["plan.requests"] == cli["requests_per_probe"]
    priced = {name for name, hw in hardware_catalog().items() if hw.price_usd_per_hour is not None}
    assert set(at.sidebar.multiselect(key="plan.hw").value) == priced  # the CLI's --hw default


def test_plan_with_pd_ratios_compares_disaggregated_and_colocated():
    at = open_page("plan", hw="h100-sxm", requests="40", pd_ratios="1:1", run="true")
    assert not at.exception and not errors(at)
    table = next(d.value for d in at.dataframe if "winner" in d.value.columns)
    assert list(table.hardware) == ["h100-sxm"] and table.winner[0] in ("colocated", "disaggregated")
    assert table.why[0].startswith(("colocated wins", "disaggregation wins", "a tie"))


@pytest.mark.parametrize("slo, allowed", [("ttft_p99<=abc", "expected one of"),
                                         ("ttft_p99_ms<=1e300", "ttft_p99_ms must be a number in 0.01..3,600,000 ms")])
def test_plan_bad_slo_is_an_in_page_error(slo: str, allowed: str):
    at = open_page("plan", hw="h100-sxm", slo=slo)
    at.button[0].click().run()
    assert not at.exception
    assert any(f"{slo!r} is invalid: {allowed}" in e for e in errors(at))


def test_plan_zero_rate_is_an_in_page_error():
    at = open_page("plan", hw="h100-sxm", rate="0", run="true")
    assert not at.exception
    assert errors(at) == ["URL parameter rate='0' is invalid: must be a finite number in 0.001..1e+06 (requests/s)"]
    assert not at.subheader  # refused, not replaced: nothing was planned


def test_plan_errors_name_the_pages_inputs_not_the_planners_parameters():
    at = open_page("plan", hw="h100-sxm", requests="10", run="true")
    assert not at.exception
    assert errors(at) and errors(at)[0].startswith("Requests: 10 is invalid: must be between 20 and"), errors(at)
    assert not any("requests_per_probe" in e or "--" in e for e in errors(at))


def _agent_trace(n: int = 81) -> bytes:
    return "".join(json.dumps({"arrival_s": 0.25 * i, "input_tokens": 2400 + 10 * (i % 7), "output_tokens": 60,
                               "prefix_id": "tools"}) + "\n" for i in range(n)).encode()


def test_plan_a_trace_upload_at_its_own_rate():
    at = open_page("plan", **{**NARROW_PLAN, "workload": "upload a trace", "run": "true"})
    assert not at.exception and "Upload a trace" in at.info[0].value
    at.sidebar.file_uploader[0].set_value(("agent.jsonl", _agent_trace(), "application/json"))
    at.button[0].click().run()
    assert not at.exception and not errors(at), errors(at)
    assert at.subheader[0].value.startswith("Recommended:")
    assert any("trace agent (81 requests)" in c.value and "1 shared prefix of 1,200 tokens" in c.value
               and "4.00 req/s" in c.value for c in at.caption)


@pytest.mark.parametrize(("name", "data", "message"), [
    ("secret.csv", b"password,hunter2\nroot,toor\n", "the header names none of the trace columns"),
    ("bin.jsonl", bytes(range(256)), "is invalid"),
])
def test_plan_a_bad_trace_upload_is_one_line_without_its_contents(name, data, message):
    at = open_page("plan", **{**NARROW_PLAN, "workload": "upload a trace", "run": "true"})
    at.sidebar.file_uploader[0].set_value((name, data, "text/plain"))
    at.button[0].click().run()
    assert not at.exception
    [error] = errors(at)
    assert message in error and "\n" not in error and "hunter2" not in error and "toor" not in error


def test_plan_an_oversized_trace_upload_is_refused_before_it_is_read(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("dashboard.inputs.MAX_UPLOAD_BYTES", 1000)
    at = open_page("plan", **{**NARROW_PLAN, "workload": "upload a trace", "run": "true"})
    at.sidebar.file_uploader[0].set_value(("big.jsonl", _agent_trace(), "application/json"))
    at.button[0].click().run()
    assert not at.exception
    assert errors(at) == [f"upload='big.jsonl' is invalid: is {len(_agent_trace()):,} bytes; the limit is 1,000"]


def test_simulate_with_a_shared_prefix_hits_the_prefix_cache():
    at = open_page("simulate", **SMALL, prefix_tokens="2000", prefixes="2")
    assert not at.exception and not errors(at), errors(at)
    assert float(metric(at, "Prefix-cache hit rate").rstrip("%")) > 50
    at = open_page("simulate", **SMALL, prefix_share="0.5")
    assert not at.exception
    assert errors(at) == ["Share of requests with the prefix (0-1): 0.5 is invalid: applies to a shared prefix: give "
                          "its length too"]


def test_an_unset_engine_knob_reads_engine_default():
    """Streamlit draws a None selection as its placeholder, "Choose an option" unless told: an engine
    knob left to the engine reads "engine default" on every page that offers one."""
    for page in ("plan", "simulate"):
        at = open_page(page, hw="h100-sxm")
        unset = [box for box in at.selectbox if box.value is None]
        assert unset, page  # Plan: prefix caching; Simulate: the optional engine knobs
        assert {box.proto.placeholder for box in unset} == {"engine default"}, [(b.label, b.proto.placeholder) for b in unset]


# --------------------------------------------------------------------------- Simulate


def test_simulate_shows_latencies_cost_and_breakdown():
    at = open_page("simulate", **SMALL)
    assert not at.exception and not errors(at)
    assert float(metric(at, "TTFT P99 (ms)")) > 0
    assert float(metric(at, "Cost (US$/h)")) == pytest.approx(get_hardware("h100-sxm").price_usd_per_hour)
    [percentiles] = [d.value for d in at.dataframe if "P50" in d.value.columns]
    assert list(percentiles.metric) == ["TTFT (ms)", "ITL (ms)", "TPOT (ms)", "E2E (ms)", "queueing (ms)"]
    assert any("US$" in c.value and "per GPU-hour" in c.value for c in at.caption)  # the cost basis is shown
    # Where a step's time goes: the decode step and prefill chunk the run's summary carries.
    [split] = [d.value for d in at.dataframe if list(d.value.columns) == ["phase", "operator", "ms"]]
    assert {phase.split(" ")[0] for phase in split.phase} == {"decode", "prefill"} and (split.ms > 0).all()
    # Throughput over the steady window, not first arrival to last finish (which counts the drain tail).
    steady = compute.simulate_view("llama-3.1-8b", Deployment(hardware="h100-sxm"), get_workload(
        "chat", num_requests=60, arrival={"kind": "poisson", "rate_per_s": 4.0}, seed=0), None, None,
        "ttft_p99_ms<=500,tpot_p99_ms<=50", "round_robin").summary.steady_state
    assert metric(at, "Steady output (tokens/s)") == f"{steady.output_tokens_per_s:,.0f}"
    assert any(c.value.startswith("Steady state:") and "mean batch" in c.value for c in at.caption)


def test_simulate_draws_the_prediction_interval_of_a_gpu_run(monkeypatch: pytest.MonkeyPatch):
    # A public fit's bands (x0.8..x1.25 between P10 and P90), as `serveplan calibrate --public` writes them.
    band = Band(probabilities=[0.05, 0.1, 0.5, 0.9, 0.95], ratios=[0.7, 0.8, 1.0, 1.25, 1.5], held_out_coverage=0.8,
                figures=100)
    model = FittedModel(families={}, engines={}, source="test", bands=dict.fromkeys(("throughput", "ttft", "tpot_itl", "e2e"), band))
    monkeypatch.setattr(fitted, "fitted_model", lambda *_: model)
    at = open_page("simulate", **{**SMALL, "rate": "3"})  # inputs no other test caches
    assert not at.exception and not errors(at)
    [bands] = [d.value for d in at.dataframe if {"figure", "low", "high"} <= set(d.value.columns)]
    ttft = bands[bands.figure == "ttft_ms.p99"].iloc[0]
    assert (ttft.low, ttft.high) == (pytest.approx(0.8 * ttft.predicted), pytest.approx(1.25 * ttft.predicted))
    assert "throughput.output_tokens_per_s" in set(bands.figure)


def test_simulate_input_goes_to_the_url_and_a_cached_rerun_answers():
    at = open_page("simulate", **SMALL)
    at.sidebar.number_input(key="simulate.replicas").set_value(2).run()
    assert not at.exception
    assert at.query_params["replicas"] == "2"
    assert "2 × 1 h100-sxm" in at.subheader[0].value
    at.run()  # same inputs: served from st.cache_data
    assert "2 × 1 h100-sxm" in at.subheader[0].value


@pytest.mark.parametrize(("params", "message"), [
    ({"tp": "3"}, "Tensor parallel (GPUs per replica): 3 is invalid: must divide the 32 attention heads"),
    ({"rate": "0"}, "URL parameter rate='0' is invalid"),
    ({"slo": "latency<=5"}, "SLO: 'latency<=5' is invalid"),
    ({"model": "llama-3.1-70b", "hw": "l4"}, "is invalid"),  # 70B in bf16 does not fit one L4
])
def test_simulate_bad_input_is_an_in_page_error(params, message):
    at = open_page("simulate", **{**SMALL, **params})
    assert not at.exception
    assert any(message in e for e in errors(at)), errors(at)


def test_simulate_replays_a_trace_and_names_a_bad_line():
    trace = "\n".join(json.dumps({"arrival_s": i * 0.5, "input_tokens": 200, "output_tokens": 50}) for i in range(20))
    dep = Deployment(hardware="h100-sxm")
    view = compute.simulate_view("llama-3.1-8b", dep, None, "t.jsonl", trace.encode(), "", "round_robin")
    assert view.summary.num_finished == 20 and len(view.requests) == 20
    with pytest.raises(InputError, match="t.jsonl"):
        compute.simulate_view("llama-3.1-8b", dep, None, "t.jsonl", b'{"arrival_s": 0}\n', "", "round_robin")


# --------------------------------------------------------------------------- Compare


def test_compare_two_variants_with_deltas():
    at = open_page("compare", **SMALL)
    assert not at.exception and not errors(at)
    wide = at.dataframe[1].value  # [0] is the variants editor
    assert {"metric", "A: bf16", "B: fp8", "B: fp8 vs A (%)"} <= set(wide.columns)
    tpot = wide[wide.metric == "TPOT P99, ms"].iloc[0]
    assert tpot["B: fp8"] < tpot["A: bf16"]  # fp8 weights read half the bytes per decode step


def _variant(name: str, **fields) -> dict:
    return {"name": name, "hardware": "h100-sxm", "tp": 1, "weight_dtype": "bf16", "kv_dtype": "bf16",
            "prefix_caching": True, "token_budget": 8192, "speculative_tokens": 0, **fields}


def test_compare_bad_variant_is_reported_in_page():
    rows = [_variant("A"), _variant("B", tp=3)]
    at = open_page("compare", variants=json.dumps(rows), **SMALL)
    assert not at.exception
    assert any("variant 'B': tensor_parallel=3 is invalid" in e for e in errors(at)), errors(at)


def test_compare_simulates_a_speculative_variant():
    """The simulator models speculative decoding (docs/speculative.md): a variant with drafts is
    simulated, not left out, and verifying 3 drafts accepted at 0.8 each cuts the time per token."""
    rows = [_variant("A"), _variant("S", speculative_tokens=3, draft_acceptance=0.8)]
    at = open_page("compare", variants=json.dumps(rows), **SMALL)
    assert not at.exception and not errors(at), errors(at)
    assert not any("not modelled" in w.value for w in at.warning)
    wide = next(d.value for d in at.dataframe if "S vs A (%)" in d.value.columns)
    tpot = wide[wide.metric == "TPOT P50, ms"].iloc[0]
    assert tpot["S"] < 0.8 * tpot["A"]
    # Without its acceptance the variant is refused in the table's own words.
    rows[1]["draft_acceptance"] = None
    at = open_page("compare", variants=json.dumps(rows), **SMALL)
    assert not at.exception
    assert any("variant 'S': draft acceptance" in e and "needs the probability" in e for e in errors(at)), errors(at)


def test_compare_capacity_within_the_slo_on_request():
    """Ticked, each variant's capacity and its cost per token there are compared (a search of
    simulations per variant: an L4 with a loose SLO keeps it to seconds)."""
    rows = [_variant("A", hardware="l4"), _variant("B", hardware="l4", kv_dtype="fp8")]
    at = open_page("compare", variants=json.dumps(rows), capacity="true", slo="ttft_p99_ms<=2000,tpot_p99_ms<=200",
                   **SMALL)
    assert not at.exception and not errors(at), errors(at)
    wide = next(d.value for d in at.dataframe if "B vs A (%)" in d.value.columns).set_index("metric")
    capacity = wide.loc["capacity within the SLO, requests/s"]
    assert capacity["A"] > 0 and capacity["B"] > 0
    assert "requests/s" not in wide.index  # whole-run rates (with the drain tail) are not compared
    # How each capacity was found (or why a variant has none), as `serveplan compare` prints it.
    for name in ("A", "B"):
        assert any(c.value.startswith(f"Capacity of {name}: Poisson arrivals") and "met the SLO" in c.value
                   for c in at.caption), [c.value for c in at.caption]


def test_compare_likely_ranges_are_numbers_formatted_like_the_rest(monkeypatch: pytest.MonkeyPatch):
    """Each side's P10 and P90 if measured are columns of numbers (shown as people read them,
    downloaded exact), not a pair of 15-digit floats in one cell."""
    import pyarrow as pa

    from dashboard import ui

    band = Band(probabilities=[0.05, 0.1, 0.5, 0.9, 0.95], ratios=[0.7, 0.8, 1.0, 1.25, 1.5], held_out_coverage=0.8,
                figures=100)
    model = FittedModel(families={}, engines={}, source="test", bands=dict.fromkeys(("throughput", "ttft", "tpot_itl", "e2e"), band))
    monkeypatch.setattr(fitted, "fitted_model", lambda *_: model)
    at = open_page("compare", **{**SMALL, "rate": "3"})  # inputs no other test caches
    assert not at.exception and not errors(at), errors(at)
    detail = next(d for d in at.dataframe if "B − A" in d.value.columns)
    row = detail.value.set_index("metric").loc["TTFT P99, ms"]
    assert row["A: bf16: likely if measured, P10"] == pytest.approx(0.8 * row["A: bf16"])
    assert row["B: fp8: likely if measured, P90"] == pytest.approx(1.25 * row["B: fp8"])
    shown = pa.ipc.open_stream(detail.proto.arrow_data.styler.display_values).read_pandas()
    likely = [c for c in detail.value.columns if "likely if measured" in c]
    assert len(likely) == 4
    assert all(shown[c].tolist() == [ui.readable(v) for v in detail.value[c]] for c in likely)


# --------------------------------------------------------------------------- Memory


def test_memory_breakdown_and_concurrency_curve():
    at = open_page("memory", model="llama-3.1-70b", tp="4", weight_dtype="fp8", kv_dtype="fp8", context="8192")
    assert not at.exception and not errors(at)
    parts = at.dataframe[0].value
    assert parts.GiB.sum() == pytest.approx(get_hardware("h100-sxm").memory_gib, rel=1e-6)
    lines = at.dataframe[1].value  # the same lines, rules and sources as `serveplan memory`
    kv = lines[lines.line == "KV cache"]
    assert len(kv) == 1 and kv.GiB.iloc[0] == pytest.approx(parts[parts.part == "KV cache"].GiB.iloc[0], abs=1e-3)
    assert lines.rule.str.len().min() > 0 and lines.source.str.len().min() > 0
    curve = at.dataframe[2].value
    assert curve["max concurrent sequences"].is_monotonic_decreasing


def test_memory_shows_the_kv_tiers_a_host_tier_adds():
    at = open_page("memory", kv_offload_host_gib="64")
    assert not at.exception and not errors(at)
    tiers = next(d.value for d in at.dataframe if "tier" in d.value.columns).set_index("tier")
    assert list(tiers.index) == ["device", "host", "disk"]  # the H100 profile lists host memory and a local disk
    assert tiers.loc["host", "GiB per replica"] == pytest.approx(64, rel=0.01)  # whole blocks of 64 GiB
    assert tiers.loc["host", "blocks"] > 0 and tiers.loc["disk", "blocks"] == 0
    # More than the profile lists per GPU is refused in the page, naming the knob.
    at = open_page("memory", kv_offload_host_gib="100000")
    assert not at.exception
    assert any("kv_offload_host_gib" in e or "Host KV tier" in e for e in errors(at)), errors(at)


def test_memory_bad_context_is_an_in_page_error():
    at = open_page("memory", context="999999")
    assert not at.exception
    assert any("Context per sequence (tokens): 999999 is invalid: exceeds the model's max_position_embeddings" in e
               for e in errors(at)), errors(at)


# --------------------------------------------------------------------------- Hardware


def test_hardware_catalog_and_roofline():
    at = open_page("hardware", chips="h100-sxm,l4")
    assert not at.exception and not errors(at)
    assert len(at.dataframe[0].value) == len(hardware_catalog())
    points = at.dataframe[1].value
    assert set(points.phase) == {"decode", "prefill"} and set(points.chip) == {"h100-sxm", "l4"}
    decode = points[points.phase == "decode"]
    prefill = points[points.phase == "prefill"]
    # Prefill reuses each weight read across its tokens: far higher arithmetic intensity.
    assert (prefill["intensity (FLOP/byte)"].to_numpy() > 5 * decode["intensity (FLOP/byte)"].to_numpy()).all()


def test_hardware_bad_url_value_is_refused_not_replaced():
    at = open_page("hardware", batch="many")
    assert not at.exception
    assert errors(at) == ["URL parameter batch='many' is invalid: must be an integer in 1..4096 (requests)"]
    assert not at.dataframe  # the page stopped: nothing drawn from a substitute


# --------------------------------------------------------------------------- Validate


def _report_json() -> str:
    model = resolve_model("llama-3.1-8b")
    summary = simulate(model, get_hardware("h100-sxm"), Deployment(hardware="h100-sxm"),
                       get_workload("chat", num_requests=20)).summary
    errors_pct = {"ttft_ms.mean": 4.0, "ttft_ms.p99": -12.0, "tpot_ms.mean": 2.0, "e2e_ms.mean": 3.0,
                  "throughput.output_tokens_per_s": -1.0}
    return ValidationReport(
        model=model.name, calibration="cal.json", hardware_profile="local", fit_median_abs_error_pct=1.5,
        rows=[ValidationRow(scenario="poisson-2", description="Poisson 2 req/s", engine=summary, simulator=summary,
                            error_pct=errors_pct)],
        median_abs_error_pct={k: abs(v) for k, v in errors_pct.items()},
        bounds_pct={"ttft_ms.mean": 10.0, "ttft_ms.p99": 20.0}, passed=True).model_dump_json()


@pytest.fixture
def docs(tmp_path, monkeypatch) -> Path:
    """A docs/ folder of our own for the Validate page, with a good and a malformed report."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "validation.json").write_text(_report_json())
    (folder / "bad.json").write_text('{"model": "x"}')
    monkeypatch.setattr(compute, "REPORTS_DIR", folder)
    return folder


def test_validate_explains_how_to_produce_a_missing_report(tmp_path, monkeypatch):
    monkeypatch.setattr(compute, "REPORTS_DIR", tmp_path)
    at = open_page("validate")
    assert not at.exception
    assert "serveplan validate" in at.info[0].value


def test_validate_shows_a_report_from_docs_and_rejects_a_malformed_one(docs):
    at = open_page("validate")
    assert not at.exception and not errors(at)
    assert at.success[0].value.startswith("llama-3.1-8b")
    assert at.dataframe[1].value.iloc[0]["ttft_ms.p99"] == -12.0
    at = open_page("validate", report="bad.json")
    assert not at.exception
    assert "bad.json is not a ValidationReport" in errors(at)[0]


def test_validate_shows_an_uploaded_report_and_refuses_an_oversized_one(docs, monkeypatch):
    at = open_page("validate", report="bad.json")
    at.file_uploader[0].set_value(("mine.json", _report_json().encode(), "application/json")).run()
    assert not at.exception and not errors(at)
    assert at.success[0].value.startswith("llama-3.1-8b")
    at.file_uploader[0].set_value(("bin.json", bytes(range(256)), "application/json")).run()
    assert not at.exception
    assert errors(at) == ["bin.json is not a ValidationReport: ValidationReport='256 bytes' is invalid: Invalid JSON: "
                          "expected value at line 1 column 1"]
    monkeypatch.setattr("dashboard.inputs.MAX_UPLOAD_BYTES", 100)
    at.file_uploader[0].set_value(("big.json", b" " * 101, "application/json")).run()
    assert errors(at) == ["upload='big.json' is invalid: is 101 bytes; the limit is 100"]


def _public_json() -> str:
    from planner.public.calibration import FigureResult, bands
    from planner.public.report import TARGETS_PCT, PublicValidation, group_errors, scatter_floors

    rows = [FigureResult(id=f"r{i}-{m}", run_key=f"src{i % 3}/r{i}", source_key=f"src{i % 3}", publisher="lab",
                         metric=m, family="throughput" if m == "output_throughput" else "ttft", engine="vllm-0.11",
                         hardware="h100-sxm", gpu_family="hopper", confidence="high", measured=100.0,
                         in_sample=100.0 + i, held_out=100.0 + 2 * i, held_out_publisher=100.0 + 3 * i)
            for i in range(6) for m in ("output_throughput", "ttft_median")]
    by_family = group_errors(rows, lambda r: r.family)
    return PublicValidation(
        fit_file="fit.json", figures=len(rows), sources=3, runs=6, skipped=[], by_metric_family=by_family,
        by_client=group_errors(rows, lambda r: f"offline (every request at once): {r.family}"),
        by_architecture=group_errors(rows, lambda r: f"dense: {r.family}"),
        by_engine=group_errors(rows, lambda r: r.engine), by_gpu=group_errors(rows, lambda r: r.hardware),
        by_source=group_errors(rows, lambda r: r.source_key), bands=bands(rows), targets_pct=TARGETS_PCT,
        met={g.group: g.held_out_median_abs_pct <= TARGETS_PCT[g.group] for g in by_family},
        scatter_floors=scatter_floors(rows, {r.run_key: "offline (every request at once), dense-fixed" for r in rows}),
        figure_errors=rows,
    ).model_dump_json()


def test_validate_shows_the_public_validation_beside_the_engine_one(docs):
    (docs / "validation-public.json").write_text(_public_json())
    at = open_page("validate")
    assert not at.exception and not errors(at)
    assert at.success[0].value.startswith("llama-3.1-8b")  # the engine tab is intact
    assert "12 figures, 6 runs, 3 sources" in at.success[1].value
    families = next(d.value for d in at.dataframe if "metric family" in d.value.columns and "target %" in d.value.columns)
    assert set(families["metric family"]) == {"throughput", "ttft"}
    floors = next(d.value for d in at.dataframe if "left, one factor per run %" in d.value.columns)
    assert list(floors["left, one factor per run %"]) == [0.0, 0.0]  # one figure of each family per run
    groups = [set(d.value["group"]) for d in at.dataframe if "group" in d.value.columns]
    assert {"dense: throughput", "dense: ttft"} in groups  # by model architecture
    (docs / "validation-public.json").write_text('{"figures": "many"}')
    at = open_page("validate")
    assert not at.exception
    assert at.success[0].value.startswith("llama-3.1-8b")  # a bad public file does not stop the engine tab
    assert errors(at)[0].startswith("validation-public.json is not a public validation")


# --------------------------------------------------------------------------- charts and tables (issue 21)


def test_an_empty_queue_gets_a_unit_axis_not_nan():
    """Vega labels the one tick of a [0, 0] domain NaN: a queue that never fills gets 0..1."""
    import pandas as pd

    from dashboard import charts

    samples = pd.DataFrame({"replica": [0, 0, 0], "start_s": [0.0, 1.0, 2.0], "num_waiting": [0, 0, 0]})
    y = charts.step_series(samples, "num_waiting", "queue depth (requests)").to_dict()["encoding"]["y"]
    assert y["scale"]["domain"] == [0, 1] and y["axis"]["tickMinStep"] == 1
    assert charts.step_series(samples.assign(num_waiting=[0, 7, 3]), "num_waiting", "q").to_dict()[
        "encoding"]["y"]["scale"]["domain"] == [0, 7]


def test_pareto_of_candidates_with_equal_costs_keeps_a_cost_axis_and_names_its_legend():
    from types import SimpleNamespace

    from dashboard import charts

    plans = [SimpleNamespace(label=f"c{i}", usd_per_hour=3.0, ttft_p99_ms=100.0 + i, replicas=1, gpus=1) for i in range(3)]
    spec = charts.pareto(plans, plans[:1], "ttft_p99_ms").to_dict()
    x = spec["layer"][0]["encoding"]["x"]
    low, high = x["scale"]["domain"]
    assert low < 3.0 < high and high - low >= 0.5  # not one tick at 3.0
    kinds = {row["candidate kind"] for row in spec["datasets"][next(iter(spec["datasets"]))]}
    assert kinds == {charts.FRONT, charts.DOMINATED}  # words, not true/false


def test_concurrency_by_context_is_log_on_both_axes():
    import pandas as pd

    from dashboard import charts

    data = pd.DataFrame({"context (tokens)": [256, 8192, 131072], "max concurrent sequences": [5000, 156, 0]})
    spec = charts.concurrency_curve(data).to_dict()
    assert spec["encoding"]["x"]["scale"]["type"] == "log" and spec["encoding"]["y"]["scale"]["type"] == "log"
    assert [r["max concurrent sequences"] for r in spec["datasets"][next(iter(spec["datasets"]))]] == [5000, 156]


@pytest.mark.parametrize(("value", "shown"), [(28105.0, "28,105"), (16123, "16,123"), (15.2073, "15.2"),
                                              (1753.7394, "1,754"), (6.4698, "6.47"), (0.004741, "0.00474"),
                                              (-12.34, "-12.3"), (0.0, "0"), (float("nan"), ""), (None, "")])
def test_numbers_are_formatted_for_people(value, shown):
    from dashboard import ui

    assert ui.readable(value) == shown


def test_tables_show_readable_numbers():
    """What the page sends for display: the formatted text, while the values (and the downloads) stay exact."""
    import pyarrow as pa

    at = open_page("simulate", **SMALL)
    table = next(d for d in at.dataframe if "P50" in d.value.columns)
    shown = pa.ipc.open_stream(table.proto.arrow_data.styler.display_values).read_pandas()
    itl = shown[shown.metric == "ITL (ms)"].iloc[0]
    assert itl["count"] == f"{int(table.value[table.value.metric == 'ITL (ms)'].iloc[0]['count']):,}"
    assert all(len(text.partition(".")[2]) <= 3 for text in shown.drop(columns="metric").to_numpy().ravel())
