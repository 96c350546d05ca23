"""Typed specs shared by every part of ServePlan: hardware, deployment, workload, SLO.

Pydantic models at the boundary (YAML profiles, CLI flags, the dashboard, the Python API);
every numeric field carries its unit in its name, has bounds and a description, and the
JSON Schema of each is exported to docs/schemas/ by `serveplan schema`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.config import EngineKnobs
from engine.errors import InputError

Dtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4", "fp4"]
"""Numeric formats for weights, KV cache and compute."""

BYTES_PER_ELEMENT: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "fp4": 0.5,
}


class Spec(BaseModel):
    """Base for every boundary spec: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- hardware


class PeakTflops(Spec):
    """Dense peak throughput per numeric format (no 2:4 sparsity); TOPS for integer formats.

    A format left out is not supported natively by the tensor/matrix units; the cost model
    then computes in the next wider supported format and charges dequantisation.
    """

    fp32: float | None = Field(None, gt=0, description="FP32 (vector or TF32-free) dense TFLOPS")
    bf16: float | None = Field(None, gt=0, description="BF16 dense TFLOPS")
    fp16: float | None = Field(None, gt=0, description="FP16 dense TFLOPS")
    fp8: float | None = Field(None, gt=0, description="FP8 (e4m3) dense TFLOPS")
    int8: float | None = Field(None, gt=0, description="INT8 dense TOPS")
    int4: float | None = Field(None, gt=0, description="INT4 dense TOPS")
    fp4: float | None = Field(None, gt=0, description="FP4 (NVFP4/MXFP4) dense TFLOPS")

    def supported(self) -> list[str]:
        return [k for k, v in self.model_dump().items() if v is not None]


class Link(Spec):
    """One interconnect as seen by a single device: per-direction bandwidth and latency."""

    name: str = Field(description="Link technology, e.g. 'NVLink4', 'PCIe Gen5 x16', '8x400G InfiniBand NDR'")
    bandwidth_gb_s: float = Field(gt=0, description="Per-device bandwidth in GB/s, one direction")
    latency_us: float = Field(ge=0, description="One-way small-message latency in microseconds")
    domain_size: int = Field(
        1, ge=1, description="Most devices reachable at this bandwidth (e.g. 8 in an HGX node, 72 in NVL72)"
    )


class Efficiencies(Spec):
    """Achieved fraction of datasheet peaks, used until a calibration overrides them."""

    compute: float = Field(0.7, gt=0, le=1, description="Fraction of dense peak FLOPs a large GEMM reaches")
    memory: float = Field(0.85, gt=0, le=1, description="Fraction of peak bandwidth a streaming weight read reaches")
    attention_memory: float = Field(
        0.6, gt=0, le=1, description="Fraction of peak bandwidth a paged KV-cache read reaches"
    )
    interconnect: float = Field(0.8, gt=0, le=1, description="Fraction of link bandwidth a large all-reduce reaches")
    step_overhead_us: float = Field(
        200.0, ge=0, description="Fixed host-side cost per engine step (scheduling, input preparation), microseconds"
    )
    kernel_launch_us: float = Field(
        0.0, ge=0, description="Host time to issue one kernel in eager mode, microseconds; the device only waits for it "
        "when its kernels are shorter (0: not modelled apart, e.g. CPUs, where it sits in the step and layer overheads)"
    )
    graph_kernel_us: float = Field(
        0.0, ge=0, description="Device-side gap per kernel inside a replayed graph (CUDA/HIP graphs), microseconds"
    )


