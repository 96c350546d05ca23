import pytest

from engine.core import RequestStatus, SamplingParams, SchedulerConfig

from .testlib import FakeRunner, check_invariants, make_request, make_scheduler, run_to_completion, sample_all


def _step(sched, now, sampled=None, token=7):
    out = sched.schedule(now)
    check_invariants(sched, out)
    updates = sched.update(out, sample_all(out, token) if sampled is None else sampled, now)
    return out, updates


def _by_id(out):
    return {s.request_id: s for s in out.scheduled}


# ---- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens=0 is invalid: must be >= 1"),
        ({"max_num_seqs": 0}, "max_num_seqs=0 is invalid"),
        ({"block_size": 0}, "block_size=0 is invalid"),
        ({"max_model_len": 1}, "max_model_len=1 is invalid"),
        ({"policy": "lifo"}, "policy='lifo' is invalid: must be 'fcfs' or 'priority'"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens=-1 is invalid"),
        ({"max_num_seqs": 128}, "must be >= max_num_seqs=128"),
    ],
)
def test_config_validation(kwargs, message):
    base = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128, block_size=16)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SchedulerConfig(**{**base, **kwargs})


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_tokens=0 is invalid: must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature=-1.0 is invalid"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p=0.0 is invalid"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k=-2 is invalid"):
        SamplingParams(top_k=-2)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]


def test_kv_manager_must_match_config():
    from engine.core import KVCacheManager, Scheduler

    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, block_size=16)
    with pytest.raises(ValueError, match="block_size=8 does not match config.block_size=16"):
        Scheduler(cfg, KVCacheManager(10, 8))


# ---- intake ------------------------------------------------------------------------------


def test_add_request_rejections():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="request 'e': prompt is empty"):
        sched.add_request(make_request("e", []))
    with pytest.raises(ValueError, match=r"'long': prompt length 30 \+ max_tokens 4 = 34 exceeds max_model_len=32"):
        sched.add_request(make_request("long", 30, max_tokens=4))
    # 15 + 3 - 1 = 17 KV slots -> 5 blocks of 4 > 4 blocks in the pool.
    with pytest.raises(ValueError, match="request 'big': prompt length 15 \\+ max_tokens 3 needs 5 KV blocks.*has 4"):
        sched.add_request(make_request("big", 15, max_tokens=3))
    unchunked = make_scheduler(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False)
    # Unchunked, a whole sequence must fit one step (a preempted one is recomputed in one step).
    with pytest.raises(ValueError, match="'wide': prompt length 14 \\+ max_tokens 4 exceeds max_num_batched_tokens=16"):
        unchunked.add_request(make_request("wide", 14, max_tokens=4))
    unchunked.add_request(make_request("narrow", 14, max_tokens=3))
    sched.add_request(make_request("fits", 14, max_tokens=3))  # 16 slots: exactly the pool
    with pytest.raises(ValueError, match="request 'fits' was already added"):
        sched.add_request(make_request("fits", 2))
    assert sched.num_waiting == 1
    assert run_to_completion(sched)
    assert sched.get_request("fits").num_output_tokens == 3


def test_prompt_is_never_truncated():
    sched = make_scheduler(max_model_len=16)
    r = make_request("r", 12, max_tokens=4)
    sched.add_request(r)
    run_to_completion(sched)
    assert len(r.prompt_token_ids) == 12
    assert r.num_output_tokens == 4


# ---- budget ------------------------------------------------------------------------------


