import gc
import sys
import tracemalloc

import pytest

from engine.core import BlockHash, KVCacheManager, Request, SamplingParams, hash_block_tokens
from engine.core.block_pool import PRIVATE_KEY

from .testlib import make_request

BS = 4


def _admit(kv: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does at admission: take the cached prefix, allocate the rest."""
    blocks, num_hit = kv.get_computed_blocks(request)
    new_ids = kv.allocate_slots(request, request.num_tokens - num_hit, blocks)
    assert new_ids is not None
    request.num_computed_tokens = num_hit
    return new_ids


def test_common_prefix_shares_blocks():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(8)) + [50, 51, 52])
    _admit(kv, a)
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert [blk.block_id for blk in blocks] == kv.get_block_ids("a")[:2]
    _admit(kv, b)
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2] != kv.get_block_ids("a")[2]
    assert [blk.ref_cnt for blk in kv.req_to_blocks["b"]] == [2, 2, 1]
    assert kv.num_free_blocks == 16 - 4


def test_whole_prompt_is_never_a_hit():
    kv = KVCacheManager(16, BS)
    _admit(kv, make_request("a", list(range(8))))
    blocks, num_hit = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert num_hit == 4  # the second block holds the last token, whose logits are needed
    assert len(blocks) == 1


def test_partial_blocks_are_not_cached():
    kv = KVCacheManager(16, BS)
    _admit(kv, make_request("a", list(range(7))))
    assert len(kv.block_pool.cached_block_hash_to_block) == 1


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(4, BS)
    _admit(kv, make_request("a", list(range(10))))  # 3 blocks
    b = make_request("b", list(range(8)) + [60, 61, 62, 63, 64])  # hits 2 blocks, needs 2 more
    blocks, num_hit = kv.get_computed_blocks(b)
    free_before = kv.num_free_blocks
    refs_before = [blk.ref_cnt for blk in kv.block_pool.blocks]
    assert kv.allocate_slots(b, b.num_tokens - num_hit, blocks) is None
    assert kv.num_free_blocks == free_before
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == refs_before
    assert "b" not in kv.req_to_blocks
    assert kv.prefix_cache_stats.num_queries == 1


def test_revived_hit_blocks_count_against_free_space():
    kv = KVCacheManager(3, BS)
    a = make_request("a", list(range(9)))
    _admit(kv, a)
    a.num_computed_tokens = 9
    kv.free(a)
    # Blocks 0 and 1 of `a` are cached and free. `b` hits both and needs 2 more: 3 free blocks
    # would seem enough, but the hits are among them.
    b = make_request("b", list(range(8)) + [70] * 5)
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, b.num_tokens - num_hit, blocks) is None
    c = make_request("c", list(range(8)) + [70])
    blocks, num_hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - num_hit, blocks) == [2]


def test_hit_counters_in_tokens():
    kv = KVCacheManager(16, BS)
    _admit(kv, make_request("a", list(range(10))))
    _admit(kv, make_request("b", list(range(10))))
    stats = kv.prefix_cache_stats
    assert (stats.num_queries, stats.query_tokens, stats.hit_tokens) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)


def test_lookups_without_admission_are_not_counted():
    kv = KVCacheManager(16, BS)
    r = make_request("a", list(range(10)))
    for _ in range(3):
        kv.get_computed_blocks(r)
    assert kv.prefix_cache_stats.num_queries == 0


def test_free_releases_tail_first():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(12)))
    _admit(kv, a)
    a.num_computed_tokens = 12
    ids = kv.get_block_ids("a")
    kv.free(a)
    assert kv.block_pool.free_block_ids()[-3:] == ids[::-1]
    assert kv.get_block_ids("a") == []
    assert kv.num_free_blocks == 8


def test_extra_key_separates_caches():
    kv = KVCacheManager(16, BS)
    _admit(kv, make_request("a", list(range(10))))
    b = Request("b", list(range(10)), SamplingParams(), 0.0, extra_key="lora-1")
    assert kv.get_computed_blocks(b) == ([], 0)


def test_hash_chains_over_the_prefix():
    kv = KVCacheManager(16, BS)
    _admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: no hit at all.
    assert kv.get_computed_blocks(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == ([], 0)


def test_a_block_hash_is_120_bits_over_parent_tokens_and_extra_key():
    root, tokens = BlockHash(0), (1000, 1001, 1002, 1003)
    h = hash_block_tokens(root, tokens, None)
    assert h == hash_block_tokens(root, list(tokens), None)  # a pure function of the values
    assert 0 <= h < 2**120 and h.bit_length() > 64  # wide, not Python's 64-bit hash()
    assert len({h, hash_block_tokens(h, tokens, None),  # the parent, i.e. the prefix, counts
                hash_block_tokens(root, tokens[::-1], None), hash_block_tokens(root, tokens[:3], None),
                hash_block_tokens(root, tokens, "1"), hash_block_tokens(root, tokens, 1),  # a str is not its int
                hash_block_tokens(root, tokens, "")}) == 7


def test_an_extra_key_must_be_a_str_or_an_int():
    for key in ("lora-1", 7, None):
        Request("r", [1, 2], SamplingParams(), 0.0, extra_key=key)
    # Refused by Request's own check, or, where the core is compiled (engine/core/compiled.py), by the
    # compiled dataclass's check of the field's type, which comes first.
    with pytest.raises((ValueError, TypeError),
                       match=r"extra_key=\(1, 2\) is invalid: must be None, a str or an int|"
                             r"union\[str, int, None\] object expected; got tuple"):
        Request("r", [1, 2], SamplingParams(), 0.0, extra_key=(1, 2))  # type: ignore[arg-type]


def test_a_cached_block_keeps_only_its_block_object_and_its_hash() -> None:
    """Memory follows the blocks a pool has filled, not what was in them: once its requests are
    gone, all that is live is, per cached block, the KVCacheBlock, its id and its hash, plus the
    pool's list of blocks and its hash -> block map. No token ids, no per-entry queue nodes."""
    num_blocks, bs, blocks_per_request = 4096, 16, 8
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kv = KVCacheManager(num_blocks, bs)
        for i in range(num_blocks // blocks_per_request):
            r = make_request(f"r{i}", blocks_per_request * bs)  # fresh token ids >= 1000: real int objects
            _admit(kv, r)
            r.num_computed_tokens = r.num_tokens
            kv.free(r)
        del r
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    pool = kv.block_pool
    assert len(pool.cached_block_hash_to_block) == num_blocks == pool.num_free_blocks
    stored = sum(sys.getsizeof(b) + sys.getsizeof(b.block_id) + sys.getsizeof(b.block_hash) for b in pool.blocks)
    stored += sys.getsizeof(pool.blocks) + sys.getsizeof(pool.cached_block_hash_to_block)
    # Slack: the manager's own objects and the interpreter's free lists, a few bytes a block.
    assert used <= stored + 64 * 1024, f"{used / num_blocks:.0f} bytes per cached block, {stored / num_blocks:.0f} stored"
    # 72 the block (5 slots and the GC header), 28 its id, 40 a 120-bit int, 8 its place in
    # pool.blocks, 32-120 its dict entry depending on the dict's fill: under 256 in all, where a
    # tuple of its 16 token ids alone took 184 + 16 * 28 (the ints too, once the prompt is gone).
    assert used / num_blocks < 256, f"{used / num_blocks:.0f} bytes per cached block"


def test_draft_tokens_are_never_hashed():
    kv = KVCacheManager(16, BS)
    r = make_request("a", list(range(5)))
    _admit(kv, r)
    r.num_computed_tokens = 5
    r.output_token_ids.append(40)  # 6 known tokens
    # The last known token plus two drafts fill block 1, but only 6 tokens are known.
    assert kv.allocate_slots(r, 3) == []
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    r.num_computed_tokens = 5 + 3 - 1  # one draft accepted, one rejected...
    r.output_token_ids += [41, 42]  # ...plus the bonus token: 8 known
    assert kv.allocate_slots(r, 1) == []
    assert len(kv.block_pool.cached_block_hash_to_block) == 2


def test_free_before_the_step_ran_drops_unfilled_hashes():
    kv = KVCacheManager(8, BS)
    r = make_request("a", list(range(10)))
    _admit(kv, r)  # blocks 0 and 1 registered, but the step never ran
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    r.num_computed_tokens = 0  # still: nothing was computed
    kv.free(r)
    assert not kv.block_pool.cached_block_hash_to_block
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)


def test_computed_blocks_stay_cached_after_free():
    kv = KVCacheManager(8, BS)
    r = make_request("a", list(range(10)))
    _admit(kv, r)
    r.num_computed_tokens = 10
    kv.free(r)
    assert kv.get_computed_blocks(make_request("b", list(range(10))))[1] == 8


def test_prefix_caching_off():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    _admit(kv, make_request("a", list(range(10))))
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    assert not kv.block_pool.cached_block_hash_to_block
    assert kv.prefix_cache_stats.num_queries == 0


def test_reset_prefix_cache():
    kv = KVCacheManager(8, BS)
    r = make_request("a", list(range(10)))
    _admit(kv, r)
    r.num_computed_tokens = 10
    assert not kv.reset_prefix_cache()
    kv.free(r)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)


