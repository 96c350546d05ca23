"""A day of traffic: an arrival rate that moves through the hours, the workload its requests are
drawn from, and how the fleet may scale (the `serveplan plan --traffic DAY.yaml` file).

The rate is piecewise constant (`time_varying` segments, the workload module's own type): given per
hour, as a diurnal curve held constant over steps, or as segments. Arrivals within a segment are
a Poisson process; each segment draws from its own seeded stream, so changing one hour's rate
leaves every other hour's requests as they were. Requests are drawn a chunk at a time as the
simulation reaches them, so memory follows the chunk, not the day; the whole day's expected
count is checked against a limit before anything is drawn.
"""

from __future__ import annotations

from collections.abc import Iterator
import dataclasses
import itertools
import math
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine import limits
from engine.errors import InputError, from_validation_error, over_limit
from engine.files import load_yaml
from planner.sim.autoscaler import MAX_FLEET_REPLICAS, AutoscalePolicy
from planner.workload import (PRESETS, CumulativeRate, OfflineArrivals, RateSegment, TimeVaryingArrivals, Workload,
                              WorkloadRequest, draw)

MAX_TRAFFIC_HOURS = 168  # a week: longer is a capacity forecast, not a day of traffic
CHUNK_REQUESTS = 20_000  # requests drawn at once: bounds the memory their token ids take
STAND_IN_CHUNK = 2_000  # a stand-in replica's requests drawn at once (a few hours' worth at a replica's rate)
STAND_IN_STREAM = 1  # seeds a stand-in's requests apart from the day's own segments


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HourlyRates(_Spec):
    """One Poisson rate per hour, in order from hour 0."""

    kind: Literal["hourly"] = "hourly"
    rates_per_s: list[Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]] = Field(
        min_length=1, max_length=MAX_TRAFFIC_HOURS, description="Arrivals per second in each hour")

    def rate_segments(self) -> list[RateSegment]:
        return [RateSegment(duration_s=3600.0, rate_per_s=r) for r in self.rates_per_s]


class DiurnalCurve(_Spec):
    """A daily cosine between a trough and a peak: rate(h) = trough + (peak - trough) x
    (1 + cos(2 pi (h - peak_hour) / 24)) / 2, held at its value at each step's middle."""

    kind: Literal["diurnal"] = "diurnal"
    peak_rate_per_s: float = Field(gt=0, le=1e6, description="Arrivals per second at peak_hour")
    trough_rate_per_s: float = Field(ge=0, le=1e6, description="Arrivals per second twelve hours from the peak")
    peak_hour: float = Field(14.0, ge=0, lt=24, description="Hour of the day (0-24) of the peak")
    hours: int = Field(24, ge=1, le=MAX_TRAFFIC_HOURS, description="Length of the run, hours")
    step_s: float = Field(300.0, ge=60, le=3600, description="The curve is held constant over steps this long, seconds")

    @model_validator(mode="after")
    def _ordered(self) -> DiurnalCurve:
        if self.trough_rate_per_s > self.peak_rate_per_s:
            raise InputError("trough_rate_per_s", self.trough_rate_per_s, f"must be <= peak_rate_per_s={self.peak_rate_per_s:g}")
        return self

    def rate_segments(self) -> list[RateSegment]:
        total_s = self.hours * 3600.0
        starts = np.arange(0.0, total_s, self.step_s)
        ends = np.minimum(starts + self.step_s, total_s)
        hour = (starts + ends) / 2 / 3600.0
        swing = (1 + np.cos(2 * np.pi * (hour - self.peak_hour) / 24)) / 2
        rates = self.trough_rate_per_s + (self.peak_rate_per_s - self.trough_rate_per_s) * swing
        return [RateSegment(duration_s=float(e - s), rate_per_s=float(r)) for s, e, r in zip(starts, ends, rates)]


# `time_varying` is the workload module's own piecewise-constant rate, played once (not repeated).
RateCurve = Annotated[HourlyRates | DiurnalCurve | TimeVaryingArrivals, Field(discriminator="kind")]


def _workload(value: object) -> object:
    """A preset's name, or a workload spec without arrival or count (the day supplies both)."""
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in PRESETS:
            raise ValueError(f"unknown workload preset {value!r}; presets: {', '.join(PRESETS)} (or a spec mapping)")
        return PRESETS[key]
    if isinstance(value, dict):
        return {"arrival": {"kind": "offline"}, "num_requests": 1, **value}
    return value


