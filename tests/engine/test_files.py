"""Every reader of a user's file refuses what is not a small UTF-8 regular file, refuses YAML alias
bombs and over-deep JSON, and never echoes the file back."""

from __future__ import annotations

from collections.abc import Callable
import os
from pathlib import Path
import threading
import tracemalloc

import pytest
import yaml

from engine import limits
from engine.config import ModelConfig
from engine.errors import EXCERPT_CHARS, InputError
from engine.files import load_json, load_yaml, read_text
from planner.calibrate import load_calibration
from planner.compare import load_side
from planner.hardware import load_profile_file
from planner.workload import get_workload, load_trace

SECRET = "hunter2-do-not-echo"

# (reader, the file suffix it takes): every place ServePlan reads a file a user names.
READERS: dict[str, tuple[Callable[[Path], object], str]] = {
    "workload-yaml": (lambda p: get_workload(str(p)), ".yaml"),
    "workload-json": (lambda p: get_workload(str(p)), ".json"),
    "hardware": (load_profile_file, ".yaml"),
    "compare": (lambda p: load_side(p, "llama-3.1-8b", "chat", {}, None), ".yaml"),
    "config.json": (ModelConfig.from_json_file, ".json"),
    "calibration": (load_calibration, ".json"),
    "trace-jsonl": (load_trace, ".jsonl"),
    "trace-csv": (load_trace, ".csv"),
}
YAML_READERS = [name for name, (_, suffix) in READERS.items() if suffix == ".yaml"]
JSON_READERS = [name for name, (_, suffix) in READERS.items() if suffix == ".json"]


def refused(name: str, path: Path, match: str) -> str:
    read, _ = READERS[name]
    with pytest.raises(InputError, match=match) as exc:
        read(path)
    message = str(exc.value)
    assert str(path) in message or path.name in message, message
    assert SECRET not in message
    assert len(message) < 600, message
    return message


# --------------------------------------------------------------------------- not a regular file


@pytest.mark.parametrize("name", READERS)
def test_a_directory_is_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"folder{READERS[name][1]}"
    path.mkdir()
    if name == "config.json":  # a folder means "the config.json inside it": make that one a folder
        (path / "config.json").mkdir()
    refused(name, path, "is a directory")