def test_allocation_grows_one_block_at_a_boundary():
    kv = KVCacheManager(8, BS)
    r = make_request("a", list(range(4)))
    assert _admit(kv, r) == [0]
    r.num_computed_tokens = 4
    r.output_token_ids.append(9)
    assert kv.allocate_slots(r, 1) == [1]
    r.num_computed_tokens = 5
    r.output_token_ids.append(9)
    assert kv.allocate_slots(r, 1) == []
    with pytest.raises(ValueError, match="num_new_tokens=0"):
        kv.allocate_slots(r, 0)


def test_a_served_request_leaves_its_full_blocks_cached_and_counts_nothing():
    """A server's history: what it served before a measured run is in its prefix cache, as a
    request that ran and finished would have left it; the hit statistics are the run's alone."""
    kv = KVCacheManager(8, BS)
    kv.served("before", list(range(10)) + [90, 91])  # prompt of 10, output of 2: three full blocks
    assert kv.num_free_blocks == 8 and kv.prefix_cache_stats.num_queries == 0
    again = make_request("again", list(range(10)))
    assert kv.get_computed_blocks(again)[1] == 8  # the prompt's full blocks; its last token recomputed
    longer = make_request("longer", list(range(10)) + [90, 91, 5])
    assert kv.get_computed_blocks(longer)[1] == 12  # the output's block too


