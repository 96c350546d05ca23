"""The named operators of one engine step, each with its FLOPs, bytes and kernels per step.

Every figure is per GPU of the replica and summed over the layers it runs in (identical layers
have identical rooflines, so the sum over layers is the roofline of the summed work). Kernel
counts follow the engine's CUDA path (engine/model): one GEMM per projection; rotary, KV write
and attention; gate_up, SwiGLU, down; a fused add+norm per norm plus the final norm and the
embedding gather; routed experts: gather, two grouped GEMMs, SwiGLU (and a shared expert's
three); router: GEMM and top-k; sampling: softmax, draw, copy out.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from planner.memory import SAMPLER_COPIES, WEIGHT_BYTES_PER_PARAM, kv_bytes_per_token_per_layer_per_gpu
from planner.specs import Deployment

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


@dataclass(frozen=True)
class Attention:
    flops_per_pair: float  # one (query, key) pair, one layer
    kv_bytes_per_token: float  # one token's K/V in one layer
    act_bytes_per_row: float  # new K/V written, Q read, output written: all layers
    kernels: float


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
    allreduce_bytes_per_row: float  # one all-reduce's payload per row
    allreduces: int  # per step (two per layer under TP)
    pp_bytes_per_row: float
    pp_handoffs: int
    layers: int

    @property
    def graph_kernels(self) -> float:
        """Kernels of the forward pass a captured graph holds (all but the LM head and sampling)."""
        layer_ops = (self.qkv_proj, self.o_proj, self.mlp, self.shared_experts, self.router)
        experts = self.experts.kernels if self.experts is not None else 0.0
        return sum(g.kernels for g in layer_ops) + experts + self.attention.kernels + self.norm_kernels


def build_operators(model: ModelConfig, dep: Deployment) -> Operators:
    """The operators of `model` served as `dep`, per GPU (tensor-parallel shards; every layer once,
    pipeline stages in turn)."""
    tp, pp = dep.tensor_parallel, dep.pipeline_parallel
    h, L = model.hidden_size, model.num_layers
    act = 4.0 if dep.weight_dtype == "fp32" else 2.0
    high = act  # embeddings, LM head and router stay unquantised (planner/memory/weights.py)
    wbytes = WEIGHT_BYTES_PER_PARAM[dep.weight_dtype]

    def gemm(params: float, in_dim: float, out_dim: float, layers: int, kernels: float) -> Gemm:
        return Gemm(2 * layers * params / tp, layers * params / tp * wbytes, layers * (in_dim + out_dim) * act,
                    layers * params / tp * DEQUANT_OPS_PER_WEIGHT, kernels)

    n = model.num_attention_heads
    if model.mla is not None:
        m = model.mla
        o_params = n * m.v_head_dim * h
        q_out, o_in = n * (m.qk_nope_head_dim + m.qk_rope_head_dim), n * m.v_head_dim
        qkv_out = q_out + m.kv_lora_rank + m.qk_rope_head_dim
    else:
        o_params = n * model.head_dim * h
        q_out = o_in = n * model.head_dim
        qkv_out = q_out + 2 * model.num_kv_heads * model.head_dim
    qkv_params = model.attention_params_per_layer() - o_params  # biases, q/k norms and sinks ride with qkv

    n_moe = model.num_moe_layers
    n_dense = L - n_moe
    inter = model.intermediate_size
    experts = None
    shared = router = Gemm(0.0, 0.0, 0.0, 0.0, 0.0)
    if model.moe is not None and n_moe:
        mo = model.moe
        per_expert = model.expert_params()
        experts = Experts(mo.num_experts, mo.top_k, 2 * n_moe * mo.top_k * per_expert / tp,
                          n_moe * per_expert / tp * wbytes,
                          n_moe * (2 * h + 3 * mo.top_k * mo.expert_intermediate_size / tp) * act,
                          n_moe * per_expert / tp * DEQUANT_OPS_PER_WEIGHT, 4 * n_moe)
        if mo.num_shared_experts:
            size = mo.num_shared_experts * mo.shared_expert_intermediate_size
            shared = gemm(3 * h * size, 2 * h, 3 * size / tp, n_moe, 3 * n_moe)
        router_params = h * mo.num_experts + (mo.num_experts if mo.router_bias else 0)
        # Replicated on every rank and unquantised.
        router = Gemm(2 * n_moe * router_params, n_moe * router_params * high,
                      n_moe * (h * act + mo.num_experts * LOGIT_BYTES), 0.0, 2 * n_moe, high_precision=True)

    V = model.vocab_size
    kv_tok = kv_bytes_per_token_per_layer_per_gpu(model, dep)
    return Operators(
        qkv_proj=gemm(qkv_params, h, qkv_out / tp, L, L),
        o_proj=gemm(o_params, o_in / tp, h, L, L),
        mlp=gemm(model.dense_mlp_params(), 2 * h, 3 * inter / tp, n_dense, 3 * n_dense),
        shared_experts=shared,
        experts=experts,
        router=router,
        lm_head=Gemm(2 * V * h / tp, V * h / tp * high, h * act + V / tp * LOGIT_BYTES, 0.0, 1, high_precision=True),
        attention=Attention(model.attention_flops_per_token(1) / L / tp, kv_tok,
                            L * (kv_tok + (q_out + o_in) / tp * act), 3 * L),
        norm_bytes_per_row=((L * model.norms_per_layer + 1) * NORM_TRAFFIC * h + h) * act,
        norm_kernels=L * (model.norms_per_layer + (2 if model.qk_norm else 0)) + 2,
        sample_bytes_per_row=V * LOGIT_BYTES * SAMPLER_COPIES,
        sample_kernels=3,
        allreduce_bytes_per_row=h * act if tp > 1 else 0.0,
        allreduces=2 * L if tp > 1 else 0,
        pp_bytes_per_row=h * act if pp > 1 else 0.0,
        pp_handoffs=pp - 1,
        layers=L,
    )