def test_budget_decode_first_then_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 3, max_tokens=10))
    sched.add_request(make_request("b", 3, max_tokens=10))
    out, _ = _step(sched, 0.0)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 3), ("b", 3)]
    sched.add_request(make_request("c", 20, max_tokens=2, arrival_time=0.5))
    out, _ = _step(sched, 1.0)
    s = _by_id(out)
    assert [r for r in s] == ["a", "b", "c"]
    assert (len(s["a"].token_ids), len(s["b"].token_ids), len(s["c"].token_ids)) == (1, 1, 6)
    assert not s["a"].is_prefill and s["c"].is_prefill
    assert s["a"].samples and not s["c"].samples
    assert s["c"].reset_block_table and not s["a"].reset_block_table
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (2, 6)
    out, updates = _step(sched, 2.0)
    s = _by_id(out)
    assert s["c"].num_computed_tokens == 6 and len(s["c"].token_ids) == 6
    assert s["c"].token_ids == tuple(sched.get_request("c").prompt_token_ids[6:12])
    assert {u.request_id for u in updates} == {"a", "b"}  # c got no token mid-prefill
    out, _ = _step(sched, 3.0)
    assert not _by_id(out)["c"].samples
    out, _ = _step(sched, 4.0)
    assert _by_id(out)["c"].samples and len(_by_id(out)["c"].token_ids) == 2  # 6 + 6 + 6 + 2
    assert sched.get_request("c").num_output_tokens == 1


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 2, max_tokens=2))
    out, _ = _step(sched, 0.0)
    assert len(out.scheduled) == 2 and out.num_waiting == 1


def test_chunked_prefill_off_waits_for_room():
    sched = make_scheduler(max_num_batched_tokens=20, max_model_len=20, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 12, max_tokens=4))
    sched.add_request(make_request("b", 12, max_tokens=4))
    sched.add_request(make_request("c", 2, max_tokens=4))
    out, _ = _step(sched, 0.0)
    # b does not fit in the 8 tokens left and is not chunked; c may not overtake it (FCFS).
    assert [s.request_id for s in out.scheduled] == ["a"]
    out, _ = _step(sched, 1.0)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 12), ("c", 2)]


def test_chunked_prefill_on_splits_the_same_workload():
    sched = make_scheduler(max_num_batched_tokens=20, max_model_len=20)
    sched.add_request(make_request("a", 12, max_tokens=4))
    sched.add_request(make_request("b", 12, max_tokens=4))
    out, _ = _step(sched, 0.0)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 12), ("b", 8)]


# ---- stop conditions ---------------------------------------------------------------------


def test_eos_stops_and_frees():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=10, eos_token_id=2)
    sched.add_request(r)
    _step(sched, 0.0, token=5)
    _, updates = _step(sched, 1.0, token=2)
    assert updates[0].finished and updates[0].finish_reason == "stop"
    assert r.output_token_ids == [5, 2] and r.status is RequestStatus.FINISHED_STOPPED
    assert r.finish_time == 1.0 and r.token_times == [0.0, 1.0] and r.first_token_time == 0.0
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
    assert sched.schedule(2.0).finished_request_ids == ("r",)
    assert not sched.has_unfinished_requests()


def test_ignore_eos():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=3, eos_token_id=2, ignore_eos=True)
    sched.add_request(r)
    run_to_completion(sched, token=2)
    assert r.output_token_ids == [2, 2, 2] and r.finish_reason == "length"


def test_stop_token_ids():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=10, stop_token_ids=(9,), ignore_eos=True)
    sched.add_request(r)
    run_to_completion(sched, token=9)
    assert r.output_token_ids == [9] and r.finish_reason == "stop"


def test_max_tokens():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=5)
    sched.add_request(r)
    run_to_completion(sched)
    assert r.num_output_tokens == 5 and r.finish_reason == "length"
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert sched.stats().num_finished["length"] == 1


# ---- abort -------------------------------------------------------------------------------


def test_abort_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    sched.add_request(make_request("run", 3, max_tokens=10))
    sched.add_request(make_request("wait", 3, max_tokens=10))
    _step(sched, 0.0)
    assert sched.abort_request("wait", 0.5)
    assert sched.abort_request("run", 0.5)
    assert not sched.abort_request("run", 0.6)  # already finished: no-op
    with pytest.raises(KeyError):
        sched.abort_request("nope", 0.6)
    for rid in ("run", "wait"):
        r = sched.get_request(rid)
        assert r.status is RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort" and r.finish_time == 0.5
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
    out = sched.schedule(1.0)
    assert out.is_empty and set(out.finished_request_ids) == {"run", "wait"}
    assert not sched.has_unfinished_requests()
    assert sched.stats().num_finished["abort"] == 2


