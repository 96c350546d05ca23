"""Typed specs shared by every part of ServePlan: hardware, deployment, workload, SLO.

Pydantic models at the boundary (YAML profiles, CLI flags, the dashboard, the Python API);
every numeric field carries its unit in its name, has bounds and a description, and the
JSON Schema of each is exported to docs/schemas/ by `serveplan schema`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.config import MAX_CONTEXT, EngineKnobs
from engine.dtypes import Dtype, KVDtype
from engine.errors import InputError, from_validation_error
from engine.knobs import Knob
from engine.limits import MAX_REQUEST_TOKENS
from planner.quality import DEFAULT_MAX_QUALITY_LOSS_PCT, NO_QUALITY_LIMIT_PCT

__all__ = ["SLO", "Deployment", "Disaggregation", "Dtype", "EngineKnobs", "HardwareProfile", "MemoryQuery", "MemoryTier",
           "PlanSettings", "Spec", "WorkloadOverrides"]


class Spec(BaseModel):
    """Base for every boundary spec: unknown keys are errors, values are immutable, and every
    number is finite (an infinite bandwidth or a NaN price is a typo, never a figure)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- hardware

# Bounds of a profile's figures: a decade or more beyond every device in hwprofiles/ on each side
# (the slowest is a one-thread CPU at 0.02 TFLOPS and 7.5 GB/s), so that a typo such as 1e-300
# GB/s or 1e9 US$/h is refused instead of turning into 1e300-second or free answers.
MIN_TFLOPS, MAX_TFLOPS = 1e-3, 1e6
MIN_BANDWIDTH_GB_S, MAX_BANDWIDTH_GB_S = 0.1, 1e6
MAX_MEMORY_GIB = 1 << 16
MAX_LATENCY_US = 1e6
MAX_DOMAIN_SIZE = 1 << 20
MAX_POWER_W = 1e5
MIN_PRICE_USD_PER_HOUR, MAX_PRICE_USD_PER_HOUR = 0.001, 1000.0
MAX_OVERHEAD_US = 1e6
MAX_GEMM_HALF_SIZE_TOKENS = 4096.0  # the CPU calibration's bound too (planner/calibrate.py)


def _peak(description: str) -> float | None:
    return Field(None, ge=MIN_TFLOPS, le=MAX_TFLOPS, description=description)


def _bandwidth(description: str) -> float:
    return Field(ge=MIN_BANDWIDTH_GB_S, le=MAX_BANDWIDTH_GB_S, description=description)


class PeakTflops(Spec):
    """Dense peak throughput per numeric format (no 2:4 sparsity); TOPS for integer formats.

    A format left out is not supported natively by the tensor/matrix units; the cost model
    then computes in the next wider supported format and charges dequantisation.
    """

    fp32: float | None = _peak("FP32 (vector or TF32-free) dense TFLOPS")
    bf16: float | None = _peak("BF16 dense TFLOPS")
    fp16: float | None = _peak("FP16 dense TFLOPS")
    fp8: float | None = _peak("FP8 (e4m3) dense TFLOPS")
    int8: float | None = _peak("INT8 dense TOPS")
    int4: float | None = _peak("INT4 dense TOPS")
    fp4: float | None = _peak("FP4 (NVFP4/MXFP4) dense TFLOPS")

    def supported(self) -> list[str]:
        return [k for k, v in self.model_dump().items() if v is not None]


Collective = Literal["all_reduce", "all_gather", "all_to_all"]
# Most points in one measured curve: a sweep from bytes to gigabytes in steps of 2 is ~35.
MAX_CURVE_POINTS = 64
MAX_PAYLOAD_BYTES = 1 << 40


