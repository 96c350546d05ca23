"""The named operators of one engine step, each with its FLOPs, bytes and kernels per step.

Every figure is per GPU of the replica and summed over the layers it runs in (identical layers
have identical rooflines, so the sum over layers is the roofline of the summed work). Kernel
counts follow the engine's CUDA path (engine/model): one GEMM per projection; rotary, KV write
and attention; gate_up, SwiGLU, down; a fused add+norm per norm plus the final norm and the
embedding gather; routed experts: gather, two grouped GEMMs, SwiGLU (and a shared expert's
three); router: GEMM and top-k; sampling: softmax, draw, copy out.

Communication is a list of `Comm`: which collective, over how many ranks, how often per step and
how many bytes per row of the step, each named by the breakdown operator it adds to. Where the
engines put each collective (and where the figures come from) is said at each one below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.config import ModelConfig
from planner.engines import get_engine
from planner.memory import (SAMPLER_COPIES, WEIGHT_BYTES_PER_PARAM, attention_params_per_rank,
                            kv_bytes_per_token_per_layer_per_gpu, mxfp4_layout, quantises_experts_only)
from planner.specs import Collective, Deployment, HardwareProfile

# Vector operations per weight element to dequantise a weight-only-quantised matrix (unpack,
# subtract zero, scale), run at the fp32 (non-tensor-core) peak; once per step per weight read.
DEQUANT_OPS_PER_WEIGHT = 4.0
# Bytes per token per layer of each norm, in units of hidden_size x activation bytes: the
# residual add is fused into the norm (read the hidden state and the residual, write both).
NORM_TRAFFIC = 4
LOGIT_BYTES = 4  # fp32 logits


@dataclass(frozen=True)
class Gemm:
    """A weight matmul over the step's rows."""

    flops_per_row: float
    weight_bytes: float  # read once per step, whatever the rows
    act_bytes_per_row: float
    dequant_ops: float  # vector ops per step to dequantise weight-only formats (0 otherwise)
    kernels: float
    high_precision: bool = False  # runs at the unquantised peak (LM head, router)
    # Share of the step's rows one GPU runs through it: 1/dp for attention projections under
    # data-parallel attention (each group has its own requests).
    row_share: float = 1.0

    @property
    def present(self) -> bool:
        return bool(self.flops_per_row or self.weight_bytes)


@dataclass(frozen=True)
class Experts:
    """Routed experts: the tokens' top-k choices touch some of the E experts, whose weights are read."""

    num_experts: int
    top_k: int
    flops_per_row: float  # all top_k experts of one token
    bytes_per_expert: float  # one expert's weights, all MoE layers
    act_bytes_per_row: float
    dequant_ops_per_expert: float
    kernels: float
    # Expert-parallel ranks, each holding num_experts / ranks whole experts: a layer's experts end
    # when the busiest rank does (model.busiest_rank_factors). 1: every rank holds a slice of each.
    ranks: int = 1
    # Stored as 4-bit floats (MXFP4), run by the engine's MXFP4 MoE kernel (fp4_moe_kernel_efficiency).
    fp4: bool = False


@dataclass(frozen=True)
class Attention:
    flops_per_pair: float  # one (query, key) pair of a decode, one layer, on one GPU's share of it
    prefill_flops_per_pair: float  # the same for a prefill (MLA: the expanded form, see `operators`)
    kv_bytes_per_token: float  # one token's K/V in one layer, one GPU's share of the replica's cache
    act_bytes_per_row: float  # new K/V written, Q read, output written: all layers
    kernels: float
    # Context parallelism: each GPU computes 1/cp of every (query, key) pair, and a prefill's
    # chunk reads all of its keys (gathered) though each GPU stores only 1/cp of them.
    prefill_kv_reads: float = 1.0


