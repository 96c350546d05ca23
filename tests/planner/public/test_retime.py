"""Re-timing a traced schedule: with the durations it was simulated with, it gives the simulator's
own figures exactly; with other durations, what a fresh simulation gives when the schedule holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import numpy as np
import pytest

from engine.catalog import resolve_model
from engine.config import EngineKnobs
from engine.errors import InputError
from planner.costmodel import CostModel, CostParams
from planner.hardware import get_hardware
from planner.public.retime import SUMMARY_FIELD, _stats, figures, retime, summary_value
from planner.sim import simulate
from planner.specs import Deployment
from planner.workload import (ClosedLoopArrivals, ConstantArrivals, LognormalLength, OfflineArrivals, PoissonArrivals,
                              Workload)

MODEL, HW = resolve_model("llama-3.1-8b"), get_hardware("h100-sxm")
METRICS = sorted(SUMMARY_FIELD)


def run(arrival: object, api_s: float, replicas: int = 1, seed: int = 0, holds: bool = False):
    w = Workload(name="t", arrival=arrival, num_requests=120, seed=seed,
                 input_tokens=LognormalLength(median_tokens=300, sigma=0.8, max_tokens=2000),
                 output_tokens=LognormalLength(median_tokens=60, sigma=0.8, max_tokens=400))
    dep = Deployment(hardware="h100-sxm", replicas=replicas, knobs=EngineKnobs(max_num_seqs=32, max_num_batched_tokens=1024))
    params = CostParams.defaults(HW).with_values({"api_request_s": api_s, "api_hold_share": 1.0 if holds else 0.0})
    return simulate(MODEL, HW, dep, w, calibration=params, trace=True, router="round_robin"), dep, params


@pytest.mark.parametrize(("arrival", "api_s", "replicas"), [
    (ConstantArrivals(rate_per_s=1e6), 0.004, 1),  # a burst: the API server spreads it out
    (PoissonArrivals(rate_per_s=20.0), 0.0, 1),
    (ClosedLoopArrivals(concurrency=6), 0.002, 1),
    (ClosedLoopArrivals(concurrency=1), 0.002, 1),  # one chain of 120 requests, each released by the last
    (PoissonArrivals(rate_per_s=40.0), 0.001, 2),
    (OfflineArrivals(), 0.0, 1),  # everything at SimPy's time 0, an int
], ids=["burst", "poisson", "closed-loop", "closed-loop-one-client", "two-replicas", "offline"])
def test_the_traced_durations_give_back_the_simulators_figures(arrival, api_s, replicas) -> None:
    result, _, _ = run(arrival, api_s, replicas)
    trace = result.trace
    assert trace is not None and trace.num_steps == result.summary.num_steps
    durations = np.array([s.end_s - s.start_s for s in result.record.samples])
    got = figures(trace, retime(trace, durations, api_s), METRICS)
    for metric in METRICS:
        assert got[metric] == pytest.approx(summary_value(result.summary, metric), rel=1e-9), metric


def test_other_durations_move_the_figures_like_a_fresh_simulation() -> None:
    """A closed loop keeps its schedule when every step slows by the same factor: re-timing the old
    schedule gives what simulating the slower hardware gives."""
    result, dep, params = run(ClosedLoopArrivals(concurrency=6), 0.0)
    slower = params.with_values({"memory_efficiency": params.memory_efficiency / 2,
                                 "compute_efficiency": params.compute_efficiency / 2,
                                 "attention_memory_efficiency": params.attention_memory_efficiency / 2,
                                 "attention_compute_efficiency": params.attention_compute_efficiency / 2})
    cm = CostModel(MODEL, HW, dep, slower)
    step_s = sum(cm.times(result.trace.shapes)[0])
    got = figures(result.trace, retime(result.trace, step_s, 0.0), METRICS)
    fresh = simulate(MODEL, HW, dep, Workload(name="t", arrival=ClosedLoopArrivals(concurrency=6), num_requests=120,
                     input_tokens=LognormalLength(median_tokens=300, sigma=0.8, max_tokens=2000),
                     output_tokens=LognormalLength(median_tokens=60, sigma=0.8, max_tokens=400)),
                     calibration=slower).summary
    for metric in ("output_throughput", "tpot_mean", "ttft_median", "e2e_mean"):
        assert got[metric] == pytest.approx(summary_value(fresh, metric), rel=0.03), metric


def test_an_open_loop_run_retimed_at_slower_steps_matches_a_fresh_simulation() -> None:
    """Poisson arrivals keep a replica busy for the whole run (15,000 steps back to back here):
    a request that arrives late in it must wait for the steps it meets, not for every step's
    extra time since the start. Re-timed on one clock from the start, 2 % slower steps made the
    median TTFT 903 ms where a fresh simulation gives 15."""
    w = Workload(name="t", arrival=PoissonArrivals(rate_per_s=20.0), num_requests=2000, seed=0,
                 input_tokens=LognormalLength(median_tokens=300, sigma=0.8, max_tokens=2000),
                 output_tokens=LognormalLength(median_tokens=60, sigma=0.8, max_tokens=400))
    dep = Deployment(hardware="h100-sxm", knobs=EngineKnobs(max_num_seqs=32, max_num_batched_tokens=1024))
    params = CostParams.defaults(HW).with_values({"api_request_s": 0.002})
    traced = simulate(MODEL, HW, dep, w, calibration=params, trace=True)
    assert traced.trace is not None and traced.summary.num_steps > 10_000
    for factor in (1.02, 1.1):
        slower = params.with_values({"memory_efficiency": params.memory_efficiency / factor,
                                     "compute_efficiency": params.compute_efficiency / factor,
                                     "attention_memory_efficiency": params.attention_memory_efficiency / factor})
        step_s = sum(CostModel(MODEL, HW, dep, slower).times(traced.trace.shapes)[0])
        got = figures(traced.trace, retime(traced.trace, step_s, 0.002), METRICS)
        fresh = simulate(MODEL, HW, dep, w, calibration=slower).summary
        for metric in ("ttft_median", "ttft_mean", "e2e_mean", "e2e_median", "tpot_mean", "itl_median", "output_throughput"):
            assert got[metric] == pytest.approx(summary_value(fresh, metric), rel=0.03), (factor, metric)


@pytest.mark.parametrize("arrival", [OfflineArrivals(max_concurrency=8), PoissonArrivals(rate_per_s=30.0, max_concurrency=5)],
                         ids=["offline-capped", "poisson-capped"])
def test_a_capped_client_is_retimed_exactly(arrival) -> None:
    """A client that holds requests while max_concurrency are in flight: each waits for a finish."""
    result, _, _ = run(arrival, 0.003)
    trace = result.trace
    assert (trace.gate >= 0).sum() == 120 - arrival.max_concurrency  # all but the first wave waited for a slot
    durations = np.array([s.end_s - s.start_s for s in result.record.samples])
    got = figures(trace, retime(trace, durations, 0.003), METRICS)
    for metric in METRICS:
        assert got[metric] == pytest.approx(summary_value(result.summary, metric), rel=1e-9), metric


@pytest.mark.parametrize(("arrival", "replicas"), [(PoissonArrivals(rate_per_s=40.0), 1), (ClosedLoopArrivals(concurrency=6), 1),
                                                  (PoissonArrivals(rate_per_s=60.0), 2)], ids=["poisson", "closed-loop", "two-replicas"])
def test_a_server_in_the_engines_process_is_retimed_exactly(arrival, replicas) -> None:
    """Its time on each request that arrives while the engine runs is taken from the step loop: the
    replica's next step starts that much later, and re-timing puts those holds back where they were."""
    api_s = 0.004
    result, _, _ = run(arrival, api_s, replicas, holds=True)
    trace = result.trace
    assert trace.api_holds.sum() > 0  # requests did arrive while steps ran
    durations = np.array([s.end_s - s.start_s for s in result.record.samples])
    got = figures(trace, retime(trace, durations, api_s, api_s), METRICS)
    for metric in METRICS:
        assert got[metric] == pytest.approx(summary_value(result.summary, metric), rel=1e-9), metric
    # Without the holds the same steps end sooner: the holds are what moved them.
    assert figures(trace, retime(trace, durations, api_s), ["tpot_mean"])["tpot_mean"] < summary_value(result.summary, "tpot_mean")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0, 3.25, 1e-3, 40.0, 977.0]) | st.floats(1e-6, 1e4),
                          st.integers(1, 9)), min_size=1, max_size=40))
