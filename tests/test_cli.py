"""The serveplan command: readable answers, JSON for scripts, short errors without tracebacks."""

import json

import pytest

from planner.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_memory_issue_example(capsys) -> None:
    code, out, _ = run(
        capsys, "memory", "--model", "llama-3.1-70b", "--hw", "h100-sxm", "--tp", "4",
        "--weight-dtype", "fp8", "--kv-dtype", "fp8", "--context", "8192",
    )
    assert code == 0
    assert "KV cache" in out and "fits:" in out and "Assumptions" in out


def test_memory_json(capsys) -> None:
    code, out, _ = run(capsys, "memory", "--model", "llama-3.1-8b", "--json")
    data = json.loads(out)
    assert code == 0 and data["kv_bytes_per_token_model"] == 131_072 and data["fits"]


def test_does_not_fit_exits_one_with_the_answer(capsys) -> None:
    code, out, _ = run(capsys, "memory", "--model", "llama-3.1-405b", "--hw", "l4")
    assert code == 1 and "does not fit: needs" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["memory", "--model", "llama-3.1-8bb"], "did you mean llama-3.1-8b"),
        (["memory", "--hw", "h100"], "did you mean"),
        (["memory", "--tp", "0"], "--tp='0' is invalid"),
        (["memory", "--tp", "3"], "--tp=3 is invalid: must divide the 32 attention heads"),
        (["memory", "--context", "-5"], "--context='-5' is invalid"),
        (["memory", "--block-size", "0"], "--block-size='0' is invalid"),
        (["memory", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization='1.5' is invalid"),
        (["hw", "show", "nonesuch"], "hardware='nonesuch' is invalid"),
        (["engine", "generate", "--temperature", "-1", "hi"], "is invalid: must be >= 0"),
        (["engine", "generate", "--model", "nonesuch-7b", "hi"], "--model='nonesuch-7b' is invalid"),
    ],
)
def test_bad_input_is_one_line_without_traceback(capsys, argv: list[str], message: str) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_malformed_profile_file(capsys, tmp_path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("name: [\n")
    code, _, err = run(capsys, "memory", "--hw", str(path))
    assert code == 2 and "malformed YAML" in err


def test_catalog_listings(capsys) -> None:
    code, out, _ = run(capsys, "hw", "list", "--json")
    assert code == 0 and len(json.loads(out)) >= 24
    code, out, _ = run(capsys, "models", "list", "--json")
    assert code == 0 and len(json.loads(out)) >= 20
    code, out, _ = run(capsys, "hw", "show", "h100-pcie")
    assert code == 0 and "sparse" in out


def test_schema_export(capsys, tmp_path) -> None:
    code, out, _ = run(capsys, "schema", "--out", str(tmp_path))
    assert code == 0
    schema = json.loads((tmp_path / "HardwareProfile.schema.json").read_text())
    assert "memory_bandwidth_gb_s" in schema["properties"]
