"""How fast the simulator runs: simulated seconds per wall second, and requests per wall second.

    .venv/bin/python bench/sim_speed.py                      # 10,000 chat requests, Llama-3.1-8B, 1 x H100
    .venv/bin/python bench/sim_speed.py --rates 4 16 --requests 10000 --json

Each rate is simulated twice in the same run: with bulk decodes (the default: the scheduler
applies decode steps in which nothing happens to a request in one go, engine/core/bulk_decodes.py)
and one by one (every request looked at in every step, as the engine does), the peer the ratio is
taken against. The two runs must give the same summary; the bench stops if they do not. The
published figure to compare simulated/wall with is Vidur's 141x (median experiment, its hardware).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Literal, TypedDict

from engine.catalog import resolve_model
from engine.config import ModelConfig
from engine.core.compiled import is_compiled
from planner.hardware import get_hardware
from planner.metrics import RunSummary
from planner.sim import simulate
from planner.specs import Deployment, HardwareProfile
from planner.workload import Workload, get_workload

Mode = Literal["bulk", "one_by_one"]
MODES: dict[Mode, bool] = {"bulk": True, "one_by_one": False}
CORE = "compiled (mypyc)" if is_compiled() else "pure Python"  # `make core` compiles it


class Row(TypedDict):
    rate_per_s: float
    core: str
    requests: int
    steps: int
    simulated_s: float
    mean_running: float
    bulk: dict[str, float]
    one_by_one: dict[str, float]
    speedup_bulk_vs_one_by_one: float


def _measure(model: ModelConfig, hw: HardwareProfile, dep: Deployment, workload: Workload,
             bulk: bool) -> tuple[dict[str, float], RunSummary]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    summary = simulate(model, hw, dep, workload, bulk_decodes=bulk).summary
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "simulated_s_per_wall_s": round(summary.duration_s / wall, 1),
        "requests_per_wall_s": round(summary.num_finished / wall, 1),
        "steps_per_wall_s": round(summary.num_steps / wall),
    }, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--hw", default="h100-sxm")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0, 16.0], help="Poisson arrival rates, requests/s")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model, hw = resolve_model(args.model), get_hardware(args.hw)
    dep = Deployment(hardware=args.hw)
    rows: list[Row] = []
    for rate in args.rates:
        workload = get_workload(args.workload, num_requests=args.requests, arrival={"kind": "poisson", "rate_per_s": rate})
        runs: dict[Mode, dict[str, float]] = {}
        summaries: dict[Mode, RunSummary] = {}
        for mode, bulk in MODES.items():
            runs[mode], summaries[mode] = _measure(model, hw, dep, workload, bulk)
        if summaries["bulk"].model_dump() != summaries["one_by_one"].model_dump():
            raise SystemExit(f"rate {rate}: bulk decodes and one-by-one simulations disagree; the speed figures mean nothing")
        summary = summaries["bulk"]
        rows.append({
            "rate_per_s": rate,
            "core": CORE,
            "requests": summary.num_finished,
            "steps": summary.num_steps,
            "simulated_s": round(summary.duration_s, 1),
            "mean_running": round(sum(summary.timeseries.num_running) / len(summary.timeseries.num_running), 1),
            "bulk": runs["bulk"],
            "one_by_one": runs["one_by_one"],
            "speedup_bulk_vs_one_by_one": round(runs["one_by_one"]["wall_s"] / runs["bulk"]["wall_s"], 2),
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.requests:,} {args.workload} requests, {args.model} on 1 x {args.hw}; "
          f"{platform.processor() or platform.machine()}; engine core {CORE}")
    for r in rows:
        print(f"  rate {r['rate_per_s']:g}/s: {r['simulated_s']:.1f} s simulated, {r['steps']:,} steps, mean batch "
              f"{r['mean_running']}; summaries identical")
        for mode in MODES:
            m = r[mode]
            print(f"    {mode:>10}: {m['wall_s']:>6.2f} s wall -> {m['simulated_s_per_wall_s']:>6.1f}x real time, "
                  f"{m['requests_per_wall_s']:>7.1f} requests/s, {m['steps_per_wall_s']:>6,} steps/s")
        print(f"    bulk / one by one: {r['speedup_bulk_vs_one_by_one']:.2f}x")


if __name__ == "__main__":
    main()
