"""Maps requests to KV blocks: allocation, prefix-cache lookup and release; with offload tiers,
the copies between device blocks and host or disk slots that each step needs (engine/core/kv_tiers.py);
with sliding-window groups, the window's blocks beside the full-attention ones (engine/core/window_blocks.py)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from hashlib import blake2b
import operator

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.by_fields import PickledByFields
from engine.core.kv_tiers import BlockCopy, ExternalLoad, KVTiers, KVTransfers, Tier, TierStats
from engine.core.request import BlockHash, ExtraKey, Request
from engine.core.sampling_params import SamplingParams
from engine.core.window_blocks import WindowBlocks, WindowGroups, blocks_to_hold

# Parent of a request's first block: a fixed value keeps hashes identical across processes.
_ROOT_HASH = BlockHash(0)
# 120 bits: CPython stores ints in 30-bit digits, so 4 digits take 40 bytes, as a 64-bit int does
# (pymalloc rounds 36 up to 40); a 128-bit key would need a fifth digit and 48.
_HASH_BYTES = 15


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int], extra_key: ExtraKey) -> BlockHash:
    """The prefix-cache key of a block: BLAKE2b-120 of its parent's key, its tokens and the extra key.

    The chain makes the key stand for every token up to the block's end, so equal keys mean equal
    prefixes and a hit is taken on the key alone, as vLLM v1 does with SHA-256. A collision would
    hand one request another's KV, so the hash is cryptographic and wide: 10^14 probes (a year of
    1,000 replicas at 16 req/s of 60-block prompts is ~3e13) of caches holding 10^6 blocks each
    meet a false hit with probability under 10^20 / 2^120 ~ 8e-17, and aiming a prompt at another
    user's cached block needs a second preimage of its key (~2^120 BLAKE2b calls). Python's hash()
    of a tuple of ints would give neither: 64 bits, unkeyed, built to spread keys, not to resist
    collisions. Tokens are int64 in native byte order: the keys never leave the process.
    """
    return _block_key(parent_hash, len(token_ids).to_bytes(4, "little"), array("q", token_ids).tobytes(), _extra_bytes(extra_key))


def _block_key(parent_hash: BlockHash, num_tokens: bytes, tokens: bytes, extra: bytes) -> BlockHash:
    """hash_block_tokens from the bytes of its parts: a request's blocks are hashed in one go."""
    # The token count fixes where the tokens end and the extra key begins.
    data = b"".join((parent_hash.to_bytes(_HASH_BYTES, "little"), num_tokens, tokens, extra))
    return BlockHash(int.from_bytes(blake2b(data, digest_size=_HASH_BYTES).digest(), "little"))


def _extra_bytes(extra_key: ExtraKey) -> bytes:
    return b"" if extra_key is None else repr(extra_key).encode()