@dataclass(frozen=True)
class Comm:
    """A collective of every step: `calls` calls, each of rows x bytes_per_row + fixed_bytes payload
    bytes (nccl-tests' size), where rows are the step's `rows` kind; its time adds to `operator`."""

    operator: Literal["tp_allreduce", "tp_gather", "ep_alltoall", "cp_transfer"]
    collective: Collective
    ranks: int
    calls: float
    bytes_per_row: float
    rows: Literal["dense", "sampled", "prefill", "decode"] = "dense"
    fixed_bytes: float = 0.0


@dataclass(frozen=True)
class Operators:
    qkv_proj: Gemm
    o_proj: Gemm
    mlp: Gemm
    shared_experts: Gemm
    experts: Experts | None
    router: Gemm
    lm_head: Gemm
    attention: Attention
    norm_bytes_per_row: float
    norm_kernels: float
    sample_bytes_per_row: float
    sample_kernels: float
    comms: tuple[Comm, ...]
    pp_bytes_per_row: float
    pp_handoffs: int
    layers: int
    prefill_row_share: float = 1.0  # context parallelism: a GPU runs 1/cp of the prefill tokens

    @property
    def graph_kernels(self) -> float:
        """Kernels of the forward pass a captured graph holds (all but the LM head and sampling)."""
        layer_ops = (self.qkv_proj, self.o_proj, self.mlp, self.shared_experts, self.router)
        experts = self.experts.kernels if self.experts is not None else 0.0
        return sum(g.kernels for g in layer_ops) + experts + self.attention.kernels + self.norm_kernels