class CollectiveCurve(Spec):
    """One collective's measured time by message size on a link: the small-message latency, the
    large-message bandwidth and the measured shape between (nccl-tests or the engine's own gloo
    benchmark). Payloads are nccl-tests' `size`: the buffer all-reduced, the whole gathered
    output, the whole buffer one rank sends to all others."""

    ranks: int = Field(ge=2, le=MAX_DOMAIN_SIZE, description="Ranks the measurement ran on")
    points: tuple[tuple[Annotated[float, Field(gt=0, le=MAX_PAYLOAD_BYTES)], Annotated[float, Field(gt=0, le=1e9)]], ...] = Field(
        min_length=2, max_length=MAX_CURVE_POINTS,
        description="(payload bytes, time in microseconds) pairs, payloads strictly ascending")
    source: str = Field(min_length=1, max_length=500, description="Where the figures come from (tool, versions, page)")

    @model_validator(mode="after")
    def _ascending(self) -> CollectiveCurve:
        sizes = [size for size, _ in self.points]
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise InputError("points", sizes[:8], "payload sizes must be strictly ascending")
        return self


class Link(Spec):
    """One interconnect as seen by a single device: per-direction bandwidth and latency, and
    where measured, its collectives' curves (which the cost model then prefers)."""

    name: str = Field(max_length=200, description="Link technology, e.g. 'NVLink4', 'PCIe Gen5 x16', '8x400G InfiniBand NDR'")
    bandwidth_gb_s: float = _bandwidth("Per-device bandwidth in GB/s, one direction")
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US, description="One-way small-message latency in microseconds")
    domain_size: int = Field(
        1, ge=1, le=MAX_DOMAIN_SIZE, description="Most devices reachable at this bandwidth (e.g. 8 in an HGX node, 72 in NVL72)"
    )
    collectives: dict[Collective, CollectiveCurve] = Field(
        default_factory=dict, description="Measured time by message size per collective; a collective left out is "
        "priced from bandwidth_gb_s and latency_us (ring algorithm)")
    custom_all_reduce: tuple[CollectiveCurve, ...] = Field(
        default=(), max_length=MAX_DOMAIN_SIZE, description="Measured time by payload of the serving engines' own "
        "all-reduce kernel (vLLM's custom all-reduce), one curve per rank count; an all-reduce an engine sends "
        "through that kernel is priced from the curve of the fewest measured ranks at or above its group's (the "
        "most where none is). Without curves: barriers of latency_us and the bytes read at bandwidth_gb_s")

    @model_validator(mode="after")
    def _one_curve_per_rank_count(self) -> Link:
        ranks = [c.ranks for c in self.custom_all_reduce]
        if len(set(ranks)) != len(ranks):
            raise InputError("custom_all_reduce", ranks, "one curve per rank count")
        return self


MAX_TIER_GIB = 1 << 24  # 16 PiB per device: beyond any host memory or disk


class MemoryTier(Spec):
    """Memory beside a device that the engine copies KV blocks to and back: host DRAM over the host
    link, or a local NVMe disk. Per device; rates are achieved ones (measured, or a datasheet's
    sequential rate), used as they are."""

    name: str = Field(max_length=200, description="What it is, e.g. 'DDR5 over PCIe Gen5 x16', 'NVMe U.2 (PCIe Gen4)'")
    capacity_gib: float = Field(gt=0, le=MAX_TIER_GIB, description="Capacity per device, GiB")
    write_gb_s: float = _bandwidth("Device to tier, GB/s per device")
    read_gb_s: float = _bandwidth("Tier to device, GB/s per device")
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US, description="Fixed cost of one step's batch of copies, microseconds")


class Efficiencies(Spec):
    """Achieved fraction of datasheet peaks, used until a calibration overrides them."""

    compute: float = Field(0.7, gt=0, le=1, description="Fraction of dense peak FLOPs a large GEMM reaches")
    memory: float = Field(0.85, gt=0, le=1, description="Fraction of peak bandwidth a streaming weight read reaches")
    attention_memory: float = Field(
        0.6, gt=0, le=1, description="Fraction of peak bandwidth a paged KV-cache read reaches"
    )
    interconnect: float = Field(0.8, gt=0, le=1, description="Fraction of link bandwidth a large all-reduce reaches")
    step_overhead_us: float = Field(
        200.0, ge=0, le=MAX_OVERHEAD_US, description="Fixed host-side cost per engine step (scheduling, input preparation), microseconds"
    )
    kernel_launch_us: float = Field(
        0.0, ge=0, le=MAX_OVERHEAD_US, description="Host time to issue one kernel in eager mode, microseconds; the device only waits for it "
        "when its kernels are shorter (0: not modelled apart, e.g. CPUs, where it sits in the step and layer overheads)"
    )
    graph_kernel_us: float = Field(
        0.0, ge=0, le=MAX_OVERHEAD_US, description="Device time each kernel costs beyond its roofline (its shortest run and the gap to "
        "the next), microseconds"
    )
    gemm_half_size_tokens: float = Field(
        0.0, ge=0, le=MAX_GEMM_HALF_SIZE_TOKENS, description="Rows at which a dense weight matmul reaches half the rate it "
        "reaches with many rows (its tiles fill the GPU only with enough rows), from kernel measurements; 0: no falloff "
        "(no such measurements for this device)"
    )


