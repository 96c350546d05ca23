from collections import OrderedDict
from collections.abc import Iterable

from hypothesis import given, settings, strategies as st
import pytest

from engine.core import BlockHash, BlockPool
from engine.core.block_pool import KVCacheBlock

from .testlib import make_request


def _cached(pool: BlockPool, n: int) -> list:
    """Allocate n blocks and register them under made-up hashes."""
    request = make_request("r", 1)
    request.block_hashes = [BlockHash(i) for i in range(n)]
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
    assert pool.free_block_ids() == [3, 2, 1, 0]
    evicted = pool.get_new_blocks(1)[0]
    assert evicted.block_id == 3
    assert evicted.block_hash is None
    assert BlockHash(3) not in pool.cached_block_hash_to_block
    assert pool.get_cached_block(BlockHash(0)) is blocks[0]


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
    hit = pool.get_cached_block(BlockHash(0))
    assert hit is block
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert hit.block_id not in pool.free_block_ids()
    assert pool.num_free_blocks == 3
    pool.touch([hit])  # a second holder: not in the free queue, just counted
    assert hit.ref_cnt == 2


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
    assert pool.get_cached_block(BlockHash(0)) is first
    assert second.block_hash is None


def test_reset_prefix_cache_refused_while_blocks_are_held():
    pool = BlockPool(4, enable_caching=True)
    blocks = _cached(pool, 2)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache()
    assert not pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in pool.blocks)


# --------------------------------------------------------------------------- lazy = eager


class EagerBlockPool:
    """The known answer: the pool as it was before blocks were made lazily, with every block
    object created up front and one OrderedDict as the free queue."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, block: KVCacheBlock) -> None:
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        if len(self.free_queue) != len(self.blocks):
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True


OPS = st.sampled_from(["allocate", "allocate", "free", "cache", "hit", "uncache", "reset"])


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 10), ops=st.lists(st.tuples(OPS, st.integers(0, 2**16)), max_size=80))
def test_the_lazy_pool_hands_out_blocks_in_the_eager_pools_order(num_blocks: int, ops: list) -> None:
    lazy, eager = BlockPool(num_blocks, enable_caching=True), EagerBlockPool(num_blocks)
    groups: list[list[int]] = []  # block ids held together, as by one request

    def both(block_id: int) -> tuple[KVCacheBlock, KVCacheBlock]:
        return lazy.blocks[block_id], eager.blocks[block_id]

    for op, x in ops:
        if op == "allocate":
            n = x % (num_blocks + 1)
            if n > len(eager.free_queue):
                with pytest.raises(ValueError, match="cannot allocate"):
                    lazy.get_new_blocks(n)
                continue
            ids = [b.block_id for b in lazy.get_new_blocks(n)]
            assert ids == [b.block_id for b in eager.get_new_blocks(n)]
            groups.append(ids)
        elif op == "free" and groups:
            ids = groups.pop(x % len(groups))
            lazy.free_blocks(reversed([lazy.blocks[i] for i in ids]))
            eager.free_blocks(reversed([eager.blocks[i] for i in ids]))
        elif op == "cache" and groups and groups[x % len(groups)]:
            # Register a held block under one of a few hashes: equal hashes are duplicate content.
            ids = groups[x % len(groups)]
            block_id = ids[x % len(ids)]
            if eager.blocks[block_id].block_hash is not None:
                continue
            block_hash = BlockHash(x % 5)
            request = make_request("r", 1)
            request.block_hashes = [block_hash]
            lazy_block, eager_block = both(block_id)
            lazy.cache_full_blocks(request, [lazy_block], 0, 1)
            eager.cache(eager_block, block_hash)
        elif op == "hit" and eager.cached:
            block_hash = sorted(eager.cached)[x % len(eager.cached)]
            hit = lazy.get_cached_block(block_hash)
            assert hit is not None and hit.block_id == eager.cached[block_hash].block_id
            lazy.touch([hit])
            eager.touch(eager.cached[block_hash])
            groups.append([hit.block_id])
        elif op == "uncache" and groups and groups[x % len(groups)]:
            ids = groups[x % len(groups)]
            lazy_block, eager_block = both(ids[x % len(ids)])
            if eager_block.ref_cnt == 1:  # as KVCacheManager.free does for blocks never filled
                lazy.uncache(lazy_block)
                eager.uncache(eager_block)
        elif op == "reset":
            assert lazy.reset_prefix_cache() == eager.reset_prefix_cache()

        assert lazy.free_block_ids() == list(eager.free_queue)
        assert lazy.num_free_blocks == len(eager.free_queue)
        assert {h: b.block_id for h, b in lazy.cached_block_hash_to_block.items()} == {
            h: b.block_id for h, b in eager.cached.items()}
        for block in eager.blocks:
            if block.block_id < len(lazy.blocks):
                made = lazy.blocks[block.block_id]
                assert (made.ref_cnt, made.block_hash) == (block.ref_cnt, block.block_hash)
            else:  # never handed out: the eager block is untouched too
                assert block.ref_cnt == 0 and block.block_hash is None


def test_a_pool_creates_block_objects_only_when_first_handed_out() -> None:
    pool = BlockPool(10_000_000, enable_caching=True)
    assert pool.num_free_blocks == 10_000_000 and not pool.blocks
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert len(pool.blocks) == 3
    assert [b.block_id for b in pool.get_new_blocks(4)] == [0, 1, 2, 3]  # freed (uncached) ones first
    assert len(pool.blocks) == 4
