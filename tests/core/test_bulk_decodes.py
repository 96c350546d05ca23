"""Bulk decodes (engine/core/bulk_decodes.py) against the scheduler handling every request one by one.

Two schedulers take the same requests, aborts and sampled tokens; one is given the decode token
and applies decodes in bulk. After every step both must agree on everything a simulator or a
runner could observe: the step's shape (requests, prefill and decode tokens, summed and longest
decode context), preemptions, finishes, cache use, the block pool down to the order of its free
queue and every request's blocks; and at the end on every request's tokens and timestamps. A step
the bulk scheduler promised to be bulk decodes only (Scheduler.bulk_run) must be one, of the shape
it said.
"""

from __future__ import annotations

import random

from hypothesis import event, given, settings
from hypothesis import strategies as st
import pytest

from engine.core import KVCacheManager, Request, SamplingParams, Scheduler, SchedulerConfig, SchedulerOutput
from engine.core.scheduler import OutputReservation

from .testlib import draw_config, make_request

TOKEN = 5  # what the executor samples, every step, for every request
MAX_STEPS = 4000


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    return draw_config(
        draw, [2, 3, 4, 8], st.integers(16, 64), st.integers(1, 8),
        batching=draw(st.sampled_from(["mixed", "prefill_first"])),
        output_reservation=draw(st.sampled_from([None, OutputReservation(1.0, 1.0), OutputReservation(0.7, 0.2, 0.05)])),
    )


