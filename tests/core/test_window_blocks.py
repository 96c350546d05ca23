"""Sliding-window groups: a window group holds the blocks of the last window - 1 computed tokens and
of the tokens being computed, and gives the older ones back to the shared pool (vLLM's hybrid KV
cache manager); checked against that rule computed independently, step by step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from engine.core import KVCacheManager, Request, SamplingParams, WindowGroups


def _request(n: int) -> Request:
    return Request("r", list(range(2, 2 + n)), SamplingParams(max_tokens=64, ignore_eos=True), arrival_time=0.0,
                   eos_token_id=0)


def _live(computed: int, end_tokens: int, window: int, bs: int) -> int:
    """Blocks one group holds to compute tokens computed..end_tokens - 1 (the rule, written out)."""
    positions = set(range(-(-end_tokens // bs)))
    oldest_needed = computed - window + 1
    return sum(1 for p in positions if (p + 1) * bs - 1 >= oldest_needed)


@settings(max_examples=300, deadline=None)
@given(bs=st.sampled_from([1, 2, 4, 16]), window=st.integers(1, 40), groups=st.integers(1, 3),
       prompt=st.integers(1, 60), chunk=st.integers(1, 24), decodes=st.integers(0, 40))
def test_window_groups_hold_exactly_the_live_blocks(bs: int, window: int, groups: int, prompt: int, chunk: int,
                                                   decodes: int) -> None:
    kv = KVCacheManager(1000, bs, enable_prefix_caching=False, window=WindowGroups(groups, window))
    r = _request(prompt)
    while r.num_computed_tokens < prompt:  # chunked prefill
        n = min(chunk, prompt - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        full = -(-(r.num_computed_tokens + n) // bs)
        assert kv.num_free_blocks == 1000 - full - groups * _live(r.num_computed_tokens, r.num_computed_tokens + n, window, bs)
        r.num_computed_tokens += n
    for _ in range(decodes):
        r.output_token_ids.append(5)
        assert kv.allocate_slots(r, 1) is not None
        full = -(-r.num_tokens // bs)
        assert kv.num_free_blocks == 1000 - full - groups * _live(r.num_computed_tokens, r.num_tokens, window, bs)
        r.num_computed_tokens += 1
    assert kv.max_blocks(r.num_tokens, chunk) >= 1000 - kv.num_free_blocks
    kv.free(r)
    assert kv.num_free_blocks == 1000


def test_a_window_changes_nothing_when_the_pool_cannot_take_the_step() -> None:
    # 16 tokens in one step: 4 full blocks and, computing all 16, 4 window blocks; the pool has 6.
    kv = KVCacheManager(6, 4, enable_prefix_caching=False, window=WindowGroups(1, 4))
    r = _request(16)
    assert kv.max_blocks(16, 16) == 8
    assert kv.allocate_slots(r, 16) is None and kv.num_free_blocks == 6
    assert kv.allocate_slots(r, 8) is not None and kv.num_free_blocks == 2  # 2 full + 2 window


def test_windows_refuse_what_they_do_not_model() -> None:
    with pytest.raises(ValueError, match="offload tiers with sliding-window groups"):
        KVCacheManager(8, 4, host_blocks=4, window=WindowGroups(1, 8))
    kv = KVCacheManager(8, 4, window=WindowGroups(1, 8))
    r = _request(3)
    assert kv.allocate_slots(r, 3) is not None
    with pytest.raises(ValueError, match="bulk decodes are not modelled"):
        kv.decode_block_steps(r)
