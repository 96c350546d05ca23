"""The tunable figures of the cost model, and where each comes from.

A GPU family's figures (how close its kernels get to the datasheet) and an engine's figures (what
its host and API server add) meet in one `CostParams`. Defaults come from the hardware profile's
`efficiency` block and the engine profile's `overheads`; a fit replaces them: the CPU calibration
of ServePlan's own engine (`serveplan calibrate`), or the public GPU fit (planner/public), which
fits per GPU family and per engine profile, never per measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Literal

from engine.errors import InputError
from planner.costmodel.fitted import FittedModel, fitted_model
from planner.engines import EngineProfile
from planner.specs import HardwareProfile


@dataclass(frozen=True)
class CostParams:
    """Efficiencies are shares of the datasheet peak; times are seconds.

    Matmuls with few rows under-use the hardware: compute efficiency at M rows is
    compute_efficiency x (f + (1 - f) x M / (M + gemm_half_size_tokens)) with f =
    `gemm_efficiency_floor`, the share kept however few the rows (a GPU's tensor cores fall off
    towards 0; a CPU's small-M GEMM keeps a flat, low rate). gemm_half_size_tokens = 0 turns the
    falloff off. A GPU's comes from its hardware profile (kernel measurements of dense matmuls) and
    slows its dense weight matmuls: routed experts run there in fused grouped kernels, whose rows
    per expert the grouped-GEMM share prices. A CPU calibration fits it for every matmul, the
    experts' too (one matmul per expert in ServePlan's engine on a CPU).
    """

    compute_efficiency: float
    memory_efficiency: float
    attention_memory_efficiency: float  # paged KV-cache reads (decode attention)
    interconnect_efficiency: float
    step_overhead_s: float  # host time per step: scheduling, input preparation, output handling
    attention_compute_efficiency: float = 0.5  # FLOP share of the prefill attention kernels
    # Share of that FLOP rate an engine's portable Triton attention kernels reach on this GPU family,
    # where the engine runs them instead of its FlashAttention-class ones (`CostModel.triton_attention`):
    # Triton's tiles and pipelines are not FlashAttention-2/3's. The estimate, a half, is of the order
    # reported for vLLM's unified Triton kernel (an 8k-token prefill on an A100 1.5 s against 0.6 s,
    # vLLM issue 18152, before its causal tile skipping, PR 20308); the public fit learns it per family.
    triton_attention_efficiency: float = 0.5
    per_request_overhead_s: float = 0.0  # host time per scheduled request per step
    layer_overhead_s: float = 0.0  # host time per layer per step (a CPU engine's per-module Python)
    # Device time every kernel costs beyond its roofline (ramp-up, tail, the gap to the next one).
    kernel_latency_s: float = 0.0
    # Eager steps: the host issues kernels one by one, so an operator takes at least its kernels x
    # kernel_launch_s; a replayed graph costs one launch.
    kernel_launch_s: float = 0.0
    gemm_half_size_tokens: float = 0.0
    gemm_efficiency_floor: float = 0.0
    # Host work of the next step overlaps this step's device work (SGLang, TensorRT-LLM), so a step
    # lasts max(device, host) instead of device + host.
    overlap_host: bool = False
    # Time the engine's API server spends on a request before the engine sees it (HTTP, tokeniser),
    # one request at a time. Not part of a step: the simulator's front end.
    api_request_s: float = 0.0
    # What a chat request adds to api_request_s where the server renders its messages with the model's
    # Jinja chat template (CostModel.front_end_s decides whether a run's requests pay it).
    api_chat_template_s: float = 0.0
    # Time each request spends between the client and the engine that does not occupy the API server:
    # hand-offs to the engine's process and the first token's way back through the detokeniser and the
    # stream. Requests overlap in it, so it adds to TTFT and E2E without limiting throughput.
    api_latency_s: float = 0.0
    # Host time the API server takes from the step loop to stream a step's tokens: once per step
    # that delivers tokens (the hand-off of the step's outputs) plus once per delivered token (its
    # SSE event). Not zero where the server shares the engine's process and GIL (ServePlan's own).
    api_step_s: float = 0.0
    api_token_s: float = 0.0
    # Share of api_request_s that a request arriving while the engine runs takes from its step loop
    # (a server in the engine's process, sharing its GIL): the simulator holds the replica that long.
    api_hold_share: float = 0.0
    # "causal": the kernel skips masked (query, key) pairs and keys outside windows (FlashAttention,
    # the Triton kernels). "dense": it computes the whole masked score matrix of each prefill chunk
    # and pads a decode batch to its longest context (the engine's torch reference path on CPU).
    attention_pairs: Literal["causal", "dense"] = "causal"
    # Every collective and pipeline hand-off takes this multiple of its priced time (a link's measured
    # curve, the ring on its datasheet figures, or the engine's custom all-reduce): engines' builds
    # and overlaps differ from the benchmarks'. The public fit learns it per GPU family;
    # interconnect_efficiency stays the profile's datasheet-to-achieved estimate for links without a curve.
    collective_time_scale: float = 1.0
    # All-reduces under this many bytes on a fully connected scale-up link take the engine's own
    # kernel (comm.CollectiveCost); 0: the engine sends every all-reduce through NCCL.
    custom_all_reduce_max_bytes: int = 0
    # Every rank's kernels take this multiple of their roofline time when a step runs on several
    # ranks that share one host: CPU engine processes, whose cores share caches and memory bandwidth
    # (and, on a virtual machine, possibly physical cores). 1 on one process; `calibrate --tp/--ep`
    # fits it from the same grid timed on one process and on several. A GPU has its own memory: 1.
    shared_host_slowdown: float = 1.0
    # Share of the dense-GEMM roofline an engine's fused-MoE kernel reaches on the routed experts
    # (tokens gathered and sorted by expert, uneven loads, small per-expert tiles, the engine's kernel
    # for the weight format): 1 prices experts like dense matmuls, the profiles' estimate. The public
    # fit learns it per engine.
    moe_kernel_efficiency: float = 1.0
    # The same share for experts stored as 4-bit floats (MXFP4: gpt-oss), which every engine runs
    # through another kernel than its bf16/fp8 fused MoE (vLLM: triton_kernels' matmul_ogs on Hopper,
    # Marlin on Ampere; SGLang and TensorRT-LLM their own MXFP4 paths): one engine's two shares need
    # not agree, as its published runs show (SGLang's gpt-oss runs 2-14x slower than its Qwen3 and
    # GLM runs would have it). The public fit learns it per engine.
    fp4_moe_kernel_efficiency: float = 1.0
    # Share of the family's roofline an engine's dense weight matmuls reach (the LM head's and shared
    # experts' included): engines wrap the same GEMM libraries in their own fusions, layouts and
    # compiled graphs (TensorRT-LLM's plugins, vLLM's torch.compile'd graphs, SGLang's), and published
    # runs of one model on one GPU differ by engine in the decode they are bound by. 1 prices them at
    # the family's shares, the profiles' estimate; the public fit learns it per engine.
    dense_kernel_efficiency: float = 1.0
    # Share of the dense-GEMM roofline a grouped GEMM (the routed experts' kernels) reaches on this GPU
    # family, whatever the engine: Hopper's peak needs wgmma, TMA and warp-specialised pipelines,
    # which cuBLAS's dense GEMMs have and Triton's fused-MoE kernels (vLLM's and SGLang's default
    # for bf16 and fp8 experts) reach only in part; Ampere's mma path they reach. It is a share of
    # the experts' compute only: their weights stream at the dense rate (a decode step's fused-MoE
    # kernel is bound by those reads, as a dense GEMV is). The routed experts' compute runs at
    # grouped_gemm_efficiency x moe_kernel_efficiency of the dense roofline, their weight reads at
    # moe_kernel_efficiency. The public fit learns it per GPU family; 1 (the profiles' estimate)
    # prices them like dense matmuls.
    grouped_gemm_efficiency: float = 1.0
    # Shares of their format's roofline that scaled low-precision weight matmuls (W8A8 fp8, W4A4 fp4
    # on tensor cores that have the format) reach on this GPU family, of its math and of its weight
    # reads: each GEMM first quantises its activations (a kernel of its own), reads the scales and
    # applies them in its epilogue, and fp8 checkpoints scaled per 128 x 128 block (Qwen3's and
    # DeepSeek's) run block-scaled kernels (Triton, DeepGEMM) that do not match cuBLAS's bf16 GEMMs.
    # 1 prices them at the format's datasheet rates (fp8 math and weight reads twice bf16's), the
    # profiles' estimate; the public fit learns both per family. Weight-only formats, which
    # dequantise to bf16 math, are priced by their dequantisation instead.
    scaled_gemm_efficiency: float = 1.0
    scaled_gemm_memory_efficiency: float = 1.0

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "memory_efficiency", "attention_memory_efficiency",
                     "attention_compute_efficiency", "triton_attention_efficiency", "interconnect_efficiency",
                     "moe_kernel_efficiency", "fp4_moe_kernel_efficiency",
                     "dense_kernel_efficiency",
                     "grouped_gemm_efficiency", "scaled_gemm_efficiency", "scaled_gemm_memory_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InputError(name, value, "must be in (0, 1]")
        if not 0.0 <= self.api_hold_share <= 1.0:
            raise InputError("api_hold_share", self.api_hold_share, "must be in [0, 1]")
        for name in ("step_overhead_s", "per_request_overhead_s", "layer_overhead_s", "gemm_half_size_tokens",
                     "kernel_launch_s", "kernel_latency_s", "api_request_s", "api_chat_template_s", "api_latency_s",
                     "api_step_s", "api_token_s"):
            value = getattr(self, name)
            if not 0.0 <= value < float("inf"):  # also rejects NaN
                raise InputError(name, value, "must be a finite number >= 0")
        for name in ("collective_time_scale", "shared_host_slowdown"):
            value = getattr(self, name)
            if not 0.0 < value < float("inf"):
                raise InputError(name, value, "must be a finite number > 0")
        if not 0.0 <= self.gemm_efficiency_floor <= 1.0:
            raise InputError("gemm_efficiency_floor", self.gemm_efficiency_floor, "must be in [0, 1]")
        if self.attention_pairs not in ("causal", "dense"):
            raise InputError("attention_pairs", self.attention_pairs, "allowed: causal, dense")

    @classmethod
    def defaults(cls, hw: HardwareProfile, engine: EngineProfile | None = None) -> CostParams:
        """The hardware profile's efficiencies and the engine profile's overheads, before any fit."""
        e = hw.efficiency
        params = cls(
            compute_efficiency=e.compute,
            memory_efficiency=e.memory,
            attention_memory_efficiency=e.attention_memory,
            interconnect_efficiency=e.interconnect,
            step_overhead_s=e.step_overhead_us * 1e-6,
            kernel_launch_s=e.kernel_launch_us * 1e-6,
            kernel_latency_s=e.graph_kernel_us * 1e-6,
            gemm_half_size_tokens=e.gemm_half_size_tokens,
        )
        if engine is None:
            return params
        o = engine.overheads
        return replace(params, step_overhead_s=o.step_us * 1e-6, per_request_overhead_s=o.per_request_us * 1e-6,
                       api_request_s=o.api_request_ms * 1e-3, api_chat_template_s=o.api_chat_template_ms * 1e-3,
                       api_latency_s=o.api_latency_ms * 1e-3, api_step_s=o.api_step_us * 1e-6,
                       api_token_s=o.api_token_us * 1e-6, overlap_host=engine.execution.overlap_host,
                       custom_all_reduce_max_bytes=engine.execution.custom_all_reduce_max_bytes,
                       api_hold_share=o.api_hold_share)

    def in_process(self) -> CostParams:
        """These figures for requests that do not pass the API server (the LLM class, `engine bench`)."""
        return replace(self, api_request_s=0.0, api_chat_template_s=0.0, api_latency_s=0.0, api_step_s=0.0,
                       api_token_s=0.0, api_hold_share=0.0)

    @classmethod
    def fitted(cls, hw: HardwareProfile, engine: EngineProfile, model: FittedModel | None = None) -> CostParams:
        """The profiles' estimates with what a fit (`model`, else the public GPU fit) learnt of hw's
        family and the engine (planner/costmodel/fitted.py); the estimates alone where it saw neither."""
        params = cls.defaults(hw, engine)
        model = model or fitted_model()
        if model is None:
            return params
        values = {**model.families.get(hw.family, {}), **model.engines.get(engine.name, {})}
        return params.with_values(values) if values else params

    def with_values(self, values: Mapping[str, object]) -> CostParams:
        """A copy with some figures replaced (a fit's); unknown names are refused."""
        known = {f.name for f in fields(self)}
        for name in values:
            if name not in known:
                raise InputError("cost parameter", name, f"known: {', '.join(sorted(known))}")
        # Fields named at run time (checked above): mypy cannot match each value to its field's type.
        return replace(self, **values)  # type: ignore[arg-type]
