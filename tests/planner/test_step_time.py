"""A simulated run's step time by operator: the steps that stand for the run are the ones its record
describes, priced by the very cost model (and fit) the run was priced with."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.catalog import resolve_model
from planner.costmodel import CostModel, CostParams
from planner.engines import get_engine
from planner.cli import main
from planner.hardware import get_hardware
from planner.sim import simulate
from planner.specs import Deployment, EngineKnobs
from planner.workload import FixedLength, OfflineArrivals, Workload, get_workload

MODEL = resolve_model("qwen3-8b")
H100 = get_hardware("h100-sxm")


def test_the_steps_are_the_runs_mean_batch_and_mean_prompt_priced_by_its_cost_model():
    dep = Deployment(hardware="h100-sxm")
    result = simulate(MODEL, H100, dep, get_workload("chat", num_requests=60))
    decode, prefill = result.summary.step_time
    busy = [s.num_running for s in result.record.samples if s.num_running > 0]
    prompt = sum(r.prompt_tokens for r in result.record.requests) / len(result.record.requests)
    output = sum(r.output_tokens for r in result.record.requests) / len(result.record.requests)
    assert (decode.kind, decode.requests, decode.tokens) == ("decode", round(sum(busy) / len(busy)), round(prompt + output / 2))
    assert (prefill.kind, prefill.requests, prefill.tokens) == ("prefill", 1, round(prompt))
    cm = CostModel(MODEL, H100, dep)
    assert decode.total_ms == pytest.approx(cm.decode_time_per_token_s(decode.requests, decode.tokens) * 1e3, rel=1e-9)
    assert prefill.total_ms == pytest.approx(cm.prefill_time_s(prefill.tokens) * 1e3, rel=1e-9)
    for step in (decode, prefill):
        assert sum(step.operators_ms.values()) == pytest.approx(step.total_ms, rel=1e-9)
        assert all(ms > 0 for ms in step.operators_ms.values())  # zeros are left out


def test_a_run_priced_with_other_figures_shows_them():
    dep = Deployment(hardware="h100-sxm")
    base = CostParams.fitted(H100, get_engine(dep.engine))
    slow = replace(base, memory_efficiency=base.memory_efficiency / 2)
    workload = get_workload("chat", num_requests=40)
    fast_decode = simulate(MODEL, H100, dep, workload, calibration=base).summary.step_time[0]
    slow_decode = simulate(MODEL, H100, dep, workload, calibration=slow).summary.step_time[0]
    assert slow_decode.operators_ms["mlp"] > 1.5 * fast_decode.operators_ms["mlp"]  # decode weight reads at half the rate
    expected = CostModel(MODEL, H100, dep, slow).decode_time_per_token_s(slow_decode.requests, slow_decode.tokens)
    assert slow_decode.total_ms == pytest.approx(expected * 1e3, rel=1e-9)


def test_a_prompt_longer_than_the_step_budget_is_priced_as_one_chunk_of_the_budget():
    dep = Deployment(hardware="h100-sxm", knobs=EngineKnobs(max_num_batched_tokens=1024))
    workload = Workload(name="long", arrival=OfflineArrivals(), input_tokens=FixedLength(tokens=3000),
                        output_tokens=FixedLength(tokens=8), num_requests=4)
    prefill = simulate(MODEL, H100, dep, workload).summary.step_time[1]
    assert prefill.tokens == 1024
    assert "capped by the 1024-token step budget" in prefill.basis


def test_simulate_prints_the_steps_time_by_operator(capsys: pytest.CaptureFixture[str]):
    assert main(["simulate", "--hw", "h100-sxm", "--model", "qwen3-8b", "--requests", "30"]) == 0
    out = capsys.readouterr().out
    assert "step time by operator, ms" in out
    decode_basis = next(line for line in out.splitlines() if line.startswith("decode step: "))
    assert "the run's mean batch over its busy steps" in decode_basis
    assert any(line.startswith("prefill step: one chunk of") for line in out.splitlines())
    assert any(line.strip("│ ").startswith("mlp") for line in out.splitlines())  # the largest operator of a dense decode
