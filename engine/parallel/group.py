"""One rank's view of its tensor-parallel group: its rank, the group's size, and the collectives
the parallel layers call, each timed.

Between CPU processes the data goes through shared memory (engine/parallel/shm.py), or gloo where
that cannot run; between GPUs, NCCL. Every
collective adds its wall time to `comm_s` under its kind, so a run can say which share of a step
went to communication, waiting for the slowest rank included (docs/parallelism.md). On CUDA the
collectives are asynchronous to the host and the timer would see only their launch: it is kept
for CPUs only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
import time

import torch
import torch.distributed as dist
from torch import Tensor

from engine.parallel.shm import ShmCollectives, connect
from engine.parallel.worker import COLLECTIVE_TIMEOUT


@dataclass
class TPGroup:
    rank: int
    size: int
    timed: bool = True
    comm_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # CPU ranks' shared-memory collectives; None on GPUs (NCCL) or where they cannot run (gloo).
    shm: ShmCollectives | None = field(init=False)

    def __post_init__(self) -> None:
        on_cpu = dist.get_backend() == "gloo"
        self.shm = connect(self.rank, self.size, COLLECTIVE_TIMEOUT.total_seconds()) if on_cpu else None

    def all_reduce(self, x: Tensor) -> Tensor:
        """The element-wise sum of x over the ranks, in place; every rank ends with the same bits."""
        start = self._start()
        if self.shm is None or not self.shm.all_reduce(x):
            dist.all_reduce(x)
        self._stop("all_reduce", start)
        return x

    def all_gather(self, x: Tensor) -> Tensor:
        """Every rank's x (the same shape on each) concatenated along dim 0, rank order."""
        start = self._start()
        out = self.shm.all_gather(x) if self.shm is not None else None
        if out is None:
            out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
            dist.all_gather_single(out, x.contiguous())
        self._stop("all_gather", start)
        return out

    def all_to_all(self, x: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        """Rows x[sum(send_counts[:r]) : ...] go to rank r; the rows each rank sent here come back
        concatenated in rank order (recv_counts[r] of them from rank r)."""
        start = self._start()
        out = self.shm.all_to_all(x, send_counts, recv_counts) if self.shm is not None else None
        if out is None:
            out = x.new_empty((sum(recv_counts), *x.shape[1:]))
            dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts)
        self._stop("all_to_all", start)
        return out

    def exchange_counts(self, send_counts: Tensor) -> Tensor:
        """send_counts [size, n] (row r: what goes to rank r) -> [size, n] (row r: what rank r sends here):
        an all-to-all of one row per rank."""
        one_each = [1] * self.size
        return self.all_to_all(send_counts, one_each, one_each)

    def take_stats(self) -> tuple[dict[str, float], dict[str, int]]:
        """(seconds, calls) per collective kind since the last call, and start counting anew."""
        stats = dict(self.comm_s), dict(self.calls)
        self.comm_s.clear()
        self.calls.clear()
        return stats

    def _start(self) -> float:
        return time.perf_counter() if self.timed else 0.0

    def _stop(self, kind: str, start: float) -> None:
        self.calls[kind] += 1
        if self.timed:
            self.comm_s[kind] += time.perf_counter() - start