class HardwareProfile(Spec):
    """One accelerator or system, as a single device of the deployment."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.\-]*$", max_length=64,
                      description="Short id used on the command line, e.g. 'h100-sxm'")
    display_name: str = Field(max_length=200, description="Human-readable product name")
    vendor: str
    kind: Literal["gpu", "accelerator", "soc", "cpu"] = Field(description="Device class")
    family: str = Field(
        description="Architecture family; hypothetical hardware borrows the calibrated efficiencies of its family"
    )
    memory_gib: float = Field(ge=0.25, le=MAX_MEMORY_GIB,
                              description="Device memory as marketed, GiB")
    memory_reported_gib: float | None = Field(
        None, ge=0.25, le=MAX_MEMORY_GIB,
        description="Device memory the runtime reports as its total (torch.cuda.mem_get_info, which serving engines "
        "size their KV cache from), GiB: less than marketed, the driver keeps a share; None where no figure is known "
        "(the marketed one is used)")
    memory_bandwidth_gb_s: float = _bandwidth("Peak device-memory bandwidth, GB/s")
    peak_tflops: PeakTflops
    scale_up: Link | None = Field(None, description="Intra-node device-to-device link (NVLink, xGMI, ICI); None if PCIe only")
    scale_out: Link | None = Field(None, description="Inter-node network per device")
    pcie: Link | None = Field(None, description="Host link")
    host_memory: MemoryTier | None = Field(
        None, description="Host memory for KV blocks (offload tier, swap space), reached over the host link; None: no figures")
    local_disk: MemoryTier | None = Field(None, description="Local disk for KV blocks behind host memory; None: no figures")
    graph_capture: bool = Field(
        False, description="The engine can capture a decode step as one graph and replay it (CUDA/HIP graphs)"
    )
    power_w: float | None = Field(None, ge=1, le=MAX_POWER_W, description="Board or module power, watts")
    price_usd_per_hour: Annotated[float | None, Knob("--price", "Price", "US$ per GPU-hour")] = Field(
        None, ge=MIN_PRICE_USD_PER_HOUR, le=MAX_PRICE_USD_PER_HOUR,
        description="Typical on-demand cloud price per device-hour, US$")
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
            raise InputError("peak_tflops", None, "at least one numeric format needs a peak")
        return self

    @model_validator(mode="after")
    def _reported_within_marketed(self) -> HardwareProfile:
        if self.memory_reported_gib is not None and self.memory_reported_gib > self.memory_gib:
            raise InputError("memory_reported_gib", self.memory_reported_gib,
                             f"must not exceed the marketed memory_gib={self.memory_gib:g}")
        return self

    @property
    def reported_memory_gib(self) -> float:
        """What an engine on this device sees as total memory (the marketed figure where none is known)."""
        return self.memory_gib if self.memory_reported_gib is None else self.memory_reported_gib

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


# The engine a deployment runs when none is named: the most widely used, its current release line.
DEFAULT_ENGINE = "vllm-0.11"

KVLink = Literal["auto", "scale_up", "scale_out", "pcie"]


class Disaggregation(Spec):
    """Prefill/decode disaggregation, xPyD: each replica is x prefill and y decode instances, each
    of the deployment's parallelism; a router sends a request to a prefill instance, which computes
    its prompt, then to a decode instance, which receives the prompt's KV and generates."""

    prefill_instances: Annotated[int, Knob("--prefill-instances", "Prefill instances (x of xPyD)")] = Field(
        1, ge=1, le=1024, description="Prefill instances per replica")
    decode_instances: Annotated[int, Knob("--decode-instances", "Decode instances (y of xPyD)")] = Field(
        1, ge=1, le=1024, description="Decode instances per replica")
    kv_link: Annotated[KVLink, Knob("--kv-link", "KV transfer link")] = Field(
        "auto", description="The link prompt KV moves over: auto (the scale-up domain when a replica's instances fit "
        "in it, else scale-out; a CPU's shared memory), or one of the profile's links")

    @property
    def label(self) -> str:
        return f"{self.prefill_instances}P{self.decode_instances}D"

    @property
    def instances(self) -> int:
        return self.prefill_instances + self.decode_instances


