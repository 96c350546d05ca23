"""Autoscaling a fleet of replicas in the simulator: when to add replicas and when to take them away.

The policy reads what an operator's autoscaler reads from each engine (vLLM's
`num_requests_running` + `num_requests_waiting`), every `interval_s` as Kubernetes' HPA does, and
sizes the fleet as Knative's concurrency autoscaler does: replicas = requests in flight, averaged
over `window_s`, divided by a target per replica. A scheduler queue longer than
`scale_up_queue_per_replica` per ready replica adds one more replica whatever the average says.
A new replica is billed at once and serves only after `load_s` (weights read from storage into
the GPU, then the engine's start-up). Replicas go only after every decision for
`scale_down_idle_s` wanted fewer (HPA's scale-down stabilisation window); loads in progress are
cancelled first, then the least busy ready replicas stop receiving requests and drain: each
serves what it accepted, and its billing stops when it is empty. After any action the policy
waits `cooldown_s`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
import math
from typing import Protocol

import simpy
from simpy.events import ProcessGenerator
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.errors import InputError

MAX_FLEET_REPLICAS = 100_000  # as Deployment.replicas allows
# Weights are read from this when the hardware profile names no local disk: a network volume or
# an object store pulled at a few GB/s per GPU (an assumption, said in every report that uses it).
DEFAULT_STORAGE_READ_GB_S = 2.0


class AutoscalePolicy(BaseModel):
    """The `autoscaling:` section of a traffic file; a field left out is derived where it is used
    (the report says from what)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=1, le=MAX_FLEET_REPLICAS, description="Fewest replicas ready or loading")
    max_replicas: int | None = Field(None, ge=1, le=MAX_FLEET_REPLICAS,
                                     description="Most replicas ready or loading (default: the fleet sized for the peak)")
    initial_replicas: int | None = Field(
        None, ge=1, le=MAX_FLEET_REPLICAS,
        description="Replicas ready at the start (default: the peak fleet scaled to the first hour's rate)")
    target_in_flight_per_replica: float | None = Field(
        None, gt=0, le=1e6, description="Requests in flight (running or waiting) per replica the policy aims at "
        "(default: what one replica of the fleet sized for the peak carries at the peak, by Little's law)")
    scale_up_queue_per_replica: float = Field(
        4.0, gt=0, le=1e6, description="Scheduler-queue requests per ready replica (averaged over window_s) above which "
        "one replica is added")
    interval_s: float = Field(15.0, ge=1, le=3600, description="Seconds between decisions (HPA's sync period)")
    window_s: float = Field(60.0, ge=1, le=3600, description="Seconds of samples averaged per decision (Knative's stable window)")
    scale_down_idle_s: float = Field(
        300.0, ge=0, le=86_400, description="Replicas go only when every decision over this long wanted fewer")
    cooldown_s: float = Field(60.0, ge=0, le=86_400, description="Seconds after a scaling action before the next")
    load_s: float | None = Field(
        None, ge=0, le=86_400, description="Seconds from provisioning a replica to its first request (default: weight "
        "bytes per GPU over the storage read rate, plus engine_start_s)")
    storage_read_gb_s: float | None = Field(
        None, gt=0, le=10_000, description="Weights read rate per GPU, GB/s (default: the profile's local disk, capped by "
        f"its PCIe link; {DEFAULT_STORAGE_READ_GB_S:g} GB/s when it names no disk)")
    engine_start_s: float = Field(
        30.0, ge=0, le=86_400, description="Engine start-up after the weights are in (CUDA context, graph capture): "
        "an estimate, not a measurement; set it from your engine's logs")

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalePolicy:
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise InputError("min_replicas", self.min_replicas, f"must be <= max_replicas={self.max_replicas}")
        return self


@dataclass(frozen=True)
class ScalingRule:
    """An AutoscalePolicy with every default worked out: the numbers the simulation runs on."""

    min_replicas: int
    max_replicas: int
    initial_replicas: int
    target_in_flight_per_replica: float
    scale_up_queue_per_replica: float
    interval_s: float
    window_s: float
    scale_down_idle_s: float
    cooldown_s: float
    load_s: float

    @classmethod
    def pinned(cls, replicas: int, load_s: float = 0.0) -> ScalingRule:
        """A fleet that never changes size: min = max = initial."""
        return cls(replicas, replicas, replicas, math.inf, math.inf, 15.0, 60.0, 300.0, 60.0, load_s)


class ScalableFleet(Protocol):
    """What the autoscaler reads from and does to a fleet (planner/sim/fleet.py)."""

    @property
    def num_ready(self) -> int: ...
    @property
    def num_active(self) -> int: ...  # ready or loading: what the policy counts (draining ones are leaving)
    def in_flight(self) -> float: ...  # counted, or estimated from a sample (planner/sim/fleet.py)
    def waiting(self) -> float: ...
    def provision(self, n: int) -> None: ...
    def retire(self, n: int) -> None: ...


class Autoscaler:
    """The policy as a SimPy process over a fleet, deciding every interval_s until `until_s`."""

    def __init__(self, env: simpy.Environment, fleet: ScalableFleet, rule: ScalingRule, until_s: float) -> None:
        self.env, self.fleet, self.rule, self.until_s = env, fleet, rule, until_s
        self.actions: list[tuple[float, int]] = []  # (time, replicas added (+) or retired (-))
        env.process(self._run())

    def desired(self, in_flight: float, waiting: float) -> int:
        """Replicas wanted for a window's mean in-flight and queued requests, within min..max."""
        rule, fleet = self.rule, self.fleet
        want = math.ceil(in_flight / rule.target_in_flight_per_replica) if in_flight else 0
        if waiting > rule.scale_up_queue_per_replica * max(fleet.num_ready, 1):
            want = max(want, fleet.num_active + 1)
        return min(max(want, rule.min_replicas), rule.max_replicas)

    def _run(self) -> ProcessGenerator:
        env, rule, fleet = self.env, self.rule, self.fleet
        samples: deque[tuple[float, float, float]] = deque()  # (time, in flight, waiting)
        wanted: deque[tuple[float, int]] = deque()  # (time, desired) over the scale-down window
        last_action = -math.inf
        first_decision_s = env.now + rule.interval_s
        while env.now + rule.interval_s <= self.until_s:
            yield env.timeout(rule.interval_s)
            now = env.now
            samples.append((now, fleet.in_flight(), fleet.waiting()))
            while samples[0][0] <= now - rule.window_s:
                samples.popleft()
            want = self.desired(sum(s[1] for s in samples) / len(samples), sum(s[2] for s in samples) / len(samples))
            wanted.append((now, want))
            while wanted[0][0] < now - rule.scale_down_idle_s:
                wanted.popleft()
            if now - last_action < rule.cooldown_s:
                continue
            active = fleet.num_active
            if want > active:
                fleet.provision(want - active)
            elif now - first_decision_s >= rule.scale_down_idle_s and (keep := max(w for _, w in wanted)) < active:
                # A full window (scale_down_idle_s of decisions), every one of which wanted fewer.
                fleet.retire(active - keep)
            if fleet.num_active != active:  # a retirement can find nothing to take (one replica ready)
                self.actions.append((now, fleet.num_active - active))
                last_action = now
