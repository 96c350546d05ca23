"""Weight bytes per GPU as engines lay them out: sharded over tensor-parallel ranks where the layer is
split, replicated where it is not, padded where a kernel needs aligned shapes.

What "Model loading took X GiB" reports in vLLM is every tensor the model holds after loading:
parameters in their stored formats (quantised weights with their scales), the vocabulary padded to
a multiple of 64, and buffers such as the rotary cos/sin cache.
"""

from __future__ import annotations

from dataclasses import dataclass
import math

from engine.config import ModelConfig
from planner.engines import EngineProfile
from planner.memory.parts import Part
from planner.specs import Deployment, HardwareProfile

# Bytes per weight including the quantisation scales that travel with it.
WEIGHT_BYTES_PER_PARAM: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,  # per-output-channel or 128x128-block scales: negligible
    "int8": 1.0,  # per-output-channel scales: negligible
    "int4": 0.5 + 2 * 2 / 128,  # group 128, asymmetric: an fp16 scale and zero point per group
    "fp4": 0.5 + 1 / 32,  # MXFP4: one 8-bit shared exponent per 32 values
}
# VocabParallelEmbedding and ParallelLMHead pad the vocabulary to a multiple of 64 before splitting it.
VOCAB_PADDING = 64
VOCAB_SOURCE = "https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/model_executor/layers/vocab_parallel_embedding.py#L23-L64"
MXFP4_SOURCE = "https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/model_executor/layers/quantization/mxfp4.py#L59-L228"
ROTARY_SOURCE = "https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/model_executor/layers/rotary_embedding/base.py#L19-L71"
LAYOUT_SOURCE = ("planner/memory/weights.py: column/row-parallel linears split over tensor-parallel ranks, "
                 "norms and routers replicated; KV heads replicated when tp exceeds them")


@dataclass(frozen=True)
class Mxfp4Layout:
    """How an engine pads MXFP4 expert weights for its MoE kernel (gpt-oss)."""

    kernel: str
    hidden_multiple: int
    intermediate_multiple: int

    def expert_values(self, hidden: int, intermediate: int, with_bias: bool) -> tuple[int, int]:
        """(weights, biases) of one expert as the kernel holds it, padded: gate_up [2I, H] and down [H, I]."""
        h = _round_up(hidden, self.hidden_multiple)
        i = _round_up(intermediate, self.intermediate_multiple)
        return 3 * i * h, (2 * i + h) if with_bias else 0

    def expert_bytes(self, hidden: int, intermediate: int, with_bias: bool) -> float:
        """One expert's weights at 4 bits with an 8-bit scale per 32, and its bf16 biases."""
        weights, biases = self.expert_values(hidden, intermediate, with_bias)
        return weights * (0.5 + 1 / 32) + 2 * biases


def mxfp4_layout(engine: EngineProfile, hw: HardwareProfile) -> Mxfp4Layout:
    """vLLM 0.10-0.11 pick the MXFP4 MoE backend by device: FlashInfer on Blackwell (in the release images),
    Triton on ROCm, Marlin elsewhere (Hopper and Ampere: triton_kernels is not installed in these releases)."""
    if engine.engine != "vllm":
        return Mxfp4Layout("unpadded", 1, 1)
    if hw.vendor == "AMD":
        return Mxfp4Layout("Triton (ROCm)", 256, 256)
    if hw.family in ("blackwell", "grace-blackwell"):
        return Mxfp4Layout("FlashInfer (SM100)", 256, 256)
    return Mxfp4Layout("Marlin", 256, 128)


@dataclass(frozen=True)
class StageWeights:
    """The weights one GPU of a pipeline stage holds."""

    layers: float
    embedding: float
    lm_head: float
    buffers: float
    num_layers: int
    parts: tuple[Part, ...]

    @property
    def total(self) -> float:
        return self.layers + self.embedding + self.lm_head + self.buffers


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous, even split of layers over pipeline stages; earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    stages, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        stages.append(range(start, start + size))
        start += size
    return stages


