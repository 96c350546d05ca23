"""Per-GPU memory plan: weights, activation reserve, runtime overhead and the KV cache that fits.

Answers the first question an infra team asks — does model M fit on hardware H with this
parallelism and precision, and how many sequences of length L can it hold at once? The
simulator sizes its KV-cache manager from the same plan, so both always agree.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from engine.config import ModelConfig
from engine.errors import InputError
from planner.specs import Deployment, HardwareProfile

GIB = 2**30

# Bytes per weight including the quantisation scales that travel with it.
WEIGHT_BYTES_PER_PARAM: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,  # per-output-channel scales: negligible
    "int8": 1.0,  # per-output-channel scales: negligible
    "int4": 0.5 + 2 * 2 / 128,  # group 128, asymmetric: an fp16 scale and zero point per group
    "fp4": 0.5 + 1 / 32,  # MXFP4: one 8-bit shared exponent per 32 values
}
# CUDA context, allocator fragmentation, communication buffers and captured graphs.
RUNTIME_OVERHEAD_GIB = 1.0
# Logits and sampler temporaries (probabilities, sorted copy for top-p) per sampled row, fp32.
SAMPLER_COPIES = 3


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WeightBreakdown(Report):
    transformer_layers_gib: float = Field(description="Attention and MLP/expert weights of the worst pipeline stage")
    embedding_gib: float = Field(description="Input embedding shard (first stage)")
    lm_head_gib: float = Field(description="LM head shard (last stage)")
    total_gib: float


class MemoryPlan(Report):
    model: str
    hardware: str
    tensor_parallel: int
    pipeline_parallel: int
    expert_parallel: int
    weight_dtype: str
    kv_dtype: str
    context_tokens: int
    device_memory_gib: float
    usable_memory_gib: float = Field(description="Device memory x gpu_memory_utilization")
    weights: WeightBreakdown
    activation_reserve_gib: float = Field(description="Peak activations of one step at max_num_batched_tokens")
    runtime_overhead_gib: float
    kv_cache_gib: float = Field(description="What is left for the KV cache (negative when it does not fit)")
    kv_bytes_per_token_model: int = Field(description="KV bytes per token, all layers, unsharded")
    kv_bytes_per_token_per_gpu: int
    block_size_tokens: int
    kv_bytes_per_block_per_gpu: int
    kv_cache_blocks: int
    kv_cache_tokens: int
    max_concurrent_sequences: int = Field(description="Sequences of context_tokens the KV cache holds at once")
    max_concurrent_sequences_window_aware: int | None = Field(
        None, description="The same for an engine that frees blocks outside sliding windows (models with windows only)"
    )
    max_num_seqs: int
    fits: bool
    reason: str
    assumptions: list[str]


def plan_memory(model: ModelConfig, hw: HardwareProfile, dep: Deployment, context_tokens: int) -> MemoryPlan:
    """The per-GPU memory breakdown of one replica; the worst pipeline stage decides."""
    check_parallelism(model, dep)
    if context_tokens < 1:
        raise InputError("context_tokens", context_tokens, "must be at least 1 token")
    if context_tokens > model.max_position_embeddings:
        raise InputError(
            "context_tokens", context_tokens, f"exceeds the model's max_position_embeddings={model.max_position_embeddings}"
        )
    tp, knobs = dep.tensor_parallel, dep.knobs
    stages = _stage_layers(model.num_layers, dep.pipeline_parallel)
    weight_bytes = WEIGHT_BYTES_PER_PARAM[dep.weight_dtype]
    high_bytes = 4.0 if dep.weight_dtype == "fp32" else 2.0  # embeddings, LM head stay unquantised

    stage_weights = []
    for index, layers in enumerate(stages):
        layer_params = sum(model.layer_params(i) for i in layers)
        embedding = model.embedding_params / tp * high_bytes if index == 0 else 0.0
        # The last stage needs the LM head; a tied head is the embedding again, shared only on one stage.
        head_params = model.lm_head_params or (model.embedding_params if len(stages) > 1 else 0)
        lm_head = head_params / tp * high_bytes if index == len(stages) - 1 else 0.0
        stage_weights.append((layer_params / tp * weight_bytes, embedding, lm_head, len(layers)))

    act_bytes = 4.0 if dep.weight_dtype == "fp32" else 2.0
    activation = _activation_bytes(model, dep, act_bytes)
    usable = hw.memory_bytes * knobs.gpu_memory_utilization
    overhead = RUNTIME_OVERHEAD_GIB * GIB

    kv_per_token_per_layer = kv_bytes_per_token_per_layer_per_gpu(model, dep)
    worst = None
    for layers_w, emb_w, head_w, num_layers in stage_weights:
        kv_budget = usable - (layers_w + emb_w + head_w) - activation - overhead
        block_bytes = kv_per_token_per_layer * num_layers * knobs.block_size_tokens
        blocks = max(0, math.floor(kv_budget / block_bytes))
        if worst is None or blocks < worst[0]:
            worst = (blocks, kv_budget, block_bytes, layers_w, emb_w, head_w, num_layers)
    blocks, kv_budget, block_bytes, layers_w, emb_w, head_w, num_layers = worst

    blocks_per_seq = math.ceil(context_tokens / knobs.block_size_tokens)
    max_seqs = blocks // blocks_per_seq
    window_aware = None
    if any(model.layer_windows) and kv_budget > 0:
        seq_bytes = model.kv_bytes_for_sequence(context_tokens, dep.kv_dtype)
        per_gpu_seq = seq_bytes * kv_per_token_per_layer * num_layers / model.kv_bytes_per_token(dep.kv_dtype)
        window_aware = int(kv_budget // per_gpu_seq)

    weights = WeightBreakdown(
        transformer_layers_gib=layers_w / GIB,
        embedding_gib=emb_w / GIB,
        lm_head_gib=head_w / GIB,
        total_gib=(layers_w + emb_w + head_w) / GIB,
    )
    needed = weights.total_gib + (activation + overhead) / GIB
    if kv_budget <= 0:
        fits, reason = False, (
            f"does not fit: needs {needed:.1f} GiB per GPU before any KV cache (weights {weights.total_gib:.1f} + "
            f"activations {activation / GIB:.1f} + runtime {overhead / GIB:.1f}), has {usable / GIB:.1f} GiB "
            f"({hw.memory_gib:g} GiB x gpu_memory_utilization {knobs.gpu_memory_utilization:g})"
        )
    elif max_seqs < 1:
        fits, reason = False, (
            f"does not fit: the KV cache holds {blocks * knobs.block_size_tokens} tokens per replica, "
            f"less than one sequence of {context_tokens} tokens"
        )
    else:
        fits, reason = True, f"fits: {max_seqs} sequences of {context_tokens} tokens in the KV cache"

    return MemoryPlan(
        model=model.name,
        hardware=hw.name,
        tensor_parallel=tp,
        pipeline_parallel=dep.pipeline_parallel,
        expert_parallel=dep.expert_parallel,
        weight_dtype=dep.weight_dtype,
        kv_dtype=dep.kv_dtype,
        context_tokens=context_tokens,
        device_memory_gib=hw.memory_gib,
        usable_memory_gib=usable / GIB,
        weights=weights,
        activation_reserve_gib=activation / GIB,
        runtime_overhead_gib=overhead / GIB,
        kv_cache_gib=kv_budget / GIB,
        kv_bytes_per_token_model=model.kv_bytes_per_token(dep.kv_dtype),
        kv_bytes_per_token_per_gpu=int(kv_per_token_per_layer * num_layers),
        block_size_tokens=knobs.block_size_tokens,
        kv_bytes_per_block_per_gpu=int(block_bytes),
        kv_cache_blocks=blocks,
        kv_cache_tokens=blocks * knobs.block_size_tokens,
        max_concurrent_sequences=max_seqs,
        max_concurrent_sequences_window_aware=window_aware,
        max_num_seqs=knobs.max_num_seqs,
        fits=fits,
        reason=reason,
        assumptions=_assumptions(model, dep),
    )


def check_parallelism(model: ModelConfig, dep: Deployment) -> None:
    """Reject parallel layouts the model's shapes cannot be split into."""
    tp = dep.tensor_parallel
    if model.num_attention_heads % tp:
        raise InputError("tensor_parallel", tp, f"must divide the {model.num_attention_heads} attention heads of {model.name or model.model_type}")
    if model.mla is None and model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise InputError("tensor_parallel", tp, f"must divide, or be a multiple of, the {model.num_kv_heads} KV heads")
    if dep.pipeline_parallel > model.num_layers:
        raise InputError("pipeline_parallel", dep.pipeline_parallel, f"exceeds the model's {model.num_layers} layers")
    if dep.expert_parallel > 1:
        if not model.is_moe:
            raise InputError("expert_parallel", dep.expert_parallel, "expert parallelism needs a mixture-of-experts model")
        assert model.moe is not None
        if model.moe.num_experts % dep.expert_parallel or tp % dep.expert_parallel:
            raise InputError(
                "expert_parallel", dep.expert_parallel, f"must divide both the {model.moe.num_experts} experts and tp={tp}"
            )


