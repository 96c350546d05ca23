"""How fast and how lean a fleet's day simulates: requests per wall second and peak memory of
`planner/sim/fleet.py` over N replicas, against one replica of the ordinary simulator (`simulate`)
at the same per-replica load, measured in the same run; and what a whole day would take.

    .venv/bin/python bench/fleet_day.py --replicas 1000 --rate-per-replica 8 --seconds 20
    .venv/bin/python bench/fleet_day.py --replicas 10 --rate-per-replica 8 --seconds 600 --json
    .venv/bin/python bench/fleet_day.py --replicas 1000 --rate-per-replica 16 --stand-ins 1 --hours 24

Each measurement runs in its own process (peak RSS is per process). The fleet serves a flat
Poisson rate of replicas x rate-per-replica for `--seconds` with its autoscaler running (pinned at
N: the per-request work is the same whatever the rate's shape), then drains; the peer serves one
replica's share (the same simulated span, so warm-up and drain weigh the same in both). The day's estimate
is the diurnal day's expected requests (trough 20 %, peak 100 % of that rate; mean 60 %) over the
fleet's measured requests per CPU second (the machine is shared: CPU time is what the run itself
took, wall time also counts the other sessions): the simulator's cost is per request and per step, and
memory follows live requests and replicas, not the day.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: the functions import what they run, as _fleet does
    from planner.specs import Deployment

DIURNAL_MEAN_SHARE = 0.6  # (trough 0.2 + peak 1.0) / 2: a cosine's mean over a day


def _deployment(hw_name: str, prefix_caching: bool) -> Deployment:
    from planner.specs import Deployment, EngineKnobs

    return Deployment(hardware=hw_name, knobs=EngineKnobs(enable_prefix_caching=prefix_caching))


def _fleet(model_name: str, hw_name: str, workload: str, replicas: int, rate_per_s: float, seconds: float,
           prefix_caching: bool, out: mp.Queue) -> None:
    from engine.catalog import resolve_model
    from planner.hardware import get_hardware
    from planner.sim.autoscaler import ScalingRule
    from planner.sim.fleet import simulate_fleet
    from planner.sim.simulator import ReplicaTemplate
    from planner.specs import SLO
    from planner.traffic import TrafficDay

    model, hw = resolve_model(model_name), get_hardware(hw_name)
    template = ReplicaTemplate.resolve(model, hw, _deployment(hw_name, prefix_caching))
    day = TrafficDay.model_validate({"rate": {"kind": "time_varying", "segments": [
        {"duration_s": seconds, "rate_per_s": replicas * rate_per_s}]}, "workload": workload})
    slo = SLO.parse("ttft_p99_ms<=1000,tpot_p99_ms<=50")
    wall0, cpu0 = time.perf_counter(), time.process_time()
    run = simulate_fleet(template, day.requests(model.vocab_size, template.max_len), day.duration_s,
                         ScalingRule.pinned(replicas), slo)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    arrived = sum(h.arrived for h in run.hours)
    out.put({"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "requests": run.finished,
             "requests_per_wall_s": round(run.finished / wall, 1), "requests_per_cpu_s": round(run.finished / cpu, 1),
             "slo_attainment": round(sum(h.good for h in run.hours) / arrived, 4),
             "mean_ttft_ms": round(sum(h.ttft_s for h in run.hours) / arrived * 1e3, 1),
             "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)})


def _peer(model_name: str, hw_name: str, workload: str, rate_per_s: float, requests: int, prefix_caching: bool,
          out: mp.Queue) -> None:
    from engine.catalog import resolve_model
    from planner.hardware import get_hardware
    from planner.sim import simulate
    from planner.workload import get_workload

    model, hw = resolve_model(model_name), get_hardware(hw_name)
    w = get_workload(workload, num_requests=requests, arrival={"kind": "poisson", "rate_per_s": rate_per_s})
    wall0, cpu0 = time.perf_counter(), time.process_time()
    summary = simulate(model, hw, _deployment(hw_name, prefix_caching), w).summary
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    out.put({"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "requests": summary.num_finished,
             "requests_per_wall_s": round(summary.num_finished / wall, 1),
             "requests_per_cpu_s": round(summary.num_finished / cpu, 1),
             "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)})


def _sampled_day(model_name: str, hw_name: str, workload: str, replicas: int, rate_per_s: float, hours: int,
                 stand_ins: int, target_in_flight: float, out: mp.Queue) -> None:
    from engine.catalog import resolve_model
    from planner.hardware import get_hardware
    from planner.sim.autoscaler import AutoscalePolicy, ScalingRule
    from planner.sim.fleet import simulate_sampled_fleet
    from planner.sim.simulator import ReplicaTemplate
    from planner.specs import SLO
    from planner.traffic import TrafficDay

    model, hw = resolve_model(model_name), get_hardware(hw_name)
    template = ReplicaTemplate.resolve(model, hw, _deployment(hw_name, True))
    peak = replicas * rate_per_s
    day = TrafficDay.model_validate({"rate": {"kind": "diurnal", "peak_rate_per_s": peak,
                                              "trough_rate_per_s": 0.2 * peak, "hours": hours},
                                     "workload": workload, "stand_in_replicas": stand_ins})
    slo = SLO.parse("ttft_p99_ms<=1000,tpot_p99_ms<=50")
    wall0, cpu0 = time.perf_counter(), time.process_time()
    rule = ScalingRule.pinned(replicas)
    if target_in_flight:  # autoscaled between 1 and `replicas`, the policy's defaults, a 60 s model load
        p = AutoscalePolicy()
        initial = max(1, round(replicas * day.rate_at(0.0) / peak))
        rule = ScalingRule(1, replicas, initial, target_in_flight, p.scale_up_queue_per_replica, p.interval_s,
                           p.window_s, p.scale_down_idle_s, p.cooldown_s, 60.0)
    run = simulate_sampled_fleet(template, day, rule, slo, stand_ins=stand_ins, vocab_size=model.vocab_size)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    arrived = sum(h.arrived for h in run.hours)
    out.put({"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "fleet_requests_estimated": round(arrived),
             "fleet_requests_expected": round(day.expected_requests), "stand_in_requests": run.finished,
             "stand_in_requests_per_cpu_s": round(run.finished / cpu, 1),
             "slo_attainment": round(sum(h.good for h in run.hours) / arrived, 4),
             "mean_ttft_ms": round(sum(h.ttft_s for h in run.hours) / arrived * 1e3, 1),
             "replica_hours": round(run.replica_hours, 1), "scaling_actions": len(run.actions),
             "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)})


def _in_process(target: Callable[..., None], *args: object) -> dict:
    out: mp.Queue = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=target, args=(*args, out))
    p.start()
    result = out.get()
    p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--hw", default="h100-sxm")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--replicas", type=int, default=1000)
    ap.add_argument("--rate-per-replica", type=float, default=8.0, help="Poisson requests/s per replica")
    ap.add_argument("--seconds", type=float, default=20.0, help="simulated seconds of traffic")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="replicas without the prefix cache (freed blocks are not kept for later hits)")
    ap.add_argument("--stand-ins", type=int, default=0,
                    help="simulate a diurnal day (trough 20 %%, peak --rate-per-replica) of the fleet as this many "
                         "stand-in replicas (planner/sim/fleet.py, SampledFleet) instead of the flat span")
    ap.add_argument("--hours", type=int, default=24, help="length of the --stand-ins day")
    ap.add_argument("--target-in-flight", type=float, default=0.0,
                    help="autoscale the --stand-ins day between 1 and --replicas at this many requests in flight per "
                         "replica (0: a fixed fleet)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    caching = not args.no_prefix_caching
    if args.stand_ins:
        load = os.getloadavg()
        day = _in_process(_sampled_day, args.model, args.hw, args.workload, args.replicas, args.rate_per_replica,
                          args.hours, args.stand_ins, args.target_in_flight)
        print(json.dumps({"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
                                     f"average before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}",
                          "setup": f"{args.model} on {args.hw}, workload {args.workload}, {args.replicas} replicas "
                                   + (f"(autoscaled, target {args.target_in_flight:g} in flight)" if args.target_in_flight
                                      else "(fixed)") + f", diurnal {args.hours} h peaking at {args.rate_per_replica:g} req/s per "
                                   f"replica, {args.stand_ins} stand-in(s)",
                          "sampled_day": day}, indent=2))
        return

    load = os.getloadavg()
    fleet = _in_process(_fleet, args.model, args.hw, args.workload, args.replicas, args.rate_per_replica, args.seconds,
                        caching)
    peer = _in_process(_peer, args.model, args.hw, args.workload, args.rate_per_replica,
                       round(fleet["requests"] / args.replicas), caching)
    day_requests = args.replicas * args.rate_per_replica * DIURNAL_MEAN_SHARE * 86_400
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average before "
                   f"{load[0]:.1f}, after {os.getloadavg()[0]:.1f}",
        "setup": f"{args.model} on {args.hw}, workload {args.workload}, {args.replicas} replicas at "
                 f"{args.rate_per_replica:g} req/s each for {args.seconds:g} simulated s, prefix caching "
                 + ("on" if caching else "off"),
        "fleet": fleet, "peer_one_replica_simulate": peer,
        "fleet_over_peer_requests_per_cpu_s": round(fleet["requests_per_cpu_s"] / peer["requests_per_cpu_s"], 2),
        "day": {"requests": round(day_requests),
                "basis": f"diurnal, trough 20 % and peak 100 % of {args.rate_per_replica:g} req/s per replica",
                "estimated_cpu_h": round(day_requests / fleet["requests_per_cpu_s"] / 3600, 1)},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
