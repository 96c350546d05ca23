"""Collectives through shared memory between the ranks of one machine, for CPU tensor parallelism.

gloo carries a collective over loopback sockets: a ring of dependent sends and receives, each
waiting for the peer process to be woken. On this project's 2-core VM a small all-reduce took
1.4-2.4 ms that way, and once the ranks also compute between collectives, as a decode step does,
every collective cost 0.5-1 ms of waking: half of an expert-parallel decode step. vLLM's CPU
backend replaces gloo by a shared-memory all-reduce for the same reason (its CpuCommunicator, on
x86); this is that idea in a few lines of torch.

One segment holds, per rank, a sequence counter on a cache line of its own and two slots (a
header and a payload). A collective is one round, the "one-shot" algorithm:
1. the rank writes its payload into its slot of this round's parity, then its counter;
2. it waits until every peer's counter has reached this round;
3. it reads what it needs from the peers' slots (sum, concatenation, its rows).
Two slots make a second round unnecessary: a peer can only overwrite the slot of round k with
round k + 2, which it starts after this rank has posted k + 1, that is after this rank finished
reading round k.

x86-64 only: its stores become visible to other cores in program order (TSO), so a peer that
sees the counter sees the payload written before it. Elsewhere (ARM's weaker ordering) the
engine keeps gloo, as vLLM does. Waiting spins on the counters with sched_yield, so a waiting
rank keeps its core awake (no wake-up latency) and still gives it up when ranks outnumber cores.
"""

from __future__ import annotations

import math
import mmap
import os
import platform
import secrets
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

# One rank's payload per round. A payload that does not fit on some rank sends the whole
# collective over gloo on every rank (they agree through the headers, see `_round`).
SLOT_BYTES = 4 << 20
LINE = 64  # bytes: a counter or a header per cache line, so ranks never write the same line
HEADER_INTS = 32  # int64s: [payload bytes, then up to 31 row counts of an all-to-all]


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def connect(rank: int, size: int, timeout_s: float, slot_bytes: int = SLOT_BYTES) -> ShmCollectives | None:
    """The group's shared-memory collectives, or None where they cannot run (not x86-64, more
    ranks than a header holds, /dev/shm too small): then every rank keeps gloo. Call on every rank
    at the same point, after init_process_group: rank 0 creates the segment, the others open it,
    and it is unlinked at once, so no segment outlives the ranks however they end."""
    total = size * LINE + 2 * size * (HEADER_INTS * 8 + slot_bytes)
    path: list[str | None] = [None]
    if rank == 0 and supported() and size < HEADER_INTS and _room_in_dev_shm(total):
        path[0] = created = f"/dev/shm/serveplan-tp-{secrets.token_hex(8)}"
        fd = os.open(created, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, total)
    dist.broadcast_object_list(path, src=0)
    if path[0] is None:
        return None
    if rank != 0:
        fd = os.open(path[0], os.O_RDWR)
    try:
        segment = mmap.mmap(fd, total)
    finally:
        os.close(fd)
    dist.barrier()
    if rank == 0:
        os.unlink(path[0])
    return ShmCollectives(segment, rank, size, timeout_s, slot_bytes)


def _room_in_dev_shm(nbytes: int) -> bool:
    """A segment larger than /dev/shm's free space would fault (SIGBUS) on first touch, mid-run."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize >= 2 * nbytes


class ShmCollectives:
    """The collectives of one group of `size` ranks over one shared segment (see `connect`)."""

    def __init__(self, segment: mmap.mmap, rank: int, size: int, timeout_s: float, slot_bytes: int) -> None:
        self.rank, self.size, self.timeout_s, self.slot_bytes = rank, size, timeout_s, slot_bytes
        self._segment = segment
        self._slot_stride = HEADER_INTS * 8 + slot_bytes
        buf = memoryview(segment)
        self._counters = np.ndarray((size, LINE // 8), dtype=np.int64, buffer=buf)
        self._bytes = torch.frombuffer(buf, dtype=torch.uint8)
        self._round_no = 0

    def all_reduce(self, x: Tensor) -> bool:
        """x summed over the ranks, in place, in rank order on every rank (the same bits
        everywhere); False, with x untouched, when the collective must go over gloo instead."""
        parity = self._round(x, ())
        if parity is None:
            return False
        x.copy_(self._payload(0, parity, x.dtype, x.numel()).view_as(x))
        for r in range(1, self.size):
            x += self._payload(r, parity, x.dtype, x.numel()).view_as(x)
        return True

    def all_gather(self, x: Tensor) -> Tensor | None:
        """Every rank's x concatenated along dim 0 in rank order; None: use gloo."""
        parity = self._round(x, ())
        if parity is None:
            return None
        return torch.cat([self._payload(r, parity, x.dtype, x.numel()).view(x.shape) for r in range(self.size)])

    def all_to_all(self, x: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor | None:
        """Rows send_counts[r] of x to rank r, in order; the rows each rank sent here, rank order. None: use gloo."""
        parity = self._round(x, send_counts)
        if parity is None:
            return None
        row = math.prod(x.shape[1:])
        parts = []
        for r in range(self.size):
            counts = self._header(r, parity)[1 : 1 + self.size]
            if int(counts[self.rank]) != recv_counts[r]:
                raise RuntimeError(f"all-to-all: rank {r} sends {int(counts[self.rank])} rows here, "
                                   f"rank {self.rank} expects {recv_counts[r]}")
            start = int(counts[: self.rank].sum())
            sent = self._payload(r, parity, x.dtype, int(counts.sum()) * row)
            parts.append(sent[start * row : (start + recv_counts[r]) * row])
        return torch.cat(parts).view(sum(recv_counts), *x.shape[1:])

    def _round(self, x: Tensor, row_counts: list[int] | tuple[()]) -> int | None:
        """Post x (and its row counts) and wait for every peer's post: the parity of this round's
        slots, or None when some rank's payload exceeds a slot (then no rank reads the slots)."""
        self._round_no += 1
        parity = self._round_no & 1
        nbytes = x.numel() * x.element_size()
        header = self._header(self.rank, parity)
        header[0] = nbytes
        header[1 : 1 + len(row_counts)] = row_counts
        if nbytes <= self.slot_bytes:
            self._payload(self.rank, parity, x.dtype, x.numel()).copy_(x.reshape(-1))
        self._counters[self.rank, 0] = self._round_no  # after the payload: x86 keeps the order
        self._wait(self._round_no)
        fits = all(self._header(r, parity)[0] <= self.slot_bytes for r in range(self.size))
        return parity if fits else None

    def _wait(self, round_no: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        for peer in range(self.size):
            spins = 0
            while self._counters[peer, 0] < round_no:
                os.sched_yield()
                spins += 1
                if spins % 4096 == 0 and time.monotonic() > deadline:
                    raise RuntimeError(f"rank {self.rank} waited {self.timeout_s:.0f} s in a collective "
                                       f"for rank {peer}, which has stopped answering")

    def _slot_offset(self, rank: int, parity: int) -> int:
        return self.size * LINE + (2 * rank + parity) * self._slot_stride

    def _header(self, rank: int, parity: int) -> np.ndarray:
        return np.ndarray((HEADER_INTS,), dtype=np.int64, buffer=self._segment, offset=self._slot_offset(rank, parity))

    def _payload(self, rank: int, parity: int, dtype: torch.dtype, numel: int) -> Tensor:
        """The first `numel` elements of a rank's slot, as a flat tensor over the shared memory."""
        start = self._slot_offset(rank, parity) + HEADER_INTS * 8
        return self._bytes[start : start + numel * dtype.itemsize].view(dtype)
