"""How close a fleet simulated by stand-in replicas comes to the same fleet simulated whole, and at
what cost: the same traffic, seed and scaling rule, both in the same run.

    .venv/bin/python bench/fleet_stand_ins.py          # the three cases of docs/benchmarks.md (~4 CPU minutes)
    .venv/bin/python bench/fleet_stand_ins.py --json

Llama-3.1-8B on one H100 per replica (vLLM 0.11 profile, the public fit), round robin.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import TypedDict

from engine.catalog import resolve_model
from planner.hardware import get_hardware
from planner.sim.autoscaler import ScalingRule
from planner.sim.fleet import FleetRun, simulate_fleet, simulate_sampled_fleet
from planner.sim.simulator import ReplicaTemplate
from planner.specs import SLO, Deployment
from planner.traffic import TrafficDay

SHORT = {"name": "short", "input_tokens": 200, "output_tokens": {"kind": "uniform", "min_tokens": 20, "max_tokens": 120}}


@dataclass(frozen=True)
class Case:
    name: str
    segments: list[tuple[float, float]]  # (duration_s, fleet rate_per_s)
    workload: str | dict[str, object]  # a preset name or a workload spec, as TrafficDay reads it
    rule: ScalingRule
    slo: str
    stand_ins: int


CASES = [
    Case("10 fixed replicas, 80 req/s for 90 s", [(90.0, 80.0)], "chat", ScalingRule.pinned(10),
         "ttft_p99_ms<=300,tpot_p99_ms<=25", 3),
    Case("autoscaled 2-30, 80 -> 200 -> 80 req/s", [(300.0, 80.0), (600.0, 200.0), (600.0, 80.0)], "chat",
         ScalingRule(2, 30, 5, 50.0, 4.0, 15.0, 60.0, 300.0, 60.0, 60.0), "ttft_p99_ms<=300,tpot_p99_ms<=25", 4),
    Case("autoscaled 1-20, 8 -> 60 -> 8 req/s", [(120.0, 8.0), (240.0, 60.0), (240.0, 8.0)], SHORT,
         ScalingRule(1, 20, 2, 8.0, 4.0, 5.0, 10.0, 30.0, 10.0, 30.0), "ttft_p99_ms<=40", 2),
]


class Row(TypedDict):
    case: str
    slo: str
    stand_ins: int
    whole: dict[str, float]
    stand_ins_run: dict[str, float]


def _summary(run: FleetRun, cpu_s: float) -> dict[str, float]:
    arrived = sum(h.arrived for h in run.hours)
    return {"requests_simulated": run.finished, "cpu_s": round(cpu_s, 1),
            "slo_attainment": round(sum(h.good for h in run.hours) / arrived, 4),
            "mean_ttft_ms": round(sum(h.ttft_s for h in run.hours) / arrived * 1e3, 1),
            "mean_e2e_ms": round(sum(h.e2e_s for h in run.hours) / arrived * 1e3, 1),
            "replica_s": round(run.replica_s), "scaling_actions": len(run.actions)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model, hw = resolve_model("llama-3.1-8b"), get_hardware("h100-sxm")
    template = ReplicaTemplate.resolve(model, hw, Deployment(hardware=hw.name))
    rows: list[Row] = []
    for case in CASES:
        day = TrafficDay.model_validate({"rate": {"kind": "time_varying", "segments": [
            {"duration_s": d, "rate_per_s": r} for d, r in case.segments]}, "workload": case.workload})
        slo = SLO.parse(case.slo)
        cpu0 = time.process_time()
        whole = simulate_fleet(template, day.requests(model.vocab_size, template.max_len), day.duration_s, case.rule,
                               slo)
        cpu1 = time.process_time()
        sampled = simulate_sampled_fleet(template, day, case.rule, slo, stand_ins=case.stand_ins,
                                         vocab_size=model.vocab_size)
        cpu2 = time.process_time()
        rows.append({"case": case.name, "slo": case.slo, "stand_ins": case.stand_ins,
                     "whole": _summary(whole, cpu1 - cpu0), "stand_ins_run": _summary(sampled, cpu2 - cpu1)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        print(f"{row['case']} ({row['slo']}), {row['stand_ins']} stand-ins")
        for key in ("whole", "stand_ins_run"):
            print(f"  {key:>13}: " + ", ".join(f"{k} {v:,}" for k, v in row[key].items()))


if __name__ == "__main__":
    main()
