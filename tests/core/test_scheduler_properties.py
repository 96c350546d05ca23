"""Randomised end-to-end runs of the scheduler with a fake runner.

Each request has a hidden "true" continuation, which the fake model emits exactly as greedy
decoding would; drafts are the truth with random corruption, accepted up to the first wrong
one. So whatever the scheduler does (chunking, preemption, prefix sharing, rollback), every
request must end with precisely its true continuation cut at its stop condition.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine.core import KVCacheManager, Request, SamplingParams, Scheduler, SchedulerConfig, WindowGroups

from .testlib import FakeRunner, check_invariants, draw_config

VOCAB = 12
EOS = 0
STOP = 1
MAX_STEPS = 3000


@dataclass
class Plan:
    request: Request
    truth: list[int]
    arrival_step: int
    abort_step: int | None


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SchedulerConfig, int, list[Plan], int]:
    config = draw_config(draw, [1, 2, 4], st.integers(12, 40), st.integers(1, 6),
                         num_speculative_tokens=draw(st.integers(0, 3)),
                         preemption_mode=draw(st.sampled_from(["recompute", "swap"])))
    block_size = config.block_size
    # Small pools force preemption; some requests will not fit at all and must be refused.
    num_blocks = draw(st.integers(12 // block_size, 24 // block_size) | st.integers(12 // block_size, 64 // block_size))
    # Offload tiers: none, a host tier, or host and disk; small ones, so they fill and evict too.
    host_blocks = draw(st.sampled_from([0, 0, 2, 8, 32]))
    disk_blocks = draw(st.sampled_from([0, 4, 16])) if host_blocks else 0
    # Sliding-window groups (a hybrid model's KV), where no offload tier is.
    window = None if host_blocks else draw(st.none() | st.builds(WindowGroups, st.integers(1, 2), st.integers(1, 16)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 10))] for _ in range(3)]
    arrival_window = draw(st.sampled_from([0, 4, 15]))  # 0: everything arrives at once
    plans = []
    for i in range(draw(st.integers(1, 14))):
        prefix = rng.choice(prefixes + [[]])
        prompt = prefix + [rng.randrange(2, VOCAB) for _ in range(rng.randint(0 if prefix else 1, 8))]
        max_tokens = rng.randint(1, 10)
        # EOS and the stop token are rare, so most requests run to max_tokens.
        truth = [rng.choice([EOS, STOP]) if rng.random() < 0.04 else rng.randrange(2, VOCAB) for _ in range(max_tokens)]
        params = SamplingParams(
            max_tokens=max_tokens,
            stop_token_ids=(STOP,) if rng.random() < 0.5 else (),
            ignore_eos=rng.random() < 0.2,
        )
        # Some prompts arrive with external KV (a prefill instance's transfer) for all but their last token.
        external = len(prompt) - 1 if rng.random() < 0.2 else 0
        request = Request(f"r{i}", prompt, params, arrival_time=0.0, eos_token_id=EOS, priority=rng.randint(0, 3),
                          num_external_computed_tokens=external)
        arrival = rng.randint(0, arrival_window)
        request.arrival_time = float(arrival)
        abort = arrival + rng.randint(0, 20) if rng.random() < 0.15 else None
        plans.append(Plan(request, truth, arrival, abort))
    return config, (num_blocks, host_blocks, disk_blocks, window), plans, seed


def _most_blocks(num_tokens: int, config: SchedulerConfig, window: WindowGroups | None) -> int:
    """The most blocks a request of num_tokens KV tokens can hold at once, by brute force over every step it
    could be given (any start, any number of tokens within the budget): a block per block_size tokens, and
    each window group the blocks of the window's last window - 1 computed tokens and the step's tokens."""
    bs = config.block_size
    if window is None:
        return -(-num_tokens // bs)
    return max(-(-(s + c) // bs) + window.groups * (-(-(s + c) // bs) - max(0, s - window.window_tokens + 1) // bs)
               for s in range(num_tokens) for c in range(1, min(config.max_num_batched_tokens, num_tokens - s) + 1))


def _expected_output(plan: Plan) -> list[int]:
    params = plan.request.sampling_params
    for i, token in enumerate(plan.truth):
        if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
            return plan.truth[: i + 1]
    return plan.truth


def _propose(sched: Scheduler, truth: dict[str, list[int]], rng: random.Random) -> None:
    """Draft tokens for decoding requests: the truth, sometimes corrupted."""
    k = sched.config.num_speculative_tokens
    for request in sched.running:
        if not k or request.num_computed_tokens != request.num_tokens - 1 or not request.output_token_ids:
            continue
        start = request.num_output_tokens
        drafts = truth[request.request_id][start : start + rng.randint(0, k)]
        request.spec_token_ids = [t if rng.random() < 0.7 else (t + 1) % VOCAB for t in drafts]


def _sample(sched: Scheduler, out, truth: dict[str, list[int]]) -> dict[str, list[int]]:
    sampled = {}
    for s in out.scheduled:
        if not s.samples:
            continue
        request = sched.get_request(s.request_id)
        true = truth[s.request_id][request.num_output_tokens :]
        drafts = s.token_ids[len(s.token_ids) - s.num_draft_tokens :]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == true[accepted]:
            accepted += 1
        sampled[s.request_id] = list(true[: accepted + 1])
    return sampled


def _record_events(out) -> None:
    """Shows, with --hypothesis-show-statistics, that the paths under test are exercised."""
    if out.preempted_request_ids:
        event("preemption")
    if out.kv_transfers is not None:
        for c in out.kv_transfers.copies:
            event(f"copy {c.src} -> {c.dst}")
        if out.kv_transfers.external:
            event("external KV")
    for s in out.scheduled:
        if s.reset_block_table and s.num_computed_tokens:
            event("prefix hit")
        if s.num_draft_tokens:
            event("drafts scheduled")
        if s.is_prefill and not s.samples:
            event("chunked prefill")
        if s.reset_block_table and len(s.token_ids) + s.num_computed_tokens > s.prompt_len:
            event("resume with output tokens")


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_random_workloads_keep_invariants_and_finish(scenario):
    config, (num_blocks, host_blocks, disk_blocks, window), plans, seed = scenario
    rng = random.Random(seed + 1)
    sched = Scheduler(config, KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                             host_blocks=host_blocks, disk_blocks=disk_blocks, window=window))
    runner = FakeRunner(sched, external={p.request.request_id: list(p.request.prompt_token_ids) for p in plans})
    truth = {p.request.request_id: p.truth for p in plans}
    accepted: list[Plan] = []
    aborted: set[str] = set()
    last_arrival = max(p.arrival_step for p in plans)

    step = 0
    while step <= last_arrival or sched.has_unfinished_requests():
        assert step < MAX_STEPS, "requests starved"
        now = float(step)
        for plan in plans:
            if plan.arrival_step == step:
                r, n = plan.request, plan.request.num_prompt_tokens + plan.request.max_tokens
                fits = n <= config.max_model_len and _most_blocks(n - 1, config, window) <= num_blocks
                if fits:
                    sched.add_request(r)
                    accepted.append(plan)
                else:
                    try:
                        sched.add_request(r)
                    except ValueError as e:
                        assert repr(r.request_id) in str(e)
                        event("refused")
                    else:
                        raise AssertionError(f"{r.request_id} should have been refused")
            if plan.abort_step == step and plan in accepted and sched.abort_request(plan.request.request_id, now):
                aborted.add(plan.request.request_id)
                event("abort")
        _propose(sched, truth, rng)
        out = sched.schedule(now)
        check_invariants(sched, out)
        runner.execute(out)
        for rid in out.preempted_request_ids:
            swapped = sched.kv_cache_manager.is_swapped(sched.get_request(rid))
            assert swapped or sched.get_request(rid).num_computed_tokens == 0
            assert not swapped or config.preemption_mode == "swap"
        _record_events(out)
        finishes_none = sched.finishes_none(out)
        updates = sched.update(out, _sample(sched, out, truth), now)
        if finishes_none:  # what lets the simulator complete a step ahead of SimPy's clock
            event("finishes none")
            assert not any(u.finished for u in updates)
        step += 1

    pool = sched.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks), "leaked blocks"
    assert pool.num_free_blocks == pool.num_blocks
    assert not sched.kv_cache_manager.req_to_blocks
    tiers = sched.kv_cache_manager.tiers
    if tiers is not None:
        assert tiers.host.num_held == 0, "leaked swap slots"
    stats = sched.stats()
    assert stats.num_requests == len(accepted)
    assert sum(stats.num_finished.values()) == len(accepted)
    assert stats.num_finished["abort"] == len(aborted)
    for plan in accepted:
        r = plan.request
        assert r.is_finished
        if r.request_id in aborted:
            assert r.finish_reason == "abort"
            assert r.output_token_ids == plan.truth[: r.num_output_tokens]
            continue
        expected = _expected_output(plan)
        assert r.output_token_ids == expected
        assert r.finish_reason == ("length" if len(expected) == r.max_tokens and expected is plan.truth else "stop")
        assert len(r.token_times) == r.num_output_tokens
        assert r.token_times == sorted(r.token_times)
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time