# How a memory-profiling pass's top-k/top-p sampler works (planner/memory/activations.py): it decides
# the bytes per logit the pass reserves.
ProfileSampler = Literal["torch_sort", "torch_sort_gather", "flashinfer"]
# The engine's attention kernels: FlashAttention-class (FlashAttention 2/3, FlashInfer, the engines' own
# CUDA kernels) or its portable Triton ones (SGLang --attention-backend triton, vLLM's TRITON_ATTN).
AttentionKernel = Literal["flash", "triton"]


class Deployment(Spec):
    """How one model is served: hardware, parallelism, precision and engine settings."""

    hardware: str = Field(description="Hardware profile name (see `serveplan hw list`)")
    tensor_parallel: Annotated[int, Knob("--tp", "Tensor parallel", "GPUs per replica")] = Field(
        1, ge=1, le=1024, description="GPUs a layer is split across (TP); must divide the attention heads")
    pipeline_parallel: Annotated[int, Knob("--pp", "Pipeline stages", "stages")] = Field(
        1, ge=1, le=1024, description="Pipeline stages (PP): layers split into sequential stages")
    expert_parallel: Annotated[int, Knob("--ep", "Expert parallel", "GPUs")] = Field(
        1, ge=1, le=1024, description="GPUs the routed experts are spread across (EP; MoE models)")
    attention_data_parallel: Annotated[int, Knob("--dp-attention", "Attention data parallel", "groups")] = Field(
        1, ge=1, le=1024, description="Attention runs data-parallel over this many groups of the tensor-parallel GPUs, "
        "each with its own requests and KV cache, the MLP/experts over all of them (SGLang --enable-dp-attention, vLLM "
        "data parallelism with expert parallelism); for MLA models, whose KV latent TP would replicate; must divide "
        "tensor_parallel")
    context_parallel: Annotated[int, Knob("--cp", "Context parallel", "GPUs")] = Field(
        1, ge=1, le=1024, description="GPUs each sequence's tokens and KV cache are split across (prefill context "
        "parallelism: each takes 1/cp of a prompt and the chunk's K/V is all-gathered per layer; decode attention "
        "scans each GPU's share and merges); multiplies the GPUs per replica")
    replicas: Annotated[int, Knob("--replicas", "Replicas")] = Field(
        1, ge=1, le=100_000, description="Data-parallel replicas (DP) behind the router")
    weight_dtype: Annotated[Dtype, Knob("--weight-dtype", "Weight dtype")] = Field(
        "bf16", description="Storage format of the weights (fp8/fp4 compute natively where the chip has a peak for it)")
    kv_dtype: Annotated[KVDtype, Knob("--kv-dtype", "KV-cache dtype")] = Field(
        "bf16", description="Storage format of the KV cache")
    engine: Annotated[str, Knob("--engine", "Serving engine")] = Field(
        DEFAULT_ENGINE, pattern=r"^[a-z0-9][a-z0-9.\-]*(@[0-9][0-9a-z.+\-]*)?$", max_length=64,
        description="Engine profile (`serveplan engines list`): its defaults, scheduling and overheads apply; "
        "`profile@release` (vllm-0.11@0.10.2) runs one release of the line, with the settings its older releases had")
    api_server: Annotated[bool, Knob("--api-server", "Served over HTTP")] = Field(
        True, description="Requests pass the engine's HTTP API server, and the engine profile's API figures "
        "(overheads api_request_ms, api_step_us, api_token_us) are priced; off for in-process runs (the LLM class, "
        "`engine bench`)")
    api_endpoint: Annotated[Literal["chat", "completions"], Knob("--api-endpoint", "API endpoint")] = Field(
        "chat", description="What clients call on the API server: /v1/chat/completions, whose messages the server "
        "renders with the model's chat template (overheads api_chat_template_ms, unless the engine renders the model's "
        "chat format natively), or /v1/completions with a ready prompt")
    peer_access: Annotated[bool, Knob("--peer-access", "GPU peer access")] = Field(
        True, description="A replica's GPUs reach each other directly (NVLink, xGMI, PCIe peer-to-peer). Off where the "
        "platform gives them no peer access (some VMs and containers: vLLM then logs 'Custom allreduce is disabled "
        "because your platform lacks GPU P2P capability'): their collectives go through host memory over each GPU's "
        "PCIe link, whatever links the board has")
    knobs: EngineKnobs = Field(default_factory=EngineKnobs)
    profile_sampler: Annotated[ProfileSampler | None, Knob("--profile-sampler", "Profiling-pass sampler")] = Field(
        None, description="The top-k/top-p sampler of the engine's memory-profiling pass, for engines whose pass "
        "samples (vLLM): torch_sort, torch_sort_gather or flashinfer (default: the profile's). vLLM 0.10.x-0.11.0 "
        "sample with flashinfer when FlashInfer is installed, as in their release images (docs/memory.md)")
    attention_kernel: Annotated[AttentionKernel | None, Knob("--attention-kernel", "Attention kernels")] = Field(
        None, description="flash: FlashAttention-class kernels (FlashAttention 2/3, FlashInfer); triton: the engine's "
        "portable Triton kernels (SGLang --attention-backend triton, vLLM TRITON_ATTN), priced at the GPU family's "
        "triton_attention_efficiency of their FLOP rate (default: the engine's choice, Triton only where it has no "
        "other kernel for the model: attention sinks before Hopper)")
    disaggregation: Disaggregation | None = Field(
        None, description="Separate prefill and decode instances (xPyD) per replica; None: every instance does both")

    @model_validator(mode="after")
    def _ep_within_replica(self) -> Deployment:
        if self.expert_parallel > self.tensor_parallel * self.pipeline_parallel:
            raise InputError("expert_parallel", self.expert_parallel, "must not exceed the GPUs of one replica's model "
                             f"(tensor_parallel x pipeline_parallel = {self.tensor_parallel * self.pipeline_parallel})")
        if self.tensor_parallel % self.attention_data_parallel:
            raise InputError("attention_data_parallel", self.attention_data_parallel,
                             f"must divide tensor_parallel={self.tensor_parallel} (attention groups share its GPUs)")
        return self

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def instances_per_replica(self) -> int:
        """Engine instances a replica is made of: x + y when disaggregated, else 1."""
        return self.disaggregation.instances if self.disaggregation is not None else 1

    @property
    def gpus_per_group(self) -> int:
        """GPUs of one replica with all its instances: what a replica costs."""
        return self.gpus_per_replica * self.instances_per_replica

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_group * self.replicas


