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
    assert data["engine"] == "vllm-0.11" and all(line["rule"] and line["source"] for line in data["lines"])


@pytest.mark.parametrize(("engine", "rule", "outside"),
                         [("vllm-0.11", "gpu_memory_utilization 0.9 x 79.18 GiB reported", True),
                          ("sglang-0.5", "mem_fraction_static", True),
                          ("trtllm-1.2", "free_gpu_memory_fraction 0.9", False)])  # its peak includes everything
def test_memory_breakdown_by_engine_names_each_rule_and_source(capsys, engine: str, rule: str, outside: bool) -> None:
    code, out, _ = run(capsys, "memory", "--model", "llama-3.1-8b", "--engine", engine)
    assert code == 0 and f"with {engine}" in out and rule in out and "github.com" in out
    assert ("outside the budget" in out) == outside


def test_validate_needs_a_calibration_or_memory(capsys) -> None:
    code, _, err = run(capsys, "validate")
    assert code == 2 and "--calibration is required" in err and "--public or --memory" in err


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


# --------------------------------------------------------------------------- issue 14, defects 8 and 11
# One top-level handler: whatever the input, one line on stderr and exit 2 (130 for Ctrl-C), no
# traceback and nothing of a file's contents. Each case raised a traceback or was accepted with
# an absurd answer before.


def one_line_error(capsys, *argv: str) -> str:
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    assert err.startswith("serveplan: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_files_that_cannot_be_read_are_one_line_naming_the_file(capsys, tmp_path, monkeypatch) -> None:
    # Named as typed, relative: a long absolute path would show as an excerpt (its middle cut).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "profile.yaml").mkdir()
    assert "--hw='profile.yaml' is invalid" in one_line_error(capsys, "memory", "--hw", "profile.yaml")
    binary = tmp_path / "w.yaml"
    binary.write_bytes(b"\xff\xfe\xfa" * 100)
    assert "not utf-8 text" in one_line_error(capsys, "simulate", "--workload", str(binary), "--requests", "5").lower()
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    line = one_line_error(capsys, "models", "show", str(deep))
    assert "model=" in line and "deep.json" in line and "MAX_NESTING_DEPTH" in line


def test_a_path_too_long_for_the_os_is_named_by_an_excerpt(capsys) -> None:
    """The OS refuses a 5,000-character name (ENAMETOOLONG); the line shows an excerpt of it, not all
    of it (found by bench/hostile_inputs.py)."""
    err = one_line_error(capsys, "simulate", "--model", "x" * 5000)
    assert "File name too long" in err and len(err) < 200


def test_ctrl_c_is_interrupted_exit_130_without_traceback(capsys, monkeypatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("planner.cli.simulate", interrupted)
    code, _, err = run(capsys, "simulate", "--requests", "5")
    assert code == 130 and err == "serveplan: interrupted\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--rate", "1", "--slo", "ttft_p99_ms<=500", "--headroom", "inf"], "--headroom='inf' is invalid"),
        (["plan", "--rate", "1", "--slo", "ttft_p99_ms<=500", "--budget-usd-per-hour", "nan"],
         "--budget-usd-per-hour='nan' is invalid"),
        (["simulate", "--rate", "1e-30"], "--rate='1e-30' is invalid: must be a finite number in 0.001..1e+06 (requests/s)"),
        (["simulate", "--slo", ",,,"], "--slo=',,,' is invalid: needs at least one target"),
        (["simulate", "--slo", "ttft_p99_ms<=500,ttft_p99_ms<=900"], "ttft_p99_ms is given twice"),
        (["simulate", "--slo", "ttft_p99_ms<=inf"],
         "--slo='ttft_p99_ms<=inf' is invalid: ttft_p99_ms must be a number in 0.01..3,600,000 ms"),
        (["simulate", "--slo", "ttft_p99_ms<=1e300"], "ttft_p99_ms must be a number in 0.01..3,600,000 ms"),
        (["simulate", "--slo", "ttft_p99_ms<=500,tpot_p50_ms<=nan"],
         "--slo='tpot_p50_ms<=nan' is invalid: tpot_p50_ms must be a number in 0.01..60,000 ms"),
        (["simulate", "--slo", "itl_p99_ms<=-5"], "--slo='itl_p99_ms<=-5' is invalid: itl_p99_ms must be a number in 0.01"),
        (["simulate", "--slo", "e2e_p99_ms<=1e-300"], "e2e_p99_ms must be a number in 0.01..86,400,000 ms"),
        (["plan", "--rate", "1", "--slo", "ttft_p99_ms<=500,goodput_share>=0"],
         "--slo='goodput_share>=0' is invalid: goodput_share must be a share in (0, 1]"),
        (["simulate", "--requests", "0"], "--requests='0' is invalid: must be an integer >= 1"),
        (["simulate", "--rate", "2", "--concurrency", "4"], "--concurrency=4 is invalid: not together with an arrival rate"),
        (["simulate", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["memory", "--kv-dtype", "int4"], "--kv-dtype='int4' is invalid: must be one of fp32, bf16, fp16, fp8, int8"),
        (["memory", "--tp", "9" * 500], "is invalid: must be an integer in 1..1024"),
        (["engine", "generate", "--threads", "0", "hi"], "--threads='0' is invalid"),
        (["engine", "bench", "--num-kv-blocks", "-1"], "--num-kv-blocks='-1' is invalid"),
        (["calibrate", "--dtype", "float64"], "--dtype='float64' is invalid: must be one of float32, bfloat16, float16"),
    ],
)
def test_absurd_values_are_refused_with_the_allowed_range(capsys, argv: list[str], message: str) -> None:
    err = one_line_error(capsys, *argv)
    assert message in err
    assert len(err) < 400  # a value is shown as a short excerpt, never whole


