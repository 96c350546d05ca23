"""Micro-benchmark of the quantised Linears against fp32 F.linear on SmolLM2-135M shapes.

    OMP_NUM_THREADS=2 .venv/bin/python bench/quant_linears.py [--rows 1 16] [--threads 2]

Prints the best-of-5 mean time per call (microseconds) for each shape and row count. The w4a8
column is the native kernel (engine/quant/native.py; `make native` first). "int8 dynamic" (per-token
W8A8) in each implementation this CPU has: fbgemm's linear_dynamic with its torch ops around it, and
the native per-channel kernel on AVX-512 VNNI and on AMX tiles.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import contextlib
from functools import partial
import time
import warnings

import torch

from engine.model.layers import Linear
from engine.quant import native
from engine.quant.linear import Fp8Linear, Int4Linear, Int8Linear

# SmolLM2-135M: hidden 576, FFN 1536, 9 heads / 3 KV heads of 64 -> qkv 960 rows.
SHAPES = {"qkv 576->960": (576, 960), "o 576->576": (576, 576), "gate_up 576->3072": (576, 3072),
          "down 1536->576": (1536, 576), "576->1536": (576, 1536)}


def best_us(fn: Callable[[], object], budget_s: float = 0.05, reps: int = 5) -> float:
    fn()
    t = time.perf_counter()
    fn()
    calls = max(2, min(50, int(budget_s / max(time.perf_counter() - t, 1e-6))))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability {torch.backends.cpu.get_cpu_capability()}")
    # (label, build, instruction-set level to call it at: None = as detected)
    level = native.detected_isa_level() if native.available() else 0
    dynamic = [("int8 dyn fbgemm", 1), ("int8 dyn VNNI", 2), ("int8 dyn AMX", 3)]
    dynamic = [(label, lvl) for label, lvl in dynamic if lvl <= level or lvl == 1]
    kinds = ["fp32", "int8 int8pack", "int8 dequant", *(label for label, _ in dynamic), "int4 int4pack", "int4 w4a8 g32",
             "int4 dequant", "fp8"]
    print(f"{'shape':20s} rows " + " ".join(f"{k:>15s}" for k in kinds))

    def at(lvl: int | None) -> contextlib.AbstractContextManager[None]:
        return native.forced_isa(lvl) if lvl is not None and native.available() else contextlib.nullcontext()

    with torch.inference_mode():
        for name, (k, n) in SHAPES.items():
            lin = Linear(k, n).requires_grad_(False)
            lin.weight.normal_(0, 0.02)
            with at(min(1, level)):  # below VNNI "dynamic" packs for fbgemm
                fbgemm = Int8Linear.from_linear(lin, "dynamic")
            native_dynamic = Int8Linear.from_linear(lin, "dynamic")
            mods = [(lin, None), (Int8Linear.from_linear(lin, "int8pack"), None), (Int8Linear.from_linear(lin, "dequant"), None),
                    *((fbgemm if lvl == 1 else native_dynamic, None if lvl == 1 else lvl) for _, lvl in dynamic),
                    (Int4Linear.from_linear(lin, 128, kernel="int4pack"), None), (Int4Linear.from_linear(lin, 32, kernel="w4a8"), None),
                    (Int4Linear.from_linear(lin, 128, kernel="dequant"), None), (Fp8Linear.from_linear(lin), None)]
            for rows in args.rows:
                x = torch.randn(rows, k)
                times = []
                for m, lvl in mods:
                    with at(lvl):
                        times.append(best_us(partial(m, x)))
                print(f"{name:20s} {rows:4d} " + " ".join(f"{t:13.0f}us" for t in times))


if __name__ == "__main__":
    main()