def _stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous, even split of layers over pipeline stages; earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    stages, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        stages.append(range(start, start + size))
        start += size
    return stages


def kv_bytes_per_token_per_layer_per_gpu(model: ModelConfig, dep: Deployment) -> float:
    whole = model.kv_bytes_per_token_per_layer(dep.kv_dtype)  # values and, for 8-bit caches, their scales
    if model.mla is not None:  # the latent is replicated on every tensor-parallel rank
        return whole
    kv_heads_per_gpu = max(1, model.num_kv_heads // dep.tensor_parallel)  # fewer heads than ranks: replicated
    return whole * kv_heads_per_gpu // model.num_kv_heads


def _activation_bytes(model: ModelConfig, dep: Deployment, act_bytes: float) -> float:
    """Peak live activations of one forward step over max_num_batched_tokens tokens, per GPU."""
    tokens = dep.knobs.max_num_batched_tokens
    tp = dep.tensor_parallel
    residual = 2 * model.hidden_size  # residual stream and its normalised copy
    attention = (model.num_attention_heads * 2 + 2 * model.num_kv_heads) * model.head_dim / tp
    if model.is_moe:
        assert model.moe is not None
        mlp = 3 * model.moe.top_k * model.moe.expert_intermediate_size / tp
    else:
        mlp = 3 * model.intermediate_size / tp  # gate and up outputs, then their product
    per_token = (residual + max(attention, mlp)) * act_bytes
    sampled_rows = min(dep.knobs.max_num_seqs, tokens)
    logits = sampled_rows * model.vocab_size * 4 * SAMPLER_COPIES
    return tokens * per_token + logits


def _assumptions(model: ModelConfig, dep: Deployment) -> list[str]:
    notes = [
        f"memory in GiB (2^30 bytes); the engine may use gpu_memory_utilization={dep.knobs.gpu_memory_utilization:g} of the device",
        f"transformer-layer weights in {dep.weight_dtype} at {WEIGHT_BYTES_PER_PARAM[dep.weight_dtype]:.4g} bytes/param "
        "(quantisation scales included); embeddings and LM head unquantised",
        "attention, MLP and expert weights split evenly over tensor-parallel ranks; embedding and LM head "
        "vocab-parallel; layers split evenly over pipeline stages (the worst stage is shown)",
        f"activation reserve: one step of max_num_batched_tokens={dep.knobs.max_num_batched_tokens} tokens "
        f"plus fp32 logits for up to max_num_seqs={dep.knobs.max_num_seqs} sampled rows",
        f"runtime overhead {RUNTIME_OVERHEAD_GIB:g} GiB per GPU (context, allocator, communication buffers, graphs)",
        f"paged KV cache in {dep.kv_dtype}, block of {dep.knobs.block_size_tokens} tokens; every layer stores every token",
    ]
    if model.mla is not None:
        notes.append("MLA: the compressed KV latent is replicated on every tensor-parallel rank")
    elif model.num_kv_heads < dep.tensor_parallel:
        notes.append(f"{model.num_kv_heads} KV heads over tp={dep.tensor_parallel}: each rank keeps one replicated head")
    return notes
