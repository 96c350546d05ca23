"""A day of traffic planned: the deployment the search recommends for the day's peak, then that
replica over the whole day twice: as a fixed fleet sized for the peak, and autoscaled.

The replica (hardware, parallelism, formats, knobs) is the one `plan` recommends at the peak rate;
its replica count there is the fixed fleet. Both fleets then serve the same requests
(planner/traffic.py) in planner/sim/fleet.py, hour by hour: replicas billed, SLO attainment,
cost per day.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.catalog import resolve_model
from engine.errors import InputError
from planner.costmodel.fitted import FittedModel
from planner.metrics import RunSummary
from planner.search import PlanResult, plan
from planner.search.space import priced_profiles
from planner.sim.autoscaler import DEFAULT_STORAGE_READ_GB_S, AutoscalePolicy, ScalingRule
from planner.sim.fleet import HOUR_S, FleetRun, simulate_fleet, simulate_sampled_fleet
from planner.sim.simulator import ReplicaTemplate
from planner.specs import SLO, Deployment, HardwareProfile
from planner.traffic import TrafficDay, check_limits
from planner.workload import RateSegment


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HourReport(_Out):
    hour: int
    offered_rate_per_s: float = Field(description="Mean arrival rate the traffic file sets for the hour")
    arrived: int = Field(description="Requests that arrived in the hour (a sampled fleet's: its stand-ins' scaled)")
    replicas: float = Field(description="Replicas billed, averaged over the hour (loading and draining ones included)")
    most_ready_replicas: int = Field(description="Most replicas serving at once in the hour")
    slo_attainment: float | None = Field(
        description="Share of the hour's arrivals served within every per-request limit of the SLO; None: no arrivals")
    slo_met: bool | None = Field(description="slo_attainment >= the SLO's goodput_share; None: no arrivals")
    mean_ttft_ms: float | None
    mean_e2e_ms: float | None


class FleetDayReport(_Out):
    fleet: str = Field(description="'fixed' (sized for the peak) or 'autoscaled'")
    hours: list[HourReport]
    replica_hours: float = Field(description="Replica-hours billed over the day")
    gpu_hours: float
    usd_per_day: float | None = Field(description="GPU-hours at the profile's price; None: the profile lists none")
    slo_attainment: float = Field(description="Share of the day's requests served within every per-request limit")
    hours_meeting_slo: int = Field(description="Hours whose attainment reaches the SLO's goodput_share (of hours with arrivals)")
    hours_with_traffic: int
    scaling_actions: int = Field(description="Times the autoscaler added or retired replicas")


class DayPlan(_Out):
    """`serveplan plan --traffic DAY.yaml --json`."""

    model: str
    traffic: str
    slo: SLO
    peak_rate_per_s: float
    deployment: Deployment = Field(description="One replica, as the search recommended it for the peak")
    fixed_replicas: int = Field(description="The fixed fleet: the search's replica count at the peak rate")
    fixed: FleetDayReport
    autoscaled: FleetDayReport
    saving_usd_per_day: float | None = Field(description="Fixed minus autoscaled cost per day")
    assumptions: dict[str, str]


def plan_day(model: str, day: TrafficDay, slo: str | SLO, *, hardware: list[str] | None = None,
             fit: FittedModel | None = None, on_hour: Callable[[str, float], None] | None = None,
             **plan_kwargs: Any) -> tuple[PlanResult, DayPlan | None]:
    """The search's answer at the day's peak, and the day planned with it (None when nothing is
    recommended). `fit` prices the search and the day alike (None: the public fit, as `plan`).
    `plan_kwargs` go to `plan` as they are (engine, headroom, executor, ...); the search
    is colocated only: a disaggregated pair is not one fleet replica. `on_hour(fleet, hours)` hears
    each simulated hour of each fleet, for a progress bar."""
    cfg = resolve_model(model)
    slo = SLO.parse(slo) if isinstance(slo, str) else slo
    result = plan(cfg, day.workload, day.peak_rate_per_s, slo, hardware=hardware, pd_ratios="none", fit=fit,
                  **plan_kwargs)
    rec, verification = result.recommended, result.verification
    if rec is None or verification is None:
        return result, None
    dep = rec.deployment
    hw = next(hw for hw in priced_profiles(hardware) if hw.name == dep.hardware)
    template = ReplicaTemplate.resolve(cfg, hw, dep.model_copy(update={"replicas": 1}), fit=fit)
    fixed_n = dep.replicas
    rule, notes = scaling_rule(day.autoscaling, day, template, hw, fixed_n, verification)
    runs = {}
    stand_ins = day.stand_in_replicas
    for name, r in (("fixed", ScalingRule.pinned(fixed_n, rule.load_s)), ("autoscaled", rule)):
        hours = None if on_hour is None else lambda h, n=name: on_hour(n, h)
        if r.max_replicas > stand_ins:
            # The stand-ins serve about their share of the fleet at its peak size all day.
            check_limits(day, min(1.0, stand_ins / fixed_n))
            runs[name] = simulate_sampled_fleet(template, day, r, slo, stand_ins=stand_ins, vocab_size=cfg.vocab_size,
                                                on_hour=hours)
        else:
            runs[name] = simulate_fleet(template, day.requests(cfg.vocab_size, template.max_len), day.duration_s, r,
                                        slo, seed=day.seed, on_hour=hours)
    if max(rule.max_replicas, fixed_n) > stand_ins:
        notes["stand-ins"] = (
            f"fleets that may grow past {stand_ins} replicas are simulated as {stand_ins} stand-in replica(s), each serving one "
            "replica's round-robin share (every n-th arrival); hourly counts are the stand-ins' scaled to the fleet. "
            "Exact in distribution for a fixed fleet; an autoscaled one's new replicas take their share at once (not "
            "empty and cold) and a retired one stops billing when retired, not drained")
    price = hw.price_usd_per_hour
    reports = {name: _report(name, run, day, slo, template.dep.gpus_per_replica, price) for name, run in runs.items()}
    fixed, auto = reports["fixed"], reports["autoscaled"]
    assumptions = {
        "replica": f"{rec.label}: the search's recommendation for the peak, {day.peak_rate_per_s:g} req/s",
        "fixed fleet": f"{fixed_n} replicas all day: the search's count at the peak (headroom {result.headroom:g})",
        **notes,
        "arrivals": f"Poisson within each rate segment of traffic {day.name!r} (seed {day.seed}); workload "
                    f"{day.workload.name!r} lengths",
        "router": "round robin over the ready replicas; each replica has its own API server",
        "billing": "a replica is billed from provisioning (its load included) until it has drained; the day's cost "
                   "covers 0-24 h, requests still in flight at the end are served and counted, not billed",
        "slo_attainment": "per request, the SLO's per-request limits (TTFT, TPOT, E2E: its P99 target, else its P50); "
                          "an hour meets the SLO when its share reaches goodput_share",
        "price": f"US${price:.2f} per GPU-hour (profile price)" if price else "the profile lists no price",
    }
    plan_ = DayPlan(
        model=cfg.name, traffic=day.name, slo=slo, peak_rate_per_s=day.peak_rate_per_s,
        deployment=dep.model_copy(update={"replicas": 1}), fixed_replicas=fixed_n, fixed=fixed, autoscaled=auto,
        saving_usd_per_day=None if fixed.usd_per_day is None or auto.usd_per_day is None
        else fixed.usd_per_day - auto.usd_per_day,
        assumptions=assumptions)
    return result, plan_


def scaling_rule(policy: AutoscalePolicy, day: TrafficDay, template: ReplicaTemplate, hw: HardwareProfile,
                 fixed_replicas: int, verification: RunSummary) -> tuple[ScalingRule, dict[str, str]]:
    """The policy with its defaults worked out, and what each default assumed."""
    notes: dict[str, str] = {}
    if policy.load_s is not None:
        load_s = policy.load_s
        notes["model load"] = f"{load_s:g} s (traffic file)"
    else:
        weights_gb = template.memory.weights.total_gib * 2**30 / 1e9
        if policy.storage_read_gb_s is not None:
            read, source = policy.storage_read_gb_s, "traffic file"
        elif hw.local_disk is not None:
            read, source = hw.local_disk.read_gb_s, f"the profile's local disk ({hw.local_disk.name})"
            if hw.pcie is not None and hw.pcie.bandwidth_gb_s < read:
                read, source = hw.pcie.bandwidth_gb_s, f"the profile's PCIe link ({hw.pcie.name})"
        else:
            read, source = DEFAULT_STORAGE_READ_GB_S, "an assumed network volume: the profile names no local disk"
        load_s = weights_gb / read + policy.engine_start_s
        notes["model load"] = (f"{load_s:,.1f} s: {weights_gb:,.1f} GB of weights per GPU at {read:g} GB/s ({source}), "
                               f"then {policy.engine_start_s:g} s of engine start-up (an estimate)")
    if policy.target_in_flight_per_replica is not None:
        target = policy.target_in_flight_per_replica
        notes["target"] = f"{target:g} requests in flight per replica (traffic file)"
    else:
        per_replica_s = day.peak_rate_per_s / fixed_replicas
        target = per_replica_s * verification.e2e_ms.mean / 1e3
        notes["target"] = (f"{target:,.1f} requests in flight per replica: one replica of the peak fleet at the peak "
                           f"({per_replica_s:,.2f} req/s x mean E2E {verification.e2e_ms.mean:,.0f} ms of the search's "
                           "verification run, Little's law)")
    most = policy.max_replicas if policy.max_replicas is not None else fixed_replicas
    if policy.min_replicas > most:
        raise InputError("autoscaling.min_replicas", policy.min_replicas,
                         f"must be <= max_replicas, which defaults to the peak fleet's {fixed_replicas}")
    if policy.initial_replicas is not None:
        initial = policy.initial_replicas
    else:
        initial = math.ceil(fixed_replicas * day.rate_at(0.0) / day.peak_rate_per_s)
    initial = min(max(initial, policy.min_replicas), most)
    notes["autoscaling"] = (f"{policy.min_replicas}-{most} replicas, starting with {initial}; decisions every "
                            f"{policy.interval_s:g} s on the last {policy.window_s:g} s; one more replica past "
                            f"{policy.scale_up_queue_per_replica:g} queued requests per replica; scale-down after "
                            f"{policy.scale_down_idle_s:g} s of wanting fewer; cooldown {policy.cooldown_s:g} s")
    rule = ScalingRule(policy.min_replicas, most, initial, target, policy.scale_up_queue_per_replica, policy.interval_s,
                       policy.window_s, policy.scale_down_idle_s, policy.cooldown_s, load_s)
    return rule, notes


def _report(name: str, run: FleetRun, day: TrafficDay, slo: SLO, gpus_per_replica: int,
            price_usd_per_gpu_hour: float | None) -> FleetDayReport:
    hours = []
    segments = day.segments()
    for h, tally in enumerate(run.hours):
        start_s, end_s = h * HOUR_S, min((h + 1) * HOUR_S, run.duration_s)  # the last hour may be short
        hours.append(HourReport(
            hour=h, offered_rate_per_s=_mean_rate(segments, start_s, end_s), arrived=round(tally.arrived),
            replicas=tally.replica_s / (end_s - start_s), most_ready_replicas=tally.most_ready,
            slo_attainment=tally.good / tally.arrived if tally.arrived else None,
            slo_met=tally.good / tally.arrived >= slo.goodput_share if tally.arrived else None,
            mean_ttft_ms=tally.ttft_s / tally.arrived * 1e3 if tally.arrived else None,
            mean_e2e_ms=tally.e2e_s / tally.arrived * 1e3 if tally.arrived else None))
    arrived = sum(t.arrived for t in run.hours)
    gpu_hours = run.replica_hours * gpus_per_replica
    return FleetDayReport(
        fleet=name, hours=hours, replica_hours=run.replica_hours, gpu_hours=gpu_hours,
        usd_per_day=gpu_hours * price_usd_per_gpu_hour if price_usd_per_gpu_hour else None,
        slo_attainment=sum(t.good for t in run.hours) / arrived if arrived else 1.0,
        hours_meeting_slo=sum(bool(h.slo_met) for h in hours), hours_with_traffic=sum(h.arrived > 0 for h in hours),
        scaling_actions=len(run.actions))


def _mean_rate(segments: list[RateSegment], start_s: float, end_s: float) -> float:
    """Expected arrivals per second over [start_s, end_s) of piecewise-constant `segments`."""
    t, mass = 0.0, 0.0
    for s in segments:
        lo, hi = max(t, start_s), min(t + s.duration_s, end_s)
        if hi > lo:
            mass += s.rate_per_s * (hi - lo)
        t += s.duration_s
    return mass / (end_s - start_s)
