"""`serveplan calibrate --from-bench` on runs of our own server: the fit file is written, every
figure of every run gets a held-out prediction (fitted on the other runs), and `simulate
--calibration` prices with the fitted figures. How close the held-out predictions come is measured
by bench/calibrate_from_bench.py (docs/serving.md), not asserted here: it depends on the machine.
Bad input gets one line naming what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
import dataclasses
import json
from pathlib import Path

import pytest

from engine.catalog import resolve_model
from engine.knobs import read_flags
from engine.llm import LLM
from planner.bench_fit import BENCH_ENGINE_PARAMS, BenchFit, bench_replay, calibrate_from_bench, fitted_engine_params, in_process_run, load_bench
from planner.cli import build_parser, deployment_from_args, main, replay_from_args
from planner.costmodel import CostParams
from planner.costmodel.fitted import load_fitted_model
from planner.endpoint_bench import BenchReport, BenchRun, ClientSemantics, RequestRecord, bench_endpoint, report
from planner.engines import get_engine
from planner.hardware import get_hardware
from planner.playback import Replay, request_lengths
from planner.sim import simulate
from planner.workload import ClosedLoopArrivals, Conversation, FixedLength, PoissonArrivals, Workload

from .helpers import running_server

VOCAB = 256
HW, ENGINE = "cpu-amd-epyc-1t", "serveplan"
KNOB_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--block-size", "4"]


def workload(**changes: object) -> Workload:
    base = dict(name="tiny", arrival=ClosedLoopArrivals(concurrency=1), input_tokens=FixedLength(tokens=16),
                output_tokens=FixedLength(tokens=6), num_requests=6, first_token_id=10, vocab_size_tokens=VOCAB)
    return Workload(**{**base, **changes})


RUNS = {
    "c1": workload(),
    "c3-two-turns": workload(arrival=ClosedLoopArrivals(concurrency=3), conversation=Conversation(min_turns=2, max_turns=2),
                             seed=1),
    "poisson": workload(arrival=PoissonArrivals(rate_per_s=50.0), seed=2),
}


@pytest.fixture(scope="module")
def bench_files(byte_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    folder = tmp_path_factory.mktemp("bench-runs")
    llm = LLM(str(byte_model), random_weights=True, seed=3, block_size_tokens=4, num_kv_blocks=512,
              max_num_batched_tokens=256, max_num_seqs=8)
    paths = []
    with running_server(llm) as server:
        for name, w in RUNS.items():
            run = bench_endpoint(server.base_url, "tiny", Replay.of(w, VOCAB), arrival=w.arrival.kind,
                                 rate_per_s=getattr(w.arrival, "rate_per_s", None))
            path = folder / f"{name}.json"
            path.write_text(report([run], None, [None], None).model_dump_json())
            paths.append(path)
    yield paths


def calibrate(files: list[Path], out: Path, model: Path, *extra: str) -> int:
    return main(["calibrate", "--from-bench", *map(str, files), "--hw", HW, "--engine", ENGINE, "--model", str(model),
                 *KNOB_FLAGS, "--rounds", "1", "--out", str(out), *extra])


def test_bench_replay_is_the_measured_requests(bench_files: list[Path]) -> None:
    """The replay holds every measured request with its lengths; follow-ups extend their parent."""
    for path in bench_files:
        run = load_bench(path).runs[0]
        replay = bench_replay(run, VOCAB, path.name)
        lengths = request_lengths(replay)
        assert {r.request_id: (r.prompt_tokens, r.prompt_tokens + r.output_tokens) for r in run.requests} == lengths
        assert replay.concurrency == run.client.concurrency
        roots = [r for r in replay.requests if r.parent_id is None]
        if replay.concurrency is None:  # open loop: each arrives when it was due
            due = {r.request_id: r.due_s for r in run.requests}
            assert all(r.arrival_s == due[r.request_id] for r in roots)


def test_calibrate_from_bench_holds_each_run_out_and_simulate_uses_the_fit(
        bench_files: list[Path], byte_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fit.json"
    assert calibrate(bench_files[:2], out, byte_model) == 0
    assert "held-out median |error|" in capsys.readouterr().out
    fit = BenchFit.model_validate_json(out.read_text())
    assert fit.runs == [f"{p.name}#0" for p in bench_files[:2]] and fit.hold_out == "leave-one-run-out"
    assert {f.run_key for f in fit.figures} == set(fit.runs)
    assert all(f.held_out > 0 and f.in_sample > 0 for f in fit.figures)
    assert fit.held_out_median_abs_error_pct >= 0
    family = get_hardware(HW).family
    assert set(fit.model.families) == {family} and set(fit.model.engines) == {ENGINE}
    # ServePlan's server shares the engine's process: how much of its request time holds the step
    # loop is fitted too (the public fit, of engines whose servers are processes of their own, does not).
    assert 0 < fit.model.engines[ENGINE]["api_hold_share"] <= 1
    # The held-out prediction of a run is not its in-sample one: its fold never saw it.
    assert any(f.held_out != f.in_sample for f in fit.figures)

    # simulate --calibration prices with the fitted figures: exactly what CostParams.fitted makes of
    # the file, and not what the profiles' estimates give.
    spec = tmp_path / "workload.json"
    spec.write_text(workload(arrival=PoissonArrivals(rate_per_s=20.0), num_requests=8).model_dump_json())
    args = ["simulate", "--model", str(byte_model), "--hw", HW, "--engine", ENGINE, *KNOB_FLAGS, "--workload", str(spec),
            "--json"]
    assert main([*args, "--calibration", str(out)]) == 0
    with_fit = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    without = json.loads(capsys.readouterr().out)
    parsed = build_parser().parse_args(args)
    read_flags(parsed)
    model, hw = resolve_model(str(byte_model)), get_hardware(HW)
    replay = replay_from_args(parsed, model.vocab_size, model.max_position_embeddings)
    params = CostParams.fitted(hw, get_engine(ENGINE), load_fitted_model(out))
    expected = simulate(model, hw, deployment_from_args(parsed), replay, calibration=params)
    assert with_fit["tpot_ms"]["mean"] == pytest.approx(expected.summary.tpot_ms.mean)
    assert with_fit["tpot_ms"]["mean"] != pytest.approx(without["tpot_ms"]["mean"])
    # Its band is the bench runs' held-out errors, and says so: not the published runs'.
    basis = with_fit["prediction_interval"]["basis"]
    assert "bench runs, each predicted by a fit that left its run out" in basis and "published" not in basis


def test_served_and_in_process_runs_together_recover_the_streaming_cost(byte_model: Path) -> None:
    """Known answer: runs simulated at known per-step and per-token streaming costs, served and in
    process, stand in for measurements; fitted together, they give those costs back. Served runs
    alone leave them out of the fit (they cannot separate them from the engine's step time)."""
    model, hw, engine = resolve_model(str(byte_model)), get_hardware(HW), get_engine(ENGINE)
    dep = deployment_from_args(build_parser().parse_args(["simulate", "--model", str(byte_model), "--hw", HW,
                                                          "--engine", ENGINE, *KNOB_FLAGS]))
    truth = CostParams.defaults(hw, engine).with_values({"api_step_s": 600e-6, "api_token_s": 150e-6})
    workloads = {"c1": workload(num_requests=8, output_tokens=FixedLength(tokens=24)),
                 "c8": workload(arrival=ClosedLoopArrivals(concurrency=8), num_requests=16,
                                output_tokens=FixedLength(tokens=24), seed=1)}
    runs = []
    for name, w in workloads.items():
        replay = Replay.of(w, VOCAB)
        for served in (True, False):
            summary = simulate(model, hw, dep.model_copy(update={"api_server": served}), replay, calibration=truth).summary
            run = in_process_run(f"{name}-{served}", summary, replay, model, hw, engine, dep, model.max_position_embeddings)
            runs.append(dataclasses.replace(run, dep=run.dep.model_copy(update={"api_server": served})))
    assert fitted_engine_params(runs[::2]) == fitted_engine_params(runs[1::2]) == (*BENCH_ENGINE_PARAMS, "api_hold_share")
    assert {"api_step_s", "api_token_s"} <= set(fitted_engine_params(runs))
    fit = calibrate_from_bench(runs, command="test", model_name="tiny", rounds=4)
    figures = fit.model.engines[ENGINE]
    assert figures["api_step_s"] == pytest.approx(600e-6, rel=0.15)
    assert figures["api_token_s"] == pytest.approx(150e-6, rel=0.15)


# --------------------------------------------------------------------------- bad input


def _client() -> ClientSemantics:
    return ClientSemantics(arrival="closed_loop", rate_per_s=None, concurrency=1, max_concurrency=None, temperature=0.0,
                           ignore_eos=True, token_count_source="token_ids")


def _record(request_id: str, error: str | None = None) -> RequestRecord:
    return RequestRecord(request_id=request_id, parent_id=None, released_by=None, think_s=0.0, due_s=0.0, send_s=0.0,
                         first_token_s=None if error else 0.01, chunk_times_s=[] if error else [0.01, 0.02],
                         chunk_tokens=[] if error else [1, 1], finish_s=None if error else 0.02, prompt_tokens=8,
                         server_prompt_tokens=8, max_tokens=2, output_tokens=0 if error else 2,
                         finish_reason=None if error else "length", http_status=429 if error else 200, error=error)


def _one_line(capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("content, needles", [
    ("not json at all", ("--from-bench",)),
    (json.dumps({"name": "h100", "memory_gib": 80}), ("not a bench file",)),
    (json.dumps({"version": 7, "runs": []}), ("version", "7")),
    (json.dumps({"version": 1, "sweep": None, "slo": None, "max_goodput_requests_per_s": 0, "max_goodput_point": None,
                 "runs": []}), ("bad.json: runs", "at least one run")),
    (json.dumps({"version": 1, "sweep": None, "slo": None, "max_goodput_requests_per_s": 0, "max_goodput_point": None,
                 "runs": [{"url": 5}]}), ("bad.json: runs.0.url", "valid string")),
])
def test_not_a_bench_file(tmp_path: Path, byte_model: Path, capsys: pytest.CaptureFixture[str], content: str,
                          needles: tuple[str, ...]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert calibrate([path, path], tmp_path / "fit.json", byte_model) == 2
    _one_line(capsys, *needles)
    assert "memory_gib" not in capsys.readouterr().err  # the file's contents are never echoed


def test_a_run_with_failed_requests_is_refused(tmp_path: Path, byte_model: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = BenchRun(url="http://x/v1", model="tiny", workload="w", client=_client(), summary=None,
                   requests=[_record("a"), _record("b", error="queue full")])
    path = tmp_path / "failed.json"
    path.write_text(BenchReport(sweep=None, slo=None, runs=[run, run], max_goodput_requests_per_s=0,
                                max_goodput_point=None).model_dump_json())
    assert calibrate([path], tmp_path / "fit.json", byte_model) == 2
    _one_line(capsys, "failed.json#0: requests", "1 of 2 failed", "HTTP 429")
    assert not (tmp_path / "fit.json").exists()


@pytest.mark.parametrize("flags, needles", [
    (["--engine", "nope"], ("engine", "nope")),
    (["--hw", "no-such-gpu"], ("no-such-gpu",)),
    (["--public"], ("--public and --from-bench",)),
    (["--quick"], ("--quick", "does not apply to --from-bench")),
])
def test_bad_flags(bench_files: list[Path], tmp_path: Path, byte_model: Path, capsys: pytest.CaptureFixture[str],
                   flags: list[str], needles: tuple[str, ...]) -> None:
    assert calibrate(bench_files[:2], tmp_path / "fit.json", byte_model, *flags) == 2
    _one_line(capsys, *needles)


def test_one_run_cannot_be_held_out(bench_files: list[Path], tmp_path: Path, byte_model: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert calibrate(bench_files[:1], tmp_path / "fit.json", byte_model) == 2
    _one_line(capsys, "--from-bench", "at least 2 runs")


def test_simulate_refuses_a_file_that_is_not_a_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"model": {"families": []}}))
    assert main(["simulate", "--calibration", str(path), "--requests", "4"]) == 2
    _one_line(capsys, "cal.json: model: families", "dictionary")