def test_abort_between_schedule_and_update():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    sched.add_request(make_request("b", 3))
    out = sched.schedule(0.0)
    sched.abort_request("a", 0.1)
    updates = sched.update(out, sample_all(out), 0.2)
    assert [u.request_id for u in updates] == ["b"]
    assert sched.get_request("a").num_output_tokens == 0


# ---- protocol ----------------------------------------------------------------------------


def test_schedule_twice_without_update_raises():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    sched.schedule(0.0)
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule(1.0)


def test_update_checks_sampled_tokens_before_changing_anything():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 3))
    sched.add_request(make_request("b", 20))
    out = sched.schedule(0.0)
    with pytest.raises(ValueError, match="request 'a' must get 1..1 sampled tokens"):
        sched.update(out, {}, 0.0)
    with pytest.raises(ValueError, match="request 'b' computed a prompt chunk and cannot sample"):
        sched.update(out, {"a": [1], "b": [1]}, 0.0)
    assert sched.get_request("a").num_computed_tokens == 0
    assert len(sched.update(out, {"a": [1], "b": []}, 0.0)) == 1


def test_empty_step_needs_no_update():
    sched = make_scheduler()
    assert sched.schedule(0.0).is_empty
    sched.add_request(make_request("a", 3))
    assert not sched.schedule(1.0).is_empty


# ---- preemption --------------------------------------------------------------------------


def test_preemption_by_recompute_when_blocks_run_out():
    # 4 blocks of 4 tokens. Each request: 6 prompt + 6 output -> up to 11 KV slots = 3 blocks.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    a = make_request("a", list(range(6)), max_tokens=6)
    b = make_request("b", list(range(10, 16)), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    preempted_at = None
    for step in range(100):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule(float(step))
        check_invariants(sched, out)
        runner.execute(out)
        if out.preempted_request_ids:
            assert out.preempted_request_ids == ("b",)  # FCFS: the last admitted
            assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert "b" not in _by_id(out) and out.num_waiting == 1
            assert not any(s.reset_block_table for s in out.scheduled)  # no admission this step
            preempted_at = step
            outputs_at_preemption = list(b.output_token_ids)
        if preempted_at is not None and "b" in _by_id(out) and _by_id(out)["b"].reset_block_table:
            resumed = _by_id(out)["b"]
            # Prompt and output recomputed, minus the prefix-cache hit.
            known = b.prompt_token_ids + outputs_at_preemption
            assert resumed.token_ids == tuple(known[resumed.num_computed_tokens :])
            assert resumed.new_block_ids == tuple(sched.kv_cache_manager.get_block_ids("b"))
        # Token = output index, so a recompute must reproduce exactly the same sequence.
        sched.update(
            out,
            {
                s.request_id: [100 + sched.get_request(s.request_id).num_output_tokens]
                for s in out.scheduled
                if s.samples
            },
            float(step),
        )
    assert preempted_at is not None
    for r in (a, b):
        assert r.output_token_ids == [100 + i for i in range(6)]
        assert r.finish_reason == "length"
    assert b.num_preemptions >= 1 and sched.stats().num_preemptions == b.num_preemptions
    assert len(b.token_times) == 6


def test_priority_policy_preempts_least_important():
    sched = make_scheduler(num_blocks=6, block_size=4, max_model_len=16, policy="priority")
    # Equal needs; "low" (priority 5) is admitted second, "mid" third.
    sched.add_request(make_request("high", 4, max_tokens=8, priority=0, arrival_time=0.0))
    sched.add_request(make_request("low", 4, max_tokens=8, priority=5, arrival_time=0.1))
    sched.add_request(make_request("mid", 4, max_tokens=8, priority=1, arrival_time=0.2))
    first_preempted = None
    for step in range(100):
        if not sched.has_unfinished_requests():
            break
        out, _ = _step(sched, float(step))
        if out.preempted_request_ids and first_preempted is None:
            first_preempted = out.preempted_request_ids[0]
    assert first_preempted == "low"
    assert all(sched.get_request(r).num_output_tokens == 8 for r in ("high", "low", "mid"))


def test_priority_victim_already_scheduled_this_step_is_undone():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, policy="priority")
    low = make_request("low", 3, max_tokens=8, priority=9)
    high = make_request("high", 8, max_tokens=8, priority=0, arrival_time=1.0)
    sched.add_request(low)
    _step(sched, 0.0)  # low admitted first, so it comes first in every step
    sched.add_request(high)
    _step(sched, 1.0)  # low 1 block, high 2 blocks
    # low takes the last free block for position 4; then high needs one for position 8 and
    # the least important request, low, is preempted after all.
    out = sched.schedule(2.0)
    check_invariants(sched, out)
    assert out.preempted_request_ids == ("low",)
    assert [s.request_id for s in out.scheduled] == ["high"]
    assert out.total_num_scheduled_tokens == 1  # low's token was given back
    assert low.num_computed_tokens == 0 and low.status is RequestStatus.PREEMPTED
    sched.update(out, sample_all(out), 2.0)
    run_to_completion(sched, start=3.0)
    assert low.num_output_tokens == 8 and high.num_output_tokens == 8