def test_repeated_values_give_numpys_statistics_of_the_repeated_array(pairs: list[tuple[float, int]]) -> None:
    # The ITL is priced once per pair of steps and counted as often as tokens fell between them:
    # its percentiles must be numpy's over the repeated gaps, bit for bit (ties included).
    values, count = np.array([v for v, _ in pairs]), np.array([c for _, c in pairs])
    repeated = np.repeat(values, count)
    got = _stats(values, count, {"mean", "p50", "p99"})
    assert got["p50"] == float(np.percentile(repeated, 50))
    assert got["p99"] == float(np.percentile(repeated, 99))
    assert got["mean"] == pytest.approx(float(repeated.mean()), rel=1e-12)


def _served(engine: str, endpoint: str, timed: bool):
    w = Workload(name="t", arrival=OfflineArrivals(), num_requests=60, seed=1,
                 input_tokens=LognormalLength(median_tokens=300, sigma=0.8, max_tokens=2000),
                 output_tokens=LognormalLength(median_tokens=8, sigma=0.8, max_tokens=40))
    dep = Deployment(hardware="h100-sxm", engine=engine, api_server=True, api_endpoint=endpoint,
                     knobs=EngineKnobs(max_num_seqs=32, max_num_batched_tokens=1024))
    params = CostParams.defaults(HW).with_values({"api_request_s": 0.002})
    return simulate(MODEL, HW, dep, w, calibration=params, trace=True, client_times_every_event=timed)


