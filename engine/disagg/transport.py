"""Moving a finished prefill's KV blocks to a decode worker.

A transport has a sending side, in the prefill worker, and a receiving side, in each decode
worker; between them only a small picklable `TransferHandle` travels with the request (through
the router). `SharedMemoryTransport` stages the blocks in one shared-memory segment per prefill
worker on this machine; a network (RDMA, NCCL) transport would put the same calls over a wire.

Flow: the prefill worker `send`s a request's blocks (a copy out of its KV cache into a range of
staging slots) and hands the handle on; the decode worker's runner `read`s them into its own
cache blocks when the scheduler admits the request; the decode worker then `release`s the handle
(through the router) so the sender can reuse its slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import math
from multiprocessing import shared_memory
from typing import Protocol

import torch
from torch import Tensor

from engine.errors import InputError


@dataclass(frozen=True)
class TransferHandle:
    """One request's KV in flight: which sender holds it, where, and how much."""

    sender: int  # the prefill worker's index
    first_slot: int
    num_blocks: int
    nbytes: int


@dataclass(frozen=True)
class StagingLayout:
    """The shape of one staged block (every layer) and how many slots a sender has."""

    num_layers: int
    block_shape: tuple[int, ...]  # [2, block_size, kv_heads, last], one layer's block
    dtype: torch.dtype
    num_slots: int

    @property
    def block_bytes(self) -> int:
        return self.num_layers * math.prod(self.block_shape) * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, caches: Sequence[Tensor], staging_gib: float) -> StagingLayout:
        """The layout for an engine's caches ([2, blocks, block_size, heads, last] per layer)."""
        block_shape = (2, *caches[0].shape[2:])
        one = cls(len(caches), block_shape, caches[0].dtype, 1)
        slots = int(staging_gib * 2**30 // one.block_bytes)
        if slots < 1:
            raise InputError("kv_transfer_gib", staging_gib, f"holds no KV block of {one.block_bytes:,} bytes")
        return cls(len(caches), block_shape, caches[0].dtype, slots)


class KVSender(Protocol):
    def send(self, blocks: Sequence[Tensor]) -> TransferHandle | None:
        """Stage per layer [2, n, ...] blocks; None when there is no room now (release some first)."""
        ...

    def release(self, handle: TransferHandle) -> None: ...


class KVReceiver(Protocol):
    def read(self, handle: TransferHandle, first_block: int, num_blocks: int) -> list[Tensor]:
        """Per layer [2, num_blocks, ...] views of staged blocks first_block.. of the handle."""
        ...


class SharedMemoryStaging:
    """A sender's staging slots in a shared-memory segment, viewed as [slots, layers, 2, block_size,
    heads, last]. The router creates the segment (and unlinks it at the end); workers attach by name."""

    def __init__(self, name: str, layout: StagingLayout) -> None:
        self.layout = layout
        self._shm = shared_memory.SharedMemory(name=name)
        raw = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=layout.num_slots * layout.block_bytes)
        self.slots = raw.view(layout.dtype).view(layout.num_slots, layout.num_layers, *layout.block_shape)

    @staticmethod
    def create(layout: StagingLayout) -> shared_memory.SharedMemory:
        return shared_memory.SharedMemory(create=True, size=layout.num_slots * layout.block_bytes)

    def close(self) -> None:
        del self.slots
        self._shm.close()


class SharedMemorySender:
    """The prefill side: first-fit ranges of contiguous slots, so a receiver reads one slice per layer."""

    def __init__(self, index: int, staging: SharedMemoryStaging) -> None:
        self.index, self.staging = index, staging
        self._free: list[tuple[int, int]] = [(0, staging.layout.num_slots)]  # (start, length), sorted

    def send(self, blocks: Sequence[Tensor]) -> TransferHandle | None:
        n = blocks[0].shape[1]
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                self._free[i : i + 1] = [(start + n, length - n)] if length > n else []
                break
        else:
            return None
        target = self.staging.slots[start : start + n]  # [n, layers, 2, block_size, heads, last]
        for layer, block in enumerate(blocks):
            target[:, layer].copy_(block.transpose(0, 1))
        return TransferHandle(self.index, start, n, n * self.staging.layout.block_bytes)

    def release(self, handle: TransferHandle) -> None:
        spans = sorted([*self._free, (handle.first_slot, handle.num_blocks)])
        merged: list[tuple[int, int]] = []
        for start, length in spans:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged


class SharedMemoryReceiver:
    """The decode side: views into every sender's staging segment."""

    def __init__(self, stagings: Sequence[SharedMemoryStaging]) -> None:
        self.stagings = list(stagings)

    def read(self, handle: TransferHandle, first_block: int, num_blocks: int) -> list[Tensor]:
        if first_block + num_blocks > handle.num_blocks:
            raise RuntimeError(f"blocks {first_block}..{first_block + num_blocks - 1} are beyond the "
                               f"{handle.num_blocks} the transfer holds")
        start = handle.first_slot + first_block
        staged = self.stagings[handle.sender].slots[start : start + num_blocks]
        return [staged[:, layer].transpose(0, 1) for layer in range(staged.shape[1])]
