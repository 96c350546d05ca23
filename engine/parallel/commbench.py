"""The engine's collectives timed by message size, between processes of this machine (shared
memory, engine/parallel/shm.py; gloo past its slots).

`serveplan calibrate` runs this and hands the curves to the cost model (the local profile's
scale-up link), so the CPU validation of tensor and expert parallelism prices communication
from measurements of the very calls the engine makes (engine/parallel/group.py). Payloads follow
nccl-tests: the buffer all-reduced, the whole gathered output, the whole buffer a rank sends.
Each size is timed as the engine calls it, back to back: ranks start a run of calls together (a
barrier), and the figure is the run's mean time per call, the median over `ROUNDS` runs
(nccl-tests reports the same mean over iterations). A run is `repeats` calls, ten times as many
for messages up to 64 KiB, whose times are short and heavy-tailed. Not the median of single calls:
on a virtual machine a rank that sleeps in a collective can take a scheduler tick to wake, so a
quarter of the calls of a 2 KiB all-reduce took 3-4 ms where the median was 0.46 ms (mean 1.6 ms);
a decode step pays the mean, one all-reduce per layer after another.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
import multiprocessing as mp
from multiprocessing.queues import Queue
from pathlib import Path
import statistics
import tempfile
import time

KINDS = ("all_reduce", "all_gather", "all_to_all")
ROUNDS = 3
SMALL_MESSAGE_BYTES = 1 << 16
SMALL_MESSAGE_CALLS = 10  # times `repeats`
SIZES = tuple(1 << n for n in range(8, 25, 2))  # 256 B to 16 MiB in steps of 4


def measure(world: int = 2, sizes: tuple[int, ...] = SIZES, repeats: int = 20, threads: int = 1,
            timeout_s: float = 600.0) -> dict[str, list[tuple[int, float]]]:
    """kind -> [(payload bytes, median microseconds)] over `world` processes on this machine."""
    ctx = mp.get_context("spawn")
    results: Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="serveplan-commbench-") as folder:
        init = Path(folder, "rendezvous").as_uri()
        procs = [ctx.Process(target=_rank, args=(rank, world, init, sizes, repeats, threads, results), daemon=True)
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        try:
            out = results.get(timeout=timeout_s)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    if isinstance(out, str):
        raise RuntimeError(f"communication benchmark failed: {out}")
    return out


def _rank(rank: int, world: int, init: str, sizes: tuple[int, ...], repeats: int, threads: int, results: Queue) -> None:
    import traceback

    import torch
    import torch.distributed as dist

    from engine.parallel.group import TPGroup

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group = TPGroup(rank, world)
        # message bytes -> a call of the collective on a message that size (its tensors made once, up front)
        calls: dict[str, Callable[[int], Callable[[], torch.Tensor]]] = {
            "all_reduce": lambda n: partial(group.all_reduce, torch.ones(n // 4)),
            "all_gather": lambda n: partial(group.all_gather, torch.ones(n // 4 // world)),
            "all_to_all": lambda n: partial(group.all_to_all, torch.ones(n // 4), [n // 4 // world] * world,
                                            [n // 4 // world] * world),
        }
        curves: dict[str, list[tuple[int, float]]] = {}
        for kind in KINDS:
            curves[kind] = []
            for size in sizes:
                call = calls[kind](size)
                call()  # warm-up: connections, buffers
                n = repeats * (SMALL_MESSAGE_CALLS if size <= SMALL_MESSAGE_BYTES else 1)
                means = []
                for _ in range(ROUNDS):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(n):
                        call()
                    means.append((time.perf_counter() - start) / n)
                curves[kind].append((size, statistics.median(means) * 1e6))
        if rank == 0:
            results.put(curves)
    except Exception:  # noqa: BLE001 (reported to the caller, which raises)
        if rank == 0:
            results.put(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