@pytest.mark.parametrize(("engine", "endpoint", "events"), [
    ("vllm-0.11", "chat", 1),  # the role chunk before the first token's
    ("sglang-0.5", "chat", 2),  # the role chunk, and finish_reason in a chunk of its own
    ("vllm-0.11", "completions", 0),
])
def test_a_client_that_times_every_event_counts_the_servers_token_less_ones(engine, endpoint, events) -> None:
    """`vllm bench serve` takes an ITL at every SSE event with a choice: each token-less event of the
    server's is a gap of about nothing, so many per request; the schedule and every other figure stay."""
    plain, timed = _served(engine, endpoint, False), _served(engine, endpoint, True)
    gaps, n = plain.summary.itl_ms.count, len(plain.record.requests)
    assert timed.summary.itl_ms.count == gaps + events * n
    assert timed.summary.itl_ms.mean == pytest.approx(plain.summary.itl_ms.mean * gaps / (gaps + events * n), rel=1e-12)
    assert timed.summary.tpot_ms == plain.summary.tpot_ms and timed.summary.ttft_ms == plain.summary.ttft_ms
    durations = np.array([s.end_s - s.start_s for s in timed.record.samples])
    got = figures(timed.trace, retime(timed.trace, durations, 0.002), METRICS)
    for metric in METRICS:
        assert got[metric] == pytest.approx(summary_value(timed.summary, metric), rel=1e-9), metric


def test_a_profile_that_does_not_say_its_streamed_events_is_refused_for_such_a_client() -> None:
    with pytest.raises(InputError, match="engine"):
        _served("sglang-0.4", "chat", True)


def test_a_harmony_model_streams_its_channel_header_without_events() -> None:
    """gpt-oss under vLLM: its responses' first two tokens' only event is the role chunk, so each
    request of three tokens or more has one gap fewer (the second token arrives with the third), and no
    gap of about nothing; the re-timing counts them the same way."""
    model = resolve_model("gpt-oss-20b")
    w = Workload(name="t", arrival=OfflineArrivals(), num_requests=40, seed=2,
                 input_tokens=LognormalLength(median_tokens=200, sigma=0.5, max_tokens=1000),
                 output_tokens=LognormalLength(median_tokens=6, sigma=0.8, max_tokens=30))
    dep = Deployment(hardware="h100-sxm", engine="vllm-0.11", api_server=True, api_endpoint="chat",
                     knobs=EngineKnobs(max_num_seqs=32, max_num_batched_tokens=1024))
    params = CostParams.defaults(HW).with_values({"api_request_s": 0.002})
    plain, timed = (simulate(model, HW, dep, w, calibration=params, trace=True, client_times_every_event=flag)
                    for flag in (False, True))
    merged = sum(len(r.token_times) >= 3 for r in plain.record.requests)
    assert merged > 0 and timed.summary.itl_ms.count == plain.summary.itl_ms.count - merged
    assert timed.summary.tpot_ms == plain.summary.tpot_ms
    durations = np.array([s.end_s - s.start_s for s in timed.record.samples])
    got = figures(timed.trace, retime(timed.trace, durations, 0.002), METRICS)
    for metric in METRICS:
        assert got[metric] == pytest.approx(summary_value(timed.summary, metric), rel=1e-9), metric
