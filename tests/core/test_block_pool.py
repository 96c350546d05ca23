import pytest

from engine.core import BlockHash, BlockPool

from .testlib import make_request


def _cached(pool: BlockPool, n: int) -> list:
    """Allocate n blocks and register them under made-up hashes."""
    request = make_request("r", 1)
    request.block_hashes = [BlockHash(i, (i,)) for i in range(n)]
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(request, blocks, 0, n)
    return blocks


def test_new_blocks_come_from_the_head_with_ref_one():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)


def test_cannot_allocate_more_than_free():
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)


def test_lru_eviction_order_tail_of_a_request_goes_first():
    pool = BlockPool(4, enable_caching=True)
    blocks = _cached(pool, 4)
    pool.free_blocks(reversed(blocks))  # as KVCacheManager.free does
    assert list(pool.free_queue) == [3, 2, 1, 0]
    evicted = pool.get_new_blocks(1)[0]
    assert evicted.block_id == 3
    assert evicted.block_hash is None
    assert BlockHash(3, (3,)) not in pool.cached_block_hash_to_block
    assert pool.get_cached_block(BlockHash(0, (0,))) is blocks[0]


def test_least_recently_freed_is_evicted_first():
    pool = BlockPool(4, enable_caching=True)
    blocks = _cached(pool, 4)
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[0]])
    pool.free_blocks([blocks[3], blocks[2]])
    assert [b.block_id for b in pool.get_new_blocks(4)] == [1, 0, 3, 2]
    assert not pool.cached_block_hash_to_block


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, enable_caching=True)
    cached = _cached(pool, 2)
    plain = pool.get_new_blocks(2)
    pool.free_blocks(reversed(cached))
    pool.free_blocks(reversed(plain))
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 3]
    assert len(pool.cached_block_hash_to_block) == 2


def test_cache_hit_after_free_revives_the_block():
    pool = BlockPool(4, enable_caching=True)
    block = _cached(pool, 1)[0]
    pool.free_blocks([block])
    assert pool.num_free_blocks == 4
    hit = pool.get_cached_block(BlockHash(0, (0,)))
    assert hit is block
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert hit.block_id not in pool.free_queue
    assert pool.num_free_blocks == 3
    pool.touch([hit])  # a second holder: not in the free queue, just counted
    assert hit.ref_cnt == 2


def test_same_hash_differing_tokens_is_a_miss():
    pool = BlockPool(2, enable_caching=True)
    _cached(pool, 1)
    assert pool.get_cached_block(BlockHash(0, (999,))) is None


def test_double_free_raises():
    pool = BlockPool(2, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free_blocks([block])


def test_duplicate_content_keeps_the_first_copy():
    pool = BlockPool(4, enable_caching=True)
    first = _cached(pool, 1)[0]
    second = _cached(pool, 1)[0]
    assert pool.get_cached_block(BlockHash(0, (0,))) is first
    assert second.block_hash is None


def test_reset_prefix_cache_refused_while_blocks_are_held():
    pool = BlockPool(4, enable_caching=True)
    blocks = _cached(pool, 2)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache()
    assert not pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in pool.blocks)