# --------------------------------------------------------------------------- workload overrides

# Below one request per 1000 s a run is idle time and every per-token cost is meaningless
# (1e-30 req/s once priced 1M tokens at US$3e30); above a million per second is a typo.
MIN_RATE_PER_S, MAX_RATE_PER_S = 1e-3, 1e6


_PREFIX_FIELDS = ("prefix_tokens", "num_prefixes", "prefix_share")


class WorkloadOverrides(Spec):
    """What the CLI's flags and the dashboard's inputs may replace in a workload preset or file;
    unset fields keep the workload's own. The workload then validates the result as a whole."""

    rate_per_s: Annotated[float | None, Knob("--rate", "Arrival rate", "requests/s")] = Field(
        None, ge=MIN_RATE_PER_S, le=MAX_RATE_PER_S, description="Poisson arrivals at this rate, replacing the workload's "
        "(in a multi-turn workload an arrival starts a conversation, whose turns follow its replies)")
    concurrency: Annotated[int | None, Knob("--concurrency", "Concurrent users", "users")] = Field(
        None, ge=1, le=1_000_000, description="Closed loop instead: users each sending their next request on a reply")
    num_requests: Annotated[int | None, Knob("--requests", "Requests")] = Field(
        None, ge=1, description="Requests to draw, follow-up turns included (default: the workload's)")
    input_tokens: Annotated[int | None, Knob("--input-tokens", "Prompt tokens", "tokens")] = Field(
        None, ge=1, description="One prompt length for every request (default: the workload's distribution)")
    output_tokens: Annotated[int | None, Knob("--output-tokens", "Output tokens", "tokens")] = Field(
        None, ge=1, description="One reply length for every request (default: the workload's distribution)")
    seed: Annotated[int | None, Knob("--seed", "Seed")] = Field(
        None, ge=0, le=2**32 - 1, description="Seed of every random draw (default: the workload's)")
    prefix_tokens: Annotated[int | None, Knob("--prefix-tokens", "Shared prefix", "tokens")] = Field(
        None, ge=1, le=MAX_REQUEST_TOKENS, description="A shared prompt prefix (system prompt, tool specs) of this "
        "many tokens before each request's own prompt, replacing the workload's shared prefix (default: the workload's)")
    num_prefixes: Annotated[int | None, Knob("--prefixes", "Distinct shared prefixes")] = Field(
        None, ge=1, le=100_000, description="How many different shared prefixes requests pick from, equally "
        "(with the shared prefix; default 1)")
    prefix_share: Annotated[float | None, Knob("--prefix-share", "Share of requests with the prefix", "0-1")] = Field(
        None, ge=0, le=1, description="Share of requests that start with a shared prefix (with the shared prefix; "
        "default 1)")

    @model_validator(mode="after")
    def _one_arrival_process(self) -> WorkloadOverrides:
        if self.rate_per_s is not None and self.concurrency is not None:
            raise InputError("concurrency", self.concurrency, "not together with an arrival rate: give one of the two")
        if self.prefix_tokens is None:
            for name in ("num_prefixes", "prefix_share"):
                if getattr(self, name) is not None:
                    raise InputError(name, getattr(self, name), "applies to a shared prefix: give its length too")
        return self

    def workload_fields(self) -> dict[str, object]:
        """The Workload fields these replace, for `get_workload(name, **fields)`."""
        fields: dict[str, object] = {k: v for k, v in self.model_dump().items()
                                     if v is not None and k not in ("rate_per_s", "concurrency", *_PREFIX_FIELDS)}
        if self.prefix_tokens is not None:
            fields["shared_prefix"] = {"prefix_tokens": self.prefix_tokens, "num_prefixes": self.num_prefixes or 1,
                                       "share": 1.0 if self.prefix_share is None else self.prefix_share}
        if self.rate_per_s is not None:
            fields["arrival"] = {"kind": "poisson", "rate_per_s": self.rate_per_s}
        if self.concurrency is not None:
            fields["arrival"] = {"kind": "closed_loop", "concurrency": self.concurrency}
        return fields


