"""Fuzzing the `serveplan` command line (issue 14): argument vectors for memory, simulate, plan,
compare, hw and models, drawn from each flag's valid values, its bounds and a pool of hostile
ones (non-numbers, infinities, huge and negative numbers, paths to a secret file, a folder, a
device). Every answer is either an answer (exit 0, or 1 for memory's "does not fit") or one line
on stderr with exit 2: never a traceback, never the secret file's contents, never a hang or a
memory blow-up (each invocation runs in a forked child under a cap, tests/fuzz/conftest.py).

Examples are few and derandomized, and sizes stay small (a handful of requests), so the suite
runs in a couple of minutes and the same examples run every time.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st
import pytest

from .harness import SECRET, Outcome, assert_clean_refusal, run_cli

FUZZ = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

NUMBERS = ["0", "-1", "1e-30", "1e300", "inf", "-inf", "nan", "abc", "", "9" * 40, "0x10", "1.5", " 3", "true"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Hostile paths: a passwd-like file with a secret mid-way, a folder named like a YAML file,
    a binary file, /dev/null, and files that do not exist."""
    root = tmp_path_factory.mktemp("paths")
    passwd = root / "passwd.yaml"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n" * 10 + f"{SECRET}:x:1000\n" + "daemon:x:1:1\n" * 10)
    folder = root / "folder.yaml"
    folder.mkdir()
    binary = root / "binary.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    return {"passwd": str(passwd), "folder": str(folder), "binary": str(binary),
            "null": "/dev/null", "missing": str(root / "missing.yaml"), "dotdot": "../../../../etc/passwd.yaml"}


def hostile(paths: dict[str, str]) -> st.SearchStrategy[str]:
    return st.sampled_from([*NUMBERS, *paths.values()])


def flag_values(valid: list[str], paths: dict[str, str]) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(valid), hostile(paths))


def argv_of(flags: dict[str, st.SearchStrategy[str]], switches: list[str]) -> st.SearchStrategy[list[str]]:
    """A few of `flags` with drawn values and a few boolean `switches`, in a drawn order."""
    pairs = st.dictionaries(st.sampled_from(sorted(flags)), st.just(None), max_size=4).flatmap(
        lambda chosen: st.tuples(*(st.tuples(st.just(f), flags[f]) for f in chosen)) if chosen else st.just(()))
    chosen_switches = st.lists(st.sampled_from(switches), max_size=2, unique=True) if switches else st.just([])
    return st.tuples(pairs, chosen_switches).map(
        lambda t: [x for pair in t[0] for x in pair] + t[1])


def check(outcome: Outcome, answer_codes: tuple[int, ...] = (0,)) -> None:
    if outcome.code == 2:
        assert_clean_refusal(outcome)
    else:
        assert outcome.code in answer_codes and outcome.out.strip(), outcome
        assert "Traceback" not in outcome.err and SECRET not in outcome.out + outcome.err, outcome


def deployment_flags(paths: dict[str, str]) -> dict[str, st.SearchStrategy[str]]:
    v = lambda *valid: flag_values(list(valid), paths)  # noqa: E731
    return {
        "--model": v("llama-3.2-1b", "llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v3", "nonesuch"),
        "--hw": v("h100-sxm", "l4", "H100-SXM", "m4-max"),
        "--tp": v("1", "2", "3", "8", "1024", "1025"),
        "--pp": v("1", "2", "200"),
        "--ep": v("1", "2"),
        "--replicas": v("1", "2", "100001"),
        "--weight-dtype": v("bf16", "fp8", "int4", "fp64"),
        "--kv-dtype": v("bf16", "fp8", "int4"),
        "--block-size": v("16", "32", "1025"),
        "--max-num-batched-tokens": v("2048", "8192", "1048577"),
        "--max-num-seqs": v("16", "256", "65537"),
        "--gpu-memory-utilization": v("0.9", "0.5", "1", "1.01"),
        "--policy": v("fcfs", "priority", "lifo"),
        "--max-graph-batch-size": v("8", "512", "4097"),
    }


SWITCHES = ["--no-prefix-caching", "--no-chunked-prefill", "--enforce-eager", "--json"]


@FUZZ
@given(data=st.data())
def test_memory(data: st.DataObject, paths: dict[str, str]) -> None:
    flags = {**deployment_flags(paths), "--context": flag_values(["1", "8192", "131072", "16777217"], paths)}
    argv = ["memory", *data.draw(argv_of(flags, SWITCHES))]
    check(run_cli(argv), answer_codes=(0, 1))


