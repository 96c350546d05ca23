"""The KV-cache manager against a known answer: a prefix cache keyed by the tokens themselves.

The manager keys a cached block by a hash chained over its prefix and keeps its cached free blocks
in a linked list; the reference keys a block by its extra key and every token up to the block's
end, and keeps one OrderedDict as the free queue (cached blocks appended at the tail, uncached ones
pushed to the head, the head reused first). Equal hits, equal block ids handed out, equal free
queues after every operation: the hash neither misses a shared prefix nor mixes two different
ones, and eviction order is the plain LRU it stands for.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from hypothesis import given, settings, strategies as st

from engine.core import KVCacheManager, Request, SamplingParams

PrefixKey = tuple[type, object, tuple[int, ...]]


class ReferencePrefixCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head first
        self.key_of: dict[int, PrefixKey] = {}  # registered blocks
        self.block_of: dict[PrefixKey, int] = {}
        self.ref_cnt: Counter[int] = Counter()
        self.held: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}  # leading blocks of a request already looked at for registering

    def key(self, request: Request, end_block: int) -> PrefixKey:
        # The type too: the extra keys 1 and "1" are different adapters.
        return type(request.extra_key), request.extra_key, tuple(request.all_token_ids[: end_block * self.bs])

    def hits(self, request: Request) -> list[int]:
        out: list[int] = []
        for i in range((request.num_tokens - 1) // self.bs):
            block = self.block_of.get(self.key(request, i + 1))
            if block is None:
                break
            out.append(block)
        return out

    def allocate(self, request: Request, num_new_tokens: int, hits: list[int]) -> list[int] | None:
        """As KVCacheManager.allocate_slots: None, changing nothing, when the free blocks do not suffice."""
        held = self.held.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.bs
        num_to_allocate = -(-(num_computed + num_new_tokens) // self.bs) - len(held) - len(hits)
        if num_to_allocate > len(self.free) - sum(1 for b in hits if self.ref_cnt[b] == 0):
            return None
        for block in hits:
            self.free.pop(block, None)
            self.ref_cnt[block] += 1
        new = [self.free.popitem(last=False)[0] for _ in range(max(num_to_allocate, 0))]
        for block in new:
            if block in self.key_of:  # evicted
                del self.block_of[self.key_of.pop(block)]
            self.ref_cnt[block] = 1
        rid = request.request_id
        held = self.held[rid] = held + hits + new
        num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.bs
        for i in range(self.num_cached.setdefault(rid, len(hits)), num_full):
            key = self.key(request, i + 1)
            if key not in self.block_of:  # else a copy filled first serves hits; this one never will
                self.key_of[held[i]], self.block_of[key] = key, held[i]
        self.num_cached[rid] = max(self.num_cached[rid], num_full)
        return new

    def free_request(self, request: Request) -> None:
        del self.num_cached[request.request_id]
        for block in reversed(self.held.pop(request.request_id)):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free[block] = None
                if block not in self.key_of:
                    self.free.move_to_end(block, last=False)

    def reset(self) -> bool:
        if self.held:
            return False
        self.key_of.clear()
        self.block_of.clear()
        return True


# A few families of shared prompt heads, tails over a tiny alphabet (so unrelated requests still
# fill equal blocks now and then), a few extra keys, among them an int and its str.
OPS = st.sampled_from(["admit", "admit", "admit", "decode", "decode", "free", "reset"])
EXTRA_KEYS = [None, None, None, 1, "1"]


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 4]),
       ops=st.lists(st.tuples(OPS, st.integers(0, 2**20)), max_size=60))
def test_hits_and_evictions_match_a_prefix_cache_keyed_by_tokens(num_blocks: int, block_size: int, ops: list) -> None:
    kv, ref = KVCacheManager(num_blocks, block_size), ReferencePrefixCache(num_blocks, block_size)
    live: list[Request] = []
    for n, (op, x) in enumerate(ops):
        if op == "admit":
            head = [1000 * (x % 3) + j for j in range(x % 13)]
            tail = [x >> (4 + j) & 1 for j in range(1 + x % 5)]
            request = Request(f"r{n}", head + tail, SamplingParams(), 0.0, extra_key=EXTRA_KEYS[x % 5])
            blocks, num_hit = kv.get_computed_blocks(request)
            hits = ref.hits(request)
            assert [b.block_id for b in blocks] == hits and num_hit == len(hits) * block_size
            new = kv.allocate_slots(request, request.num_tokens - num_hit, blocks)
            assert new == ref.allocate(request, request.num_tokens - num_hit, hits)
            if new is not None:
                request.num_computed_tokens = request.num_tokens  # the step ran
                live.append(request)
        elif op == "decode" and live:
            request = live[x % len(live)]
            request.output_token_ids.append(x >> 8 & 1)
            new = kv.allocate_slots(request, 1)
            assert new == ref.allocate(request, 1, [])
            if new is None:  # no room: the scheduler would preempt; here the token is taken back
                request.output_token_ids.pop()
            else:
                request.num_computed_tokens += 1
        elif op == "free" and live:
            request = live.pop(x % len(live))
            kv.free(request)
            ref.free_request(request)
        elif op == "reset":
            assert kv.reset_prefix_cache() == ref.reset()

        pool = kv.block_pool
        assert pool.free_block_ids() == list(ref.free)
        assert {b.block_id for b in pool.cached_block_hash_to_block.values()} == set(ref.key_of)
        assert {r.request_id: kv.get_block_ids(r.request_id) for r in live} == ref.held