def stage_weights(model: ModelConfig, dep: Deployment, hw: HardwareProfile, engine: EngineProfile) -> list[StageWeights]:
    tp = dep.tensor_parallel
    high = 4.0 if dep.weight_dtype == "fp32" else 2.0  # embeddings, LM head, norms, routers stay unquantised
    expert_only = quantises_experts_only(model, dep)
    wbytes = WEIGHT_BYTES_PER_PARAM[dep.weight_dtype]
    attn_bytes = high if expert_only else wbytes
    layout = mxfp4_layout(engine, hw) if expert_only else None

    # Data-parallel attention: each group splits its attention weights over its tp / dp GPUs only.
    attention = attention_params_per_rank(model, tp // dep.attention_data_parallel) * attn_bytes
    replicated = (model.norms_per_layer * model.hidden_size + (2 * model.head_dim if model.qk_norm else 0)) * high
    dense = model.dense_mlp_params() / tp * wbytes if not all(model.layer_is_moe) else 0.0
    moe = _moe_bytes_per_rank(model, tp, wbytes, high, layout) if model.is_moe else 0.0

    vocab = math.ceil(_round_up(model.vocab_size, VOCAB_PADDING) / tp)
    rotary = model.max_position_embeddings * model.rotary_dim * high if engine.engine != "serveplan" else 0.0
    stages = stage_layers(model.num_layers, dep.pipeline_parallel)
    out = []
    for index, layers in enumerate(stages):
        layer_bytes = sum(attention + replicated + (moe if model.layer_is_moe[i] else dense) for i in layers)
        first, last = index == 0, index == len(stages) - 1
        embedding = vocab * model.hidden_size * high if first else 0.0
        # The last stage needs the LM head; a tied head is the embedding again, shared only on one stage.
        has_head = last and (not model.tie_word_embeddings or len(stages) > 1)
        lm_head = vocab * model.hidden_size * high if has_head else 0.0
        parts = [
            Part("weights.layers", "weights: transformer layers", layer_bytes,
                 _layers_rule(model, dep, len(layers), attn_bytes, wbytes, layout), LAYOUT_SOURCE),
            Part("weights.embedding", "weights: embedding", embedding,
                 f"{_round_up(model.vocab_size, VOCAB_PADDING):,} (vocabulary padded to {VOCAB_PADDING}) / tp={tp} "
                 f"x {model.hidden_size} x {high:g} B", VOCAB_SOURCE),
            Part("weights.lm_head", "weights: LM head", lm_head,
                 "tied to the embedding" if model.tie_word_embeddings and not lm_head else
                 f"{_round_up(model.vocab_size, VOCAB_PADDING):,} / tp={tp} x {model.hidden_size} x {high:g} B",
                 VOCAB_SOURCE),
        ]
        if rotary:
            parts.append(Part("weights.rotary", "rotary cos/sin cache", rotary,
                              f"max_position_embeddings {model.max_position_embeddings:,} x rotary dim "
                              f"{model.rotary_dim} x {high:g} B, on every GPU", ROTARY_SOURCE))
        out.append(StageWeights(layer_bytes, embedding, lm_head, rotary, len(layers), tuple(parts)))
    return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def quantises_experts_only(model: ModelConfig, dep: Deployment) -> bool:
    """MXFP4 checkpoints (gpt-oss) quantise the routed experts only: attention stays in bf16."""
    return dep.weight_dtype == "fp4" and model.is_moe


def attention_params_per_rank(model: ModelConfig, tp: int) -> float:
    """Attention projections on one tensor-parallel rank: heads split, KV heads replicated past their count,
    MLA's down-projections (q_a, kv_a) replicated on every rank (vLLM's and SGLang's DeepSeek attention
    hold them unsplit)."""
    h = model.hidden_size
    if model.mla is not None:
        m, n = model.mla, model.num_attention_heads / tp
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = h * n * qk_dim if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * qk_dim
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + n * m.v_head_dim * h
    q_dim = model.num_attention_heads * model.head_dim / tp
    kv_dim = max(1, model.num_kv_heads // tp) * model.head_dim
    params = h * q_dim + 2 * h * kv_dim + q_dim * h
    if model.attention_bias:
        params += q_dim + 2 * kv_dim + (h if model.model_type == "gpt_oss" else 0)
    if model.attention_sinks:
        params += model.num_attention_heads / tp
    return params


def _moe_bytes_per_rank(model: ModelConfig, tp: int, wbytes: float, high: float, layout: Mxfp4Layout | None) -> float:
    assert model.moe is not None
    m, h = model.moe, model.hidden_size
    router = (h * m.num_experts + (m.num_experts if m.router_bias else 0)) * high  # replicated, unquantised
    shared = m.num_shared_experts * 3 * h * m.shared_expert_intermediate_size / tp * wbytes
    if layout is None:
        experts = m.num_experts * model.expert_params() / tp * wbytes
    else:  # experts are split by their intermediate size over the tensor-parallel ranks, then padded
        experts = m.num_experts * layout.expert_bytes(h, m.expert_intermediate_size // tp, m.expert_bias)
    return router + shared + experts


def _layers_rule(model: ModelConfig, dep: Deployment, layers: int, attn_bytes: float, wbytes: float,
                 layout: Mxfp4Layout | None) -> str:
    rule = f"{layers} layers / tp={dep.tensor_parallel}, {dep.weight_dtype} at {wbytes:.4g} B/param"
    if layout is not None:
        rule += (f"; MXFP4 experts padded for the {layout.kernel} kernel (hidden to a multiple of "
                 f"{layout.hidden_multiple}, intermediate per rank to {layout.intermediate_multiple}, {MXFP4_SOURCE}), "
                 f"attention at {attn_bytes:g} B/param")
    if model.mla is None and model.num_kv_heads < dep.tensor_parallel:
        rule += f"; {model.num_kv_heads} KV heads over tp={dep.tensor_parallel}: one replicated per rank"
    return rule
