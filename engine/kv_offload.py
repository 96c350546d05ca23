"""The tensors behind the KV-cache manager's offload tiers, and the copies a step lists.

The core (engine/core/kv_tiers.py) decides which block goes where and lists the copies in
`SchedulerOutput.kv_transfers`; this module holds the host tier (one tensor per layer, shaped like
the device cache, pinned on CUDA so copies run as DMA) and the disk tier (a file under the
folder given, memory-mapped: its pages go to disk as the kernel writes them back), and performs
the copies in the listed order before the step's forward pass. External KV (a prefill
instance's transfer) comes from an `ExternalKV` source.

On CUDA the copies are issued on a side stream while the runner builds the step's input
tensors on the host, and the forward pass waits for them; on the CPU, where the same cores would
do both, they run in line.
"""

from __future__ import annotations

from collections.abc import Sequence
import itertools
import math
import os
from pathlib import Path
import tempfile
from typing import Protocol

import torch
from torch import Tensor

from engine.core import KVTransfers
from engine.errors import InputError

GIB = 2**30


class ExternalKV(Protocol):
    """Where a request's externally computed KV comes from (the decode side of a transport)."""

    def read(self, request_id: str, first_block: int, num_blocks: int) -> list[Tensor]:
        """Per layer, [2, num_blocks, block_size, kv_heads, head_dim] of the request's blocks
        first_block..first_block + num_blocks - 1."""
        ...

    def loaded(self, request_id: str) -> None:
        """The request's KV is in the device cache: its staging may be released."""
        ...


class TierStore:
    """Host and disk slots, laid out like the device cache: one [2, slots, block_size, heads,
    last] tensor per layer each."""

    def __init__(self, caches: Sequence[Tensor], host_blocks: int, disk_blocks: int = 0,
                 disk_folder: str | None = None) -> None:
        like = caches[0]
        self.caches = list(caches)
        block_shape = tuple(like.shape[2:])
        pin = like.device.type == "cuda"
        self.host = [torch.zeros((2, host_blocks, *block_shape), dtype=like.dtype, pin_memory=pin) for _ in caches]
        self.disk: list[Tensor] = []
        if disk_blocks:
            assert disk_folder is not None
            self.disk = _disk_tier(disk_folder, len(caches), disk_blocks, block_shape, like.dtype)
        self.places = {"device": self.caches, "host": self.host, "disk": self.disk}

    def copy(self, transfers: KVTransfers) -> None:
        """Every copy, in order; consecutive copies between the same two places go as one gather
        and scatter per layer."""
        for (src, dst), run in itertools.groupby(transfers.copies, key=lambda c: (c.src, c.dst)):
            pairs = list(run)
            src_ids = [c.src_id for c in pairs]
            dst_ids = [c.dst_id for c in pairs]
            copy_blocks(self.places[src], src_ids, self.places[dst], dst_ids)


def copy_blocks(src: Sequence[Tensor], src_ids: Sequence[int], dst: Sequence[Tensor], dst_ids: Sequence[int]) -> None:
    """dst[layer][:, dst_ids] = src[layer][:, src_ids] for every layer, across devices."""
    src_index = torch.tensor(src_ids, device=src[0].device)
    dst_index = torch.tensor(dst_ids, device=dst[0].device)
    non_blocking = src[0].device.type == "cuda" or dst[0].device.type == "cuda"
    for s, d in zip(src, dst, strict=True):
        d.index_copy_(1, dst_index, s.index_select(1, src_index).to(d.device, non_blocking=non_blocking))


def _disk_tier(folder: str, layers: int, slots: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> list[Tensor]:
    """A file of `slots` blocks for every layer under `folder`, memory-mapped. The file is unlinked
    at once, so it goes away with the engine even when the process is killed."""
    path = Path(folder)
    if not path.is_dir():
        raise InputError("kv_offload_disk_path", folder, "must be an existing folder")
    element = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * slots * math.prod(block_shape)
    size = layers * per_layer * element
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    if size > free:
        raise InputError("kv_offload_disk_gib", round(size / GIB, 3), f"more than the {free / GIB:.1f} GiB free in {folder}")
    fd, name = tempfile.mkstemp(prefix="serveplan-kv-", suffix=".bin", dir=path)
    try:
        os.ftruncate(fd, size)
        raw = torch.from_file(name, shared=True, size=size, dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(name)
    tiers = raw.view(dtype).view(layers, 2, slots, *block_shape)
    return list(tiers.unbind(0))
