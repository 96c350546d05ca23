"""Fuzzing the dashboard's URL parameters through streamlit.testing.v1.AppTest (issue 14): each
page opened with a few of its parameters set to valid, boundary or hostile values (and a
parameter it does not have). Every run ends without an exception; every value the page could
not use is named in an error (never silently replaced), no file named in a URL is read, and a
page whose parameters are all valid still draws its results."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st
import pytest

pytest.importorskip("streamlit", reason="the dashboard extra is not installed: pip install -e '.[dashboard]'")
from streamlit.testing.v1 import AppTest  # noqa: E402 (after the skip check)

from tests.dashboard.apptest import open_page  # noqa: E402

from .harness import SECRET  # noqa: E402

FUZZ = settings(max_examples=5, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Values no parameter of these pages accepts (the pools below hold the valid ones).
HOSTILE = ["-1", "1e300", "inf", "nan", "abc", "", "9" * 200, "h100-sxm,{secret}", "{secret}", "../../etc/passwd"]


@pytest.fixture(autouse=True)
def plan_cache(tmp_path, monkeypatch):
    monkeypatch.setattr("planner.search.DEFAULT_CACHE_DIR", tmp_path / "serveplan-cache")


def params_of(valid: dict[str, list[str]], secret: Path) -> st.SearchStrategy[dict[str, str]]:
    """A few parameters, each valid or hostile, plus now and then one the page does not have."""
    value = {name: st.sampled_from([*options, *(h.format(secret=secret) for h in HOSTILE)])
             for name, options in valid.items()}
    names = st.sampled_from([*valid, "not_a_parameter"])
    return st.dictionaries(names, st.just(""), max_size=3).flatmap(
        lambda chosen: st.fixed_dictionaries({n: value.get(n, st.just("1")) for n in chosen}))


def check(at: AppTest, params: dict[str, str], valid: dict[str, list[str]], results: str) -> None:
    assert not at.exception, at.exception
    errors = [e.value for e in at.error]
    text = "\n".join(str(e.value) for kind in (at.error, at.warning, at.info, at.markdown, at.caption) for e in kind)
    assert SECRET not in text
    refused = [name for name, value in params.items() if name in valid and value not in valid[name]]
    for name in refused:  # every hostile value is named, none silently replaced
        assert any(e.startswith(f"URL parameter {name}=") for e in errors), (name, errors)
    if "not_a_parameter" in params:
        assert any("'not_a_parameter' is not one of this page's" in w.value for w in at.warning)
    if not errors:
        assert any(results in str(e.value) for e in at.markdown), "valid parameters, but no results drawn"


DEPLOYMENT = {"model": ["llama-3.2-1b", "llama-3.1-8b", "qwen3-30b-a3b"], "hw": ["h100-sxm", "l40s"],
              "tp": ["1", "2"], "pp": ["1"], "replicas": ["1", "2"], "weight_dtype": ["bf16", "fp8", "int4"],
              "kv_dtype": ["bf16", "fp8"], "block_size": ["16", "32"], "max_num_batched_tokens": ["4096", "8192"],
              "max_num_seqs": ["64", "256"], "prefix_caching": ["true", "false"], "chunked_prefill": ["false"],
              "gpu_memory_utilization": ["0.8", "1"], "policy": ["fcfs", "priority"], "enforce_eager": ["true"]}


@FUZZ
@given(data=st.data())
def test_memory_page(data: st.DataObject, secret_file: Path) -> None:
    valid = {**DEPLOYMENT, "context": ["1024", "8192"]}
    params = data.draw(params_of(valid, secret_file))
    check(open_page("memory", **params), params, valid, "Per-GPU memory")


@FUZZ
@given(data=st.data())
def test_simulate_page(data: st.DataObject, secret_file: Path) -> None:
    valid = {**DEPLOYMENT, "rate": ["2", "0.5"], "seed": ["3"], "workload": ["chat", "rag"],
             "router": ["round_robin"], "input_tokens": ["100"], "output_tokens": ["20"]}
    params = data.draw(params_of(valid, secret_file))
    check(open_page("simulate", **{"requests": "20", **params}), params, valid, "Latency percentiles")


@FUZZ
@given(data=st.data())
def test_hardware_page(data: st.DataObject, secret_file: Path) -> None:
    valid = {"model": ["llama-3.2-1b"], "chips": ["h100-sxm,l4", "mi300x"], "weight_dtype": ["bf16", "fp8"],
             "batch": ["1", "4096"], "context": ["1", "2048"], "prefill": ["1", "131072"]}
    params = data.draw(params_of(valid, secret_file))
    check(open_page("hardware", **params), params, valid, "Roofline")


@settings(FUZZ, max_examples=4)
@given(report=st.sampled_from(["validation.json", "{secret}", "/etc/passwd", "..", "schemas", "", "x" * 500]))
def test_validate_page(report: str, secret_file: Path) -> None:
    params = {"report": report.format(secret=secret_file)}
    at = open_page("validate", **params)
    assert not at.exception and SECRET not in "\n".join(e.value for e in at.error)
    if report != "validation.json":
        assert at.error[0].value.startswith("URL parameter report=")