def test_undone_victim_leaves_no_unfilled_block_in_the_prefix_cache():
    # bs 2: low's rejected drafts leave it a spare block, so the block its decode fills this
    # step is not the one high takes when low is preempted.
    sched = make_scheduler(num_blocks=6, block_size=2, max_model_len=32, policy="priority", num_speculative_tokens=2)
    runner = FakeRunner(sched)
    low = make_request("low", [20, 21, 22, 23], max_tokens=6, priority=9)
    high = make_request("high", [30, 31, 32, 33], max_tokens=6, priority=0)
    sched.add_request(low)
    out = sched.schedule(0.0)
    runner.execute(out)
    sched.update(out, {"low": [40]}, 0.0)
    sched.add_request(high)
    low.spec_token_ids = [90, 91]
    out = sched.schedule(1.0)  # low: positions 4..6 in 4 blocks; high admitted in 2: pool full
    runner.execute(out)
    sched.update(out, {"low": [41], "high": [50]}, 1.0)  # both drafts rejected
    out = sched.schedule(2.0)  # low's position 5 fills its block 2, then high needs a block
    check_invariants(sched, out)
    runner.execute(out)
    assert out.preempted_request_ids == ("low",) and [s.request_id for s in out.scheduled] == ["high"]
    copy = make_request("copy", [20, 21, 22, 23, 40, 41, 60])
    blocks, num_hit = sched.kv_cache_manager.get_computed_blocks(copy)
    assert num_hit == 4, "position 5 was never written: block 2 must not be a hit"
    sched.update(out, {"high": [51]}, 2.0)
    sched.add_request(copy)
    run_to_completion(sched, 3.0, runner=runner)
    assert [r.num_output_tokens for r in (low, high, copy)] == [6, 6, 4]


def test_priority_least_important_preempting_itself_lets_others_run():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, policy="priority")
    low = make_request("low", 4, max_tokens=8, priority=9)
    high = make_request("high", 5, max_tokens=8, priority=0, arrival_time=1.0)
    sched.add_request(low)
    _step(sched, 0.0)
    sched.add_request(high)
    # Both hold 2 blocks; low (first in line) reaches position 8 first and needs a third.
    for step in range(1, 10):
        out = sched.schedule(float(step))
        check_invariants(sched, out)
        if out.preempted_request_ids:
            break
        sched.update(out, sample_all(out), float(step))
    assert out.preempted_request_ids == ("low",)
    assert [s.request_id for s in out.scheduled] == ["high"]  # not a wasted step
    sched.update(out, sample_all(out), float(step))
    run_to_completion(sched, start=float(step + 1))
    assert low.num_output_tokens == 8 and high.num_output_tokens == 8


