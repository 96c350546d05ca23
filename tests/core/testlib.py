"""Shared helpers for the engine.core tests: builders, a fake runner and invariant checks."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import strategies as st

from engine.core import (
    KVCacheManager,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

_prompt_counter = itertools.count(1)


def draw_config(draw: st.DrawFn, block_sizes: list[int], max_model_len: st.SearchStrategy[int],
                max_num_seqs: st.SearchStrategy[int], **settings: object) -> SchedulerConfig:
    """A random SchedulerConfig whose token budget holds a decode per sequence, and a whole prompt
    when prefills are not chunked; `settings` fixes the rest."""
    block_size = draw(st.sampled_from(block_sizes))
    chunked = draw(st.booleans())
    model_len, num_seqs = draw(max_model_len), draw(max_num_seqs)
    min_budget = max(num_seqs, 1 if chunked else model_len)
    return SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(min_budget, min_budget + 24)),
        max_num_seqs=num_seqs,
        max_model_len=model_len,
        block_size=block_size,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        **settings,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
    num_speculative_tokens: int = 0,
    preemption_mode: str = "recompute",
    host_blocks: int = 0,
    disk_blocks: int = 0,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        block_size=block_size,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        policy=policy,  # type: ignore[arg-type]
        num_speculative_tokens=num_speculative_tokens,
        preemption_mode=preemption_mode,  # type: ignore[arg-type]
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching, host_blocks, disk_blocks))


def make_request(
    request_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    arrival_time: float = 0.0,
    eos_token_id: int | None = None,
    priority: int = 0,
    **params: object,
) -> Request:
    """`prompt` may be a length: then fresh tokens >= 1000 are drawn, never a stop or EOS
    token and never shared with another request's prompt."""
    if isinstance(prompt, int):
        start = 1000 * next(_prompt_counter)
        tokens = list(range(start, start + prompt))
    else:
        tokens = list(prompt)
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        arrival_time=arrival_time,
        eos_token_id=eos_token_id,
        priority=priority,
    )


def sample_all(out: SchedulerOutput, token: int = 7) -> dict[str, list[int]]:
    """One token for every request that samples this step."""
    return {s.request_id: [token] for s in out.scheduled if s.samples}


def run_to_completion(sched: Scheduler, start: float = 0.0, max_steps: int = 1000, token: int = 7,
                      runner: FakeRunner | None = None) -> float:
    """Step until every request has finished (one second a step), checking the invariants each
    step and, with a `runner`, executing each step's KV copies and writes on it."""
    now = start
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return now
        out = sched.schedule(now)
        check_invariants(sched, out)
        if runner is not None:
            runner.execute(out)
        sched.update(out, sample_all(out, token), now)
        now += 1.0
    raise AssertionError(f"not finished after {max_steps} steps")


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg, kv = sched.config, sched.kv_cache_manager
    pool = kv.block_pool
    assert out.total_num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    assert all(len(s.token_ids) >= 1 for s in out.scheduled)
    assert len(sched.running) <= cfg.max_num_seqs
    assert out.num_running == len(sched.running) and out.num_waiting == sched.num_waiting

    running_ids = {r.request_id for r in sched.running}
    assert set(kv.req_to_blocks) == running_ids, "only running requests hold blocks"
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)
    holders: Counter[int] = Counter()
    window_blocks = kv.window.held() if kv.window is not None else {}
    assert set(window_blocks) <= running_ids, "only running requests hold window blocks"
    for rid, blocks in [*kv.req_to_blocks.items(), *window_blocks.items()]:
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{rid} holds a block twice"
        holders.update(ids)
    free_ids = set(pool.free_block_ids())
    assert len(free_ids) == pool.num_free_blocks
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}"
        assert (block.block_id in free_ids) == (block.ref_cnt == 0)
    assert pool.num_free_blocks + len(holders) == pool.num_blocks
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_block_hash_to_block)

    for s in out.scheduled:
        request = sched.get_request(s.request_id)
        assert request.status is RequestStatus.RUNNING
        assert request.num_computed_tokens == s.num_computed_tokens
        assert len(kv.req_to_blocks[s.request_id]) * cfg.block_size >= s.context_len
        assert s.context_len <= cfg.max_model_len


class FakeRunner:
    """Mirrors what the torch runner does with a SchedulerOutput: it keeps block tables from
    reset/append deltas alone, performs the step's KV copies (offload tiers, external KV) and
    writes each token into its KV slot. Reading the slots back proves that shared prefix blocks,
    preemption (recompute or swap), tier hits, external KV and draft rollback never corrupt a
    context. External KV of a request is its true prompt (`external[request_id]`)."""

    def __init__(self, sched: Scheduler, external: dict[str, list[int]] | None = None) -> None:
        self.sched = sched
        self.block_tables: dict[str, list[int]] = {}
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token whose KV is there
        self.tiers: dict[tuple[str, int], tuple[int | None, ...]] = {}  # (tier, slot) -> a block's tokens
        self.external = external or {}

    def _copy(self, out: SchedulerOutput) -> None:
        bs = self.sched.config.block_size
        transfers = out.kv_transfers
        if transfers is None:
            return
        for c in transfers.copies:
            if c.src == "device":
                content = tuple(self.slots.get((c.src_id, o)) for o in range(bs))
            else:
                content = self.tiers[(c.src, c.src_id)]
            if c.dst == "device":
                for o, token in enumerate(content):
                    if token is None:
                        self.slots.pop((c.dst_id, o), None)
                    else:
                        self.slots[(c.dst_id, o)] = token
            else:
                self.tiers[(c.dst, c.dst_id)] = content
        for load in transfers.external:
            prompt = self.external[load.request_id]
            for i, block_id in enumerate(load.block_ids):
                for o in range(bs):
                    pos = (load.first_block + i) * bs + o
                    if pos < len(prompt):
                        self.slots[(block_id, o)] = prompt[pos]

    def execute(self, out: SchedulerOutput) -> None:
        bs = self.sched.config.block_size
        for rid in out.finished_request_ids + out.preempted_request_ids:
            self.block_tables.pop(rid, None)
        self._copy(out)
        for s in out.scheduled:
            if s.reset_block_table:
                self.block_tables[s.request_id] = list(s.new_block_ids)
            else:
                self.block_tables[s.request_id].extend(s.new_block_ids)
            assert self.block_tables[s.request_id] == self.sched.kv_cache_manager.get_block_ids(s.request_id)
        # The whole batch's KV is written before anyone attends, as in a real forward pass.
        for s in out.scheduled:
            table = self.block_tables[s.request_id]
            for i, token in enumerate(s.token_ids):
                pos = s.num_computed_tokens + i
                self.slots[(table[pos // bs], pos % bs)] = token
        for s in out.scheduled:
            request = self.sched.get_request(s.request_id)
            table = self.block_tables[s.request_id]
            expected = list(request.token_slice(0, s.num_computed_tokens)) + list(s.token_ids)
            seen = [self.slots.get((table[p // bs], p % bs)) for p in range(s.context_len)]
            assert seen == expected, f"{s.request_id}: KV context corrupted"
