"""What one collective costs on a link, by message size: latency for small messages, bandwidth for
large ones, and the measured curve between.

A link whose profile carries a measured curve for the collective (`Link.collectives`: nccl-tests
figures for GPU interconnects, the engine's own gloo benchmark for a CPU) is priced from it: time
by payload, interpolated between measured sizes on log-log scales. That keeps what a two-parameter
latency + size / bandwidth fit misses: nccl-tests on 8 x A100 stays near 100 us from 1 to 4 MiB
before bandwidth takes over. Below the smallest measured payload a collective costs that payload's
time (the latency floor); above the largest it runs at the largest's bandwidth.

A curve measured on p0 ranks is used on p ranks through nccl-tests' bus-bandwidth factors
(2(p-1)/p for an all-reduce, (p-1)/p for an all-gather or all-to-all), which make a ring
algorithm's bandwidth the same at any rank count: time(p) = time(p0) x factor(p) / factor(p0).
Without a curve, the ring algorithm on the link's datasheet figures: steps x latency_us + bus
bytes / (bandwidth_gb_s x interconnect_efficiency). Either way the time is multiplied by
`CostParams.collective_time_scale`, the public fit's figure for how a GPU family's engines
communicate against nccl-tests (1 until fitted).

Serving engines do not send small all-reduces through NCCL. vLLM's custom all-reduce (which SGLang
ships too) reads the peers' buffers directly over a fully connected scale-up link for payloads
under its buffer size (8 MiB), in one stage or two (csrc/custom_all_reduce.cuh), where NCCL's
measured curve floors at tens of microseconds. A decode step's all-reduces (rows x hidden x 2
bytes) are that small up to a few hundred rows (512 rows of an 8,192-wide model: 8 MiB). Where the
link carries the kernel's measured curves (`Link.custom_all_reduce`, one per rank count) it is
priced from them, log-log as above, up to the last measured payload (NCCL's curve past it): the
kernel reaches a small share of the link's bandwidth (on 8 x H100, 45 us for 1 MiB, ~40 GB/s of
bus traffic against NVLink's 450), which no latency + bytes / bandwidth on the datasheet's figures
gives. Without curves: a barrier of one link latency before and after each stage's reads, and the
bytes read at the link's bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from planner.costmodel.shape import Number
from planner.specs import Collective, CollectiveCurve, Link


def bus_factor(kind: Collective, ranks: int) -> float:
    """Bytes each rank moves per payload byte (nccl-tests' busbw / algbw)."""
    return (2.0 if kind == "all_reduce" else 1.0) * (ranks - 1) / ranks


# Payloads whose price one CollectiveCost keeps (a step's payload is rows x bytes per row: one per row count).
MAX_MEMO_PAYLOADS = 8192
# vLLM's custom all-reduce runs on these group sizes only (CustomAllreduce._SUPPORTED_WORLD_SIZES).
CUSTOM_ALL_REDUCE_RANKS = frozenset({2, 4, 6, 8})


def custom_all_reduce_stages(ranks: int, payload_bytes: Number) -> Number:
    """1 or 2: vLLM's choice between its one-stage kernel (every rank reads every peer's whole
    buffer) and its two-stage one (reduce-scatter, then all-gather), csrc/custom_all_reduce.cuh."""
    one = (ranks == 2) | ((ranks <= 4) & (np.asarray(payload_bytes) < 512 * 1024)) \
        | ((ranks <= 8) & (np.asarray(payload_bytes) < 256 * 1024))
    return np.where(one, 1, 2) if isinstance(payload_bytes, np.ndarray) else (1 if bool(one) else 2)


def _curve_us(curve: CollectiveCurve, payload_bytes: Number) -> Number:
    """Microseconds of `payload_bytes` on a measured curve: log-log interpolation, flat below the
    first point (the latency floor), slope 1 (the last point's bandwidth) past the last."""
    sizes, times = np.log([p[0] for p in curve.points]), np.log([p[1] for p in curve.points])
    x = np.log(np.maximum(payload_bytes, 1.0))
    us = np.exp(np.interp(x, sizes, times) + np.maximum(x - sizes[-1], 0.0))
    return us if isinstance(payload_bytes, np.ndarray) else float(us)


def ring_steps(kind: Collective, ranks: int) -> int:
    """Latency-bound hops of the ring algorithm: reduce-scatter then all-gather for an all-reduce."""
    return (2 if kind == "all_reduce" else 1) * (ranks - 1)


@dataclass(frozen=True)
class CollectiveCost:
    """One collective of `ranks` ranks over `link`, priced per call by payload bytes."""

    kind: Collective
    ranks: int
    link: Link
    interconnect_efficiency: float
    time_scale: float = 1.0  # CostParams.collective_time_scale
    # Payloads under this many bytes take the engine's custom all-reduce (0: none, every call is NCCL's).
    custom_max_bytes: int = 0
    # Seconds by payload, for the simulator's one step at a time: a step's payload follows its rows,
    # which recur, and pricing one on a curve (logs, interpolation) cost more than the rest of a
    # tensor-parallel decode step's pricing together.
    _memo: dict[float, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def curve(self) -> CollectiveCurve | None:
        return self.link.collectives.get(self.kind)

    def seconds(self, payload_bytes: Number) -> Number:
        """Seconds of one call moving `payload_bytes` (nccl-tests' size); arrays price many at once."""
        if isinstance(payload_bytes, np.ndarray):
            return self._price(payload_bytes)
        seconds = self._memo.get(payload_bytes)
        if seconds is None:
            if len(self._memo) >= MAX_MEMO_PAYLOADS:
                self._memo.clear()
            seconds = self._memo[payload_bytes] = float(self._price(payload_bytes))
        return seconds

    def _price(self, payload_bytes: Number) -> Number:
        if not self.custom_max_bytes:
            return self._nccl_seconds(payload_bytes)
        if isinstance(payload_bytes, np.ndarray):
            return np.where(self._priced_as_custom(payload_bytes), self._custom_seconds(payload_bytes),
                            self._nccl_seconds(payload_bytes))
        # One payload: price it by the kernel that carries it only (the cost model's per-step path).
        if self._priced_as_custom(payload_bytes):
            return self._custom_seconds(payload_bytes)
        return self._nccl_seconds(payload_bytes)

    def _priced_as_custom(self, payload_bytes: Number) -> Number:
        """Payloads priced as the custom kernel: under its buffer and, where its curve is measured, no
        larger than the curve reaches. Past that the engines' all-reduces are priced by NCCL's measured
        curve, not by the kernel's curve extrapolated: on 8 x H100 the two agree at 1 MiB within 2 %
        on 2, 4 and 8 ranks, and how the kernel scales beyond is not measured (its last segment's
        rate, ~40-60 GB/s, would price 8 MiB on 2 NVLink ranks as slowly as PCIe)."""
        curve = self.custom_curve
        reach = curve.points[-1][0] if curve is not None else self.custom_max_bytes
        return (payload_bytes < self.custom_max_bytes) & (payload_bytes <= reach)

    @cached_property  # read twice per priced call on the per-step path; the link is immutable
    def custom_curve(self) -> CollectiveCurve | None:
        """The link's measured custom all-reduce curve for this group: the fewest ranks at or above
        its own (a kernel's time grows with the peers it reads), else the most measured."""
        curves = sorted(self.link.custom_all_reduce, key=lambda c: c.ranks)
        return next((c for c in curves if c.ranks >= self.ranks), curves[-1] if curves else None)

    def _custom_seconds(self, payload_bytes: Number) -> Number:
        """The custom all-reduce: its measured curve where the link has one. Otherwise a barrier
        before and after each stage's reads (one link latency each), and the bytes each rank reads
        from its peers at the link's bandwidth. One stage reads every peer's whole buffer,
        (p - 1) x payload; two stages read a 1/p slice from each peer twice, 2 (p - 1) / p x
        payload, with a barrier between them."""
        curve = self.custom_curve
        if curve is not None:
            return _curve_us(curve, payload_bytes) * 1e-6 * self.time_scale
        stages = custom_all_reduce_stages(self.ranks, payload_bytes)
        p = self.ranks
        read_bytes = np.where(stages == 1, p - 1, 2 * (p - 1) / p) * payload_bytes
        bandwidth = self.link.bandwidth_gb_s * 1e9 * self.interconnect_efficiency
        seconds = self.time_scale * ((stages + 1) * self.link.latency_us * 1e-6 + read_bytes / bandwidth)
        return seconds if isinstance(payload_bytes, np.ndarray) else float(seconds)

    def _nccl_seconds(self, payload_bytes: Number) -> Number:
        curve = self.curve
        if curve is None:
            bandwidth = self.link.bandwidth_gb_s * 1e9 * self.interconnect_efficiency
            return self.time_scale * (ring_steps(self.kind, self.ranks) * self.link.latency_us * 1e-6
                                      + bus_factor(self.kind, self.ranks) * payload_bytes / bandwidth)
        rescale = bus_factor(self.kind, self.ranks) / bus_factor(self.kind, curve.ranks) * self.time_scale
        return _curve_us(curve, payload_bytes) * 1e-6 * rescale

    def describe(self) -> dict[str, object]:
        """How this collective is priced, for reports and the simulate JSON."""
        curve = self.curve
        base: dict[str, object] = {"collective": self.kind, "ranks": self.ranks, "link": self.link.name}
        custom = self.custom_curve
        if self.custom_max_bytes and custom is not None:
            base["custom_all_reduce"] = {
                "below_payload_bytes": self.custom_max_bytes, "model": "measured curve, log-log interpolation",
                "measured_ranks": custom.ranks, "points": len(custom.points), "source": custom.source,
                "time_scale": self.time_scale}
        elif self.custom_max_bytes:
            base["custom_all_reduce"] = {
                "below_payload_bytes": self.custom_max_bytes,
                "model": "vLLM's custom all-reduce: (stages + 1) x link latency + bytes read from peers / (bandwidth x "
                         "efficiency); 1 stage reads (ranks - 1) x payload, 2 stages 2 (ranks - 1) / ranks x payload",
                "latency_us": self.link.latency_us, "bandwidth_gb_s": self.link.bandwidth_gb_s,
                "interconnect_efficiency": self.interconnect_efficiency, "time_scale": self.time_scale}
        if curve is None:
            return {**base, "model": "ring on datasheet figures: steps x latency + bus bytes / (bandwidth x efficiency)",
                    "latency_us_per_step": self.link.latency_us, "steps": ring_steps(self.kind, self.ranks),
                    "bandwidth_gb_s": self.link.bandwidth_gb_s, "interconnect_efficiency": self.interconnect_efficiency,
                    "time_scale": self.time_scale}
        small, large = curve.points[0], curve.points[-1]
        return {**base, "model": "measured curve, log-log interpolation", "measured_ranks": curve.ranks,
                "latency_us": small[1] * self.time_scale, "at_payload_bytes": small[0],
                "bus_bandwidth_gb_s": bus_factor(self.kind, curve.ranks) * large[0] / large[1] * 1e-3 / self.time_scale,
                "at_large_payload_bytes": large[0], "time_scale": self.time_scale, "points": len(curve.points),
                "source": curve.source}
