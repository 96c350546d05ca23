"""Fuzz the file readers: arbitrary bytes, YAML anchor graphs, JSON documents and hardware profiles.

Every reader either loads the file or raises one InputError: never another exception, never a
multi-line or long message, never the file's contents. Time and memory are bounded by the limits
in engine/limits.py, not by the fuzzer: examples are capped only to keep the suite short.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import io
import json
from pathlib import Path
import tempfile
import tracemalloc

from hypothesis import HealthCheck, given, settings, strategies as st
import yaml

from engine.config import ModelConfig
from engine.errors import InputError
from engine.files import load_json, load_yaml
from planner.calibrate import load_calibration
from planner.cli import main as serveplan
from planner.hardware import get_hardware, load_profile_file
from planner.workload import get_workload, load_trace

MARKER = "SECRET-" + "x" * 300  # longer than any excerpt: it must never appear whole in a message
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

READERS: dict[str, Callable[[Path], object]] = {
    ".yaml": lambda p: get_workload(str(p)),
    ".yml": load_profile_file,
    ".json": ModelConfig.from_json_file,
    ".cal.json": load_calibration,
    ".jsonl": load_trace,
    ".csv": load_trace,
}


def check(read: Callable[[Path], object], content: bytes | str, suffix: str) -> str | None:
    """Read `content` from a file; the InputError's message, or None when it loaded."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"fuzz{suffix}"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        try:
            read(path)
        except InputError as exc:
            message = str(exc)
            assert "\n" not in message and len(message) < 1000, message
            assert MARKER not in message
            return message
    return None


@SETTINGS
@given(content=st.binary(max_size=512), suffix=st.sampled_from(sorted(READERS)))
def test_arbitrary_bytes(content: bytes, suffix: str) -> None:
    check(READERS[suffix], content, suffix)


@SETTINGS
@given(content=st.lists(st.sampled_from([*"ab:-[]{}&*!|>'\"#%@`,? \n\t0.\ufeff\x00", MARKER]), max_size=200).map("".join),
       suffix=st.sampled_from([".yaml", ".yml"]))
def test_yaml_punctuation(content: str, suffix: str) -> None:
    check(READERS[suffix], content, suffix)


@st.composite
def anchor_graphs(draw: st.DrawFn) -> str:
    """YAML where each level is an anchored list of aliases to earlier levels: from harmless
    reuse to bombs that expand to billions of nodes."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * draw(st.integers(1, 9)))}]"]
    for level in range(1, draw(st.integers(1, 12))):
        refs = draw(st.lists(st.integers(0, level - 1), min_size=1, max_size=9))
        lines.append(f"l{level}: &l{level} [{', '.join(f'*l{r}' for r in refs)}]")
    return "\n".join(lines) + "\n"


@SETTINGS
@given(text=anchor_graphs())
def test_yaml_anchor_graphs_load_only_within_the_node_budget(text: str) -> None:
    tracemalloc.start()
    try:
        message = check(lambda p: load_yaml(p, "fuzz"), text, ".yaml")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message is None or "MAX_YAML_NODES" in message
    assert peak < 64 * 2**20


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10) | st.just(MARKER),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)


@SETTINGS
@given(document=JSON_VALUES, depth=st.integers(0, 200))
def test_json_documents(document: object, depth: int) -> None:
    text = "[" * depth + json.dumps(document) + "]" * depth
    message = check(lambda p: load_json(p, "fuzz"), text, ".json")
    assert message is None or "MAX_NESTING_DEPTH" in message or depth == 0
    check(ModelConfig.from_json_file, text, ".json")
    check(load_calibration, text, ".json")


# --------------------------------------------------------------------------- hardware profiles

BASE_PROFILE = get_hardware("h100-sxm").model_dump(mode="json", exclude_none=True)
ODD_VALUES = (st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats() | st.text(max_size=12)
              | st.sampled_from([0, -1, 1e-300, 1e300, "abc", MARKER, [], {}, [1, 2], {"a": 1}]))


@st.composite
def profiles(draw: st.DrawFn) -> dict:
    """h100-sxm with a few fields, possibly nested ones, replaced by odd values or dropped."""
    data = json.loads(json.dumps(BASE_PROFILE))
    for _ in range(draw(st.integers(1, 4))):
        node, key = data, draw(st.sampled_from(sorted(data)))
        while isinstance(node[key], dict) and node[key] and draw(st.booleans()):
            node, key = node[key], draw(st.sampled_from(sorted(node[key])))
        if draw(st.integers(0, 5)) == 0:
            del node[key]
        else:
            node[key] = draw(ODD_VALUES)
    if draw(st.booleans()):
        data[draw(st.text(min_size=1, max_size=8))] = draw(ODD_VALUES)
    return data


@SETTINGS
@given(profile=profiles())
def test_hardware_profiles(profile: dict) -> None:
    check(load_profile_file, yaml.safe_dump(profile), ".yaml")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles())
def test_hardware_profiles_through_the_cli(profile: dict) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hw.yaml"
        path.write_text(yaml.safe_dump(profile))
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = serveplan(["hw", "show", str(path)])
    assert code in (0, 2)
    if code == 2:
        lines = err.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith("serveplan: error: ") and MARKER not in lines[0], lines