@pytest.mark.parametrize("name", READERS)
def test_a_symlink_to_dev_zero_is_refused_without_reading(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"zero{READERS[name][1]}"
    path.symlink_to("/dev/zero")
    refused(name, path, "not a regular file")


@pytest.mark.parametrize("name", READERS)
def test_a_fifo_is_refused_without_blocking(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"pipe{READERS[name][1]}"
    os.mkfifo(path)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            READERS[name][0](path)
        except BaseException as exc:  # noqa: BLE001 (handed to the test thread)
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)  # not a speed bound: a reader that opens the FIFO blocks forever
    if reader.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer that leaves at once: EOF unblocks it
        reader.join()
        pytest.fail("the reader blocked on a FIFO")
    assert outcome and isinstance(outcome[0], InputError), outcome
    assert "not a regular file" in str(outcome[0])


@pytest.mark.parametrize("name", READERS)
def test_a_missing_file_is_named(tmp_path: Path, name: str) -> None:
    refused(name, tmp_path / f"missing{READERS[name][1]}", "no such file")


# --------------------------------------------------------------------------- contents


@pytest.mark.parametrize("name", READERS)
def test_binary_content_is_not_utf8_text(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"binary{READERS[name][1]}"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" + SECRET.encode())
    refused(name, path, "not UTF-8 text")


@pytest.mark.parametrize("name", READERS)
def test_a_file_over_the_size_limit_is_refused_before_reading(tmp_path: Path, name: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for limit in ("MAX_YAML_BYTES", "MAX_JSON_BYTES", "MAX_CONFIG_BYTES", "MAX_TRACE_BYTES"):
        monkeypatch.setattr(limits, limit, 64)
    path = tmp_path / f"big{READERS[name][1]}"
    path.write_text("# " + SECRET * 10 + "\n")
    message = refused(name, path, "exceeds the limit MAX_")
    assert "bytes" in message


@pytest.mark.parametrize("name", YAML_READERS)
def test_a_yaml_alias_bomb_is_refused_while_composing(tmp_path: Path, name: str) -> None:
    # 9 levels of nine aliases each: ~0.4 kB that expands to 9^9 (387 million) strings.
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp_path / f"bomb{READERS[name][1]}"
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size < 600
    tracemalloc.start()
    try:
        refused(name, path, "MAX_YAML_NODES")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20  # the expanded document would be gigabytes


def test_merge_keys_and_long_scalars_count_towards_the_node_budget(tmp_path: Path) -> None:
    long = "x" * 100_000
    path = tmp_path / "merge.yaml"
    path.write_text(f"a: &a {{k: {long}}}\n" + "".join(f"b{i}: {{<<: *a}}\n" for i in range(300)))
    with pytest.raises(InputError, match="MAX_YAML_NODES"):
        load_yaml(path, "workload")


def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text("a: &a [1, *a]\n")
    with pytest.raises(InputError, match="refers to a node that contains it"):
        load_yaml(path, "workload")


@pytest.mark.parametrize("name", YAML_READERS)
def test_deep_yaml_is_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"deep{READERS[name][1]}"
    path.write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")
    refused(name, path, "MAX_NESTING_DEPTH")


@pytest.mark.parametrize("name", JSON_READERS)
def test_deep_json_is_refused_not_a_recursion_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"deep{READERS[name][1]}"
    path.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(name, path, "MAX_NESTING_DEPTH")


def test_json_within_the_depth_limit_loads(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    depth = limits.MAX_NESTING_DEPTH
    path.write_text("[" * depth + "]" * depth)
    assert load_json(path, "x") is not None
    path.write_text("[" * (depth + 1) + "]" * (depth + 1))
    with pytest.raises(InputError, match="MAX_NESTING_DEPTH"):
        load_json(path, "x")


@pytest.mark.parametrize("suffix, text", [
    (".yaml", f"a: {'9' * 5000}\n"),  # int() refuses more than 4,300 digits
    (".json", f'{{"a": {"9" * 5000}}}'),
])
def test_a_number_too_long_to_convert_is_an_input_error(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"long{suffix}"
    path.write_text(text)
    with pytest.raises(InputError, match="too long|cannot convert"):
        (load_yaml if suffix == ".yaml" else load_json)(path, "x")


@pytest.mark.parametrize("name", YAML_READERS)
def test_a_yaml_syntax_error_does_not_quote_the_line(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"bad{READERS[name][1]}"
    path.write_text(f"root: {SECRET}\n  nested: [unclosed: {SECRET}\n")
    refused(name, path, "malformed YAML.*line 2")


@pytest.mark.parametrize("name", READERS)
def test_a_text_file_of_another_kind_is_refused_without_echoing_it(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"passwd{READERS[name][1]}"
    path.write_text("\n".join(f"user{i}:x:{i}:{i}:{SECRET}:/home/user{i}:/bin/sh" for i in range(50)) + "\n")
    with pytest.raises(InputError) as exc:
        READERS[name][0](path)
    message = str(exc.value)
    assert SECRET not in message and "/home/user" not in message and len(message) < 600, message


def test_a_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbfa: 1\n")
    assert read_text(path, "x", "MAX_YAML_BYTES") == "a: 1\n"
    assert load_yaml(path, "x") == {"a": 1}


def test_an_alias_bomb_through_the_cli_is_one_short_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    lines += ["arrival: *a8", "input_tokens: *a8", "output_tokens: 1", "num_requests: 1"]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    assert main(["simulate", "--workload", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and len(err) < 400 and "MAX_YAML_NODES" in err, err[:400]


def test_an_error_shows_only_a_short_excerpt_of_any_value() -> None:
    bomb: list = ["lol"] * 9
    for _ in range(30):
        bomb = [bomb] * 9  # 9^31 strings if its repr were built whole
    for value in (bomb, "x" * 10**6, {"k": "v" * 10**6, "j": list(range(10**5))}, 10**5000, b"\x00" * 10**6):
        message = str(InputError("field", value, "not allowed"))
        assert len(message) <= len("field= is invalid: not allowed") + EXCERPT_CHARS, message


def test_a_key_the_user_wrote_is_shown_on_one_short_line(tmp_path: Path) -> None:
    for key in ("\n", "x" * 5000, "a\rb"):
        path = tmp_path / "hw.yaml"
        path.write_text(yaml.safe_dump({"name": "x", key: 1}))
        with pytest.raises(InputError) as exc:
            load_profile_file(path)
        assert "\n" not in str(exc.value) and "\r" not in str(exc.value) and len(str(exc.value)) < 400
    with pytest.raises(InputError) as exc:
        raise InputError("a\nfile name:\n12: field", 1, "bad")
    assert "\n" not in str(exc.value)
