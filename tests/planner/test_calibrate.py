"""Calibration and validation on a tiny random-weight model: structure and sanity, never wall-clock bounds."""

from __future__ import annotations

from collections.abc import Callable
import os
from pathlib import Path

import pytest

from engine.catalog import resolve_model
from engine.core import Request, Scheduler
from engine.errors import InputError
from planner.calibrate import (
    Calibration, StepMeasurement, calibrate, detect_device, fit_cost_params, grid_blocks_needed, load_calibration,
    measure_interleaved, measure_steps, step_grid,
)
from planner.cli import main
from planner.costmodel import CostModel, CostParams
from planner.hardware import get_hardware
from planner.specs import Deployment, EngineKnobs
from planner.validate import COMPARED, scenarios, validate


@pytest.fixture(scope="module")
def tiny(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("tiny-cal", vocab_size=512, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stands in for hwprofiles/ while calibrating: what a calibration writes there lands here."""
    return tmp_path_factory.mktemp("hwprofiles")


@pytest.fixture(scope="module")
def calibrated(tiny: Path, tmp_path_factory: pytest.TempPathFactory, profile_dir: Path) -> tuple[Calibration, Path]:
    out = tmp_path_factory.mktemp("cal") / "tiny.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("planner.calibrate.PROFILE_DIR", profile_dir)
        return calibrate(str(tiny), device="cpu", quick=True, out=out, random_weights=True, progress=False)


def test_calibration_file_holds_measurements_fit_and_provenance(calibrated: tuple[Calibration, Path]) -> None:
    cal, path = calibrated
    assert Calibration.model_validate_json(path.read_text()) == cal
    assert len(cal.steps) == len(step_grid(quick=True, max_context=2048))
    assert all(s.measured_s > 0 and s.predicted_s > 0 and len(s.repeats_s) == 2 for s in cal.steps)
    params = cal.cost_params()
    assert isinstance(params, CostParams) and params.attention_pairs == "dense"
    assert 0 < params.compute_efficiency <= 1 and 0 < params.memory_efficiency <= 1
    assert cal.fit_median_abs_error_pct >= 0  # how small depends on how quiet the machine was: never asserted
    assert cal.profile.name == cal.hardware_profile == cal.device.slug
    # The profile records the measured bandwidth to 0.01 GB/s, however slow this machine measured it.
    assert cal.profile.memory_bandwidth_gb_s == pytest.approx(cal.microbenchmarks.memory_bandwidth_gb_s, abs=0.005 + 1e-9)
    assert cal.model_fingerprint and cal.created_utc


def test_interleaved_timing_alternates_engines_and_grid_steps_and_keeps_every_repeat(
        tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five repeats over two passes: each pass times every grid step on both engines in turn
    (three repeats each, rounded up), and each measurement keeps all six, in the grid's order."""
    from engine.llm import LLM

    grid = [("decode b2 ctx64", [(1, 63, False)] * 2), ("prefill 16 cached 0", [(16, 0, True)])]
    engines = [LLM(str(tiny), device="cpu", dtype="float32", random_weights=True, num_kv_blocks=32,
                   enable_prefix_caching=False) for _ in range(2)]
    calls: list[tuple[int, str, int]] = []

    def logged(llm: object, steps: list, repeats: int) -> list[StepMeasurement]:
        calls.append((engines.index(llm), steps[0][0], repeats))  # type: ignore[arg-type]
        return measure_steps(llm, steps, repeats)  # type: ignore[arg-type]

    monkeypatch.setattr("planner.calibrate.measure_steps", logged)
    runs = measure_interleaved(engines, grid, repeats=5, passes=2)
    labels = [label for label, _ in grid]
    assert calls == [(e, label, 3) for _ in range(2) for label in labels for e in (0, 1)]
    for measured in runs:
        assert [m.label for m in measured] == labels
        # The shape of the first timed repeat: a decode's context has grown by the warm-up's token.
        assert [sorted(m.requests) for m in measured] == [[(1, 64, False)] * 2, [(16, 0, True)]]
        assert all(len(m.repeats_s) == 6 and m.comm_s is None and m.comm_repeats_s == [] for m in measured)


def test_a_grid_batch_of_decodes_computes_distinct_tokens(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixture of experts routes identical tokens to the same experts: the grid's decodes must
    not all compute the same token, or a batch is timed at a fraction of its experts."""
    from engine.llm import LLM

    grid = [("decode b8 ctx64", [(1, 63, False)] * 8)]
    llm = LLM(str(tiny), device="cpu", dtype="float32", random_weights=True,
              num_kv_blocks=grid_blocks_needed(grid, 16, 2), enable_prefix_caching=False)
    prompts: list[list[int]] = []

    class Recording:  # the scheduler, recording what it is given (a compiled core's methods cannot be patched)
        def __init__(self, scheduler: Scheduler) -> None:
            self._scheduler = scheduler

        def add_request(self, request: Request) -> None:
            prompts.append(request.prompt_token_ids)
            self._scheduler.add_request(request)

        def __getattr__(self, name: str) -> object:
            return getattr(self._scheduler, name)

    monkeypatch.setattr(llm, "scheduler", Recording(llm.scheduler))
    measure_steps(llm, grid, repeats=2)
    assert len(prompts) == 8 and len({p[-1] for p in prompts}) == 8


def test_fit_recovers_step_times_made_with_known_figures() -> None:
    """Step times computed from known figures (no clock involved): the fit reproduces them."""
    model, hw = resolve_model("smollm2-135m"), get_hardware("xeon-8480-2s")
    dep = Deployment(hardware=hw.name)
    truth = CostParams.defaults(hw).with_values({"attention_pairs": "dense", "compute_efficiency": 0.3,
                                                 "memory_efficiency": 0.6, "step_overhead_s": 0.004})
    cm = CostModel(model, hw, dep, truth)
    steps = [StepMeasurement(label=label, requests=shape, measured_s=cm.shape_cost(shape).seconds, repeats_s=[1.0, 1.0])
             for label, shape in step_grid(quick=True, max_context=2048)]
    _, predicted = fit_cost_params(model, hw, dep, steps)
    errors = [abs(p / s.measured_s - 1) for p, s in zip(predicted, steps, strict=True)]
    assert max(errors) < 0.05


@pytest.mark.parametrize("comm_timed", [False, True])
def test_fit_over_one_and_two_processes_recovers_the_collective_scale(comm_timed: bool) -> None:
    """Steps of one process and of two, made from known figures (collectives 2.5x the link's curve,
    each rank's kernels 1.4x slower beside the other): fitted together, both come back, and every
    step is reproduced. Where the steps carry their time in collectives (as `calibrate` records a
    parallel engine's), the collectives' scale is that measurement, exactly."""
    model, hw = resolve_model("llama-3.1-8b"), get_hardware("h100-sxm")
    dep = Deployment(hardware=hw.name)
    truth = CostParams.defaults(hw).with_values({"attention_pairs": "dense", "compute_efficiency": 0.5,
                                                 "memory_efficiency": 0.7, "step_overhead_s": 0.003,
                                                 "layer_overhead_s": 2e-4, "collective_time_scale": 2.5,
                                                 "shared_host_slowdown": 1.4})
    steps = []
    for tp in (1, 2):
        cm = CostModel(model, hw, dep.model_copy(update={"tensor_parallel": tp}), truth)
        steps += [StepMeasurement(label=label, requests=shape, measured_s=(cost := cm.shape_cost(shape)).seconds,
                                  repeats_s=[1.0, 1.0], tensor_parallel=tp,
                                  comm_s=cost.comm_seconds if comm_timed and tp > 1 else None)
                  for label, shape in step_grid(quick=True, max_context=2048)]
    params, predicted = fit_cost_params(model, hw, dep, steps)
    assert params.collective_time_scale == pytest.approx(2.5, rel=1e-9 if comm_timed else 0.1)
    assert params.shared_host_slowdown == pytest.approx(1.4, rel=0.05)
    assert max(abs(p / s.measured_s - 1) for p, s in zip(predicted, steps, strict=True)) < 0.05
    # One process only: nothing to tell the collectives' scale from, so it is not fitted.
    single, _ = fit_cost_params(model, hw, dep, [s for s in steps if s.tensor_parallel == 1])
    assert single.collective_time_scale == single.shared_host_slowdown == 1.0


def test_validation_report_compares_the_same_requests(tiny: Path, calibrated: tuple[Calibration, Path]) -> None:
    _, path = calibrated
    report = validate(str(tiny), path, random_weights=True, quick=True, only=["chat-low", "overload"], progress=False)
    assert [r.scenario for r in report.rows] == ["chat-low", "overload"]
    for row in report.rows:
        assert row.engine.source == "engine" and row.simulator.source == "simulator"
        assert row.engine.num_finished == row.simulator.num_finished == row.engine.num_requests
        assert set(row.error_pct) == {m for m in COMPARED if not m.startswith(("kv_transfer", "offload"))}
    overload = report.rows[1]
    # A 48-block cache cannot hold everyone: both the engine and the simulator preempt.
    assert overload.engine.preemptions > 0 and overload.simulator.preemptions > 0
    assert set(report.median_abs_error_pct) == set(report.bounds_pct)


def test_calibration_measures_the_collectives_as_the_cpu_link(calibrated: tuple[Calibration, Path]) -> None:
    cal, _ = calibrated
    link = cal.profile.scale_up
    assert link is not None and set(link.collectives) == {"all_reduce", "all_gather", "all_to_all"}
    for kind, curve in link.collectives.items():
        measured = cal.microbenchmarks.collectives_us[kind]
        assert [size for size, _ in curve.points] == [size for size, _ in measured]
        times = [t for _, t in curve.points]
        assert times == sorted(times)  # a larger message never costs less
        # Isotonic regression pools violating neighbours to their mean: the total time is kept.
        assert sum(times) == pytest.approx(sum(m for _, m in measured), rel=1e-9)


def test_tensor_parallel_validation_prices_the_measured_collectives(tiny: Path, calibrated: tuple[Calibration, Path],
                                                                     tmp_path: Path) -> None:
    _, path = calibrated
    report = validate(str(tiny), path, random_weights=True, quick=True, only=["chat-low"], progress=False,
                      tensor_parallel=2)
    assert report.tensor_parallel == 2
    [row] = report.rows
    assert row.engine.num_finished == row.simulator.num_finished == row.engine.num_requests
    assert row.engine.assumptions["tensor_parallel"] == 2
    assert 0 < row.engine.utilisation.communication_share < 1  # type: ignore[operator]
    assert 0 < row.simulator.utilisation.communication_share < 1  # type: ignore[operator]
    # A calibration made before collectives were measured cannot price them: refused, not guessed.
    data = Calibration.model_validate_json(path.read_text())
    old = tmp_path / "old.json"
    old.write_text(data.model_copy(update={"profile": data.profile.model_copy(update={"scale_up": None})}).model_dump_json())
    with pytest.raises(InputError, match="no measurement of this machine's collectives"):
        validate(str(tiny), old, random_weights=True, quick=True, only=["chat-low"], progress=False, tensor_parallel=2)


def test_a_parallel_calibration_times_the_grid_on_one_and_on_two_processes(tiny_model: Callable[..., Path],
                                                                          tmp_path: Path, profile_dir: Path) -> None:
    """Expert parallelism over two processes (its attention tensor-parallel): the grid is timed on
    one process and on two, and every step is priced as `validate` prices ServePlan's engine, whose
    experts exchange tokens by all-to-all (vLLM's profile would all-reduce them)."""
    moe = tiny_model("tiny-cal-moe", model_type="qwen3_moe", moe_intermediate_size=32, num_experts=4,
                     num_experts_per_tok=2, vocab_size=512, max_position_embeddings=2048)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("planner.calibrate.PROFILE_DIR", profile_dir)
        cal, _ = calibrate(str(moe), device="cpu", quick=True, out=tmp_path / "ep2.json", random_weights=True,
                           progress=False, expert_parallel=2)
    grid = [label for label, _ in step_grid(quick=True, max_context=2048)]
    assert [(s.label, s.tensor_parallel, s.expert_parallel) for s in cal.steps] == (
        [(g, 1, 1) for g in grid] + [(g, 2, 2) for g in grid])
    assert all(s.measured_s > 0 and s.predicted_s > 0 for s in cal.steps)
    # Rank 0 timed its collectives in every two-process step, and that sets the collectives' scale.
    assert all((s.comm_s is None) == (s.tensor_parallel == 1) for s in cal.steps)
    assert all(0 < s.comm_s < s.measured_s for s in cal.steps if s.comm_s is not None)  # type: ignore[operator]
    assert cal.cost_params().collective_time_scale > 0
    model = resolve_model(str(moe))
    for step in cal.steps:
        dep = Deployment(hardware=cal.profile.name, weight_dtype=cal.dtype, kv_dtype=cal.dtype, engine="serveplan",
                         tensor_parallel=step.tensor_parallel, expert_parallel=step.expert_parallel,
                         knobs=EngineKnobs(block_size_tokens=cal.block_size_tokens))
        priced = CostModel(model, cal.profile, dep, cal.cost_params()).shape_cost(step.requests).seconds
        assert priced == pytest.approx(step.predicted_s, rel=1e-9), step.label


def test_a_parallel_calibration_needs_a_cpu_per_rank(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"tp=.*must be at most this machine's \d+ CPUs"):
        calibrate(str(tiny), device="cpu", quick=True, out=tmp_path / "x.json", random_weights=True, progress=False,
                  threads=1, tensor_parallel=(os.cpu_count() or 1) + 1)


@pytest.mark.parametrize("scenario", ["disagg-long-prompt", "swap-overload", "agent-host-tier"])
def test_disaggregation_and_offload_scenarios_run_engine_and_simulator_alike(
        tiny: Path, calibrated: tuple[Calibration, Path], scenario: str) -> None:
    """One scenario a test: the engine replays arrivals in real time, so they run side by side on the workers."""
    _, path = calibrated
    report = validate(str(tiny), path, random_weights=True, quick=True, only=[scenario], progress=False)
    (row,) = report.rows
    assert row.engine.num_finished == row.simulator.num_finished == row.engine.num_requests
    assert set(report.median_abs_error_pct_by_group) == {"disaggregation and offload"}
    if scenario == "disagg-long-prompt":
        # Both moved every prompt's KV from a prefill to a decode instance, and priced or timed it.
        assert row.engine.kv_transfer.requests == row.simulator.kv_transfer.requests == row.engine.num_requests
        assert "kv_transfer.total_ms.mean" in row.error_pct
    elif scenario == "swap-overload":
        # Both preempted by swap, never by recompute.
        for summary in (row.engine, row.simulator):
            assert summary.preemptions > 0 and summary.offload.swapped_out_requests == summary.preemptions
    else:
        # Both found evicted prefixes in the host tier.
        assert row.engine.offload.host_hit_tokens > 0 and row.simulator.offload.host_hit_tokens > 0


def test_scenarios_cover_the_required_behaviours() -> None:
    chosen = scenarios(quick=False)
    names = {s.name for s in chosen}
    assert {"chat-low", "chat-high", "long-prompt", "shared-prefix", "overload"} <= names
    assert sum(n.startswith("closed-loop") for n in names) >= 3
    assert {"disagg-long-prompt", "swap-overload", "agent-device-only", "agent-host-tier"} <= names
    by_name = {s.name: s for s in chosen}
    assert by_name["disagg-long-prompt"].disaggregated and by_name["swap-overload"].preemption_mode == "swap"
    # The host-tier scenario differs from its device-only twin by the tier alone.
    assert by_name["agent-host-tier"].workload.model_copy(update={"name": "x"}) == \
        by_name["agent-device-only"].workload.model_copy(update={"name": "x"})
    assert by_name["agent-host-tier"].host_blocks > 0 == by_name["agent-device-only"].host_blocks


def test_a_calibration_for_another_model_is_refused_unless_forced(calibrated: tuple[Calibration, Path]) -> None:
    _, path = calibrated
    other = resolve_model("smollm2-135m")
    with pytest.raises(InputError, match="made for model .*use --force"):
        load_calibration(path, model=other)
    with pytest.warns(UserWarning, match="made for model"):
        load_calibration(path, model=other, force=True)
    with pytest.raises(InputError, match="made on"):
        load_calibration(path, hardware="h100-sxm")


def test_corrupt_calibration_and_unknown_device_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format_version": 1, "model": ')
    with pytest.raises(InputError, match="bad.json.* is invalid: not valid JSON"):
        load_calibration(bad)
    with pytest.raises(InputError, match="^device='tpu' is invalid"):
        detect_device("tpu")
    assert main(["validate", "--calibration", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["calibrate", "--device", "tpu"]) == 2
    assert "--device='tpu' is invalid" in capsys.readouterr().err


# --------------------------------------------------------------------------- issue 14, defect 7
# Work is not thrown away at the end of a long run: outputs, the model and the calibration's
# figures are checked before anything is measured or run, and nothing lands in hwprofiles/
# unless asked. Each test failed before this change.

SHIPPED = Path(__file__).resolve().parents[2] / "hwprofiles/calibrations/cpu-amd-epyc-1t__smollm2-135m__fp32.json"


def test_a_calibration_writes_no_profile_into_hwprofiles_unless_asked(calibrated: tuple[Calibration, Path],
                                                                     profile_dir: Path) -> None:
    assert list(profile_dir.iterdir()) == []


@pytest.fixture
def nothing_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before every input was checked")

    monkeypatch.setattr("planner.calibrate.micro_benchmarks", measured)
    monkeypatch.setattr("planner.calibrate.measure_steps", measured)


@pytest.mark.usefixtures("nothing_measured")
def test_calibrate_checks_the_output_and_the_model_before_measuring(tiny: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InputError, match="^out=.* is invalid: its folder .* does not exist"):
        calibrate(str(tiny), device="cpu", quick=True, out=tmp_path / "missing" / "c.json", random_weights=True)
    with pytest.raises(InputError, match="^out=.* is invalid: is a folder"):
        calibrate(str(tiny), device="cpu", quick=True, out=tmp_path, random_weights=True)
    with pytest.raises(InputError, match="nonesuch-7b"):
        calibrate("nonesuch-7b", device="cpu", quick=True, out=tmp_path / "c.json", random_weights=True)
    assert main(["calibrate", "--model", str(tiny), "--random-weights", "--out", str(tmp_path / "no" / "c.json")]) == 2
    assert capsys.readouterr().err.startswith("serveplan: error: --out=")


def test_validate_checks_its_report_path_before_the_engine_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine ran before the report path was checked")

    monkeypatch.setattr("planner.validate.validate", ran)
    for report in (tmp_path / "missing" / "r.md", tmp_path):
        assert main(["validate", "--calibration", str(SHIPPED), "--report", str(report)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("serveplan: error: --report=") and err.count("\n") == 1, err


@pytest.mark.parametrize(("change", "message"), [
    ({"bogus_knob": 1.0}, "'bogus_knob' is not a cost parameter"),
    ({"compute_efficiency": "Infinity"}, "must be a number"),
    ({"compute_efficiency": 7.0}, "compute_efficiency=7.0 is invalid"),
])
def test_a_calibration_the_cost_model_cannot_use_is_refused_when_read(tmp_path: Path, change: dict,
                                                                      message: str) -> None:
    import json

    data = json.loads(SHIPPED.read_text())
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({**data, "params": {**data["params"], **change}}))
    with pytest.raises(InputError, match="not a valid calibration file") as info:
        load_calibration(bad)
    assert message in str(info.value)
