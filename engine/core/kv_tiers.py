"""KV-cache offload tiers: host memory, then disk, behind the device's block pool.

A tier is more places a hashed block can live (a second-level prefix cache) and, for the host
tier, swap space for preempted requests. Slot ids only: the runner owns the tier tensors and
performs the copies, in the order the scheduler's output lists them (`KVTransfers`).

- A cached block the device pool evicts is copied to the host tier first (unless already
  there), so a later request finds it by the same block hash; the host tier's least recently
  used block moves on to the disk tier, whose least recently used block is dropped.
- A request preempted by swap keeps its blocks in host slots it holds until it resumes.
- A slot read or freed in a step is pinned until the next step begins: the copies of a step
  run in order after schedule() returns, so a slot must not be overwritten before they have.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal, NamedTuple

from engine.core.by_fields import PickledByFields
from engine.core.request import BlockHash

Tier = Literal["host", "disk"]
Place = Literal["device", "host", "disk"]


class BlockCopy(NamedTuple):
    """Copy one block's KV (every layer) from one place to another. Ids are device block ids or
    tier slots, as `src`/`dst` say."""

    src: Place
    src_id: int
    dst: Place
    dst_id: int


class ExternalLoad(NamedTuple):
    """KV computed elsewhere (a prefill instance) for a request's blocks [first_block, ...): the
    runner fills `block_ids` from its external source (the transport's received blocks)."""

    request_id: str
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVTransfers(PickledByFields):
    """What the runner copies before a step's forward pass: `copies` in order (a later copy may read
    what an earlier one wrote, or reuse a slot an earlier one emptied), then `external` loads."""

    copies: tuple[BlockCopy, ...] = ()
    external: tuple[ExternalLoad, ...] = ()

    def num_blocks(self, src: Place, dst: Place) -> int:
        return sum(1 for c in self.copies if c.src == src and c.dst == dst)

    @property
    def num_external_blocks(self) -> int:
        return sum(len(e.block_ids) for e in self.external)


@dataclass(frozen=True)
class TierStats(PickledByFields):
    """Blocks copied between the places, over the run (each counted once, when scheduled)."""

    stored_blocks: int = 0  # device -> host: evicted cached blocks and swap-outs
    demoted_blocks: int = 0  # host -> disk
    loaded_host_blocks: int = 0  # host -> device: prefix hits and swap-ins
    loaded_disk_blocks: int = 0  # disk -> device: prefix hits
    swapped_out_requests: int = 0
    swap_out_refusals: int = 0  # preemptions that fell back to recompute: no host room


class TierPool:
    """The slots of one tier: free, held by a swapped-out request, or caching a block hash (LRU)."""

    def __init__(self, tier: Tier, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"{tier} tier: num_slots={num_slots} is invalid: must be >= 1")
        self.tier, self.num_slots = tier, num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 handed out first
        self._cached: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._slot_hash: dict[int, BlockHash] = {}
        self._pinned: set[int] = set()  # read or freed this step: not reusable until the next
        self._deferred_free: list[int] = []

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_held(self) -> int:
        return self.num_slots - len(self._free) - len(self._deferred_free) - len(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, block_hash: BlockHash, *, pin: bool = True) -> int:
        """Most recently used; pinned when it is read this step."""
        slot = self._cached[block_hash]
        self._cached.move_to_end(block_hash)
        if pin:
            self._pinned.add(slot)
        return slot

    def reclaimable(self) -> int:
        """Slots a new holder could get now: free ones and unpinned cached ones."""
        return len(self._free) + sum(1 for s in self._cached.values() if s not in self._pinned)

    def take(self) -> tuple[int, tuple[BlockHash, int] | None] | None:
        """A slot for new content, and the (hash, slot) it evicts if it had to; None when every
        slot is held or pinned. The caller copies the evicted block elsewhere first, if it wants it."""
        if self._free:
            return self._free.pop(), None
        for block_hash, slot in self._cached.items():  # least recently used first
            if slot not in self._pinned:
                del self._cached[block_hash], self._slot_hash[slot]
                return slot, (block_hash, slot)
        return None

    def cache(self, block_hash: BlockHash, slot: int) -> None:
        if block_hash in self._cached or slot in self._slot_hash:
            raise RuntimeError(f"{self.tier} tier: slot {slot} or its hash is already cached")
        self._cached[block_hash] = slot
        self._slot_hash[slot] = block_hash

    def release(self, slots: Sequence[int]) -> None:
        """Slots a holder gives back; reusable from the next step (their copies may be pending)."""
        self._deferred_free.extend(slots)
        self._pinned.update(slots)

    def begin_step(self) -> None:
        self._pinned.clear()
        self._free.extend(self._deferred_free)
        self._deferred_free.clear()

    def clear_cache(self) -> None:
        for slot in self._cached.values():
            self._free.append(slot)
        self._cached.clear()
        self._slot_hash.clear()


class KVTiers:
    """The host tier (and a disk tier behind it) of one KV-cache manager. Each operation returns
    the copies it needs, for the manager to list in the step's transfers."""

    def __init__(self, host_blocks: int, disk_blocks: int = 0) -> None:
        if disk_blocks and not host_blocks:
            raise ValueError(f"disk_blocks={disk_blocks} needs a host tier: blocks reach the disk through host memory")
        self.host = TierPool("host", host_blocks)
        self.disk = TierPool("disk", disk_blocks) if disk_blocks else None
        self._stats = TierStats()
        self._swapped: dict[str, list[int]] = {}  # request id -> host slots of its blocks, in order

    @property
    def stats(self) -> TierStats:
        return self._stats

    def _count(self, **increments: int) -> None:
        stats = self._stats
        self._stats = TierStats(**{f.name: getattr(stats, f.name) + increments.get(f.name, 0) for f in fields(stats)})

    def begin_step(self) -> None:
        self.host.begin_step()
        if self.disk is not None:
            self.disk.begin_step()

    # ---- second-level prefix cache --------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> Tier | None:
        """Where a hashed block lives besides the device (pure: nothing is touched)."""
        if self.host.lookup(block_hash) is not None:
            return "host"
        if self.disk is not None and self.disk.lookup(block_hash) is not None:
            return "disk"
        return None

    def offload(self, block_hash: BlockHash, device_block_id: int) -> list[BlockCopy]:
        """The device pool is about to reuse a cached block: keep its KV in the host tier."""
        if self.host.lookup(block_hash) is not None:
            self.host.touch(block_hash, pin=False)  # already there: it stays, freshly used
            return []
        copies: list[BlockCopy] = []
        slot = self._host_slot(copies)
        if slot is None:
            return copies  # every host slot is held or read this step: the block is simply dropped
        copies.append(BlockCopy("device", device_block_id, "host", slot))
        self.host.cache(block_hash, slot)
        self._count(stored_blocks=1)
        return copies

    def pin(self, hits: Sequence[tuple[BlockHash, Tier]]) -> list[int]:
        """Take tier hits (from lookup): their slots, freshly used and pinned, so that the
        allocation of their device blocks (whose evictions go to the host tier) cannot evict them."""
        return [self._pool(tier).touch(block_hash) for block_hash, tier in hits]

    def load(self, hits: Sequence[tuple[BlockHash, Tier]], slots: Sequence[int],
             device_block_ids: Sequence[int]) -> list[BlockCopy]:
        """Copy pinned tier hits into freshly allocated device blocks (same order)."""
        copies = [BlockCopy(tier, slot, "device", block_id)
                  for (_, tier), slot, block_id in zip(hits, slots, device_block_ids, strict=True)]
        disk = sum(1 for _, tier in hits if tier == "disk")
        self._count(loaded_host_blocks=len(hits) - disk, loaded_disk_blocks=disk)
        return copies

    def _pool(self, tier: Tier) -> TierPool:
        pool = self.host if tier == "host" else self.disk
        assert pool is not None
        return pool

    def _host_slot(self, copies: list[BlockCopy]) -> int | None:
        """A host slot for new content; the block it evicts moves to the disk tier, when there is
        one (that copy is appended to `copies`, ahead of whatever will overwrite the slot)."""
        taken = self.host.take()
        if taken is None:
            return None
        slot, evicted = taken
        if evicted is not None and self.disk is not None and self.disk.lookup(evicted[0]) is None:
            disk_taken = self.disk.take()
            if disk_taken is not None:  # a disk eviction is simply dropped: nothing lies beyond
                copies.append(BlockCopy("host", evicted[1], "disk", disk_taken[0]))
                self.disk.cache(evicted[0], disk_taken[0])
                self._count(demoted_blocks=1)
        return slot

    # ---- swap space -----------------------------------------------------------------------

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def swap_out(self, request_id: str, device_block_ids: Sequence[int]) -> list[BlockCopy] | None:
        """Copy a preempted request's blocks to host slots it holds; None (nothing changed) when the
        host tier cannot take them all."""
        if len(device_block_ids) > self.host.reclaimable():
            self._count(swap_out_refusals=1)
            return None
        copies: list[BlockCopy] = []
        slots = []
        for block_id in device_block_ids:
            slot = self._host_slot(copies)
            assert slot is not None  # reclaimable() counted it
            copies.append(BlockCopy("device", block_id, "host", slot))
            slots.append(slot)
        self._swapped[request_id] = slots
        self._count(stored_blocks=len(slots), swapped_out_requests=1)
        return copies

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self._swapped[request_id])

    def swap_in(self, request_id: str, loads: Sequence[tuple[int, int]]) -> list[BlockCopy]:
        """Copy (block index, device block id) of a resuming request from its slots, then give the
        slots back (reusable from the next step)."""
        slots = self._swapped.pop(request_id)
        self.host.release(slots)
        self._count(loaded_host_blocks=len(loads))
        return [BlockCopy("host", slots[index], "device", block_id) for index, block_id in loads]

    def drop_swapped(self, request_id: str) -> None:
        """An aborted swapped-out request: its slots are free again."""
        slots = self._swapped.pop(request_id, None)
        if slots:
            self.host.release(slots)

    def clear_cache(self) -> None:
        self.host.clear_cache()
        if self.disk is not None:
            self.disk.clear_cache()
