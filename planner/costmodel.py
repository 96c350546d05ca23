"""Step-time cost model: FLOPs, bytes and communication of one engine step -> seconds.

The simulator calls `CostModel.step_time(output)` for every step it simulates, so the hot path
aggregates the SchedulerOutput in one pass into a few sums (tokens, sampled rows, causal
attention pairs and KV tokens read, per decode/prefill group and attention-window class) and
turns those into operator times in O(1) from per-deployment constants computed once in
`__init__`. `breakdown()` returns the same numbers per operator; they sum to `step_time()`.

Model of one operator: time = max(FLOPs / (peak x compute_eff), bytes / (bandwidth x mem_eff))
(a roofline), summed over layers. Identical layers have identical rooflines, so the sum over
layers is the roofline of the summed FLOPs and bytes.

Rules worth knowing (all listed by `assumptions()`):
- Compute dtype of the weight matmuls: bf16/fp16/fp32 weights compute in their own format.
  fp8 (and fp4) weights compute natively (W8A8 / W4A4: activations quantised on the fly) when
  the profile lists a peak for that format (Hopper, Ada, Blackwell, MI300...); otherwise, and
  always for int8/int4, they are weight-only: the matmul runs in bf16 and each weight read
  pays DEQUANT_OPS_PER_WEIGHT vector (fp32-peak) operations, overlapping with the read.
- Weights are read once per step per layer, whatever the token count; activations in bf16
  (fp32 for fp32 models). Embedding and LM head stay unquantised, as in planner/memory.py.
- Pipeline parallelism: a step is one micro-batch flowing through every stage, so its time is
  the sum over stages (= every layer once, sharded by TP) plus (pp - 1) stage hand-offs.
  Overlap of several micro-batches in flight is not modelled.
- MoE: T tokens with top-k routing among E experts touch E(1 - (1 - k/E)^T) distinct experts
  in expectation (uniform routing); expert weight bytes scale with that, FLOPs with T x k.
  Expert-parallel all-to-all is not modelled separately (the TP all-reduces are charged).
- MLA (DeepSeek): absorbed formulation throughout; the KV latent is read once per token and
  is replicated on every TP rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, NamedTuple

from engine.config import ModelConfig, graph_batch_size
from engine.core.scheduler import SchedulerOutput
from engine.errors import InputError
from planner.memory import (
    SAMPLER_COPIES,
    WEIGHT_BYTES_PER_PARAM,
    check_parallelism,
    kv_bytes_per_token_per_layer_per_gpu,
)
from planner.specs import Deployment, HardwareProfile, Link

OPERATORS: tuple[str, ...] = (
    "qkv_proj",
    "o_proj",
    "attention",
    "mlp",
    "moe_experts",
    "router",
    "norms_elementwise",
    "lm_head",
    "sampling",
    "tp_allreduce",
    "pp_transfer",
    "overhead",
    "kernel_launch",
    "spec_draft",
)
"""Keys of `CostModel.breakdown()`, always all present (0.0 where an operator does not apply)."""
# Operators that run eagerly after a replayed graph (the graph holds the forward pass only).
_AFTER_GRAPH = (OPERATORS.index("lm_head"), OPERATORS.index("sampling"))

# Vector operations per weight element to dequantise a weight-only-quantised matrix (unpack,
# subtract zero, scale), run at the fp32 (non-tensor-core) peak; once per step per weight read.
DEQUANT_OPS_PER_WEIGHT = 4.0
# Bytes per token per layer of each norm, in units of hidden_size x activation bytes: the
# residual add is fused into the norm (read the hidden state and the residual, write both).
NORM_TRAFFIC = 4
LOGIT_BYTES = 4  # fp32 logits


class StepCost(NamedTuple):
    """One step on one GPU of the replica: its time and the work behind it (for MFU and bandwidth use)."""

    seconds: float
    flops: float
    bytes: float


NO_COST = StepCost(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class CostParams:
    """The tunable figures of the cost model; calibration fits them (e.g. with SciPy).

    Defaults come from the hardware profile (`CostParams.from_hardware`). Matmuls with few rows
    under-use the hardware: compute efficiency at T rows is
    compute_efficiency x (f + (1 - f) x T / (T + gemm_half_size_tokens)) with f =
    `gemm_efficiency_floor`, the share kept however few the rows (a GPU's tensor cores fall off
    towards 0; a CPU's small-M GEMM keeps a flat, low rate). gemm_half_size_tokens = 0 turns the
    falloff off.
    """

    compute_efficiency: float
    memory_efficiency: float
    attention_memory_efficiency: float
    interconnect_efficiency: float
    step_overhead_s: float
    layer_overhead_s: float = 0.0
    # Eager steps: the host issues kernels one by one, so an operator takes at least its kernels
    # x kernel_launch_s. Graph replays: graph_kernel_s per kernel, plus one launch.
    kernel_launch_s: float = 0.0
    graph_kernel_s: float = 0.0
    gemm_half_size_tokens: float = 0.0
    gemm_efficiency_floor: float = 0.0
    # "causal": the kernel skips masked (query, key) pairs and keys outside windows (FlashAttention,
    # the Triton kernels). "dense": it computes the whole masked score matrix of each prefill chunk
    # and pads a decode batch to its longest context (the engine's torch reference path on CPU).
    attention_pairs: Literal["causal", "dense"] = "causal"

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "memory_efficiency", "attention_memory_efficiency", "interconnect_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InputError(name, value, "must be in (0, 1]")
        for name in ("step_overhead_s", "layer_overhead_s", "gemm_half_size_tokens", "kernel_launch_s", "graph_kernel_s"):
            value = getattr(self, name)
            if not value >= 0.0:  # also rejects NaN
                raise InputError(name, value, "must be >= 0")
        if not 0.0 <= self.gemm_efficiency_floor <= 1.0:
            raise InputError("gemm_efficiency_floor", self.gemm_efficiency_floor, "must be in [0, 1]")
        if self.attention_pairs not in ("causal", "dense"):
            raise InputError("attention_pairs", self.attention_pairs, "allowed: causal, dense")

    @classmethod
    def from_hardware(cls, hw: HardwareProfile) -> CostParams:
        e = hw.efficiency
        return cls(
            compute_efficiency=e.compute,
            memory_efficiency=e.memory,
            attention_memory_efficiency=e.attention_memory,
            interconnect_efficiency=e.interconnect,
            step_overhead_s=e.step_overhead_us * 1e-6,
            kernel_launch_s=e.kernel_launch_us * 1e-6,
            graph_kernel_s=e.graph_kernel_us * 1e-6,
        )


def expected_distinct_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected number of distinct experts that `tokens` tokens touch with uniform top-k routing."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def gemm_compute_dtype(weight_dtype: str, hw: HardwareProfile) -> tuple[str, bool]:
    """(format the weight matmuls run in, whether weights are dequantised on the fly)."""
    if weight_dtype in ("bf16", "fp16", "fp32"):
        return hw.peak_flops(weight_dtype)[1], False
    if weight_dtype in ("fp8", "fp4") and hw.peak_flops(weight_dtype)[1] == weight_dtype:
        return weight_dtype, False  # W8A8 / W4A4 on tensor cores that have the format
    return hw.peak_flops("bf16")[1], True  # weight-only: bf16 math, dequantise each weight read


@dataclass
class _Sums:
    """One step, aggregated: everything the O(1) operator formulas need.

    Per group (0 decode, 1 prefill): tokens, and per attention-window class: causal
    (query, key) pairs and KV tokens read.
    """

    tokens: int
    sampled_rows: int
    group_tokens: list[float]
    pairs: list[list[float]]
    kv_read: list[list[float]]
    graph_batch: int | None = None  # set when the step replays a captured graph: the padded batch size


class CostModel:
    """Seconds per engine step of one replica of `dep` serving `model` on `hw`."""

    def __init__(
        self, model: ModelConfig, hw: HardwareProfile, dep: Deployment, calibration: CostParams | None = None
    ) -> None:
        check_parallelism(model, dep)
        self.model, self.hw, self.dep = model, hw, dep
        self.params = calibration if calibration is not None else CostParams.from_hardware(hw)
        p = self.params
        tp, pp = dep.tensor_parallel, dep.pipeline_parallel
        h, L = model.hidden_size, model.num_layers
        self._act = act = 4.0 if dep.weight_dtype == "fp32" else 2.0
        high_bytes = act  # embeddings and LM head stay unquantised (planner/memory.py)
        wbytes = WEIGHT_BYTES_PER_PARAM[dep.weight_dtype]

        # Peaks, dtypes and effective rates.
        self.gemm_dtype, self.dequant = gemm_compute_dtype(dep.weight_dtype, hw)
        self._gemm_peak = hw.peak_flops(self.gemm_dtype)[0]
        self._high_dtype = "fp32" if dep.weight_dtype == "fp32" else "bf16"
        self._high_peak, self._high_dtype_used = hw.peak_flops(self._high_dtype)
        self._vector_peak, self._vector_dtype = hw.peak_flops("fp32")
        bw = hw.memory_bandwidth_gb_s * 1e9
        self._bw_eff = bw * p.memory_efficiency
        self._attn_bw_eff = bw * p.attention_memory_efficiency
        self._ce = p.compute_efficiency
        self._half = p.gemm_half_size_tokens
        self._floor = p.gemm_efficiency_floor
        dq_rate = self._vector_peak * p.compute_efficiency
        dq = (DEQUANT_OPS_PER_WEIGHT / dq_rate) if self.dequant else 0.0  # seconds per weight element

        # Attention projections (all layers; biases, q/k norms and sinks ride with qkv).
        n = model.num_attention_heads
        if model.mla is not None:
            o_params = n * model.mla.v_head_dim * h
            q_out, o_in = n * (model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim), n * model.mla.v_head_dim
            qkv_out = q_out + model.mla.kv_lora_rank + model.mla.qk_rope_head_dim
        else:
            o_params = n * model.head_dim * h
            q_out = o_in = n * model.head_dim
            qkv_out = q_out + 2 * model.num_kv_heads * model.head_dim
        qkv_params = model.attention_params_per_layer() - o_params
        # Each op: (FLOPs per token, weight bytes, activation bytes per token, dequant seconds), all layers, per GPU.
        self._qkv = (2 * L * qkv_params / tp, L * qkv_params / tp * wbytes, L * (h + qkv_out / tp) * act, L * qkv_params / tp * dq)
        self._o = (2 * L * o_params / tp, L * o_params / tp * wbytes, L * (o_in / tp + h) * act, L * o_params / tp * dq)

        n_moe = model.num_moe_layers
        n_dense = L - n_moe
        inter = model.intermediate_size
        mlp_params = model.dense_mlp_params()
        self._mlp = (
            2 * n_dense * mlp_params / tp,
            n_dense * mlp_params / tp * wbytes,
            n_dense * (2 * h + 3 * inter / tp) * act,
            n_dense * mlp_params / tp * dq,
        )
        self._n_moe = n_moe
        if model.moe is not None and n_moe:
            m = model.moe
            ep = model.expert_params()
            self._experts, self._top_k = m.num_experts, m.top_k
            # Per distinct expert touched: weight bytes and dequant seconds; per token: FLOPs and activations.
            self._expert_w = n_moe * ep / tp * wbytes
            self._expert_dq = n_moe * ep / tp * dq
            self._expert_fpt = 2 * n_moe * m.top_k * ep / tp
            self._expert_apt = n_moe * (2 * h + 3 * m.top_k * m.expert_intermediate_size / tp) * act
            shared = m.num_shared_experts * 3 * h * m.shared_expert_intermediate_size
            self._shared = (
                2 * n_moe * shared / tp,
                n_moe * shared / tp * wbytes,
                n_moe * (2 * h + 3 * m.num_shared_experts * m.shared_expert_intermediate_size / tp) * act,
                n_moe * shared / tp * dq,
            )
            router = h * m.num_experts + (m.num_experts if m.router_bias else 0)
            # The router is replicated on every rank and kept in high precision.
            self._router = (2 * n_moe * router, n_moe * router * high_bytes, n_moe * (h * act + m.num_experts * LOGIT_BYTES), 0.0)
        else:
            self._experts = self._top_k = 0
            self._expert_w = self._expert_dq = self._expert_fpt = self._expert_apt = 0.0
            self._shared = self._router = (0.0, 0.0, 0.0, 0.0)

        # Attention core: window classes (None = full), causal-pair FLOPs and KV bytes per GPU.
        classes: dict[int | None, int] = {}
        for w in model.layer_windows:
            classes[w] = classes.get(w, 0) + 1
        self._windows: tuple[int | None, ...] = tuple(classes)
        self._window_layers: tuple[int, ...] = tuple(classes.values())
        per_position = model.attention_flops_per_token(1) / L  # all heads, one (query, key) pair, one layer
        self._pair_flops = per_position / tp
        self._kv_tok = kv_bytes_per_token_per_layer_per_gpu(model, dep)
        # New K/V written plus Q read and output written, per token, all layers.
        self._attn_apt = L * (self._kv_tok + (q_out + o_in) / tp * act)
        self._attn_rate = self._high_peak * p.compute_efficiency

        # Elementwise: norms with fused residual adds, embedding gather, final norm (memory-bound, replicated).
        self._elem_bpt = ((L * model.norms_per_layer + 1) * NORM_TRAFFIC * h + h) * act

        # LM head (vocab-parallel, unquantised) and sampling, per sampled row.
        V = model.vocab_size
        self._lm = (2 * V * h / tp, V * h / tp * high_bytes, h * act + V / tp * LOGIT_BYTES, 0.0)
        self._sample_bpr = V * LOGIT_BYTES * SAMPLER_COPIES

        # Communication.
        self.tp_link = _pick_link(hw, tp, "tensor_parallel") if tp > 1 else None
        self.pp_link = _pick_link(hw, dep.gpus_per_replica, "pipeline_parallel") if pp > 1 else None
        ie = p.interconnect_efficiency
        if self.tp_link is not None:
            ring = 2 * (tp - 1) / tp
            self._ar_bpt = 2 * L * ring * h * act / (self.tp_link.bandwidth_gb_s * 1e9 * ie)
            self._ar_fixed = 2 * L * 2 * (tp - 1) * self.tp_link.latency_us * 1e-6
        else:
            self._ar_bpt = self._ar_fixed = 0.0
        if self.pp_link is not None:
            self._pp_bpt = (pp - 1) * h * act / (self.pp_link.bandwidth_gb_s * 1e9 * ie)
            self._pp_fixed = (pp - 1) * self.pp_link.latency_us * 1e-6
        else:
            self._pp_bpt = self._pp_fixed = 0.0
        self._overhead = p.step_overhead_s + p.layer_overhead_s * L

        # Kernels each operator launches per step in the engine's CUDA path (engine/model): one GEMM
        # per projection; rotary, KV write and attention; gate_up, SwiGLU, down; a fused add+norm per
        # norm plus the final norm and the embedding gather; routed experts: gather, two grouped GEMMs,
        # SwiGLU (and a shared expert's three); router: GEMM and top-k; sampling: softmax, draw, copy out.
        shared_kernels = 3 if model.moe is not None and model.moe.num_shared_experts else 0
        self._kernels = (  # in OPERATORS order, qkv_proj .. pp_transfer
            L, L, 3 * L, 3 * n_dense, (4 + shared_kernels) * n_moe, 2 * n_moe,
            L * (model.norms_per_layer + (2 if model.qk_norm else 0)) + 2, 1, 3,
            2 * L if tp > 1 else 0, 2 * (pp - 1),
        )
        # The captured graph holds the forward pass (all but the LM head and sampling); decode-only
        # steps of at most max_graph_batch_size requests replay it, padded to a captured size.
        knobs = dep.knobs  # the engine captures sizes up to its largest possible batch
        graph_max = min(knobs.max_graph_batch_size, knobs.max_num_seqs)
        self._graph_max = graph_max if hw.graph_capture and not knobs.enforce_eager else 0

        # Speculative decoding: the drafts' verification is already in the token counts (drafts
        # are tokens of the step); what remains is proposing them. n-gram lookup costs ~nothing;
        # a draft model (or the target's first draft_layers layers, self-speculative) runs one
        # forward pass per draft position, costed by a CostModel of the draft itself.
        spec = dep.knobs.speculative
        self._draft_model: CostModel | None = None
        if spec is not None and spec.method != "ngram":
            if spec.method == "self":
                assert spec.draft_layers is not None  # SpeculativeSettings requires it
                draft_config = model.first_layers(spec.draft_layers)
            else:
                from engine.catalog import resolve_model  # torch-free; only needed for draft models

                assert spec.draft_model is not None
                draft_config = resolve_model(spec.draft_model)
            plain = dep.model_copy(update={"knobs": dep.knobs.model_copy(update={"speculative": None})})
            self._draft_model = CostModel(draft_config, hw, plain, calibration)

    # ------------------------------------------------------------------ public API

    def step_time(self, output: SchedulerOutput) -> float:
        """Seconds for one engine step of one replica (0.0 for an empty step)."""
        return self.step(output).seconds

    def step(self, output: SchedulerOutput) -> StepCost:
        """Seconds, FLOPs and bytes of one engine step, per GPU of the replica."""
        if not output.scheduled:
            return NO_COST
        times, flops, nbytes = self._times(self._aggregate(output), self._draft_cost(output))
        return StepCost(sum(times), flops, nbytes)

    def breakdown(self, output: SchedulerOutput) -> dict[str, float]:
        """Seconds per operator (keys: OPERATORS); the values sum to step_time(output)."""
        if not output.scheduled:
            return dict.fromkeys(OPERATORS, 0.0)
        return dict(zip(OPERATORS, self._times(self._aggregate(output), self._draft_cost(output))[0], strict=True))

    def decode_time_per_token_s(self, batch: int, context: int) -> float:
        """One decode step of `batch` requests, each with `context` tokens already cached."""
        return sum(self._times(self._synthetic([(1, context, False)] * batch))[0])

    def decode_breakdown(self, batch: int, context: int) -> dict[str, float]:
        return dict(zip(OPERATORS, self._times(self._synthetic([(1, context, False)] * batch))[0], strict=True))

    def prefill_time_s(self, tokens: int, cached: int = 0) -> float:
        """One step prefilling `tokens` prompt tokens of one request (after `cached` cached ones) and sampling."""
        return sum(self._times(self._synthetic([(tokens, cached, True)]))[0])

    def prefill_breakdown(self, tokens: int, cached: int = 0) -> dict[str, float]:
        return dict(zip(OPERATORS, self._times(self._synthetic([(tokens, cached, True)]))[0], strict=True))

    def decode_cost(self, batch: int, context: int) -> StepCost:
        """Seconds, FLOPs and bytes (per GPU) of the decode step of decode_time_per_token_s: for rooflines."""
        times, flops, nbytes = self._times(self._synthetic([(1, context, False)] * batch))
        return StepCost(sum(times), flops, nbytes)

    def prefill_cost(self, tokens: int, cached: int = 0) -> StepCost:
        """Seconds, FLOPs and bytes (per GPU) of the prefill step of prefill_time_s: for rooflines."""
        times, flops, nbytes = self._times(self._synthetic([(tokens, cached, True)]))
        return StepCost(sum(times), flops, nbytes)

    def assumptions(self) -> dict[str, object]:
        """Every figure the model uses, for reports."""
        dep, hw, model = self.dep, self.hw, self.model

        def link(lk: Link | None) -> dict[str, object] | None:
            return None if lk is None else {"name": lk.name, "bandwidth_gb_s": lk.bandwidth_gb_s, "latency_us": lk.latency_us}

        notes = [
            "roofline per operator: max(FLOPs / (peak x compute_eff), bytes / (bandwidth x memory_eff)), summed over layers",
            "weights read once per step per layer; activations in "
            + ("fp32" if self._act == 4.0 else "bf16")
            + "; embedding and LM head unquantised",
            "fp8/fp4 weights compute natively when the hardware lists a peak for the format (W8A8/W4A4); otherwise, "
            f"and for int8/int4, weight-only: bf16 math plus {DEQUANT_OPS_PER_WEIGHT:g} vector ops per weight read",
            "attention: causal pairs q x (cached + (q+1)/2) per request and layer, capped by sliding windows; "
            "K/V of the context read once per request and layer at attention_memory efficiency; decode and "
            "prefill requests are separate rooflines",
            "LM head and sampling only for rows that sample (1 + draft tokens per sampling request); "
            f"sampler reads fp32 logits {SAMPLER_COPIES} times",
            "TP: two ring all-reduces per layer of tokens x hidden activations: "
            "2(n-1)/n x size / (link bw x interconnect_eff) + 2(n-1) x latency",
            "PP: a step is one micro-batch through every stage in turn (sum over stages) plus (pp-1) hand-offs; "
            "overlap of micro-batches in flight is not modelled",
            f"norms: residual add fused, {NORM_TRAFFIC} x hidden x activation bytes per norm per token",
            "an empty step costs 0 s",
            (f"decode-only steps of <= {self._graph_max} requests replay a captured graph: batch padded to the captured "
             "size (1, 2, 4, multiples of 8) for the dense operators, graph_kernel_s per kernel plus one launch; "
             "LM head, sampling and every other step run eagerly, each operator taking at least its kernels x "
             "kernel_launch_s")
            if self._graph_max else
            ("every step runs eagerly (" + ("enforce_eager" if self.hw.graph_capture else f"{self.hw.name} has no graph capture")
             + "): each operator takes at least its kernels x kernel_launch_s"),
        ]
        if model.is_moe:
            notes.append(
                "MoE: distinct experts touched by T tokens = E(1-(1-k/E)^T) (uniform routing) sets expert weight "
                "bytes; FLOPs scale with T x k; router replicated and unquantised; EP all-to-all not modelled"
            )
        if model.mla is not None:
            notes.append("MLA: absorbed formulation; the KV latent is replicated on every TP rank; projections split over TP")
        spec = dep.knobs.speculative
        if spec is not None:
            notes.append(
                f"speculative ({spec.method}, k={spec.num_speculative_tokens}): drafts are verified as extra decode tokens "
                "and LM-head rows of the step; proposing them costs "
                + ("nothing (n-gram lookup)" if self._draft_model is None else
                   f"one forward pass of {self._draft_model.model.name} per draft position (operator spec_draft)")
            )
        out: dict[str, object] = {
            "model": model.name or model.model_type,
            "hardware": hw.name,
            "tensor_parallel": dep.tensor_parallel,
            "pipeline_parallel": dep.pipeline_parallel,
            "expert_parallel": dep.expert_parallel,
            "weight_dtype": dep.weight_dtype,
            "weight_bytes_per_param": WEIGHT_BYTES_PER_PARAM[dep.weight_dtype],
            "kv_dtype": dep.kv_dtype,
            "kv_bytes_per_token_per_layer_per_gpu": self._kv_tok,
            "activation_bytes": self._act,
            "gemm_compute_dtype": self.gemm_dtype,
            "gemm_peak_tflops": self._gemm_peak / 1e12,
            "weight_only_dequant": self.dequant,
            "graph_capture": bool(self._graph_max),
            "max_graph_batch_size": self._graph_max,
            "dequant_ops_per_weight": DEQUANT_OPS_PER_WEIGHT if self.dequant else 0.0,
            "vector_peak_tflops": self._vector_peak / 1e12,
            "attention_and_lm_head_dtype": self._high_dtype_used,
            "attention_peak_tflops": self._high_peak / 1e12,
            "memory_bandwidth_gb_s": hw.memory_bandwidth_gb_s,
            **asdict(self.params),
            "tp_link": link(self.tp_link),
            "pp_link": link(self.pp_link),
            "notes": notes,
        }
        return out

    # ------------------------------------------------------------------ internals

    def _aggregate(self, output: SchedulerOutput) -> _Sums:
        if self.params.attention_pairs == "dense":
            return self._aggregate_dense(
                (len(r.token_ids), r.num_computed_tokens, r.is_prefill, 1 + r.num_draft_tokens if r.samples else 0)
                for r in output.scheduled
            )
        windows = self._windows
        sampled = 0
        if len(windows) == 1 and windows[0] is None:  # fast path: every layer attends to the full context
            d_tok = d_pairs = d_kv = p_tok = p_pairs = p_kv = 0.0
            for s in output.scheduled:
                q = len(s.token_ids)
                c = s.num_computed_tokens
                if s.is_prefill:
                    p_tok += q
                    p_pairs += q * (c + (q + 1) * 0.5)
                    p_kv += c + q
                else:
                    d_tok += q
                    d_pairs += q * (c + (q + 1) * 0.5)
                    d_kv += c + q
                if s.samples:
                    sampled += 1 + s.num_draft_tokens
            return _Sums(int(d_tok + p_tok), sampled, [d_tok, p_tok], [[d_pairs], [p_pairs]], [[d_kv], [p_kv]],
                         self._graph_batch(int(d_tok), p_tok, len(output.scheduled)))
        nw = len(windows)
        g_tokens = [0.0, 0.0]
        pairs = [[0.0] * nw, [0.0] * nw]
        kv = [[0.0] * nw, [0.0] * nw]
        for s in output.scheduled:
            q = len(s.token_ids)
            c = s.num_computed_tokens
            if s.samples:
                sampled += 1 + s.num_draft_tokens
            g = 1 if s.is_prefill else 0
            g_tokens[g] += q
            mean_ctx = c + (q + 1) * 0.5
            pg, kg = pairs[g], kv[g]
            for j, w in enumerate(windows):
                if w is None:
                    pg[j] += q * mean_ctx
                    kg[j] += c + q
                else:
                    pg[j] += q * min(mean_ctx, w)
                    kg[j] += min(c + q, w)
        return _Sums(int(g_tokens[0] + g_tokens[1]), sampled, g_tokens, pairs, kv,
                     self._graph_batch(int(g_tokens[0]), g_tokens[1], len(output.scheduled)))

    def _aggregate_dense(self, shapes: Iterable[tuple[int, int, bool, int]]) -> _Sums:
        """Pairs and KV reads of a kernel that neither skips masked pairs nor honours windows:
        each prefill chunk attends to its whole context, every decode to the batch's longest.
        `shapes`: (query tokens, cached tokens, is_prefill, sampled rows) per request."""
        sampled = 0
        d_count = d_max = d_requests = 0
        p_tok = p_pairs = p_kv = 0.0
        for q, cached, prefill, rows in shapes:
            ctx = cached + q
            sampled += rows
            d_requests += not prefill
            if prefill:
                p_tok += q
                p_pairs += q * ctx
                p_kv += ctx
            else:
                d_count += q
                d_max = max(d_max, ctx)
        padded = float(d_count * d_max)
        nw = len(self._windows)
        return _Sums(int(d_count + p_tok), sampled, [float(d_count), p_tok],
                     [[padded] * nw, [p_pairs] * nw], [[padded] * nw, [p_kv] * nw],
                     self._graph_batch(d_count, p_tok, d_requests))

    def _synthetic(self, requests: list[tuple[int, int, bool]]) -> _Sums:
        """Sums for (query tokens, cached tokens, is_prefill) requests that all sample."""
        if not requests or any(q < 1 or c < 0 for q, c, _ in requests):
            raise InputError("tokens", requests[:1], "need at least one request with >= 1 token and >= 0 cached")
        if self.params.attention_pairs == "dense":
            return self._aggregate_dense((q, c, prefill, 1) for q, c, prefill in requests)
        nw = len(self._windows)
        sums = _Sums(0, 0, [0.0, 0.0], [[0.0] * nw, [0.0] * nw], [[0.0] * nw, [0.0] * nw])
        for q, c, prefill in requests:
            sums.tokens += q
            sums.sampled_rows += 1
            g = 1 if prefill else 0
            sums.group_tokens[g] += q
            mean_ctx = c + (q + 1) * 0.5
            for j, w in enumerate(self._windows):
                sums.pairs[g][j] += q * (mean_ctx if w is None else min(mean_ctx, w))
                sums.kv_read[g][j] += c + q if w is None else min(c + q, w)
        sums.graph_batch = self._graph_batch(int(sums.group_tokens[0]), sums.group_tokens[1], len(requests))
        return sums

    def _graph_batch(self, decode_tokens: int, prefill_tokens: float, requests: int) -> int | None:
        """The captured size a step is padded to when it replays a graph: decode-only, one token
        per request (speculative steps run eagerly, as in the engine), within max_graph_batch_size."""
        if prefill_tokens or decode_tokens != requests:
            return None
        return graph_batch_size(requests, self._graph_max)

    def _launch_time(self, times: Sequence[float], graph_batch: int | None) -> float:
        """Seconds the device waits on kernel launches beyond the operators' own times: eagerly, each
        operator takes at least its kernels x kernel_launch_s (the host issues them while the device
        works); a replayed graph costs graph_kernel_s per kernel of the forward pass and one launch."""
        p = self.params
        if graph_batch is None and not p.kernel_launch_s:  # CPUs: nothing to add, keep the simulator's hot path lean
            return 0.0
        eager = range(len(self._kernels)) if graph_batch is None else _AFTER_GRAPH
        wait = sum(max(0.0, self._kernels[i] * p.kernel_launch_s - times[i]) for i in eager)
        if graph_batch is not None:
            in_graph = sum(self._kernels) - sum(self._kernels[i] for i in _AFTER_GRAPH)
            wait += in_graph * p.graph_kernel_s + p.kernel_launch_s
        return wait

    def _gemm(self, tokens: float, op: tuple[float, float, float, float], peak: float, work: list[float]) -> float:
        """Roofline time of one matmul operator; adds its FLOPs and bytes to `work`."""
        fpt, wb, apt, dq = op
        if wb == 0.0 and fpt == 0.0:
            return 0.0
        flops, nbytes = fpt * tokens, wb + apt * tokens
        work[0] += flops
        work[1] += nbytes
        eff = self._gemm_efficiency(tokens)
        return max(flops / (peak * eff) + dq, nbytes / self._bw_eff)

    def _draft_cost(self, output: SchedulerOutput) -> StepCost:
        """Proposing this step's drafts with a draft model: draft pass j feeds one token of each
        request that has more than j drafts, over its context so far (engine/spec/draft.py)."""
        draft = self._draft_model
        if draft is None:
            return NO_COST
        with_drafts = [(s.num_draft_tokens, s.num_computed_tokens) for s in output.scheduled if s.num_draft_tokens]
        seconds = flops = nbytes = 0.0
        for j in range(max((d for d, _ in with_drafts), default=0)):
            times, f, b = draft._times(draft._synthetic([(1, c + j, False) for d, c in with_drafts if d > j]))
            seconds, flops, nbytes = seconds + sum(times), flops + f, nbytes + b
        return StepCost(seconds, flops, nbytes)

    def _gemm_efficiency(self, rows: float) -> float:
        if not self._half:
            return self._ce
        floor = self._floor
        return self._ce * (floor + (1.0 - floor) * rows / (rows + self._half))

    def _times(self, s: _Sums, draft: StepCost = NO_COST) -> tuple[tuple[float, ...], float, float]:
        """(seconds per operator in OPERATORS order, FLOPs, bytes moved), per GPU; `draft` is the
        step's draft-model cost, reported as its own operator."""
        # A replayed graph runs its padded batch through every dense operator; attention, the LM
        # head and sampling see only the real requests (padding rows attend to one key).
        T = s.graph_batch or s.tokens
        peak = self._gemm_peak
        work = [draft.flops, draft.bytes]
        qkv = self._gemm(T, self._qkv, peak, work)
        o = self._gemm(T, self._o, peak, work)
        mlp = self._gemm(T, self._mlp, peak, work)

        moe = router = 0.0
        if self._n_moe:
            touched = expected_distinct_experts(self._experts, self._top_k, T)
            per_expert = T * self._top_k / touched
            eff = self._gemm_efficiency(per_expert)
            flops, nbytes = self._expert_fpt * T, touched * self._expert_w + self._expert_apt * T
            work[0] += flops
            work[1] += nbytes
            moe = max(flops / (peak * eff) + touched * self._expert_dq, nbytes / self._bw_eff)
            moe += self._gemm(T, self._shared, peak, work)
            router = self._gemm(T, self._router, self._high_peak, work)

        attention = 0.0
        for g in (0, 1):
            tg = s.group_tokens[g]
            if not tg:
                continue
            pairs = kv = 0.0
            for j, n_layers in enumerate(self._window_layers):
                pairs += n_layers * s.pairs[g][j]
                kv += n_layers * s.kv_read[g][j]
            flops, nbytes = pairs * self._pair_flops, kv * self._kv_tok + tg * self._attn_apt
            work[0] += flops
            work[1] += nbytes
            attention += max(flops / self._attn_rate, nbytes / self._attn_bw_eff)

        rows = s.sampled_rows
        lm_head = self._gemm(rows, self._lm, self._high_peak, work) if rows else 0.0
        elementwise_bytes, sampling_bytes = T * self._elem_bpt, rows * self._sample_bpr
        work[1] += elementwise_bytes + sampling_bytes
        elementwise = elementwise_bytes / self._bw_eff
        sampling = sampling_bytes / self._bw_eff
        allreduce = T * self._ar_bpt + self._ar_fixed
        pp = T * self._pp_bpt + self._pp_fixed
        times = (qkv, o, attention, mlp, moe, router, elementwise, lm_head, sampling, allreduce, pp)
        launch = self._launch_time(times, s.graph_batch)
        return (*times, self._overhead, launch, draft.seconds), work[0], work[1]


def _pick_link(hw: HardwareProfile, devices: int, field: str) -> Link:
    """Scale-up link when the group fits its domain, else scale-out; PCIe-only cards use PCIe."""
    if hw.scale_up is not None and devices <= hw.scale_up.domain_size:
        return hw.scale_up
    if hw.scale_up is None and hw.pcie is not None and devices <= hw.pcie.domain_size:
        return hw.pcie
    if hw.scale_out is not None:
        return hw.scale_out
    raise InputError(field, devices, f"{hw.name} has no interconnect that reaches {devices} devices")


__all__ = [
    "OPERATORS",
    "CostModel",
    "CostParams",
    "StepCost",
    "expected_distinct_experts",
    "gemm_compute_dtype",
    "DEQUANT_OPS_PER_WEIGHT",
]