def build_operators(model: ModelConfig, dep: Deployment, hw: HardwareProfile) -> Operators:
    """The operators of `model` served as `dep` on `hw`, per GPU (tensor-parallel shards; every layer once,
    pipeline stages in turn; attention groups and context-parallel ranks each their share)."""
    tp, pp, dp, cp = dep.tensor_parallel, dep.pipeline_parallel, dep.attention_data_parallel, dep.context_parallel
    attn_tp = tp // dp  # the GPUs one attention group splits its heads over
    h, L = model.hidden_size, model.num_layers
    act = 4.0 if dep.weight_dtype == "fp32" else 2.0
    high = act  # embeddings, LM head and router stay unquantised (planner/memory/weights.py)
    wbytes = WEIGHT_BYTES_PER_PARAM[dep.weight_dtype]

    def gemm(params: float, in_dim: float, out_dim: float, layers: int, kernels: float, shards: int = tp,
             row_share: float = 1.0, unquantised: bool = False) -> Gemm:
        per_rank = layers * params / shards
        return Gemm(2 * per_rank, per_rank * (high if unquantised else wbytes), layers * (in_dim + out_dim) * act,
                    0.0 if unquantised else per_rank * DEQUANT_OPS_PER_WEIGHT, kernels, high_precision=unquantised,
                    row_share=row_share)

    n = model.num_attention_heads
    if model.mla is not None:
        m = model.mla
        o_params = n * m.v_head_dim * h
        q_out, o_in = n * (m.qk_nope_head_dim + m.qk_rope_head_dim), n * m.v_head_dim
        qkv_out = q_out + m.kv_lora_rank + m.qk_rope_head_dim
        # Engines decode MLA absorbed (scores and values over the latent: FlashMLA, SGLang's MLA
        # path) but prefill it expanded: K and V up-projected per head, scores over the qk head
        # dims, values over v_head_dim (vLLM's MLACommonImpl prefill, SGLang's MHA extend path,
        # TensorRT-LLM's context phase), 3.4x fewer FLOPs per pair for DeepSeek-V3. The
        # up-projection of the new tokens costs what absorbing it into their queries does.
        prefill_pair = 2.0 * n * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    else:
        o_params = n * model.head_dim * h
        q_out = o_in = n * model.head_dim
        qkv_out = q_out + 2 * model.num_kv_heads * model.head_dim
        prefill_pair = model.attention_flops_per_token(1) / L
    # A rank holds the attention projections as the memory model lays them out: MLA's down-projections and the
    # KV heads past their count on every rank, the rest split; qkv is what it holds beside o_proj's shard.
    qkv_per_rank = attention_params_per_rank(model, attn_tp) - o_params / attn_tp
    experts_only = quantises_experts_only(model, dep)  # attention then stays unquantised

    n_moe = model.num_moe_layers
    n_dense = L - n_moe
    inter = model.intermediate_size
    experts = None
    shared = router = Gemm(0.0, 0.0, 0.0, 0.0, 0.0)
    if model.moe is not None and n_moe:
        mo = model.moe
        # One expert's weights on one rank, as its kernel holds them: an engine's MXFP4 kernel pads them
        # (vLLM's Marlin and FlashInfer), and it streams and multiplies the padding too.
        expert_params: float
        if experts_only:
            layout = mxfp4_layout(get_engine(dep.engine), hw)
            expert_params = sum(layout.expert_values(h, mo.expert_intermediate_size // tp, mo.expert_bias))
            expert_bytes = layout.expert_bytes(h, mo.expert_intermediate_size // tp, mo.expert_bias)
        else:
            expert_params = model.expert_params() / tp
            expert_bytes = expert_params * wbytes
        experts = Experts(mo.num_experts, mo.top_k, 2 * n_moe * mo.top_k * expert_params, n_moe * expert_bytes,
                          n_moe * (2 * h + 3 * mo.top_k * mo.expert_intermediate_size / tp) * act,
                          n_moe * expert_params * DEQUANT_OPS_PER_WEIGHT, 4 * n_moe, dep.expert_parallel, experts_only)
        if mo.num_shared_experts:
            size = mo.num_shared_experts * mo.shared_expert_intermediate_size
            shared = gemm(3 * h * size, 2 * h, 3 * size / tp, n_moe, 3 * n_moe)
        router_params = h * mo.num_experts + (mo.num_experts if mo.router_bias else 0)
        # Replicated on every rank and unquantised; where tokens go to their experts by all-to-all, each
        # rank routes only the tokens it dispatches.
        router = Gemm(2 * n_moe * router_params, n_moe * router_params * high,
                      n_moe * (h * act + mo.num_experts * LOGIT_BYTES), 0.0, 2 * n_moe, high_precision=True,
                      row_share=1 / dep.expert_parallel if dispatches_by_all_to_all(dep) else 1.0)

    V = model.vocab_size
    kv_tok = kv_bytes_per_token_per_layer_per_gpu(model, dep)  # what one GPU stores of a replica's token
    return Operators(
        qkv_proj=gemm(qkv_per_rank, h, qkv_out / attn_tp, L, L, 1, 1 / dp, unquantised=experts_only),
        o_proj=gemm(o_params, o_in / attn_tp, h, L, L, attn_tp, 1 / dp, unquantised=experts_only),
        mlp=gemm(model.dense_mlp_params(), 2 * h, 3 * inter / tp, n_dense, 3 * n_dense),
        shared_experts=shared,
        experts=experts,
        router=router,
        lm_head=Gemm(2 * V * h / tp, V * h / tp * high, h * act + V / tp * LOGIT_BYTES, 0.0, 1, high_precision=True),
        attention=Attention(model.attention_flops_per_token(1) / L / tp / cp, prefill_pair / tp / cp, kv_tok,
                            L * (kv_tok + (q_out + o_in) / tp * act), 3 * L, prefill_kv_reads=cp),
        norm_bytes_per_row=((L * model.norms_per_layer + 1) * NORM_TRAFFIC * h + h) * act,
        norm_kernels=L * (model.norms_per_layer + (2 if model.qk_norm else 0)) + 2,
        sample_bytes_per_row=V * LOGIT_BYTES * SAMPLER_COPIES,
        sample_kernels=3,
        comms=_comms(model, dep, act, kv_tok * cp, o_in),
        pp_bytes_per_row=h * act if pp > 1 else 0.0,
        pp_handoffs=pp - 1,
        layers=L,
        prefill_row_share=1 / cp,
    )


def dispatches_by_all_to_all(dep: Deployment) -> bool:
    """Expert parallelism sends tokens to their experts by all-to-all where the tokens differ between
    ranks (data-parallel attention: DeepEP in SGLang, vLLM's all2all backends) or where the engine
    does so anyway (ServePlan's: engine/parallel/moe.py); otherwise each rank runs its experts on the
    replicated tokens and the layer's all-reduce sums them, as vLLM's FusedMoE does."""
    return dep.expert_parallel > 1 and (
        dep.attention_data_parallel > 1 or get_engine(dep.engine).execution.expert_dispatch == "all_to_all")


def _comms(model: ModelConfig, dep: Deployment, act: float, kv_tok: float, o_in: int) -> tuple[Comm, ...]:
    """Every collective of a step, as the engines place them. `kv_tok`: one token's K/V in one layer
    on one GPU before context parallelism splits the tokens."""
    tp, dp, ep, cp = dep.tensor_parallel, dep.attention_data_parallel, dep.expert_parallel, dep.context_parallel
    attn_tp = tp // dp
    h, L, V = model.hidden_size, model.num_layers, model.vocab_size
    n_moe = model.num_moe_layers
    a2a_layers = n_moe if dispatches_by_all_to_all(dep) else 0
    comms: list[Comm] = []
    if tp > 1:
        # Megatron-LM's layout: o_proj and down_proj (or the MoE output) are row-parallel, each followed
        # by an all-reduce; the vocabulary-parallel embedding all-reduces once; the LM head gathers
        # each sampled row's logits (vLLM's LogitsProcessor, engine/parallel/layers.py).
        if dp == 1:
            comms.append(Comm("tp_allreduce", "all_reduce", tp, 2 * L + 1 - a2a_layers, h * act))
        else:
            # SGLang's data-parallel attention: a group all-reduces inside itself after attention; before
            # each MLP every group's tokens are gathered (an all-reduce over a zero-padded buffer of all
            # tokens, dp_attention.py _dp_gather_via_all_reduce), and the MLP's output all-reduces over
            # all GPUs before each group takes its tokens back.
            if attn_tp > 1:
                comms.append(Comm("tp_allreduce", "all_reduce", attn_tp, L + 1, h * act / dp))
            comms.append(Comm("tp_allreduce", "all_reduce", tp, 2 * (L - a2a_layers), h * act))
        comms.append(Comm("tp_gather", "all_gather", tp, 1, V * act, rows="sampled"))
    if a2a_layers:
        assert model.moe is not None
        k = model.moe.top_k
        # Each rank dispatches its 1/ep of the rows, k copies each, and gets the outputs back; the
        # per-expert counts go first so a receiver knows which expert each row is for.
        comms.append(Comm("ep_alltoall", "all_to_all", ep, 2 * a2a_layers, k * h * act / ep))
        comms.append(Comm("ep_alltoall", "all_to_all", ep, a2a_layers, 0.0, fixed_bytes=8.0 * model.moe.num_experts))
        if dp == 1:  # tensor-parallel attention needs every token on every rank again
            comms.append(Comm("ep_alltoall", "all_gather", ep, a2a_layers, h * act))
    if cp > 1:
        # A prefill chunk's new K/V is all-gathered in every layer (SGLang's prefill context
        # parallelism); a decode token's attention over each GPU's share of the cache is merged by
        # gathering the partial outputs (vLLM/SGLang decode context parallelism: outputs and LSE).
        comms.append(Comm("cp_transfer", "all_gather", cp, L, kv_tok, rows="prefill"))
        comms.append(Comm("cp_transfer", "all_gather", cp, L, (o_in / attn_tp) * act, rows="decode"))
    return tuple(c for c in comms if c.calls)