def test_served_requests_evict_the_least_recently_served():
    kv = KVCacheManager(4, BS)
    first, second = list(range(16)), list(range(100, 116))
    kv.served("first", first)
    kv.served("second", second)  # four blocks in a pool of four: the first request's all go
    assert kv.get_computed_blocks(make_request("a", first + [0]))[1] == 0
    assert kv.get_computed_blocks(make_request("b", second + [0]))[1] == 16
    # Two blocks more: freed tail first, the second request's last two blocks are the least recent.
    kv.served("first-again", first[:8])
    assert kv.get_computed_blocks(make_request("c", second + [0]))[1] == 8
    assert kv.get_computed_blocks(make_request("d", first[:8] + [0]))[1] == 8


def _private(request_id: str, prompt: list[int]) -> Request:
    request = make_request(request_id, prompt)
    request.private_blocks = True
    return request


def test_a_private_request_hashes_nothing_and_registers_its_filled_blocks_when_it_finishes():
    """Its blocks go into the LRU queue when freed, as hashed ones would (so they are evicted in the
    same order), under a key no lookup can find, outside the lookup table."""
    kv = KVCacheManager(8, BS)
    r = _private("a", list(range(10)))
    _admit(kv, r)
    assert r.block_hashes == [] and not kv.block_pool.cached_block_hash_to_block
    r.num_computed_tokens = 10
    kv.free(r)
    cached = [b for b in kv.block_pool.blocks if b.block_hash is not None]
    assert [b.block_hash for b in cached] == [PRIVATE_KEY] * 2  # the two full blocks of computed tokens
    assert PRIVATE_KEY < 0 and not kv.block_pool.cached_block_hash_to_block
    assert r.block_hashes == []
    assert kv.block_pool.free_block_ids()[-2:] == [1, 0]  # the LRU queue's tail, tail first, as hashed
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)


def test_a_preempted_private_request_resumes_on_its_own_cached_blocks():
    """Preempted, it will be admitted again and may hit what it computed: its blocks are registered
    under their digests, and it is private no more."""
    kv = KVCacheManager(8, BS)
    r = _private("a", list(range(10)))
    _admit(kv, r)
    r.num_computed_tokens = 10
    kv.free(r, preempted=True)
    assert not r.private_blocks
    assert kv.get_computed_blocks(r)[1] == 8
    assert kv.get_computed_blocks(make_request("b", list(range(10))))[1] == 8  # the same as hashed blocks


def test_private_blocks_need_what_only_digests_give_with_offload_tiers():
    """A host tier keeps evicted blocks under their keys, where a digest is needed: the flag is ignored."""
    kv = KVCacheManager(8, BS, host_blocks=4)
    r = _private("a", list(range(10)))
    _admit(kv, r)
    assert len(r.block_hashes) == 2 and len(kv.block_pool.cached_block_hash_to_block) == 2