class TrafficDay(_Spec):
    """What arrives over the day, and how the fleet may scale to meet it."""

    name: str = Field("day", min_length=1, max_length=64, description="Short id used in reports and request ids")
    description: str = Field("", max_length=1000, description="One line for humans")
    rate: RateCurve = Field(description="Arrival rate through the day")
    workload: Annotated[Workload, BeforeValidator(_workload)] = Field(
        description="What each request looks like: a preset name or a workload spec (its arrival and num_requests "
        "are the day's)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of every random draw")
    autoscaling: AutoscalePolicy = Field(default_factory=AutoscalePolicy, description="How the autoscaled fleet scales")
    stand_in_replicas: int = Field(
        16, ge=1, le=1000, description="A fleet that may grow past this many replicas is simulated as this many "
        "stand-ins, each serving one replica's round-robin share (planner/sim/fleet.py, SampledFleet); smaller ones "
        "are simulated whole")

    @field_validator("name")
    @classmethod
    def _printable(cls, name: str) -> str:
        if any(not ch.isprintable() for ch in name):  # it prefixes every request id and report line
            raise ValueError("must be printable: no control characters (newlines, tabs, escape sequences)")
        return name

    @model_validator(mode="after")
    def _servable(self) -> TrafficDay:
        if self.workload.conversation is not None:
            raise InputError("workload.conversation", f"{self.workload.name!r} has conversations",
                             "not in a day of traffic: its requests arrive open loop, and a follow-up turn would wait "
                             "on the fleet's replies")
        segments = self.segments()
        hours = sum(s.duration_s for s in segments) / 3600
        if hours > MAX_TRAFFIC_HOURS:
            raise InputError("rate.segments", f"{hours:,.1f} hours", f"must last at most {MAX_TRAFFIC_HOURS} hours")
        if not any(s.rate_per_s > 0 for s in segments):
            raise InputError("rate", "0 req/s throughout", "at least one hour needs a rate above 0")
        return self

    def segments(self) -> list[RateSegment]:
        rate = self.rate
        return list(rate.segments) if isinstance(rate, TimeVaryingArrivals) else rate.rate_segments()

    @property
    def duration_s(self) -> float:
        return sum(s.duration_s for s in self.segments())

    @property
    def peak_rate_per_s(self) -> float:
        return max(s.rate_per_s for s in self.segments())

    @property
    def expected_requests(self) -> float:
        return sum(s.rate_per_s * s.duration_s for s in self.segments())

    def rate_at(self, t_s: float) -> float:
        """The rate in force at time t_s (0 after the day)."""
        start = 0.0
        for s in self.segments():
            if t_s < start + s.duration_s:
                return s.rate_per_s
            start += s.duration_s
        return 0.0

    def requests(self, vocab_size: int | None = None, max_model_len: int | None = None) -> Iterator[WorkloadRequest]:
        """The day's requests in arrival order, drawn a chunk at a time (see the module's note)."""
        check_limits(self)
        start = 0.0
        for index, seg in enumerate(self.segments()):
            rng = np.random.default_rng([self.seed, index])
            n = int(rng.poisson(seg.rate_per_s * seg.duration_s))
            # Given their count, a Poisson process's points in a segment are uniform and independent.
            times = np.sort(start + rng.uniform(0.0, seg.duration_s, size=n))
            for first in range(0, n, CHUNK_REQUESTS):
                chunk = times[first : first + CHUNK_REQUESTS]
                seed = int(np.random.SeedSequence([self.seed, index, first]).generate_state(1)[0])
                spec = self.workload.model_copy(update={"arrival": OfflineArrivals(), "num_requests": len(chunk),
                                                        "seed": seed, "name": self.name})
                drawn = draw(spec, vocab_size, max_model_len, prefix_seed=self.seed)
                for k, (request, t) in enumerate(zip(drawn, chunk.tolist())):
                    yield dataclasses.replace(request, request_id=f"{self.name}-{index}-{first + k}", arrival_s=t)
            start += seg.duration_s

    def stand_in_requests(self, stand_in: int, vocab_size: int | None = None,
                          max_model_len: int | None = None) -> Iterator[WorkloadRequest]:
        """Endless requests of the day's workload, without arrival times, for one stand-in replica
        of a sampled fleet (planner/sim/fleet.py): independent of one another and of every other
        stand-in's, as a day's requests are, and drawn a chunk at a time."""
        for chunk in itertools.count():
            seed = int(np.random.SeedSequence([self.seed, STAND_IN_STREAM, stand_in, chunk + 1]).generate_state(1)[0])
            spec = self.workload.model_copy(update={"arrival": OfflineArrivals(), "num_requests": STAND_IN_CHUNK,
                                                    "seed": seed, "name": self.name})
            for k, request in enumerate(draw(spec, vocab_size, max_model_len, prefix_seed=self.seed)):
                yield dataclasses.replace(request, request_id=f"{self.name}-s{stand_in}-{chunk * STAND_IN_CHUNK + k}")

    def stand_in_gaps(self, stand_in: int) -> np.random.Generator:
        """The stream a stand-in replica draws its arrival gaps from (its requests' chunks are the
        same entropy's 1, 2, ...)."""
        return np.random.default_rng([self.seed, STAND_IN_STREAM, stand_in, 0])

    def cumulative_rate(self) -> CumulativeRate:
        return CumulativeRate.of(self.segments())


def check_limits(day: TrafficDay, share: float = 1.0) -> None:
    """The requests a simulation of the day is expected to serve (`share` of the day's: a sampled
    fleet's stand-ins serve theirs) against MAX_TRAFFIC_REQUESTS, before anything is drawn."""
    expected = day.expected_requests * share
    if expected > limits.MAX_TRAFFIC_REQUESTS:
        what = "the day's" if share == 1.0 else f"the stand-ins' share ({share:.3g}) of the day's"
        raise over_limit("rate", f"{expected:,.0f} expected requests", "MAX_TRAFFIC_REQUESTS",
                         f"{what} expected request count")


def load_traffic(path: str) -> TrafficDay:
    """A traffic file, validated: bad input is one InputError naming the field."""
    data = load_yaml(path, "traffic")
    if not isinstance(data, dict):
        raise InputError("traffic", path, "a traffic file must be a mapping of fields (rate, workload, ...)")
    try:
        day = TrafficDay.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, Path(path).name) from None
    # The request limit is checked once the fleet is known: a sampled fleet simulates a share.
    check_limits(day, min(1.0, day.stand_in_replicas / MAX_FLEET_REPLICAS))
    return day

