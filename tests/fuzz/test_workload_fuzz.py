"""Fuzz workload files and traces: YAML workload dicts, JSONL and CSV trace rows.

A workload or trace either loads and draws, or raises one InputError: never another exception,
never a long or multi-line message, never a whole input value echoed. Memory stays bounded
because the limits are checked before token ids are drawn; the token limit is lowered here only
so that the examples that pass are quick to draw.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from pathlib import Path
import tempfile
import tracemalloc

from hypothesis import HealthCheck, example, given, settings, strategies as st
import pytest
import yaml

from engine import limits
from engine.errors import InputError
from planner.cli import main as serveplan
from planner.workload import _TRACE_FIELDS, draw, get_workload, load_trace

MARKER = "SECRET-" + "y" * 300  # longer than any excerpt: it must never appear whole in a message
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MAX_MODEL_LEN = 4096


@pytest.fixture(autouse=True)
def small_token_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_WORKLOAD_TOKENS", 200_000)


def assert_clear(exc: InputError) -> None:
    message = str(exc)
    assert "\n" not in message and len(message) < 1000, message
    assert MARKER not in message


NUMBERS = (st.integers(-10, 10**8) | st.floats() | st.integers(-10**30, 10**30)
           | st.sampled_from([0, 1, -1, 1e-300, 1e-30, 1e300, 3e7, 1e7 + 1, 10_000_000, 2**63]))
ODD = st.none() | st.booleans() | st.text(max_size=8) | st.just(MARKER) | st.lists(st.integers(), max_size=3)
VALUES = NUMBERS | ODD


def kind(name: str, **fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """A `kind:` mapping with any of `fields`."""
    return st.fixed_dictionaries({"kind": st.just(name)}, optional=fields)


def full(name: str, **fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """A `kind:` mapping with all of `fields`."""
    return st.fixed_dictionaries({"kind": st.just(name), **fields})


LENGTHS = (
    NUMBERS
    | kind("fixed", tokens=NUMBERS)
    | kind("uniform", min_tokens=NUMBERS, max_tokens=NUMBERS)
    | kind("normal", mean_tokens=NUMBERS, std_tokens=NUMBERS, min_tokens=NUMBERS, max_tokens=NUMBERS)
    | kind("lognormal", median_tokens=NUMBERS, sigma=NUMBERS, max_tokens=NUMBERS)
    | kind("empirical", tokens=st.lists(NUMBERS, max_size=4), weights=st.lists(NUMBERS, max_size=4))
    | ODD
)
SEGMENTS = st.lists(st.fixed_dictionaries({"duration_s": NUMBERS, "rate_per_s": NUMBERS}), max_size=3)
ARRIVALS = (
    kind("poisson", rate_per_s=NUMBERS)
    | kind("gamma", rate_per_s=NUMBERS, cv=NUMBERS)
    | kind("constant", rate_per_s=NUMBERS)
    | kind("time_varying", segments=SEGMENTS)
    | kind("closed_loop", concurrency=NUMBERS, think_time_s=NUMBERS)
    | kind("bursty", rate_per_s=NUMBERS)
    | ODD
)
HOSTILE = {
    "arrival": ARRIVALS, "input_tokens": LENGTHS, "output_tokens": LENGTHS, "num_requests": VALUES,
    "shared_prefix": st.fixed_dictionaries({"num_prefixes": NUMBERS, "prefix_tokens": NUMBERS, "share": NUMBERS},
                                           optional={"popularity": st.sampled_from(["uniform", "zipf", "x"]),
                                                     "zipf_exponent": NUMBERS}) | ODD,
    "conversation": st.fixed_dictionaries({"max_turns": NUMBERS},
                                          optional={"min_turns": NUMBERS, "think_time_s": NUMBERS}) | ODD,
    "seed": VALUES, "name": VALUES, "first_token_id": VALUES, "vocab_size_tokens": VALUES, "extra_field": VALUES,
}
# Valid, including sizes that only the limits refuse (long prompts, many requests, rare arrivals).
TOKENS = st.integers(1, 3000) | st.sampled_from([4095, 10**6, 10**7])
VALID = st.fixed_dictionaries(
    {"arrival": full("poisson", rate_per_s=st.floats(1e-9, 1e6)) | full("closed_loop", concurrency=st.integers(1, 64))
                | full("time_varying", segments=st.lists(st.fixed_dictionaries(
                    {"duration_s": st.floats(1e-3, 1e7), "rate_per_s": st.floats(0, 100)}), min_size=1, max_size=3)
                    .filter(lambda segs: any(s["rate_per_s"] > 0 for s in segs))),
     "input_tokens": TOKENS | full("uniform", min_tokens=st.just(1), max_tokens=TOKENS),
     "output_tokens": TOKENS | full("lognormal", median_tokens=st.floats(1, 3000), sigma=st.floats(0, 5),
                                    max_tokens=TOKENS),
     "num_requests": st.integers(1, 300) | st.sampled_from([10**5, 10**6])},
    optional={
        "shared_prefix": st.fixed_dictionaries({"num_prefixes": st.integers(1, 100_000), "prefix_tokens": TOKENS,
                                                "share": st.floats(0, 1)}),
        "conversation": st.fixed_dictionaries({"max_turns": st.integers(1, 20)}),
        "seed": st.integers(0, 2**32),
    },
)


@st.composite
def workloads(draw_: st.DrawFn) -> dict:
    """A valid workload with zero to two fields replaced by hostile values."""
    spec = draw_(VALID)
    for field in draw_(st.lists(st.sampled_from(sorted(HOSTILE)), max_size=2, unique=True)):
        spec[field] = draw_(HOSTILE[field])
    return spec


WORKLOADS = workloads()


def write(folder: str, name: str, text: str) -> Path:
    path = Path(folder) / name
    path.write_text(text)
    return path


@SETTINGS
@given(spec=WORKLOADS)
# Found by this test: a million one-token requests, refused by the token limit only after 128 MiB
# of per-request Python lists had been built (the shared-prefix choices are now an array).
@example(spec={"arrival": {"kind": "poisson", "rate_per_s": 628231.0}, "input_tokens": 1, "output_tokens": 1,
               "num_requests": 10**6, "shared_prefix": {"num_prefixes": 2983, "prefix_tokens": 1, "share": 1.0}})
# And a gamma process whose CV squared underflows to 0: its shape 1 / cv^2 divided by zero (cv is now >= 0.001).
@example(spec={"arrival": {"kind": "gamma", "rate_per_s": 1, "cv": 3.706108064009416e-210}, "input_tokens": 1,
               "output_tokens": 1, "num_requests": 1})
def test_workload_files_load_and_draw_or_refuse_clearly(spec: dict) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = write(folder, "w.yaml", yaml.safe_dump(spec))
        tracemalloc.start()
        try:
            requests = draw(get_workload(str(path)), vocab_size=32_000, max_model_len=MAX_MODEL_LEN)
        except InputError as exc:
            assert_clear(exc)
        else:
            assert 1 <= len(requests) <= limits.MAX_REQUESTS
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    assert peak < 128 * 2**20


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(spec=WORKLOADS)
def test_workload_files_through_the_cli(spec: dict) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = write(folder, "w.yaml", yaml.safe_dump(spec))
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            # Three requests, so that a valid workload simulates in an instant.
            code = serveplan(["simulate", "--model", "llama-3.2-1b", "--workload", str(path), "--requests", "3",
                              "--max-model-len", str(MAX_MODEL_LEN), "--json"])
    assert code in (0, 2)
    if code == 2:
        lines = err.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith("serveplan: error: ") and MARKER not in lines[0], lines


# --------------------------------------------------------------------------- traces

GOOD_ROW = st.fixed_dictionaries(
    {"arrival_s": st.floats(0, 1000), "input_tokens": st.integers(1, 2000), "output_tokens": st.integers(1, 500)},
    optional={"prefix_id": st.sampled_from(["a", "b"]), "conversation_id": st.sampled_from(["c", "d"])},
)
ODD_ROW = st.dictionaries(st.sampled_from([*_TRACE_FIELDS, "extra", ""]), VALUES, max_size=6)
ROWS = st.lists(GOOD_ROW | ODD_ROW, min_size=0, max_size=8)


def check_trace(path: Path) -> None:
    try:
        requests = load_trace(path, max_model_len=MAX_MODEL_LEN)
    except InputError as exc:
        assert_clear(exc)
    else:
        assert requests and all(len(r.prompt_token_ids) + r.output_tokens <= MAX_MODEL_LEN for r in requests)


@SETTINGS
@given(rows=ROWS, junk=st.lists(st.sampled_from(["", "{", "[]", "null", "1", MARKER, "{}" * 3, "\ufeff{}"]), max_size=2))
def test_jsonl_traces(rows: list[dict], junk: list[str]) -> None:
    lines = [json.dumps(r) for r in rows] + junk
    with tempfile.TemporaryDirectory() as folder:
        check_trace(write(folder, "t.jsonl", "\n".join(lines) + "\n"))


CELLS = st.text(alphabet=st.sampled_from(list('0123456789.e-+,"\n abnfi')), max_size=8) | st.just(MARKER) | NUMBERS.map(str)


@SETTINGS
@given(header=st.lists(st.sampled_from([*_TRACE_FIELDS, "extra", ""]), min_size=0, max_size=6)
       | st.permutations(_TRACE_FIELDS[:3]).map(list),
       rows=st.lists(st.lists(CELLS, max_size=6), max_size=8), bom=st.booleans(), crlf=st.booleans())
def test_csv_traces(header: list[str], rows: list[list[str]], bom: bool, crlf: bool) -> None:
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n" if crlf else "\n").writerows([header, *rows])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.csv"
        path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + out.getvalue().encode())
        check_trace(path)
