"""The simulator's fast paths: decodes applied in bulk give exactly what stepping every request one by
one gives, over random deployments and workloads (engine/core/bulk_decodes.py); a run stopped once it
has missed its SLO would have missed it whole.

Identical means identical: every request's timestamps, every step sample and the whole summary,
compared with ==, no tolerance."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
import pytest
import simpy

from engine.catalog import resolve_model
from engine.errors import InputError
from planner.costmodel import CostParams
from planner.hardware import get_hardware
from planner.playback import Replay
from planner.sim import SimulationResult, simulate, simulator
from planner.sim.replica import catch_up
from planner.specs import SLO, Deployment, EngineKnobs
from planner.workload import (ClosedLoopArrivals, Conversation, GammaArrivals, LognormalLength, OfflineArrivals,
                              PoissonArrivals, SharedPrefix, Workload)

H100 = get_hardware("h100-sxm")
MODELS = {name: resolve_model(name) for name in ("llama-3.1-8b", "qwen3-30b-a3b", "gemma-2-9b")}


def _assert_same_run(a: SimulationResult, b: SimulationResult) -> None:
    assert a.record.requests == b.record.requests
    assert a.record.samples == b.record.samples
    assert a.summary == b.summary


def _hashing_every_block(*args: object, **kwargs: object) -> SimulationResult:
    """simulate() with no request private (Request.private_blocks): every block hashed as it fills."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(simulator, "private_requests", lambda *_args: frozenset())
        return simulate(*args, **kwargs)  # type: ignore[arg-type]