def test_priority_admission_order():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    sched.add_request(make_request("late-important", 2, max_tokens=1, priority=0, arrival_time=5.0))
    sched.add_request(make_request("early", 2, max_tokens=1, priority=1, arrival_time=0.0))
    sched.add_request(make_request("early-important", 2, max_tokens=1, priority=0, arrival_time=1.0))
    order = []
    for step in range(3):
        out, _ = _step(sched, float(step))
        order += [s.request_id for s in out.scheduled]
    assert order == ["early-important", "late-important", "early"]


# ---- prefix caching ----------------------------------------------------------------------


def test_prefix_hit_in_scheduler():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", list(range(10)), max_tokens=5))
    _step(sched, 0.0)
    sched.add_request(make_request("b", list(range(10)), max_tokens=2, arrival_time=1.0))
    out, _ = _step(sched, 1.0)
    b = _by_id(out)["b"]
    assert b.num_computed_tokens == 8 and b.token_ids == (8, 9) and b.reset_block_table
    assert b.new_block_ids[:2] == tuple(sched.kv_cache_manager.get_block_ids("a")[:2])
    assert len(b.new_block_ids) == 3
    assert sched.get_request("b").num_cached_tokens == 8
    assert sched.stats().prefix_cache.hit_tokens == 8


def test_hit_within_the_same_step():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", list(range(10)), max_tokens=2))
    sched.add_request(make_request("b", list(range(10)), max_tokens=2))
    runner = FakeRunner(sched)
    out = sched.schedule(0.0)
    runner.execute(out)  # b reads a's blocks as a writes them in the same batch
    assert _by_id(out)["b"].num_computed_tokens == 8


# ---- external KV (disaggregated prefill, calibration's synthetic context) --------------------


def _external(request_id: str, prompt_len: int, external: int, max_tokens: int = 3):
    request = make_request(request_id, prompt_len, max_tokens=max_tokens)
    return type(request)(request.request_id, request.prompt_token_ids, request.sampling_params,
                         request.arrival_time, num_external_computed_tokens=external)


def test_external_tokens_take_slots_but_no_compute_or_budget():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    sched.add_request(_external("a", 30, external=27))
    out, _ = _step(sched, 0.0)
    a = _by_id(out)["a"]
    # Blocks for all 30 prompt tokens, only the last 3 computed; the budget pays for those 3.
    assert a.num_computed_tokens == 27 and len(a.token_ids) == 3 and a.samples and a.is_prefill
    assert len(a.new_block_ids) == 8 and out.total_num_scheduled_tokens == 3
    out, _ = _step(sched, 1.0)
    assert _by_id(out)["a"].num_computed_tokens == 30 and not _by_id(out)["a"].is_prefill


def test_external_tokens_beyond_a_prefix_hit():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", list(range(10)), max_tokens=2))
    _step(sched, 0.0)
    b = make_request("b", list(range(10)) + [50, 51, 52, 53, 54], max_tokens=2, arrival_time=1.0)
    sched.add_request(type(b)("b", b.prompt_token_ids, b.sampling_params, 1.0, num_external_computed_tokens=13))
    scheduled = _by_id(_step(sched, 1.0)[0])["b"]
    assert scheduled.num_computed_tokens == 13 and scheduled.token_ids == (53, 54)
    assert sched.get_request("b").num_cached_tokens == 8  # the local hit; the rest came from outside


