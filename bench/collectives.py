"""The engine's collectives between two CPU processes: shared memory (engine/parallel/shm.py)
against gloo, same calls, same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/collectives.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/collectives.py --world 2 --compute-us 2000

Two kinds of timing, each alternating the two transports round by round so machine noise hits both:
- back to back: the mean time of a call over a run of calls (as `serveplan calibrate` times them);
- between compute: each call follows some work (a matmul loop, unequal across ranks, as a rank of
  a decode step computes between collectives); the figure is the time per iteration beyond the
  compute alone, which is what a step pays for the collective, waking up included.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import json
import multiprocessing as mp
from multiprocessing.queues import Queue
from pathlib import Path
import statistics
import tempfile
import time

SIZES = (256, 4096, 65536, 1 << 20, 4 << 20)
# Below this, a "between compute" figure is within the noise of the compute it is measured against
# (it can come out negative), and no ratio is printed.
NOISE_US = 50.0
ROUNDS = 5


def _rank(rank: int, world: int, init: str, compute_us: float, results: Queue) -> None:
    import torch
    import torch.distributed as dist

    from engine.parallel.group import TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    shm_group = TPGroup(rank, world)
    gloo_group = TPGroup(rank, world)
    gloo_group.shm = None  # the same calls, over gloo
    groups = {"shared memory": shm_group, "gloo": gloo_group}

    a = torch.randn(128, 128)
    t = time.perf_counter()
    for _ in range(100):
        a @ a
    matmul_s = (time.perf_counter() - t) / 100
    # Rank 0 computes a quarter longer than the others: the others wait in each collective.
    work = max(1, round(compute_us * 1e-6 * (1.25 if rank == 0 else 1.0) / matmul_s))

    def compute() -> None:
        for _ in range(work):
            a @ a

    def call(group: TPGroup, kind: str, nbytes: int) -> Callable[[], object]:
        if kind == "all_reduce":
            x = torch.ones(nbytes // 4)
            return lambda: group.all_reduce(x)
        if kind == "all_gather":
            x = torch.ones(nbytes // 4 // world)
            return lambda: group.all_gather(x)
        x = torch.ones(nbytes // 4)
        counts = [nbytes // 4 // world] * world
        return lambda: group.all_to_all(x, counts, counts)

    def timed(fn: Callable[[], object], n: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    compute_alone = statistics.median(timed(compute, 50) for _ in range(ROUNDS))
    rows = []
    for kind in ("all_reduce", "all_gather", "all_to_all"):
        for nbytes in SIZES:
            back_to_back: dict[str, list[float]] = {name: [] for name in groups}
            between: dict[str, list[float]] = {name: [] for name in groups}
            for _ in range(ROUNDS):
                for name, group in groups.items():
                    fn = call(group, kind, nbytes)
                    fn()
                    back_to_back[name].append(timed(fn, 50 if nbytes <= 65536 else 10))

                    def step(fn: Callable[[], object] = fn) -> None:
                        compute()
                        fn()

                    between[name].append(timed(step, 30) - compute_alone)
            rows.append({"kind": kind, "bytes": nbytes,
                         **{f"{name} back to back us": statistics.median(v) * 1e6 for name, v in back_to_back.items()},
                         **{f"{name} between compute us": statistics.median(v) * 1e6 for name, v in between.items()}})
    if rank == 0:
        results.put({"compute_us_rank0": compute_alone * 1e6, "rows": rows})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--compute-us", type=float, default=1000.0,
                        help="work between two collectives, microseconds (default 1000: a small model's layer)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="serveplan-bench-") as folder:
        init = Path(folder, "rendezvous").as_uri()
        procs = [ctx.Process(target=_rank, args=(r, args.world, init, args.compute_us, results))
                 for r in range(args.world)]
        for proc in procs:
            proc.start()
        out = results.get(timeout=1800)
        for proc in procs:
            proc.join(timeout=60)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.world} processes, one thread each; compute between collectives {out['compute_us_rank0']:.0f} µs "
          f"on rank 0 (the others 20 % less); medians of {ROUNDS} rounds, transports alternating")
    print(f"{'collective':11s} {'bytes':>9s} | back to back µs: {'shm':>7s} {'gloo':>7s} {'gloo/shm':>8s} "
          f"| between compute µs: {'shm':>7s} {'gloo':>7s} {'gloo/shm':>8s}")
    for row in out["rows"]:
        b_s, b_g = row["shared memory back to back us"], row["gloo back to back us"]
        c_s, c_g = row["shared memory between compute us"], row["gloo between compute us"]
        print(f"{row['kind']:11s} {row['bytes']:9d} | {'':16s} {b_s:7.0f} {b_g:7.0f} {b_g / b_s:8.1f} "
              f"| {'':19s} {c_s:7.0f} {c_g:7.0f} {f'{c_g / c_s:.1f}' if c_s > NOISE_US else 'n/a':>8s}")


if __name__ == "__main__":
    main()