# --------------------------------------------------------------------------- memory


class MemoryQuery(Spec):
    """What `serveplan memory` and the Memory page ask of a deployment besides the deployment."""

    context_tokens: Annotated[int, Knob("--context", "Context per sequence", "tokens")] = Field(
        8192, ge=1, le=MAX_CONTEXT, description="Tokens per sequence (prompt + output) for max concurrency")


# --------------------------------------------------------------------------- plan

# Requests per simulated probe of a plan (at least 3 x max_num_seqs): the CLI's default and the Plan
# page's, so that one question asked of both gets one answer.
DEFAULT_REQUESTS_PER_PROBE = 300
# Prompts this long, on average, make a prefill chunk a visible stall in a colocated decode step:
# the planner's `pd_ratios: auto` tries disaggregated candidates from here on.
LONG_PROMPT_TOKENS = 1024


class PlanSettings(Spec):
    """The search space and sizing of `serveplan plan` that the CLI and the Plan page share."""

    max_gpus_per_replica: Annotated[int, Knob("--max-gpus", "Max GPUs per replica", "GPUs")] = Field(
        8, ge=1, le=1024, description="Most GPUs per replica; tensor parallelism is tried in powers of two up to it")
    budget_usd_per_hour: Annotated[float | None, Knob("--budget-usd-per-hour", "Budget", "US$/h")] = Field(
        None, gt=0, le=1e9, description="Most US$/h to spend on all replicas (default: no budget)")
    headroom: Annotated[float, Knob("--headroom", "Headroom", "share")] = Field(
        0.1, ge=0, le=100, description="Replicas are sized for rate x (1 + headroom)")
    pd_ratios: Annotated[str, Knob("--pd-ratios", "Prefill:decode ratios")] = Field(
        "auto", max_length=200, pattern=r"^(auto|none|[1-9]\d?:[1-9]\d?(,[1-9]\d?:[1-9]\d?)*)$",
        description="Disaggregated candidates to try beside colocated ones, as x:y prefill:decode instances per "
        "replica, e.g. 1:1,1:2,2:1; auto: those three when the SLO sets a TPOT or ITL target and prompts average "
        f"{LONG_PROMPT_TOKENS:,}+ tokens (where prefill chunks stretch decode steps); none: colocated only")
    offload: Annotated[Literal["auto", "always", "none"], Knob("--offload", "Host KV tier candidates")] = Field(
        "auto", description="Candidates with a host KV tier of half the host memory the profile lists per GPU, beside "
        "those without: auto when the workload reuses prompts (shared prefixes, conversations), always, or none")
    confidence: Annotated[float | None, Knob("--confidence", "Confidence", "probability")] = Field(
        None, ge=0.5, le=0.95, description="Size against the pessimistic bound that measurements stay within this "
        "often (from the public fit's held-out errors) instead of the prediction itself (default: the prediction)")
    every_hardware: Annotated[bool, Knob("--every-hardware", "Size every hardware")] = Field(
        True, description="Size each hardware's own cheapest deployment, so that every hardware has a simulated "
        "answer (the CLI prints the recommendation first, found without them, then sizes the rest); off: a candidate "
        "that cannot beat the cheapest answer on any hardware is not simulated, and a hardware that cannot win says "
        "the least it would cost (the same recommendation, far sooner: most of a plan's simulations are of hardware "
        "that cannot win)")
    max_quality_loss_pct: Annotated[float, Knob("--max-quality-loss", "Max quality loss", "%")] = Field(
        DEFAULT_MAX_QUALITY_LOSS_PCT, ge=0, le=NO_QUALITY_LIMIT_PCT, description=(
            "Leave out weight/KV formats whose published quality loss (weights + KV cache, % of the 16-bit score; "
            "planner/data/quality.yaml) exceeds this; 100 admits every format, even one without a published figure"))

    def ratios(self, slo: SLO, mean_prompt_tokens: float) -> list[tuple[int, int]]:
        """The (prefill, decode) instance counts to try for this question."""
        if self.pd_ratios == "none":
            return []
        if self.pd_ratios == "auto":
            tight = slo.tpot_p99_ms or slo.tpot_p50_ms or slo.itl_p99_ms
            return [(1, 1), (1, 2), (2, 1)] if tight and mean_prompt_tokens >= LONG_PROMPT_TOKENS else []
        pairs = (pair.split(":") for pair in self.pd_ratios.split(","))  # "x:y" each, by the field's pattern
        return list(dict.fromkeys((int(x), int(y)) for x, y in pairs))