@st.composite
def runs(draw: st.DrawFn) -> dict[str, object]:
    arrival = draw(st.sampled_from([
        PoissonArrivals(rate_per_s=0.5), PoissonArrivals(rate_per_s=8.0), PoissonArrivals(rate_per_s=40.0), GammaArrivals(rate_per_s=20.0, cv=3.0),
        ClosedLoopArrivals(concurrency=12), OfflineArrivals(max_concurrency=24),
    ]))
    extra: dict[str, object] = {}
    if draw(st.booleans()):
        extra["shared_prefix"] = SharedPrefix(num_prefixes=3, prefix_tokens=draw(st.sampled_from([40, 300])), share=0.7)
    if draw(st.booleans()) and not isinstance(arrival, OfflineArrivals):
        extra["conversation"] = Conversation(min_turns=1, max_turns=3, think_time_s=0.5)
    workload = Workload(
        name="t", arrival=arrival, num_requests=draw(st.integers(10, 60)), seed=draw(st.integers(0, 10_000)),
        input_tokens=LognormalLength(median_tokens=draw(st.sampled_from([30, 200, 900])), sigma=1.0, max_tokens=3000),
        output_tokens=LognormalLength(median_tokens=draw(st.sampled_from([8, 60, 200])), sigma=0.9, max_tokens=800),
        **extra)
    engine = draw(st.sampled_from(["vllm-0.11", "trtllm-1.2", "sglang-0.5", "vllm-0.6"]))
    # TensorRT-LLM and vLLM 0.6 prefill a prompt in one step: their budget must hold the longest request.
    budget = 16384 if engine in ("trtllm-1.2", "vllm-0.6") else draw(st.sampled_from([256, 2048]))
    knobs = EngineKnobs(max_num_seqs=draw(st.sampled_from([4, 16, 64])), max_num_batched_tokens=budget,
                        enable_prefix_caching=draw(st.booleans()))
    dep = Deployment(hardware="h100-sxm", replicas=draw(st.integers(1, 3)), knobs=knobs, engine=engine,
                     tensor_parallel=draw(st.sampled_from([1, 2])))
    model = draw(st.sampled_from(sorted(MODELS)))
    params = CostParams.defaults(H100)
    if draw(st.booleans()):  # the CPU engine's torch attention: decodes padded to the batch's longest
        params = replace(params, attention_pairs="dense")
    return {"model": MODELS[model], "dep": dep, "workload": workload, "calibration": params,
            "router": draw(st.sampled_from(["round_robin", "least_outstanding_tokens", "prefix_affinity"])),
            # A pool of 5,000 tokens holds a few requests: preemptions beside bulk decodes.
            "kv_cache_blocks": draw(st.sampled_from([None, 5000 // (1 if engine.startswith("sglang") else 16)]))}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_bulk_decodes_simulate_exactly_what_one_by_one_simulates(run: dict[str, object]) -> None:
    model, dep, workload = run.pop("model"), run.pop("dep"), run.pop("workload")
    try:
        one = simulate(model, H100, dep, workload, bulk_decodes=False, **run)
    except InputError:  # a drawn request beyond the context or the small pool: refused before anything runs
        event("refused")
        return
    bulk = simulate(model, H100, dep, workload, bulk_decodes=True, **run)
    if one.summary.preemptions:
        event("preemptions")
    _assert_same_run(bulk, one)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs(), st.sampled_from(["ttft_p99_ms<=60", "tpot_p99_ms<=12,goodput_share>=0.9", "e2e_p99_ms<=1500",
                                "ttft_p50_ms<=100,tpot_p50_ms<=30,goodput_share>=0.5", "itl_p99_ms<=20"]))
def test_a_run_stopped_once_it_misses_its_slo_would_have_missed_it(run: dict[str, object], slo_text: str) -> None:
    """A run may stop once so many requests have missed their limits that the SLO is out of reach
    (planner.metrics.SLOWatch): it stops only where the whole run misses, and a run it does not stop
    is the whole run, summary and all."""
    model, dep, workload = run.pop("model"), run.pop("dep"), run.pop("workload")
    slo = SLO.parse(slo_text)
    try:
        whole = simulate(model, H100, dep, workload, slo=slo, **run)
    except InputError:
        event("refused")
        return
    early = simulate(model, H100, dep, workload, slo=slo, stop_once_missed=True, **run)
    if early.summary.stopped_early is not None:
        event("stopped")
        assert whole.summary.goodput.slo_met is False and early.summary.goodput.slo_met is False
        assert early.summary.num_finished < whole.summary.num_finished
        assert early.record.requests == whole.record.requests[:early.summary.num_finished]
    else:
        assert early.summary == whole.summary


_SHORT_POOL_BLOCKS = 200  # 3,200 tokens: two or three conversations at their longest


@pytest.mark.parametrize("seed", [1, 2])
def test_bulk_decodes_exact_where_follow_ups_hit_decoded_blocks_in_a_short_pool(seed: int) -> None:
    """Prefix caching on, chats whose follow-up turns hit the blocks their parents decoded, and a pool
    that holds a few conversations: block events owed by bulk decodes (engine/core/bulk_decodes.py)
    meet hits on decode-produced blocks, evictions and preemptions, and still give what one by one gives."""
    workload = Workload(
        name="t", arrival=PoissonArrivals(rate_per_s=40.0), num_requests=90, seed=seed,
        input_tokens=LognormalLength(median_tokens=60, sigma=0.8, max_tokens=300),
        output_tokens=LognormalLength(median_tokens=100, sigma=0.6, max_tokens=300),
        conversation=Conversation(min_turns=2, max_turns=3, think_time_s=0.0))
    dep = Deployment(hardware="h100-sxm", knobs=EngineKnobs(max_num_seqs=32, enable_prefix_caching=True))
    model = MODELS["llama-3.1-8b"]
    one = simulate(model, H100, dep, workload, bulk_decodes=False, kv_cache_blocks=_SHORT_POOL_BLOCKS)
    bulk = simulate(model, H100, dep, workload, bulk_decodes=True, kv_cache_blocks=_SHORT_POOL_BLOCKS)
    _assert_same_run(bulk, one)
    # The run met what it is meant to: preemptions, and follow-ups hitting past their parent's prompt.
    assert one.summary.preemptions > 0
    prompts = {r.request_id: r.prompt_tokens for r in one.record.requests}
    parents = {r.request_id: r.parent_id for r in Replay.of(workload, model.vocab_size).requests}
    assert any(parents[r.request_id] is not None and r.cached_prompt_tokens > prompts[parents[r.request_id]]
               for r in one.record.requests)



@given(st.floats(0.0, 1e6), st.floats(0.0, 1e6))
def test_catching_up_lands_simpy_exactly_on_the_replica_clock(behind_s: float, ahead_s: float) -> None:
    """A clock left far behind by steps completed at once cannot reach `to` in one timeout: now +
    (to - now) rounds. catch_up lands on `to` exactly, whatever the two floats."""
    env = simpy.Environment(initial_time=behind_s)
    to = behind_s + ahead_s
    landed: list[float] = []
    catch_up(env, to, lambda: landed.append(env.now))
    env.run()
    assert landed == [to]


def test_bulk_decodes_exact_when_a_step_ends_long_after_simpys_clock() -> None:
    """The counterexample that found the rounding: the queue runs dry, the replica completes half
    a second of decode steps at once, and the last step's end must still be the one-by-one float."""
    workload = Workload(
        name="t", arrival=PoissonArrivals(rate_per_s=40.0), num_requests=10, seed=0,
        input_tokens=LognormalLength(median_tokens=200, sigma=1.0, max_tokens=3000),
        output_tokens=LognormalLength(median_tokens=60, sigma=0.9, max_tokens=800),
        shared_prefix=SharedPrefix(num_prefixes=3, prefix_tokens=40, share=0.7))
    dep = Deployment(hardware="h100-sxm", engine="trtllm-1.2",
                     knobs=EngineKnobs(max_num_batched_tokens=16384, max_num_seqs=4, enable_prefix_caching=False))
    model, params = MODELS["llama-3.1-8b"], CostParams.defaults(H100)
    one = simulate(model, H100, dep, workload, bulk_decodes=False, calibration=params)
    bulk = simulate(model, H100, dep, workload, bulk_decodes=True, calibration=params)
    assert bulk.record.requests == one.record.requests
    assert bulk.record.samples == one.record.samples


@pytest.mark.parametrize("engine,tp,pp,dense", [("vllm-0.11", 1, 1, False), ("vllm-0.11", 2, 2, False),
                                                ("vllm-0.6", 1, 1, False), ("sglang-0.5", 4, 1, True)])
def test_a_bulk_run_is_priced_as_each_of_its_steps(engine: str, tp: int, pp: int, dense: bool) -> None:
    """CostModel.bulk_run prices a run's steps at once, with arrays: every step the float step() gives
    it alone, across the graphs' longest context (vLLM 0.6 runs longer contexts eagerly)."""
    from engine.core import SchedulerOutput
    from engine.core.bulk_decodes import BulkShape
    from planner.costmodel import CostModel

    model = MODELS["llama-3.1-8b"]
    params = replace(CostParams.defaults(H100), attention_pairs="dense") if dense else None
    cm = CostModel(model, H100, Deployment(hardware="h100-sxm", engine=engine, tensor_parallel=tp,
                                           pipeline_parallel=pp), params)
    for n, longest in ((1, 700), (3, 8100), (37, 20_000)):
        first = BulkShape(n, n * longest - n * (n - 1), longest)
        run = cm.bulk_run(first, 300)
        assert 1 <= len(run.seconds) <= 300
        for i, (seconds, flops, nbytes, comm_s) in enumerate(zip(*run, strict=True)):
            shape = BulkShape(n, first.context_tokens + i * n, longest + i)
            alone = cm.step(SchedulerOutput((), n, (), (), 0, n, 0.0, shape))
            assert (seconds, flops, nbytes, comm_s) == tuple(alone)


def test_a_lone_request_decodes_in_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path is taken: requests far apart decode alone, their steps priced in runs, and the
    run gives what one by one gives."""
    from planner.costmodel import CostModel

    priced: list[int] = []
    bulk_run = CostModel.bulk_run
    monkeypatch.setattr(CostModel, "bulk_run", lambda self, first, count: priced.append(count) or bulk_run(self, first, count))
    workload = Workload(name="t", arrival=PoissonArrivals(rate_per_s=0.2), num_requests=20, seed=3,
                        input_tokens=LognormalLength(median_tokens=200, sigma=0.5, max_tokens=1000),
                        output_tokens=LognormalLength(median_tokens=300, sigma=0.3, max_tokens=800))
    model, dep = MODELS["llama-3.1-8b"], Deployment(hardware="h100-sxm")
    one = simulate(model, H100, dep, workload, bulk_decodes=False)
    assert not priced
    fast = simulate(model, H100, dep, workload)
    assert sum(priced) > fast.summary.num_steps / 2
    _assert_same_run(fast, one)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs(), st.booleans())
def test_private_blocks_simulate_exactly_what_hashing_every_block_simulates(run: dict[str, object], bulk: bool) -> None:
    """Requests nobody can share register their blocks only when they let go of them, under keys of
    their own (Request.private_blocks): the same run, request by request and step by step, as hashing
    every block when it fills, with shared prefixes, follow-up turns, evictions and preemptions beside them."""
    model, dep, workload = run.pop("model"), run.pop("dep"), run.pop("workload")
    try:
        private = simulate(model, H100, dep, workload, bulk_decodes=bulk, **run)
    except InputError:
        event("refused")
        return
    hashed = _hashing_every_block(model, H100, dep, workload, bulk_decodes=bulk, **run)
    if hashed.summary.preemptions:
        event("preemptions")
    if hashed.summary.prefix_cache_hit_tokens:
        event("prefix-cache hits")
    _assert_same_run(private, hashed)


@pytest.mark.parametrize("bulk", [True, False])
def test_private_blocks_exact_where_their_eviction_order_decides_shared_hits(bulk: bool) -> None:
    """Half the requests share one of a few long prefixes, half are private, in a pool that holds a
    few of them: which cached blocks a new request evicts, a private request's or a shared prefix's,
    decides the later hits, so private blocks must enter the LRU queue as hashed ones would."""
    workload = Workload(
        name="t", arrival=PoissonArrivals(rate_per_s=30.0), num_requests=150, seed=3,
        input_tokens=LognormalLength(median_tokens=200, sigma=0.6, max_tokens=600),
        output_tokens=LognormalLength(median_tokens=40, sigma=0.6, max_tokens=200),
        shared_prefix=SharedPrefix(num_prefixes=4, prefix_tokens=320, share=0.5))
    dep = Deployment(hardware="h100-sxm", knobs=EngineKnobs(max_num_seqs=8, enable_prefix_caching=True))
    model = MODELS["llama-3.1-8b"]
    private = simulate(model, H100, dep, workload, bulk_decodes=bulk, kv_cache_blocks=_SHORT_POOL_BLOCKS)
    hashed = _hashing_every_block(model, H100, dep, workload, bulk_decodes=bulk, kv_cache_blocks=_SHORT_POOL_BLOCKS)
    _assert_same_run(private, hashed)
    # What the run is meant to meet: private requests, and shared prefixes hit after evictions.
    assert len(simulator.private_requests(Replay.of(workload, model.vocab_size), 16)) > 30
    assert 0 < hashed.summary.prefix_cache_hit_rate < 0.5
