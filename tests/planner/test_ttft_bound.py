"""The TTFT queue bound (planner/search/ttft_bound.py) against the simulator it bounds: no simulated
request's TTFT is below its floor, over random deployments, engines and workloads; a probe the
bound rules out misses its SLO when simulated; and the fewest replicas it allows is the first count
a scan finds."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import numpy as np
import pytest

from engine.catalog import resolve_model
from engine.config import ModelConfig
from planner.costmodel import CostModel, CostParams
from planner.hardware import HardwareProfile, get_hardware
from planner.playback import Replay
from planner.search.capacity import probe_workload
from planner.search.ttft_bound import (ProbeRequests, applies, fewest_replicas, least_prefill_s_per_token,
                                       misses_for_certain, ttft_floor_s)
from planner.sim import simulate
from planner.specs import SLO, Deployment, EngineKnobs
from planner.workload import (Conversation, GammaArrivals, LognormalLength, PoissonArrivals, SharedPrefix, Workload,
                              get_workload)

MODELS = {name: resolve_model(name) for name in ("llama-3.1-8b", "qwen3-30b-a3b", "llama-3.1-70b")}
HARDWARE = ("h100-sxm", "l40s", "a100-80gb-sxm")


@st.composite
def probes(draw: st.DrawFn) -> dict[str, object]:
    extra: dict[str, object] = {}
    if draw(st.booleans()):
        extra["shared_prefix"] = SharedPrefix(num_prefixes=3, prefix_tokens=draw(st.sampled_from([64, 512])), share=0.7)
    rate = draw(st.sampled_from([0.5, 2.0, 8.0, 30.0]))
    arrival = draw(st.sampled_from([PoissonArrivals(rate_per_s=rate), GammaArrivals(rate_per_s=rate, cv=3.0)]))
    workload = Workload(
        name="t", arrival=arrival, num_requests=draw(st.integers(20, 150)), seed=draw(st.integers(0, 10_000)),
        input_tokens=LognormalLength(median_tokens=draw(st.sampled_from([50, 400, 2000])), sigma=1.0, max_tokens=6000),
        output_tokens=LognormalLength(median_tokens=draw(st.sampled_from([8, 100])), sigma=0.8, max_tokens=600),
        **extra)
    engine = draw(st.sampled_from(["vllm-0.11", "trtllm-1.2", "sglang-0.5", "vllm-0.6"]))
    # TensorRT-LLM and vLLM 0.6 prefill a prompt in one step: their budget must hold the longest request.
    budget = 16384 if engine in ("trtllm-1.2", "vllm-0.6") else draw(st.sampled_from([512, 2048, 8192]))
    knobs = EngineKnobs(max_num_seqs=draw(st.sampled_from([8, 64, 256])), max_num_batched_tokens=budget,
                        enable_prefix_caching=draw(st.booleans()))
    model = draw(st.sampled_from(sorted(MODELS)))
    hw = get_hardware(draw(st.sampled_from(HARDWARE)))
    tp = {"llama-3.1-8b": draw(st.sampled_from([1, 2])), "qwen3-30b-a3b": 2, "llama-3.1-70b": 4}[model]  # each fits
    dep = Deployment(hardware=hw.name, tensor_parallel=tp, weight_dtype=draw(st.sampled_from(["bf16", "fp8"])),
                     knobs=knobs, engine=engine, api_server=draw(st.booleans()))
    params = CostParams.defaults(hw)
    if draw(st.booleans()):  # steps with a large fixed cost: per-token prefill cost falls steeply with the chunk
        params = replace(params, step_overhead_s=5e-3)
    return {"model": MODELS[model], "hw": hw, "dep": dep, "workload": workload, "params": params}


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(probes())
def test_no_simulated_request_beats_its_ttft_floor(case: dict[str, object]) -> None:
    _check_floors(**case)


def test_chunks_before_a_prompts_last_sample_nothing() -> None:
    """Prompts longer than a 512-token budget on two L40S: their earlier chunks reach no LM head, so
    the least per-token time leaves the one-row LM head out (priced with it, a floor came out 0.03 %
    above its simulated TTFT)."""
    hw = get_hardware("l40s")
    workload = Workload(name="t", arrival=PoissonArrivals(rate_per_s=0.5), num_requests=20, seed=1,
                        input_tokens=LognormalLength(median_tokens=2000, sigma=1.0, max_tokens=6000),
                        output_tokens=LognormalLength(median_tokens=8, sigma=0.8, max_tokens=600))
    knobs = EngineKnobs(max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=False)
    dep = Deployment(hardware=hw.name, tensor_parallel=2, knobs=knobs, engine="vllm-0.11", api_server=False)
    _check_floors(MODELS["llama-3.1-8b"], hw, dep, workload, CostParams.defaults(hw))


def _check_floors(model: ModelConfig, hw: HardwareProfile, dep: Deployment, workload: Workload, params: CostParams) -> None:
    """No request's simulated TTFT is below its floor, and a TTFT limit just under the floors' P90
    makes the simulated probe miss its SLO, as misses_for_certain says."""
    assert applies(dep)
    replay = Replay.of(workload, model.vocab_size, model.max_position_embeddings)
    result = simulate(model, hw, dep, replay, calibration=params)
    probe = ProbeRequests.of(replay, workload)
    assert probe is not None
    tau = least_prefill_s_per_token(CostModel(model, hw, dep, params), dep.knobs.max_num_batched_tokens)
    floor = ttft_floor_s(probe, 1.0, tau)  # the replay's own arrival times: a rate of 1 leaves them as drawn
    ttft_s = {r.request_id: r.ttft_s for r in result.record.requests}
    in_order = sorted(replay.requests, key=lambda r: r.arrival_s)  # the probe's order (a stable sort)
    measured = np.array([ttft_s[r.request_id] for r in in_order])
    assert np.all(floor <= measured * (1 + 1e-9)), f"worst floor / TTFT {np.max(floor / measured):.6f}"
    limit_ms = float(np.quantile(floor, 0.9)) * 1e3 * 0.999
    slo = SLO(ttft_p99_ms=limit_ms)
    assert misses_for_certain(floor, slo)
    assert simulate(model, hw, dep, replay, calibration=params, slo=slo).summary.goodput.slo_met is False


def test_a_probe_at_any_rate_is_the_unit_rate_draw_scaled() -> None:
    """What lets one draw stand for every probe of a search: the same prompts, arrivals / rate."""
    chat, model = get_workload("chat"), MODELS["llama-3.1-8b"]
    unit = ProbeRequests.of(Replay.of(probe_workload(chat, 1.0, 300), model.vocab_size), chat)
    assert unit is not None
    for rate in (0.37, 5.0, 123.0):
        at = ProbeRequests.of(Replay.of(probe_workload(chat, rate, 300), model.vocab_size), chat)
        assert at is not None
        np.testing.assert_array_equal(at.prefill_tokens, unit.prefill_tokens)
        np.testing.assert_allclose(at.unit_arrival_s, unit.unit_arrival_s / rate, rtol=1e-12)


def test_the_floor_is_the_fcfs_queue_of_prefill_work() -> None:
    """Three prompts of 1,000 tokens at 1 ms each, arriving at 0, 0.5 and 5 s: the second waits for
    the first; the third finds the queue empty."""
    probe = ProbeRequests(np.array([0.0, 0.5, 5.0]), np.array([1000.0, 1000.0, 1000.0]))
    np.testing.assert_allclose(ttft_floor_s(probe, 1.0, 1e-3), [1.0, 1.5, 1.0])
    np.testing.assert_allclose(ttft_floor_s(probe, 2.0, 1e-3), [1.0, 1.75, 1.0])  # arrivals at 0, 0.25, 2.5


@pytest.mark.parametrize("goodput", [0.5, 0.9, 0.99])
def test_fewest_replicas_is_the_first_count_not_ruled_out(goodput: float) -> None:
    chat, model = get_workload("chat"), MODELS["llama-3.1-8b"]
    probe = ProbeRequests.of(Replay.of(probe_workload(chat, 1.0, 400), model.vocab_size), chat)
    assert probe is not None
    slo = SLO(ttft_p99_ms=400, goodput_share=goodput)
    tau, rate = 1e-4, 60.0

    def ruled_out(k: int) -> bool:
        return misses_for_certain(ttft_floor_s(probe, rate / k, tau), slo)

    scan = next(k for k in range(1, 200) if not ruled_out(k))
    assert scan >= 4  # the case binds: the bound rules out a few counts
    assert fewest_replicas(probe, tau, slo, rate, 1, 4096) == scan
    assert fewest_replicas(probe, tau, slo, rate, scan + 2, 4096) == scan + 2  # never below where it starts
    assert fewest_replicas(probe, tau, slo, rate, 1, 2) == 2  # capped


def test_it_applies_to_one_fcfs_engine_instance_only() -> None:
    base = Deployment(hardware="h100-sxm")
    assert applies(base)
    assert not applies(base.model_copy(update={"pipeline_parallel": 2}))
    assert not applies(base.model_copy(update={"knobs": EngineKnobs(policy="priority")}))
    talk = get_workload("chat", conversation=Conversation(min_turns=2, max_turns=3, think_time_s=1.0))
    drawn = Replay.of(probe_workload(talk, 1.0, 50), MODELS["llama-3.1-8b"].vocab_size)
    assert ProbeRequests.of(drawn, talk) is None  # follow-ups arrive as the run goes
