"""Engine policies the scheduler reproduces for other engines: prefill-first batching (vLLM V0,
SGLang), output reservation at admission (TensorRT-LLM, SGLang) and multi-step groups (vLLM 0.6)."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from engine.core import KVCacheManager, Scheduler, SchedulerConfig
from engine.core.errors import InputError
from engine.core.scheduler import OutputReservation

from .testlib import FakeRunner, check_invariants, make_request, run_to_completion, sample_all


def scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 64, **policy: object) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64, block_size=block_size,
                             **policy)  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(num_blocks, block_size, config.enable_prefix_caching))


def step(sched: Scheduler, now: float):
    out = sched.schedule(now)
    check_invariants(sched, out)
    return out, sched.update(out, sample_all(out), now)


def kinds(out) -> set[str]:
    return {"prefill" if s.is_prefill else "decode" for s in out.scheduled}


# ---- prefill-first batching ------------------------------------------------------------------


def test_prefill_first_stalls_decodes_while_a_prompt_waits():
    sched = scheduler(batching="prefill_first")
    sched.add_request(make_request("a", 8, max_tokens=6))
    assert kinds(step(sched, 0.0)[0]) == {"prefill"}
    assert kinds(step(sched, 1.0)[0]) == {"decode"}
    sched.add_request(make_request("b", 8, max_tokens=6))
    out, _ = step(sched, 2.0)
    assert [s.request_id for s in out.scheduled] == ["b"]  # a waits for the prefill
    out, _ = step(sched, 3.0)
    assert {s.request_id for s in out.scheduled} == {"a", "b"} and kinds(out) == {"decode"}


def test_mixed_batching_decodes_and_prefills_in_one_step():
    sched = scheduler()
    sched.add_request(make_request("a", 8, max_tokens=6))
    step(sched, 0.0)
    sched.add_request(make_request("b", 8, max_tokens=6))
    out, _ = step(sched, 1.0)
    assert {s.request_id for s in out.scheduled} == {"a", "b"} and kinds(out) == {"prefill", "decode"}


def test_prefill_first_runs_every_chunk_of_a_long_prompt_before_decoding():
    sched = scheduler(batching="prefill_first", budget=8)
    sched.add_request(make_request("a", 4, max_tokens=8))
    step(sched, 0.0)
    sched.add_request(make_request("b", 30, max_tokens=2))
    chunks = [step(sched, 1.0 + i)[0] for i in range(4)]
    assert all([s.request_id for s in out.scheduled] == ["b"] for out in chunks)  # 8 + 8 + 8 + 6 tokens
    assert [s.num_tokens for out in chunks for s in out.scheduled] == [8, 8, 8, 6]
    assert {s.request_id for s in step(sched, 5.0)[0].scheduled} == {"a", "b"}


# ---- output reservation -----------------------------------------------------------------------


def test_full_reservation_admits_only_what_can_finish():
    # 16 blocks of 4 tokens; each request needs 2 prompt blocks + 24 outputs = 6 more blocks.
    sched = scheduler(num_blocks=16, output_reservation=OutputReservation(1.0, 1.0))
    for rid in "abc":
        sched.add_request(make_request(rid, 8, max_tokens=24))
    out, _ = step(sched, 0.0)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]  # c would not fit with a's and b's outputs
    assert sched.num_waiting == 1


def test_full_reservation_counts_each_requests_last_block_whole():
    # Found by the property below: r1 (16 + 18 tokens) holds 5 of its 9 blocks when r2 (16 + 14) asks;
    # r2 takes 4 now, and the two still need 4 + 4 blocks, where their 28 remaining tokens fill only 7.
    # With 11 free, admitting r2 then would preempt it later.
    sched = scheduler(num_blocks=16, output_reservation=OutputReservation(1.0, 1.0))
    for i, (prompt, out) in enumerate([(1, 1), (16, 18), (16, 14)]):
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=out))
    run_to_completion(sched, max_steps=200, runner=FakeRunner(sched))
    assert sched.stats().num_preemptions == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20)), min_size=1, max_size=12), st.integers(12, 40))
def test_full_reservation_never_preempts(requests, num_blocks):
    sched = scheduler(num_blocks=num_blocks, output_reservation=OutputReservation(1.0, 1.0))
    for i, (prompt, out) in enumerate(requests):
        if -(-(prompt + out - 1) // 4) <= num_blocks:
            sched.add_request(make_request(f"r{i}", prompt, max_tokens=out))
    run_to_completion(sched, max_steps=2000, runner=FakeRunner(sched))
    assert sched.stats().num_preemptions == 0


def test_a_decaying_reservation_admits_more_as_it_decays_and_resets_after_preemption():
    reservation = OutputReservation(initial_ratio=1.0, min_ratio=0.0, decay_per_step=0.5)
    sched = scheduler(num_blocks=12, output_reservation=reservation)
    sched.add_request(make_request("a", 4, max_tokens=24))
    step(sched, 0.0)
    assert sched._reserve_ratio == 1.0  # a prefill step does not decay it
    step(sched, 1.0)
    assert sched._reserve_ratio == 0.5
    sched.add_request(make_request("b", 4, max_tokens=24))
    assert "b" in {s.request_id for s in step(sched, 2.0)[0].scheduled}  # 0 reserved now: b fits
    for now in range(3, 40):
        out, _ = step(sched, float(now))
        if out.preempted_request_ids:
            assert sched._reserve_ratio == 1.0
            break
    else:
        raise AssertionError("two requests of 7 blocks each never ran out of 12 blocks")


def test_a_decayed_reservation_starts_again_once_the_scheduler_is_idle():
    reservation = OutputReservation(initial_ratio=0.8, min_ratio=0.2, decay_per_step=0.1)
    sched = scheduler(output_reservation=reservation)
    sched.add_request(make_request("a", 4, max_tokens=4))
    step(sched, 0.0)
    for now in (1.0, 2.0):
        step(sched, now)
    assert sched._reserve_ratio == pytest.approx(0.6)  # two decode steps; a has one token to go
    sched.add_request(make_request("b", 4, max_tokens=8))  # waiting when a finishes: not idle
    step(sched, 3.0)
    assert sched._reserve_ratio == pytest.approx(0.5)
    run_to_completion(sched, start=4.0)
    assert sched._reserve_ratio == 0.8  # SGLang re-inits new_token_ratio when its loop finds no batch


def test_a_token_pool_reserves_running_outputs_at_the_ratio_and_a_new_request_s_in_full():
    # SGLang's PrefillAdder: the running batch counts new_token_ratio x its outputs still to come, a
    # request of the batch being formed its whole max_new_tokens. One-token blocks: counts are tokens.
    reservation = OutputReservation(initial_ratio=0.5, min_ratio=0.5)
    for num_blocks, admitted in [(48, True), (47, False)]:
        sched = scheduler(num_blocks=num_blocks, block_size=1, output_reservation=reservation)
        sched.add_request(make_request("a", 4, max_tokens=40))
        step(sched, 0.0)
        sched.add_request(make_request("b", 4, max_tokens=20))
        out, _ = step(sched, 1.0)
        # a's decode brings it to 5 blocks; b needs its 4 prompt blocks free beside 0.5 x a's 39
        # outputs to come (19) and its own 20 (at the ratio for b too, 38 blocks would do)
        assert ("b" in {s.request_id for s in out.scheduled}) is admitted, num_blocks


def test_requests_admitted_in_one_step_reserve_each_others_outputs_in_full():
    reservation = OutputReservation(initial_ratio=0.1, min_ratio=0.1)
    sched = scheduler(num_blocks=40, block_size=1, output_reservation=reservation)
    for rid in "ab":
        sched.add_request(make_request(rid, 4, max_tokens=14))
    out, _ = step(sched, 0.0)
    # a: 4 + 14 fit in 40; b then finds 36 free, a's 14 and its own 4 + 14 held back: 32, it fits.
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    sched = scheduler(num_blocks=35, block_size=1, output_reservation=reservation)
    for rid in "ab":
        sched.add_request(make_request(rid, 4, max_tokens=14))
    out, _ = step(sched, 0.0)
    assert [s.request_id for s in out.scheduled] == ["a"]  # at the ratio a's outputs would count 1, not 14
    out, _ = step(sched, 1.0)
    assert "b" in {s.request_id for s in out.scheduled}  # a now runs: 0.1 x its 13 to come


def test_a_clip_caps_the_outputs_a_request_reserves():
    reservation = OutputReservation(initial_ratio=1.0, min_ratio=1.0, clip_tokens=8)
    for prompt, admitted in [(39, True), (40, False)]:
        sched = scheduler(num_blocks=60, block_size=1, output_reservation=reservation)
        sched.add_request(make_request("a", 4, max_tokens=50))
        step(sched, 0.0)
        sched.add_request(make_request("b", prompt, max_tokens=20))
        out, _ = step(sched, 1.0)  # a holds 5 of 60; b's prompt needs its blocks beside 8 + 8 (49 + 20 unclipped)
        assert ("b" in {s.request_id for s in out.scheduled}) is admitted, prompt


def test_a_prompt_cut_by_the_budget_reserves_no_outputs_yet():
    reservation = OutputReservation(initial_ratio=1.0, min_ratio=1.0)
    sched = scheduler(num_blocks=29, block_size=1, budget=8, output_reservation=reservation)
    sched.add_request(make_request("x", 2, max_tokens=8))
    step(sched, 0.0)
    sched.add_request(make_request("a", 10, max_tokens=20))
    out, _ = step(sched, 1.0)
    # x decodes (3 of 29 held, 7 outputs to come); a's first 7 prompt tokens fit beside x's 7 where
    # its own 20 outputs would not: SGLang reserves them once its prompt is whole
    assert {s.request_id: s.num_tokens for s in out.scheduled} == {"x": 1, "a": 7}


def test_a_retraction_sends_back_the_fewest_outputs_first_and_leaves_headroom():
    """SGLang's retract_decode: a decode step with fewer free slots than running requests retracts
    the request with the fewest output tokens (among equals the longest prompt), and more, until the
    free slots hold `retract_headroom_steps` decodes of every request kept; the ratio becomes (their
    outputs + headroom x their number) / their max_tokens."""
    reservation = OutputReservation(0.0, 0.0, clip_tokens=1, retract_headroom_steps=2)
    sched = scheduler(num_blocks=20, block_size=1, batching="prefill_first", output_reservation=reservation)
    for rid, prompt in (("a", 4), ("b", 5), ("c", 3)):
        sched.add_request(make_request(rid, prompt, max_tokens=12))
    step(sched, 0.0)  # the three prompts: 12 of 20 slots
    for now in (1.0, 2.0):
        out, _ = step(sched, now)
        assert not out.preempted_request_ids  # 8, then 5 free: a slot for each decode
    assert sched.kv_cache_manager.num_free_blocks == 2  # short of the 3 decodes
    out, _ = step(sched, 3.0)
    assert out.preempted_request_ids == ("b",)  # 3 outputs each: the longest prompt goes; 9 free hold 2 x 2
    assert {s.request_id for s in out.scheduled} == {"a", "c"}
    assert sched._reserve_ratio == pytest.approx((3 + 3 + 2 * 2) / (12 + 12))
    run_to_completion(sched, start=4.0)  # b comes back and finishes


def test_a_retraction_needs_a_token_pool():
    with pytest.raises(InputError, match="block_size"):
        scheduler(block_size=4, output_reservation=OutputReservation(0.7, 0.1, retract_headroom_steps=20))


# ---- multi-step ---------------------------------------------------------------------------------


def test_multi_step_groups_hold_admission_and_deliver_tokens_together():
    sched = scheduler(num_scheduler_steps=4)
    sched.add_request(make_request("a", 4, max_tokens=10))
    _, updates = step(sched, 0.0)  # the prefill: delivered at once
    assert [u.new_token_ids for u in updates] == [(7,)]
    assert step(sched, 1.0)[1] == []  # a decode-only step opens a group of 4
    sched.add_request(make_request("b", 4, max_tokens=2))
    for now in (2.0, 3.0):
        out, updates = step(sched, now)
        assert [s.request_id for s in out.scheduled] == ["a"] and updates == []  # b waits for the group to end
    out, updates = step(sched, 4.0)
    assert len(updates) == 4 and all(u.request_id == "a" for u in updates)
    assert sched.get_request("a").token_times == [0.0, 4.0, 4.0, 4.0, 4.0]
    assert "b" in {s.request_id for s in step(sched, 5.0)[0].scheduled}


def test_multi_step_group_ends_when_its_requests_finish():
    sched = scheduler(num_scheduler_steps=8)
    sched.add_request(make_request("a", 4, max_tokens=3))
    step(sched, 0.0)
    assert step(sched, 1.0)[1] == []
    _, updates = step(sched, 2.0)
    assert [u.finished for u in updates] == [False, True]
    a = sched.get_request("a")
    assert a.finish_time == 2.0 and a.token_times == [0.0, 2.0, 2.0] and not sched.has_unfinished_requests()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("batching", "interleaved", "batching='interleaved' is invalid"),
    ("num_scheduler_steps", 0, "num_scheduler_steps=0 is invalid"),
])
def test_policy_validation(field, value, message):
    base = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, block_size=4)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, **{field: value})
    with pytest.raises(ValueError, match="ratios"):
        OutputReservation(initial_ratio=0.1, min_ratio=0.5)
