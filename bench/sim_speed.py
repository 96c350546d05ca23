"""How fast the simulator runs: simulated seconds per wall second, and requests per wall second.

    .venv/bin/python bench/sim_speed.py                      # 10,000 chat requests, Llama-3.1-8B, 1 x H100
    .venv/bin/python bench/sim_speed.py --rates 4 16 --requests 10000 --json

Each rate is one full simulation (every step through the engine's own scheduler and KV-cache
manager). The figure to compare is simulated/wall: the best published peer simulator (Vidur)
runs a median experiment 141x faster than real time. No peer runs here, so this reports
absolute rates on this machine, with its CPU time.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from engine.catalog import resolve_model
from planner.hardware import get_hardware
from planner.sim import simulate
from planner.specs import Deployment
from planner.workload import get_workload


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
    rows = []
    for rate in args.rates:
        workload = get_workload(args.workload, num_requests=args.requests, arrival={"kind": "poisson", "rate_per_s": rate})
        wall0, cpu0 = time.perf_counter(), time.process_time()
        summary = simulate(model, hw, dep, workload).summary
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        rows.append({
            "rate_per_s": rate,
            "requests": summary.num_finished,
            "steps": summary.num_steps,
            "simulated_s": round(summary.duration_s, 1),
            "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2),
            "simulated_s_per_wall_s": round(summary.duration_s / wall, 1),
            "requests_per_wall_s": round(summary.num_finished / wall, 1),
            "steps_per_wall_s": round(summary.num_steps / wall),
            "mean_running": round(sum(summary.timeseries.num_running) / len(summary.timeseries.num_running), 1),
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.requests:,} {args.workload} requests, {args.model} on 1 x {args.hw}; {platform.processor() or platform.machine()}")
    for r in rows:
        print(
            f"  rate {r['rate_per_s']:>5g}/s: {r['simulated_s']:>8.1f} s simulated in {r['wall_s']:>6.2f} s wall "
            f"-> {r['simulated_s_per_wall_s']:>6.1f}x real time, {r['requests_per_wall_s']:>7.1f} requests/s, "
            f"{r['steps_per_wall_s']:>6,} steps/s (mean batch {r['mean_running']})"
        )


if __name__ == "__main__":
    main()