# --------------------------------------------------------------------------- SLO


# The sane range of each SLO target, ms. Below 10 µs no GPU step completes (a kernel launch
# alone takes microseconds); above it, a target is a typo such as 1e300, not a latency anyone waits
# for: an hour to the first token, a minute per token (a CPU serving a 70B model takes seconds),
# a day end to end (an offline batch). Outside, `SLO.parse` says so naming the target.
SLO_RANGE_MS: dict[str, tuple[float, float]] = {
    "ttft": (0.01, 3_600_000.0), "tpot": (0.01, 60_000.0), "itl": (0.01, 60_000.0), "e2e": (0.01, 86_400_000.0)}


def _target(metric: str, description: str) -> float | None:
    low, high = SLO_RANGE_MS[metric]
    return Field(None, ge=low, le=high, description=f"{description}: {_range_text(metric)}")


def _range_text(metric: str) -> str:
    return "..".join(format(bound, ",.10g") for bound in SLO_RANGE_MS[metric]) + " ms"


class SLO(Spec):
    """Latency targets.

    A deployment meets the SLO when every percentile target set holds over all requests and
    at least `goodput_share` of the requests are good. A request is good when its own TTFT,
    TPOT and E2E are each within the limit set for that metric: the P99 target if set, else
    the P50 one (`request_limits_ms`). ITL targets are judged over all gaps only,
    since one slow step among hundreds says little about a single request.
    """

    ttft_p99_ms: float | None = _target("ttft", "Time to first token, 99th percentile")
    ttft_p50_ms: float | None = _target("ttft", "Time to first token, median")
    tpot_p99_ms: float | None = _target("tpot", "Time per output token after the first, P99")
    tpot_p50_ms: float | None = _target("tpot", "Time per output token after the first, median")
    itl_p99_ms: float | None = _target("itl", "Inter-token latency, P99")
    e2e_p99_ms: float | None = _target("e2e", "End-to-end request latency, P99")
    goodput_share: float = Field(
        0.99, gt=0, le=1, description="Share of requests that must meet every per-request target"
    )

    @property
    def targets(self) -> dict[str, float]:
        """The percentile targets that are set: field name -> limit in ms."""
        return {k: v for k, v in self.model_dump().items() if k.endswith("_ms") and v is not None}

    def request_limit_ms(self, metric: Literal["ttft", "tpot", "e2e"]) -> tuple[float, float] | None:
        """(limit in ms, quantile of requests it binds) for one metric: the P99 target if set,
        else the P50 one; None when neither is set. The one place that choice is made."""
        p99, p50 = getattr(self, f"{metric}_p99_ms", None), getattr(self, f"{metric}_p50_ms", None)
        if p99 is not None:
            return p99, 0.99
        return None if p50 is None else (p50, 0.5)

    def request_limits_ms(self) -> dict[str, float]:
        """Per-request limits for goodput: metric (ttft, tpot, e2e) -> ms."""
        limits = {metric: self.request_limit_ms(metric) for metric in ("ttft", "tpot", "e2e")}
        return {metric: limit[0] for metric, limit in limits.items() if limit is not None}

    @classmethod
    def parse(cls, text: str) -> SLO:
        """'ttft_p99_ms<=500,tpot_p99_ms<=50,goodput_share>=0.95' -> SLO; errors name the clause.

        Empty clauses between commas are skipped, but at least one target is needed, and no
        target may be given twice (which one would count?)."""
        values: dict[str, float] = {}
        clauses: dict[str, str] = {}
        allowed = ", ".join(f"{f}<=MS" for f in cls.model_fields if f.endswith("_ms")) + ", goodput_share>=X"
        for clause in filter(None, (c.strip() for c in text.split(","))):
            op = ">=" if ">=" in clause else "<="
            name, sep, number = clause.partition(op)
            name = name.strip()
            if not sep or name not in cls.model_fields:
                raise InputError("slo", clause, f"expected one of {allowed}")
            if (op == ">=") != (name == "goodput_share"):
                raise InputError("slo", clause, f"use {'>=' if name == 'goodput_share' else '<='} for {name}")
            if name in values:
                raise InputError("slo", clause, f"{name} is given twice; give each target once")
            try:
                values[name], clauses[name] = float(number), clause
            except ValueError:
                raise InputError("slo", clause, "the limit must be a number") from None
        if not values:
            raise InputError("slo", text, f"needs at least one target: {allowed}")
        try:
            return cls(**values)
        except ValidationError as exc:
            name = from_validation_error(exc).field
            allowed = (f"{name} must be a number in {_range_text(name.partition('_')[0])}" if name.endswith("_ms")
                       else f"{name} must be a share in (0, 1]")
            raise InputError("slo", clauses.get(name, text), allowed) from None