@dataclass(frozen=True)
class PrefixCacheStats(PickledByFields):
    """Counted once per admission (first schedule or resume), not per lookup: a request that
    waits at the head of the queue for many steps is looked up many times."""

    num_queries: int = 0  # admissions
    query_tokens: int = 0
    hit_tokens: int = 0  # found in device memory
    host_hit_tokens: int = 0  # found in the host tier (copied back to the device)
    disk_hit_tokens: int = 0  # found in the disk tier

    @property
    def all_hit_tokens(self) -> int:
        return self.hit_tokens + self.host_hit_tokens + self.disk_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens found anywhere: device, host or disk."""
        return self.all_hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def admitted(self, query_tokens: int, hit_tokens: int, host_hit_tokens: int, disk_hit_tokens: int) -> PrefixCacheStats:
        """These counts and one more admission: field by field, as the simulator admits 10,000s."""
        return PrefixCacheStats(self.num_queries + 1, self.query_tokens + query_tokens, self.hit_tokens + hit_tokens,
                                self.host_hit_tokens + host_hit_tokens, self.disk_hit_tokens + disk_hit_tokens)

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return self._combine(other, operator.add)

    def __sub__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return self._combine(other, operator.sub)

    def _combine(self, other: PrefixCacheStats, op: Callable[[int, int], int]) -> PrefixCacheStats:
        return PrefixCacheStats(*(op(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host_blocks: int = 0, disk_blocks: int = 0, window: WindowGroups | None = None) -> None:
        """`host_blocks`, `disk_blocks`: slots of the offload tiers (0: none). The host tier keeps
        evicted prefix-cache blocks and swapped-out requests; the disk tier keeps what the host
        tier evicts. `window`: sliding-window groups that share the pool and keep only their
        window's blocks (None: every layer keeps every token in the request's blocks)."""
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
        for name, value in (("host_blocks", host_blocks), ("disk_blocks", disk_blocks)):
            if value < 0:
                raise ValueError(f"{name}={value} is invalid: must be >= 0")
        if window is not None and (host_blocks or disk_blocks):
            raise ValueError("offload tiers with sliding-window groups are not modelled: their windows would move too")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tiers = KVTiers(host_blocks, disk_blocks) if host_blocks or disk_blocks else None
        self.window = WindowBlocks(window, block_size) if window is not None else None
        offload = self._offload_evicted if self.tiers is not None and enable_prefix_caching else None
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, on_evict=offload)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self._stats = PrefixCacheStats()
        # The step's transfers, in the order the runner must perform them.
        self._copies: list[BlockCopy] = []
        self._external: list[ExternalLoad] = []

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

    @property
    def tier_stats(self) -> TierStats | None:
        return None if self.tiers is None else self.tiers.stats

    def begin_step(self) -> None:
        """A new schedule(): the previous step's copies have run, so the slots they read are reusable."""
        if self.tiers is not None:
            self.tiers.begin_step()

    def take_transfers(self) -> KVTransfers | None:
        """The copies the step scheduled so far needs, in order; None when there are none."""
        if not self._copies and not self._external:
            return None
        out = KVTransfers(tuple(self._copies), tuple(self._external))
        self._copies, self._external = [], []
        return out

    def max_blocks(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request of `num_tokens` KV tokens can hold at once here (blocks_to_hold)."""
        return blocks_to_hold(num_tokens, self.block_size, self.window.groups if self.window is not None else None,
                              max_step_tokens)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds outside its window groups."""
        return len(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, and its length in tokens. Pure lookup: nothing
        is touched until allocate_slots commits."""
        if not self.enable_prefix_caching or self._is_private(request):
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

    def get_tier_hits(self, request: Request, num_device_blocks: int) -> list[tuple[BlockHash, Tier]]:
        """The full blocks after the device hit (`num_device_blocks` of them, from
        get_computed_blocks) that an offload tier holds, in order. Pure lookup."""
        if self.tiers is None or not self.enable_prefix_caching:
            return []
        hits: list[tuple[BlockHash, Tier]] = []
        for block_hash in request.block_hashes[num_device_blocks:(request.num_tokens - 1) // self.block_size]:
            tier = self.tiers.lookup(block_hash)
            if tier is None:
                break
            hits.append((block_hash, tier))
        return hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
        tier_hits: Sequence[tuple[BlockHash, Tier]] = (),
        num_loaded_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` (known + draft) after the request's computed tokens
        and the prefix hit `new_computed_blocks`. Returns the ids of newly allocated blocks, or
        None, changing nothing, when the pool cannot hold them. `tier_hits` (at admission, from
        get_tier_hits; their tokens counted in num_new_tokens) fill the first new blocks by copies.
        `num_loaded_tokens`: the leading ones of num_new_tokens whose KV is copied in, not computed
        (tier hits, external KV): a window group needs only the last window of them."""
        if num_new_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: num_new_tokens={num_new_tokens} must be >= 1")
        if len(tier_hits) * self.block_size > num_new_tokens:
            raise ValueError(f"request {request.request_id!r}: {len(tier_hits)} tier hits exceed num_new_tokens={num_new_tokens}")
        bs = self.block_size
        held = self.req_to_blocks.get(request.request_id)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_required = (num_computed + num_new_tokens + num_lookahead_tokens + bs - 1) // bs
        # Negative after a speculative rollback: slots of rejected drafts are reused.
        num_to_allocate = num_required - (len(held) if held is not None else 0) - len(new_computed_blocks)
        window = None if self.window is None else self.window.change(
            request.request_id, num_computed + num_loaded_tokens, num_computed + num_new_tokens + num_lookahead_tokens)
        # A window's old blocks go back before its new ones are taken (vLLM frees skipped blocks first).
        needed = max(num_to_allocate, 0) + (window.net if window is not None else 0)
        if needed > 0:
            # Hit blocks nobody holds sit in the free queue; touching them takes them out of it.
            num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if new_computed_blocks else 0
            if needed > self.block_pool.num_free_blocks - num_revived:
                return None

        if held is None:
            held = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
            if self.enable_prefix_caching:
                disk = sum(1 for _, tier in tier_hits if tier == "disk")
                self._stats = self._stats.admitted(request.num_tokens, len(new_computed_blocks) * bs,
                                                   (len(tier_hits) - disk) * bs, disk * bs)
            self.block_pool.touch(new_computed_blocks)
            held.extend(new_computed_blocks)
        elif new_computed_blocks or tier_hits:
            raise ValueError(f"request {request.request_id!r}: prefix hits are only taken at admission")
        slots = self.tiers.pin(tier_hits) if self.tiers is not None and tier_hits else []
        if window is not None:
            assert self.window is not None
            self.block_pool.free_blocks(reversed(self.window.drop(request.request_id, window)))
            self.window.take(request.request_id, window, self.block_pool.get_new_blocks(window.take))
        new_block_ids: list[int] = []
        if num_to_allocate > 0:
            # Evictions here list their copies to the host tier first (on_evict), ahead of the loads below.
            new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
            held.extend(new_blocks)
            new_block_ids = [b.block_id for b in new_blocks]
        if tier_hits:
            assert self.tiers is not None
            self._copies += self.tiers.load(tier_hits, slots, new_block_ids[: len(tier_hits)])
        self._cache_full_blocks(request, held, num_computed + num_new_tokens)
        return new_block_ids

    def allocate_decode_slot(self, request: Request) -> bool:
        """allocate_slots(request, 1) for a decoding request that holds its blocks (num_computed_tokens
        = num_tokens - 1), without the general case's work: the slot of its next token, a new block
        when that starts one, and its block registered once full. False, changing nothing, when a
        block is needed and none is free. The simulator's bulk decodes run it for every block."""
        self._no_window("bulk decodes")
        held = self.req_to_blocks[request.request_id]
        computed = request.num_computed_tokens
        if computed >= len(held) * self.block_size:
            if not self.block_pool.num_free_blocks:
                return False
            held += self.block_pool.get_new_blocks(1)
        self._cache_full_blocks(request, held, computed + 1)
        return True

    def take_decode_block(self, request: Request) -> bool:
        """allocate_decode_slot for a decode whose next token starts a new block and fills none
        (blocks as decoding leaves them: every full one registered): the block alone. False,
        changing nothing, when none is free."""
        self._no_window("bulk decodes")
        if not self.block_pool.num_free_blocks:
            return False
        self.req_to_blocks[request.request_id].append(self.block_pool.get_new_block())
        return True

    def cache_decode_block(self, request: Request) -> None:
        """allocate_decode_slot for a decode whose last known token fills its last block: the block
        registered (its slot is there already)."""
        self._cache_full_blocks(request, self.req_to_blocks[request.request_id], request.num_tokens)

    def decode_block_steps(self, request: Request) -> tuple[int, int]:
        """For a decoding request (num_computed_tokens = num_tokens - 1), counting one-token decode
        steps from the next (0): the step whose allocate_slots takes a new block, and the step whose
        allocate_slots registers a full block in the prefix cache (-1 without prefix caching)."""
        self._no_window("bulk decodes")
        bs, rid = self.block_size, request.request_id
        computed = request.num_computed_tokens
        # Step j (from 0) needs ceil((computed + j + 1) / bs) blocks and knows computed + j + 1 tokens.
        take = len(self.req_to_blocks[rid]) * bs - computed
        if not self.registers_decode_blocks(request):
            return take, -1
        return take, (self.num_cached_blocks[rid] + 1) * bs - computed - 1

    def registers_decode_blocks(self, request: Request) -> bool:
        """Whether the request's decodes register each block they fill (prefix caching, and a request
        others could share: a private one registers its blocks when it lets go of them)."""
        return self.enable_prefix_caching and not self._is_private(request)

    def _is_private(self, request: Request) -> bool:
        # Private keys stand in for digests only where nothing else reads a block's key: an offload
        # tier keeps evicted blocks under it, and window groups register their own blocks.
        return request.private_blocks and self.tiers is None and self.window is None

    def _no_window(self, what: str) -> None:
        # A window's blocks are taken and given back at their own positions: these fast paths count
        # only the full-attention group's.
        if self.window is not None:
            raise ValueError(f"{what} are not modelled with sliding-window groups")

    def _cache_full_blocks(self, request: Request, held: list[KVCacheBlock], num_tokens: int) -> None:
        """Register the request's full blocks of known tokens among its first `num_tokens`.

        Registered now, before the forward pass (or the step's copies) fill them, as vLLM does: a
        request admitted later in this same step may hit them, which is sound because the runner
        performs the step's copies and writes the whole batch's KV before attention reads it. Only
        known tokens are hashed; draft tokens may be rejected. A private request's blocks wait for
        _free_blocks: nobody can look them up meanwhile."""
        if not self.enable_prefix_caching or self._is_private(request):
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_cached = self.num_cached_blocks[request.request_id]
        if num_full > num_cached:
            self._update_block_hashes(request)
            self.block_pool.cache_full_blocks(request, held, num_cached, num_full)
            self.num_cached_blocks[request.request_id] = num_full

    def load_external(self, request: Request, num_hit_tokens: int, num_external_tokens: int) -> None:
        """At admission: the blocks of `num_external_tokens` tokens after the prefix hit are filled
        from outside (a prefill instance's transfer), by the runner's external source."""
        if not num_external_tokens:
            return
        bs = self.block_size
        first = num_hit_tokens // bs
        end = -(-(num_hit_tokens + num_external_tokens) // bs)
        held = self.req_to_blocks[request.request_id]
        self._external.append(ExternalLoad(request.request_id, first, tuple(b.block_id for b in held[first:end])))

    # ---- swap ------------------------------------------------------------------------------

    def is_swapped(self, request: Request) -> bool:
        return self.tiers is not None and self.tiers.is_swapped(request.request_id)

    def swap_out(self, request: Request) -> bool:
        """Preemption by swap: copy the request's computed blocks to the host tier and free its
        device blocks, keeping its progress. False, changing nothing, when the host tier cannot
        take them (the caller recomputes instead)."""
        if self.tiers is None:
            return False
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_filled = -(-request.num_computed_tokens // self.block_size)
        copies = self.tiers.swap_out(request.request_id, [b.block_id for b in blocks[:num_filled]])
        if copies is None:
            return False
        self._copies += copies
        self._free_blocks(request)
        return True

    def allocate_swapped_in(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Resume a swapped-out request with `num_new_tokens` to compute: its leading full blocks
        still cached on the device are taken as they are, the rest copied back from its host slots.
        Returns its whole block table, or None, changing nothing, when the pool cannot hold it."""
        assert self.tiers is not None and self.tiers.is_swapped(request.request_id)
        bs = self.block_size
        num_computed = request.num_computed_tokens
        hits = self.get_computed_blocks(request)[0][: num_computed // bs]
        num_to_allocate = -(-(num_computed + num_new_tokens) // bs) - len(hits)
        if num_to_allocate > self.block_pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0):
            return None
        self.block_pool.touch(hits)
        held = self.req_to_blocks[request.request_id] = [*hits, *self.block_pool.get_new_blocks(num_to_allocate)]
        self.num_cached_blocks[request.request_id] = len(hits)
        num_swapped = self.tiers.num_swapped_blocks(request.request_id)
        self._copies += self.tiers.swap_in(request.request_id, [(i, held[i].block_id) for i in range(len(hits), num_swapped)])
        self._cache_full_blocks(request, held, num_computed + num_new_tokens)
        return [b.block_id for b in held]

    def free(self, request: Request, preempted: bool = False) -> None:
        """Release everything the request holds: device blocks and, if it was swapped out, host slots.
        `preempted`: it will be admitted again, and its blocks still cached then are hits."""
        if self.tiers is not None:
            self.tiers.drop_swapped(request.request_id)
        self._free_blocks(request, preempted)

    def _free_blocks(self, request: Request, preempted: bool = False) -> None:
        if self.window is not None:
            self.block_pool.free_blocks(reversed(self.window.pop(request.request_id)))
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if not blocks:
            return
        if self.enable_prefix_caching and self._is_private(request):
            self._register_private(request, blocks, preempted)
        # A request preempted or aborted after schedule() but before its step ran holds blocks
        # that were registered but never filled: drop their hashes so nobody hits garbage.
        first_unfilled = request.num_computed_tokens // self.block_size
        for block in blocks[first_unfilled:]:
            if block.ref_cnt == 1:
                self.block_pool.uncache(block)
        self.block_pool.free_blocks(reversed(blocks))

    def _register_private(self, request: Request, blocks: list[KVCacheBlock], preempted: bool) -> None:
        """What registering a private request's blocks as they filled would have left registered now:
        its full blocks of computed tokens (those registered but never filled are dropped at free).
        Nobody else can have looked them up or registered their content meanwhile, so registering
        them now is the same. A finished request's blocks are never looked up again: private keys.
        A preempted one's own resume will look them up: their digests, and it is private no more."""
        num_filled = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if not preempted:
            self.block_pool.cache_private_blocks(blocks, 0, num_filled)
            return
        request.private_blocks = False
        self._update_block_hashes(request)
        self.block_pool.cache_full_blocks(request, blocks, 0, num_filled)

    def served(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Leave the cache as a request of `token_ids` (prompt, then output) that ran alone and
        finished would: a hit on its cached prefix, its other full blocks taken (evicting the least
        recently used) and registered, all freed tail first. A server's history before a measured
        run (a benchmark client's test request, the runs before it); not counted in the statistics."""
        if not self.enable_prefix_caching:
            return
        request = Request(request_id, list(token_ids), SamplingParams(max_tokens=1), arrival_time=0.0)
        hit, num_hit_tokens = self.get_computed_blocks(request)
        stats, num_copies = self._stats, len(self._copies)
        if self.allocate_slots(request, request.num_tokens - num_hit_tokens, hit) is None:
            raise ValueError(f"served request {request_id!r}: {request.num_tokens} tokens exceed the pool of "
                             f"{self.num_blocks} blocks of {self.block_size}")
        self._stats = stats
        del self._copies[num_copies:]  # evictions to a host tier happened back then, not in the next step
        request.num_computed_tokens = request.num_tokens
        self.free(request)

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.tiers is not None:
            self.tiers.clear_cache()
        return True

    def _offload_evicted(self, block_hash: BlockHash, block_id: int) -> None:
        assert self.tiers is not None
        self._copies += self.tiers.offload(block_hash, block_id)

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to every full block of known tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        start, end = len(hashes) * bs, request.num_tokens // bs * bs
        if start >= end:
            return
        parent = hashes[-1] if hashes else _ROOT_HASH
        # hash_block_tokens block by block, each part turned into bytes once.
        tokens = array("q", request.token_slice(start, end)).tobytes()
        size = len(tokens) // ((end - start) // bs)
        num_tokens, extra = bs.to_bytes(4, "little"), _extra_bytes(request.extra_key)
        for i in range(0, len(tokens), size):
            parent = _block_key(parent, num_tokens, tokens[i : i + size], extra)
            hashes.append(parent)