def test_schema_out_at_an_existing_file_is_refused(capsys, tmp_path) -> None:
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    assert "exists and is not a folder" in one_line_error(capsys, "schema", "--out", str(existing))
    assert existing.read_text() == "keep me"


def test_cuda_without_cuda_is_refused(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without CUDA, wherever it runs
    assert "--device='cuda' is invalid: no CUDA device" in one_line_error(
        capsys, "engine", "generate", "--device", "cuda", "--random-weights", "hi")


def test_model_configs_with_absurd_values_are_refused(capsys, tiny_model) -> None:
    for changes, field in (({"num_attention_heads": 0}, "num_attention_heads"),
                           ({"num_key_value_heads": 0}, "num_key_value_heads"),
                           ({"intermediate_size": -1}, "intermediate_size"),
                           ({"hidden_size": "64"}, "hidden_size")):
        err = one_line_error(capsys, "models", "show", str(tiny_model(**changes)))
        assert f"{field}=" in err


def test_flags_users_already_type_keep_working(capsys) -> None:
    code, out, _ = run(capsys, "memory", "--no-prefix-caching", "--no-chunked-prefill", "--enforce-eager",
                       "--max-num-batched-tokens", "131072", "--json")
    data = json.loads(out)
    assert code == 0 and data["max_num_seqs"] == 1024  # vLLM 0.11's default on an H100


def test_engines_catalog_lists_and_shows_profiles(capsys) -> None:
    assert main(["engines", "list", "--json"]) == 0
    names = [p["name"] for p in json.loads(capsys.readouterr().out)]
    assert {"vllm-0.11", "sglang-0.5", "trtllm-1.2", "serveplan"} <= set(names)
    assert main(["engines", "show", "vllm-0.11", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "vllm"
    assert main(["engines", "show", "vllm-9"]) == 2
    err = capsys.readouterr().err
    assert "engine='vllm-9' is invalid: unknown name" in err and err.count("\n") == 1


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the command ran with a flag its mode does not read")


@pytest.mark.parametrize(("argv", "message"), [
    (["calibrate", "--public", "--tp", "2"], "--tp does not apply to --public; calibrate reads it with a CPU "
                                             "calibration (without --public) or --from-bench"),
    (["calibrate", "--public", "--ep", "2"], "--ep does not apply to --public"),
    (["calibrate", "--from-bench", "run.json", "--hw", "h100-sxm", "--threads", "2"],
     "--threads does not apply to --from-bench; calibrate reads it with a CPU calibration (without --public) only"),
    (["validate", "--memory", "--workers", "2"], "--workers does not apply to --memory; validate reads it with --public"),
    (["validate", "--memory", "--calibration", "cal.json"],
     "--calibration does not apply to --memory; validate reads it with a CPU calibration (without --public) or --public"),
])
def test_a_flag_the_mode_does_not_read_is_refused(capsys, monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                  message: str) -> None:
    for target in ("planner.calibrate.calibrate", "planner.cli.validate_startup_logs"):
        monkeypatch.setattr(target, _must_not_run)
    assert message in one_line_error(capsys, *argv)


def test_validate_still_reads_tensor_parallel(capsys) -> None:
    """--tp is validate's (it runs the engine on that many ranks): past the mode check to the next question."""
    assert "--calibration is required" in one_line_error(capsys, "validate", "--tp", "2")


# --------------------------------------------------------------------------- plan --traffic (issue 17)


def test_plan_traffic_refusals_are_one_line_before_any_search(capsys, tmp_path) -> None:
    day = tmp_path / "day.yaml"
    day.write_text("rate: {kind: hourly, rates_per_s: [1, 2]}\nworkload: chat\n")
    slo = ("--slo", "ttft_p99_ms<=1000")
    assert "rate=None is invalid: required" in one_line_error(capsys, "plan", *slo)
    assert "not with --traffic" in one_line_error(capsys, "plan", "--traffic", str(day), "--rate", "3", *slo)
    assert "not with --traffic" in one_line_error(capsys, "plan", "--traffic", str(day), "--workload", "rag", *slo)
    assert "colocated" in one_line_error(capsys, "plan", "--traffic", str(day), "--pd-ratios", "1:1", *slo)
    day.write_text("rate: {kind: diurnal, peak_rate_per_s: 2, trough_rate_per_s: 3}\nworkload: chat\n")
    err = one_line_error(capsys, "plan", "--traffic", str(day), *slo)
    assert "rate.diurnal.trough_rate_per_s=3.0 is invalid" in err and "workload" not in err  # no file echoed