class HardwareProfile(Spec):
    """One accelerator or system, as a single device of the deployment."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.\-]*$", description="Short id used on the command line, e.g. 'h100-sxm'")
    display_name: str = Field(description="Human-readable product name")
    vendor: str
    kind: Literal["gpu", "accelerator", "soc", "cpu"] = Field(description="Device class")
    family: str = Field(
        description="Architecture family; hypothetical hardware borrows the calibrated efficiencies of its family"
    )
    memory_gib: float = Field(gt=0, description="Device memory usable for weights, KV cache and activations, GiB")
    memory_bandwidth_gb_s: float = Field(gt=0, description="Peak device-memory bandwidth, GB/s")
    peak_tflops: PeakTflops
    scale_up: Link | None = Field(None, description="Intra-node device-to-device link (NVLink, xGMI, ICI); None if PCIe only")
    scale_out: Link | None = Field(None, description="Inter-node network per device")
    pcie: Link | None = Field(None, description="Host link")
    graph_capture: bool = Field(
        False, description="The engine can capture a decode step as one graph and replay it (CUDA/HIP graphs)"
    )
    power_w: float | None = Field(None, gt=0, description="Board or module power, watts")
    price_usd_per_hour: float | None = Field(None, gt=0, description="Typical on-demand cloud price per device-hour, US$")
    efficiency: Efficiencies = Field(default_factory=Efficiencies)
    provenance: dict[str, str] = Field(
        default_factory=dict,
        description="Field path -> how that figure was obtained, for figures that are derived, halved from sparse "
        "datasheets, estimated or otherwise not read directly off a datasheet",
    )
    sources: list[str] = Field(min_length=1, description="Where the figures come from")

    @model_validator(mode="after")
    def _has_a_compute_peak(self) -> HardwareProfile:
        if not self.peak_tflops.supported():
            raise ValueError("peak_tflops: at least one numeric format needs a peak")
        return self

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    def peak_flops(self, dtype: str) -> tuple[float, str]:
        """FLOP/s for compute in `dtype`, falling back to the next wider format the device supports.

        Returns (flops_per_s, format actually used), so reports can say what was assumed. Float
        formats fall back to floats only: an A100 runs fp8 math at its bf16 rate, never its int8 rate.
        """
        peaks = self.peak_tflops.model_dump()
        for candidate in (*_COMPUTE_FALLBACK[dtype], *_COMPUTE_FALLBACK["fp32"]):
            if peaks.get(candidate):
                return peaks[candidate] * 1e12, candidate
        best = max(peaks, key=lambda k: peaks[k] or 0)
        return peaks[best] * 1e12, best


_COMPUTE_FALLBACK: dict[str, tuple[str, ...]] = {
    "fp4": ("fp4", "fp8", "bf16", "fp16"),
    "fp8": ("fp8", "bf16", "fp16"),
    "int4": ("int4", "int8", "fp16", "bf16"),
    "int8": ("int8", "fp16", "bf16"),
    "bf16": ("bf16", "fp16"),
    "fp16": ("fp16", "bf16"),
    "fp32": ("fp32",),
}


# --------------------------------------------------------------------------- deployment


class Deployment(Spec):
    """How one model is served: hardware, parallelism, precision and engine settings."""

    hardware: str = Field(description="Hardware profile name (see `serveplan hw list`)")
    tensor_parallel: int = Field(1, ge=1, le=1024, description="GPUs a layer is split across (TP)")
    pipeline_parallel: int = Field(1, ge=1, le=1024, description="Pipeline stages (PP)")
    expert_parallel: int = Field(1, ge=1, le=1024, description="GPUs the routed experts are spread across (EP)")
    replicas: int = Field(1, ge=1, le=100_000, description="Data-parallel replicas (DP)")
    weight_dtype: Dtype = Field("bf16", description="Storage format of the weights")
    kv_dtype: Dtype = Field("bf16", description="Storage format of the KV cache")
    knobs: EngineKnobs = Field(default_factory=EngineKnobs)

    @field_validator("kv_dtype")
    @classmethod
    def _kv_dtype_supported(cls, v: str) -> str:
        if v in ("int4", "fp4"):
            raise ValueError(f"kv_dtype {v!r} is not supported; use one of fp32, bf16, fp16, fp8, int8")
        return v

    @model_validator(mode="after")
    def _ep_within_replica(self) -> Deployment:
        if self.expert_parallel > self.gpus_per_replica:
            raise ValueError(
                f"expert_parallel={self.expert_parallel} exceeds the GPUs of one replica "
                f"(tensor_parallel x pipeline_parallel = {self.gpus_per_replica})"
            )
        return self

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_replica * self.replicas


# --------------------------------------------------------------------------- SLO


class SLO(Spec):
    """Latency targets.

    A deployment meets the SLO when every percentile target set holds over all requests and
    at least `goodput_share` of the requests are good. A request is good when its own TTFT,
    TPOT and E2E are each within the limit set for that metric: the P99 target if set, else
    the P50 one (`request_limits_ms`). ITL targets are judged over all gaps only,
    since one slow step among hundreds says little about a single request.
    """

    ttft_p99_ms: float | None = Field(None, gt=0, description="Time to first token, 99th percentile, ms")
    ttft_p50_ms: float | None = Field(None, gt=0, description="Time to first token, median, ms")
    tpot_p99_ms: float | None = Field(None, gt=0, description="Time per output token after the first, P99, ms")
    tpot_p50_ms: float | None = Field(None, gt=0, description="Time per output token after the first, median, ms")
    itl_p99_ms: float | None = Field(None, gt=0, description="Inter-token latency, P99, ms")
    e2e_p99_ms: float | None = Field(None, gt=0, description="End-to-end request latency, P99, ms")
    goodput_share: float = Field(
        0.99, gt=0, le=1, description="Share of requests that must meet every per-request target"
    )

    @property
    def targets(self) -> dict[str, float]:
        """The percentile targets that are set: field name -> limit in ms."""
        return {k: v for k, v in self.model_dump().items() if k.endswith("_ms") and v is not None}

    def request_limits_ms(self) -> dict[str, float]:
        """Per-request limits for goodput: metric (ttft, tpot, e2e) -> ms."""
        limits: dict[str, float] = {}
        for metric in ("ttft", "tpot", "e2e"):
            limit = getattr(self, f"{metric}_p99_ms", None) or getattr(self, f"{metric}_p50_ms", None)
            if limit is not None:
                limits[metric] = limit
        return limits

    @classmethod
    def parse(cls, text: str) -> SLO:
        """'ttft_p99_ms<=500,tpot_p99_ms<=50,goodput_share>=0.95' -> SLO; errors name the clause."""
        values: dict[str, float] = {}
        for clause in filter(None, (c.strip() for c in text.split(","))):
            op = ">=" if ">=" in clause else "<="
            name, sep, number = clause.partition(op)
            name = name.strip()
            if not sep or name not in cls.model_fields:
                allowed = ", ".join(f"{f}<=MS" for f in cls.model_fields if f.endswith("_ms")) + ", goodput_share>=X"
                raise InputError("--slo", clause, f"expected one of {allowed}")
            if (op == ">=") != (name == "goodput_share"):
                raise InputError("--slo", clause, f"use {'>=' if name == 'goodput_share' else '<='} for {name}")
            try:
                values[name] = float(number)
            except ValueError:
                raise InputError("--slo", clause, "the limit must be a number") from None
        try:
            return cls(**values)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InputError(f"--slo {first['loc'][0]}", first.get("input"), first["msg"]) from None