def test_external_tokens_are_recomputed_after_preemption():
    """External KV is taken at first admission only: a preempted request recomputes it all."""
    sched = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sched.add_request(make_request("a", 4, max_tokens=8))
    sched.add_request(_external("b", 16, external=15, max_tokens=8))
    first = _by_id(_step(sched, 0.0)[0])["b"]
    assert first.num_computed_tokens == 15 and first.token_ids == (sched.get_request("b").prompt_token_ids[-1],)
    for now in range(1, 20):
        out, _ = _step(sched, float(now))
        if "b" in out.preempted_request_ids:
            break
    else:
        raise AssertionError("b was never preempted")
    while "b" not in _by_id(out):
        out, _ = _step(sched, float(now := now + 1))
    resumed = _by_id(out)["b"]
    assert resumed.num_computed_tokens == 0 and resumed.reset_block_table


@pytest.mark.parametrize("external", [-1, 10, 11])
def test_external_tokens_must_leave_the_last_prompt_token_to_compute(external):
    with pytest.raises(ValueError, match="num_external_computed_tokens"):
        _external("a", 10, external=external)


# ---- speculative decoding ----------------------------------------------------------------


def test_speculative_step_rolls_back_rejected_drafts():
    sched = make_scheduler(num_speculative_tokens=2)
    r = make_request("r", 5, max_tokens=10)
    sched.add_request(r)
    _step(sched, 0.0, token=50)  # prefill: 5 computed, 6 known
    r.spec_token_ids = [51, 52]
    out = sched.schedule(1.0)
    s = _by_id(out)["r"]
    assert s.token_ids == (50, 51, 52) and s.num_draft_tokens == 2 and s.samples
    assert s.num_computed_tokens == 5 and not s.is_prefill
    # Draft 51 accepted, 52 rejected, 61 is the correction.
    updates = sched.update(out, {"r": [51, 61]}, 1.0)
    assert updates[0].new_token_ids == (51, 61)
    assert r.num_computed_tokens == 5 + 3 - 1 == r.num_tokens - 1
    assert r.output_token_ids == [50, 51, 61] and r.token_times == [0.0, 1.0, 1.0]
    assert r.spec_token_ids == []
    out, _ = _step(sched, 2.0, token=70)
    assert _by_id(out)["r"].token_ids == (61,) and _by_id(out)["r"].num_computed_tokens == 7


def test_drafts_all_accepted_and_capped_by_max_tokens():
    sched = make_scheduler(num_speculative_tokens=3)
    r = make_request("r", 4, max_tokens=4)
    sched.add_request(r)
    _step(sched, 0.0, token=1)
    r.spec_token_ids = [2, 3, 4]
    out = sched.schedule(1.0)
    # 1 output so far, 3 to go: at most 2 drafts plus the bonus token.
    assert _by_id(out)["r"].num_draft_tokens == 2
    updates = sched.update(out, {"r": [2, 3, 4]}, 1.0)
    assert updates[0].finished and r.output_token_ids == [1, 2, 3, 4] and r.finish_reason == "length"


def test_drafts_trimmed_by_budget_and_eos_inside_drafts():
    sched = make_scheduler(num_speculative_tokens=2, max_num_batched_tokens=8, max_num_seqs=8)
    r = make_request("r", 4, max_tokens=10, eos_token_id=0)
    big = make_request("big", 40, max_tokens=2)
    sched.add_request(r)
    _step(sched, 0.0, token=1)
    sched.add_request(big)
    out, _ = _step(sched, 1.0, token=1)  # big takes 7 of the budget after r's decode
    r.spec_token_ids = [2, 0]
    out = sched.schedule(2.0)
    s = _by_id(out)["r"]
    assert s.num_draft_tokens == 2
    updates = sched.update(out, {"r": [2, 0]}, 2.0)  # EOS is the second accepted token
    assert updates[0].finished and updates[0].new_token_ids == (2, 0) and r.finish_reason == "stop"


def test_too_many_drafts_raise():
    sched = make_scheduler(num_speculative_tokens=1)
    r = make_request("r", 4, max_tokens=10)
    sched.add_request(r)
    _step(sched, 0.0)
    r.spec_token_ids = [1, 2]
    with pytest.raises(ValueError, match="2 draft tokens, more than num_speculative_tokens=1"):
        sched.schedule(1.0)
