"""Maps requests to KV blocks: allocation, prefix-cache lookup and release."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.request import BlockHash, Request

# Parent of a request's first block: a fixed int keeps hashes identical across processes
# (hash(None) is not, before Python 3.12).
_ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...], extra_key: object) -> BlockHash:
    key = (parent_hash, token_ids) if extra_key is None else (parent_hash, token_ids, extra_key)
    return BlockHash(hash(key), token_ids)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counted once per admission (first schedule or resume), not per lookup: a request that
    waits at the head of the queue for many steps is looked up many times."""

    num_queries: int = 0  # admissions
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self._stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._stats

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, and its length in tokens. Pure lookup: nothing
        is touched until allocate_slots commits."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        # The last known token is always recomputed: its logits are what the next step samples.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` (known + draft) after the request's computed tokens
        and the prefix hit `new_computed_blocks`. Returns the ids of newly allocated blocks, or
        None, changing nothing, when the pool cannot hold them."""
        if num_new_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: num_new_tokens={num_new_tokens} must be >= 1")
        bs = self.block_size
        held = self.req_to_blocks.get(request.request_id)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_required = (num_computed + num_new_tokens + num_lookahead_tokens + bs - 1) // bs
        # Negative after a speculative rollback: slots of rejected drafts are reused.
        num_to_allocate = num_required - (len(held) if held is not None else 0) - len(new_computed_blocks)
        if num_to_allocate > 0:
            # Hit blocks nobody holds sit in the free queue; touching them takes them out of it.
            num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if new_computed_blocks else 0
            if num_to_allocate > self.block_pool.num_free_blocks - num_revived:
                return None

        if held is None:
            held = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
            if self.enable_prefix_caching:
                self._stats = PrefixCacheStats(
                    self._stats.num_queries + 1,
                    self._stats.query_tokens + request.num_tokens,
                    self._stats.hit_tokens + len(new_computed_blocks) * bs,
                )
            self.block_pool.touch(new_computed_blocks)
            held.extend(new_computed_blocks)
        elif new_computed_blocks:
            raise ValueError(f"request {request.request_id!r}: prefix hits are only taken at admission")
        new_block_ids: list[int] = []
        if num_to_allocate > 0:
            new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
            held.extend(new_blocks)
            new_block_ids = [b.block_id for b in new_blocks]

        if self.enable_prefix_caching:
            # Registered now, before the forward pass fills them, as vLLM does: a request admitted
            # later in this same step may hit them, which is sound because the runner writes the
            # whole batch's KV before attention reads it. Only known tokens are hashed; draft
            # tokens may be rejected.
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // bs
            num_cached = self.num_cached_blocks[request.request_id]
            if num_full > num_cached:
                self._update_block_hashes(request)
                self.block_pool.cache_full_blocks(request, held, num_cached, num_full)
                self.num_cached_blocks[request.request_id] = num_full
        return new_block_ids

    def untouched_decode_steps(self, request: Request) -> int:
        """How many one-token decode steps of a decoding request (num_computed_tokens = num_tokens
        - 1), counting from the next, allocate_slots would serve without touching the pool: no new
        block, and no full block to register in the prefix cache."""
        bs, rid = self.block_size, request.request_id
        computed = request.num_computed_tokens
        # Step j (from 0) needs ceil((computed + j + 1) / bs) blocks and fills computed + j + 1 slots.
        steps = len(self.req_to_blocks[rid]) * bs - computed
        if self.enable_prefix_caching:
            steps = min(steps, (self.num_cached_blocks[rid] + 1) * bs - computed - 1)
        return steps

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if not blocks:
            return
        # A request preempted or aborted after schedule() but before its step ran holds blocks
        # that were registered but never filled: drop their hashes so nobody hits garbage.
        first_unfilled = request.num_computed_tokens // self.block_size
        for block in blocks[first_unfilled:]:
            if block.ref_cnt == 1:
                self.block_pool.uncache(block)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to every full block of known tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        start, end = len(hashes) * bs, request.num_tokens // bs * bs
        if start >= end:
            return
        parent = hashes[-1].value if hashes else _ROOT_HASH
        tokens, extra_key = request.token_slice(start, end), request.extra_key
        for i in range(0, end - start, bs):
            block_hash = hash_block_tokens(parent, tokens[i : i + bs], extra_key)
            hashes.append(block_hash)
            parent = block_hash.value