def _requests(rng: random.Random, config: SchedulerConfig, n: int) -> list[tuple[int, Request]]:
    """(arrival step, request); shared prefixes for prefix hits, some stop on the decode token. Some
    repeat an earlier prompt (equal decode-produced blocks, registered by both), some go on from an
    earlier prompt and its decodes, as a follow-up turn does (hits on decode-produced blocks)."""
    prefixes = [[rng.randrange(10, 20) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    out: list[tuple[int, Request]] = []
    for i in range(n):
        prefix = rng.choice(prefixes + [[]])
        prompt = prefix + [rng.randrange(10, 20) for _ in range(rng.randint(0 if prefix else 1, 10))]
        kind = rng.random()
        if out and kind < 0.15:
            prompt = list(rng.choice(out)[1].prompt_token_ids)
        elif out and kind < 0.3:
            prompt = list(rng.choice(out)[1].prompt_token_ids) + [TOKEN] * rng.randint(1, 20) + prompt[:2]
        prompt = prompt[: config.max_model_len - 1]
        max_tokens = rng.randint(1, max(1, min(40, config.max_model_len - len(prompt))))
        stop = rng.random()
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(TOKEN,) if stop < 0.05 else (),
                                ignore_eos=stop > 0.9)
        request = Request(f"r{i}", prompt, params, arrival_time=0.0, eos_token_id=TOKEN if stop > 0.85 else None,
                          priority=rng.randint(0, 2))
        out.append((rng.randint(0, 30), request))
    return out


def _twin(request: Request) -> Request:
    return Request(request.request_id, list(request.prompt_token_ids), request.sampling_params, request.arrival_time,
                   eos_token_id=request.eos_token_id, priority=request.priority)


def _shape(out: SchedulerOutput) -> tuple:
    """What a cost model reads of a step, with bulk decodes folded in."""
    decodes = [s for s in out.scheduled if not s.is_prefill]
    bulk = out.bulk_decodes
    return (len(out.scheduled) + bulk.num_requests, out.total_num_scheduled_tokens, out.num_prefill_tokens,
            sum(s.context_len for s in decodes) + bulk.context_tokens,
            max([s.context_len for s in decodes] + [bulk.max_context_len]),
            out.preempted_request_ids, out.finished_request_ids, out.num_running, out.num_waiting, out.kv_cache_usage)


def _sampled(out: SchedulerOutput) -> dict[str, list[int]]:
    return {s.request_id: [TOKEN] for s in out.scheduled if s.samples}


def _pool_state(sched: Scheduler) -> tuple:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    return (pool.free_block_ids(), {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_to_blocks.items()},
            sorted((b.block_id, b.block_hash) for b in pool.cached_block_hash_to_block.values()),
            dict(kv.num_cached_blocks))


@settings(max_examples=200, deadline=None)
@given(configs(), st.integers(1, 16), st.integers(0, 2**32 - 1), st.data())
def test_bulk_decodes_give_what_one_by_one_gives(config: SchedulerConfig, n: int, seed: int, data: st.DataObject) -> None:
    rng = random.Random(seed)
    num_blocks = data.draw(st.integers(-(-config.max_model_len // config.block_size), 64 // config.block_size + 8))
    plan = [(step, r) for step, r in _requests(rng, config, n)
            if r.num_prompt_tokens + r.max_tokens <= config.max_model_len
            and -(-(r.num_prompt_tokens + r.max_tokens - 1) // config.block_size) <= num_blocks
            and (config.enable_chunked_prefill or r.num_prompt_tokens + r.max_tokens - 1 <= config.max_num_batched_tokens)
            # A full reservation rounds prompt and outputs up separately: a request that fills the pool
            # exactly would wait forever (in both schedulers).
            and -(-r.num_prompt_tokens // config.block_size) + -(-r.max_tokens // config.block_size) <= num_blocks]
    aborts = {r.request_id: (step + rng.randint(0, 40), rng.random() < 0.5) for step, r in plan if rng.random() < 0.1}
    for out in _run_pair(config, num_blocks, plan, aborts):
        if out.bulk_decodes.num_requests:
            event("bulk decodes")
        if out.preempted_request_ids and out.bulk_decodes.num_requests:
            event("preemption beside bulk decodes")


def _run_pair(config: SchedulerConfig, num_blocks: int, plan: list[tuple[int, Request]],
              aborts: dict[str, tuple[int, bool]]) -> list[SchedulerOutput]:
    """Run `plan` (arrival step, request) through one scheduler one by one and through another with
    bulk decodes, with `aborts` (request id: step, between schedule() and update()), checking that
    they agree after every step and at the end. Returns the bulk scheduler's outputs."""
    one = Scheduler(config, KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching))
    bulk = Scheduler(config, KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching), TOKEN)
    twins = {r.request_id: _twin(r) for _, r in plan}
    last_arrival = max((step for step, _ in plan), default=0)

    outputs = []
    step = 0
    while step <= last_arrival or one.has_unfinished_requests():
        assert step < MAX_STEPS, "requests starved"
        now = float(step)
        for arrival, r in plan:
            if arrival == step:
                r.arrival_time = twins[r.request_id].arrival_time = now
                one.add_request(r)
                bulk.add_request(twins[r.request_id])

        def abort(between: bool) -> None:
            for rid, (at, mid_step) in aborts.items():
                if at == step and mid_step == between and rid in one.requests:
                    assert one.abort_request(rid, now) == bulk.abort_request(rid, now)

        abort(between=False)
        ahead, first = bulk.bulk_run()  # a promise the simulator's runs of bulk decodes rely on
        a, b = one.schedule(now), bulk.schedule(now)
        assert _shape(a) == _shape(b)
        if ahead:
            assert b.scheduled == () and b.kv_transfers is None and b.bulk_decodes == first
        outputs.append(b)
        abort(between=True)  # an abort between schedule() and update()
        ua, ub = one.update(a, _sampled(a), now), bulk.update(b, _sampled(b), now)
        assert [u for u in ua if u.finished] == [u for u in ub if u.finished]
        assert _pool_state(one) == _pool_state(bulk)
        step += 1

    assert one.stats() == bulk.stats()
    for _, r in plan:
        t = bulk.get_request(r.request_id)
        assert (r.output_token_ids, r.token_times, r.num_computed_tokens, r.first_scheduled_time, r.first_token_time,
                r.finish_time, r.finish_reason, r.num_preemptions, r.num_cached_tokens) == (
                t.output_token_ids, t.token_times, t.num_computed_tokens, t.first_scheduled_time, t.first_token_time,
                t.finish_time, t.finish_reason, t.num_preemptions, t.num_cached_tokens)
    return outputs


def test_owed_blocks_turn_back_into_visits_when_another_request_takes_the_pool() -> None:
    """A bulk decode owes its next block while the pool has room; an admission that takes the room
    turns it back into a visit, so the decode meets the short pool in its own place and step, and
    preempts there, as one by one does."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, block_size=4,
                             enable_prefix_caching=False)
    # "a" decodes in bulk from step 1 and owes its second block in step 2; "b" arrives in step 1 and
    # its prompt takes every block left, so in step 2 "a" finds none and preempts "b" (the latest
    # admitted). Had "a" still owed the block, paying it would have failed (a RuntimeError).
    a, b = make_request("a", 3, max_tokens=20), make_request("b", 22, max_tokens=5)
    outputs = _run_pair(config, 7, [(0, a), (1, b)], {})
    assert outputs[1].bulk_decodes.num_requests == 1
    assert outputs[2].preempted_request_ids == ("b",)
    assert [s.request_id for s in outputs[2].scheduled] == ["a"]


def test_a_decode_with_nothing_due_is_not_looked_at() -> None:
    """Between its events a bulk decode's own fields stand still; reading it brings them up to date."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, block_size=8)
    sched = Scheduler(config, KVCacheManager(16, 8, True), TOKEN)
    sched.add_request(make_request("a", 3, max_tokens=20))
    for step in range(4):
        out = sched.schedule(float(step))
        sched.update(out, _sampled(out), float(step))
    # Step 0 prefilled 3 tokens and sampled one; steps 1-3 decoded in bulk (the block holds 8 slots).
    assert out.scheduled == () and out.bulk_decodes.num_requests == 1
    request = sched.requests["a"]
    assert request.num_output_tokens == 1 and request.bulk_since >= 0
    assert sched.get_request("a").output_token_ids == [TOKEN] * 4
    assert request.token_times == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(("config", "why"), [
    (SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, block_size=1), "one-token blocks"),
    (SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, block_size=4, num_scheduler_steps=4),
     "multi-step groups"),
    (SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, block_size=4, num_speculative_tokens=2),
     "speculation"),
])
def test_no_bulk_where_every_step_changes_a_request(config: SchedulerConfig, why: str) -> None:
    sched = Scheduler(config, KVCacheManager(32, config.block_size, True), TOKEN)
    sched.add_request(make_request("a", 3, max_tokens=10))
    for step in range(5):
        out = sched.schedule(float(step))
        assert not out.bulk_decodes.num_requests, why
        sched.update(out, _sampled(out), float(step))