@FUZZ
@given(data=st.data())
def test_simulate(data: st.DataObject, paths: dict[str, str]) -> None:
    v = lambda *valid: flag_values(list(valid), paths)  # noqa: E731
    flags = {**deployment_flags(paths),
             "--workload": v("chat", "rag", "chatt"),
             "--rate": v("2", "0.001", "1000000", "0.0009"),
             "--concurrency": v("1", "4", "1000001"),
             "--requests": v("1", "8"),
             "--seed": v("0", "7", "4294967296"),
             "--input-tokens": v("1", "100"),
             "--output-tokens": v("1", "50"),
             "--slo": v("ttft_p99_ms<=500", "ttft_p99_ms<=500,ttft_p99_ms<=5", ",,,", "goodput_share>=2", "x<=1"),
             "--router": v("round_robin", "least_loaded"),
             "--max-model-len": v("4096", "1")}
    argv = ["simulate", "--model", "llama-3.2-1b", "--requests", "8", *data.draw(argv_of(flags, SWITCHES))]
    check(run_cli(argv))


@settings(FUZZ, max_examples=4)
@given(data=st.data())
def test_plan(data: st.DataObject, paths: dict[str, str]) -> None:
    v = lambda *valid: flag_values(list(valid), paths)  # noqa: E731
    flags = {"--rate": v("2", "1e-30"), "--slo": v("ttft_p99_ms<=2000", ",,,"), "--hw": v("l4", "l4,l40s", "m4-max"),
             "--max-gpus": v("1", "0"), "--budget-usd-per-hour": v("100", "1e10"), "--headroom": v("0.1", "101"),
             "--weight-dtypes": v("bf16", "int3"), "--kv-dtypes": v("bf16", "int4"), "--workload": v("chat", "chatt"),
             "--seed": v("3", "-3")}
    base = {"--model": "llama-3.2-1b", "--rate": "2", "--slo": "ttft_p99_ms<=2000", "--hw": "l4", "--max-gpus": "1",
            "--weight-dtypes": "bf16", "--kv-dtypes": "bf16"}
    drawn = data.draw(argv_of(flags, []))
    given_flags = dict(zip(drawn[::2], drawn[1::2], strict=True))
    argv = ["plan", *(x for k, val in {**base, **given_flags}.items() for x in (k, val)),
            "--requests-per-probe", "20", "--executor", "serial", "--no-cache", "--json"]
    check(run_cli(argv))


@settings(FUZZ, max_examples=6)
@given(data=st.data())
def test_compare(data: st.DataObject, paths: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("compare")
    good = root / "a.yaml"
    good.write_text("hardware: l4\nmodel: llama-3.2-1b\n")
    bad = root / "b.yaml"
    bad.write_text("hardware: l4\ntensor_parallel: abc\n")
    files = st.sampled_from([str(good), str(bad), *paths.values()])
    a, b = data.draw(files), data.draw(files)
    extra = data.draw(argv_of({"--rate": flag_values(["2"], paths), "--seed": flag_values(["1"], paths)}, ["--json"]))
    check(run_cli(["compare", a, b, "--requests", "8", *extra]))


@settings(FUZZ, max_examples=8)
@given(name=st.one_of(st.sampled_from(["h100-sxm", "l4", "mi300x", "h100"]), st.text(max_size=30)))
def test_hw_show(name: str, paths: dict[str, str]) -> None:
    if name.startswith("-"):
        name = "x" + name  # a leading dash is a flag to argparse, not a name
    check(run_cli(["hw", "show", name, "--json"]))


@settings(FUZZ, max_examples=8)
@given(data=st.data())
def test_models_show(data: st.DataObject, paths: dict[str, str]) -> None:
    name = data.draw(st.sampled_from(["llama-3.1-8b", "deepseek-v3", "gpt-oss-20b", "nonesuch", "", "x" * 300,
                                      *paths.values()]))
    check(run_cli(["models", "show", name]))


@pytest.mark.parametrize("argv", [["memory", "--hw", "{secret}"], ["simulate", "--workload", "{secret}"],
                                  ["compare", "{secret}", "{secret}"]], ids=["hw", "workload", "compare"])
def test_a_malformed_yaml_file_is_not_quoted_back(argv: list[str], secret_file: Path) -> None:
    assert_clean_refusal(run_cli([a.format(secret=secret_file) for a in argv]))


def test_listings_still_answer() -> None:
    for argv in (["hw", "list", "--json"], ["models", "list", "--json"]):
        check(run_cli(argv))


def test_valid_commands_are_still_answered() -> None:
    """The other half of the contract: ordinary inputs get ordinary answers."""
    assert run_cli(["memory", "--model", "llama-3.1-70b", "--hw", "h100-sxm", "--tp", "4", "--weight-dtype", "fp8",
                    "--kv-dtype", "fp8", "--json"]).code == 0
    outcome = run_cli(["simulate", "--model", "llama-3.2-1b", "--rate", "2", "--requests", "8", "--slo",
                       "ttft_p99_ms<=500", "--json"])
    assert outcome.code == 0 and '"num_finished": 8' in outcome.out, outcome
