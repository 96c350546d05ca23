"""KV block bookkeeping: reference counts, the free queue (LRU eviction order) and the
prefix-cache map from block hash to block. Block ids only; the tensors live in the runner."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from engine.core.request import BlockHash, Request

# The key a private request's blocks are cached under (cache_private_blocks): negative, so never a
# digest, and the same for all of them, since nothing ever looks one up.
PRIVATE_KEY = BlockHash(-1)


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is full and registered in the prefix cache, even at ref_cnt 0:
    # a freed block keeps its KV until it is evicted, so a later request can still hit it.
    block_hash: BlockHash | None = None
    # Neighbours in the pool's queue of cached free blocks (CachedFreeQueue); None when not in it.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None


class CachedFreeQueue:
    """Freed blocks still registered in the prefix cache, least recently freed first: a doubly
    linked list through the blocks' own prev/next fields, as vLLM v1's FreeKVCacheBlockQueue. A cache
    hit takes a block out of the middle in O(1). The links cost 16 bytes a block, where an
    OrderedDict entry costs 75-105 (CPython 3.11): most of a fleet's blocks sit here, and at 10^7
    of them that difference is most of a gigabyte."""

    def __init__(self) -> None:
        # A sentinel closes the list into a ring, so neither end nor an empty list needs a branch.
        self._ring = KVCacheBlock(-1)
        self._ring.prev_free_block = self._ring.next_free_block = self._ring
        self.num_blocks = 0

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._ring.next_free_block
        while block is not self._ring:
            assert block is not None
            yield block
            block = block.next_free_block

    def append(self, block: KVCacheBlock) -> None:
        ring = self._ring
        tail = ring.prev_free_block
        assert tail is not None
        block.prev_free_block, block.next_free_block = tail, ring
        tail.next_free_block = ring.prev_free_block = block
        self.num_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, next_ = block.prev_free_block, block.next_free_block
        assert prev is not None and next_ is not None, f"block {block.block_id} is not in the queue"
        prev.next_free_block, next_.prev_free_block = next_, prev
        block.prev_free_block = block.next_free_block = None
        self.num_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._ring.next_free_block
        assert block is not None and block is not self._ring, "popleft from an empty queue"
        self.remove(block)
        return block


class BlockPool:
    """The free queue, head first (next to be reused), is three parts, in this order:
    - `_uncached_free`: freed blocks with nothing worth keeping, the last freed reused first;
    - the never-used ids `len(blocks)..num_blocks-1`, in id order: their KVCacheBlocks are made
      only when first handed out, so an idle pool of a million blocks costs nothing (a simulator
      runs thousands of replicas) and memory grows with the blocks requests actually used;
    - `_cached_free`: freed blocks still registered in the prefix cache, least recently freed
      first (LRU eviction; CachedFreeQueue).
    This is exactly the order of a single queue that starts as every id in order, appends cached
    blocks at the tail and pushes uncached ones at the head: a freed block cannot gain a hash
    while free, and a never-used one cannot be hit, so no block ever moves between the parts.
    """

    def __init__(self, num_blocks: int, enable_caching: bool,
                 on_evict: Callable[[BlockHash, int], None] | None = None) -> None:
        """`on_evict(hash, block_id)` hears of a cached block about to be reused, while its KV is
        still intact (an offload tier copies it out)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        self.blocks: list[KVCacheBlock] = []  # every block handed out so far; blocks[i].block_id == i
        self._uncached_free: list[KVCacheBlock] = []  # a stack: the head of the queue is its end
        self._cached_free = CachedFreeQueue()
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._uncached_free) + (self.num_blocks - len(self.blocks)) + self._cached_free.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached but free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue, head first. O(num_blocks): for tests and debugging, not the hot path."""
        return ([b.block_id for b in reversed(self._uncached_free)] + list(range(len(self.blocks), self.num_blocks))
                + [b.block_id for b in self._cached_free])

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        return [self._pop_free() for _ in range(n)]

    def get_new_block(self) -> KVCacheBlock:
        """get_new_blocks(1)[0]: a decode crossing into its next block, the simulator's commonest take."""
        if not self.num_free_blocks:
            raise ValueError("cannot allocate 1 block: none free")
        return self._pop_free()

    def _pop_free(self) -> KVCacheBlock:
        """The head of the free queue, held once (a cached block's hash evicted); the caller checked it is not empty."""
        if self._uncached_free:
            block = self._uncached_free.pop()
        elif len(self.blocks) < self.num_blocks:
            block = KVCacheBlock(len(self.blocks))
            self.blocks.append(block)
        else:
            block = self._cached_free.popleft()
            if block.block_hash is not None:  # None only after reset_prefix_cache
                if self.on_evict is not None:
                    self.on_evict(block.block_hash, block.block_id)
                self._evict(block, block.block_hash)
        block.ref_cnt = 1
        return block

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                if block.prev_free_block is None:
                    raise RuntimeError(f"block {block.block_id} is free but not cached: only prefix-cache hits are touched")
                self._cached_free.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Callers pass a request's blocks tail first, so its tail is evicted before its head
        (the head is the part other requests are likeliest to share)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id} (ref_cnt={block.ref_cnt})")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Nothing worth keeping: reuse it before evicting any cached block.
                    self._uncached_free.append(block)
                else:
                    self._cached_free.append(block)

    def cache_full_blocks(
        self, request: Request, blocks: Sequence[KVCacheBlock], num_cached_blocks: int, num_full_blocks: int
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under request.block_hashes."""
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], request.block_hashes[i]
            if block.block_hash is not None:
                raise RuntimeError(f"block {block.block_id} is already cached")
            # Two requests that filled the same content independently: the first copy serves
            # hits, this one stays unregistered and is recycled like any uncached block.
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def cache_private_blocks(self, blocks: Sequence[KVCacheBlock], start: int, end: int) -> None:
        """Mark blocks[start:end] of a request nobody can share (Request.private_blocks) as cached
        under PRIVATE_KEY instead of their content's digests: negative, so no lookup could find them,
        as none would find the digests, and kept out of the lookup table for that reason. Cached, they
        are freed into the LRU queue and evicted in the order content-hashed blocks would be."""
        if not self.enable_caching:
            return
        for block in blocks[start:end]:
            if block.block_hash is not None:
                raise RuntimeError(f"block {block.block_id} is already cached")
            block.block_hash = PRIVATE_KEY

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's hash: its KV will never be written (see KVCacheManager.free)."""
        if block.block_hash is not None:
            self._evict(block, block.block_hash)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; refused (False) while any block is held, as its holder relies on it."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._cached_free:  # every block is free: the cached ones are all here
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _evict(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if block_hash != PRIVATE_KEY:
            del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None
