"""Per-GPU memory plan of one replica, as its serving engine sizes the KV cache at start-up.

Answers the first question an infra team asks (does model M fit on hardware H with this parallelism
and precision, and how many sequences of length L can it hold at once?) with the engine's own rule
(planner/memory/engines.py) applied to the memory the device reports, the weights as loaded, the
activation peak the engine reserves and what the runtime holds. Each figure is a line with its rule
and source. The simulator sizes its KV-cache manager from this same plan, and so do the planner's
search, `serveplan memory` and the dashboard's Memory page.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from engine.config import ModelConfig
from engine.errors import InputError
from planner.engines import get_engine, resolve_deployment
from planner.memory import activations, device
from planner.memory.engines import Budget, engine_budget
from planner.memory.kv import (
    KVGroups,
    kv_bytes_per_token_per_layer,
    kv_bytes_per_token_per_layer_per_gpu,
    kv_groups,
    window_aware_sequences,
)
from planner.memory.parts import GIB, Part, gib
from planner.memory.weights import WEIGHT_BYTES_PER_PARAM, StageWeights, stage_weights
from planner.specs import Deployment, HardwareProfile


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WeightBreakdown(Report):
    transformer_layers_gib: float = Field(description="Attention and MLP/expert weights of the worst pipeline stage")
    embedding_gib: float = Field(description="Input embedding shard (first stage)")
    lm_head_gib: float = Field(description="LM head shard (last stage)")
    buffers_gib: float = Field(0.0, description="Buffers loaded with the model: the rotary cos/sin cache")
    total_gib: float


class MemoryLine(Report):
    key: str = Field(description="Stable id of the line, e.g. 'weights.layers', 'activation.sampler'")
    label: str
    gib: float
    in_budget: bool = Field(description="The engine subtracts it before sizing the KV cache; otherwise it must fit "
                            "in the memory the engine leaves unused")
    rule: str = Field(description="The formula with its numbers")
    source: str = Field(description="Where the rule comes from: the engine's code at a release tag, a file of this "
                        "repository, or 'estimate: ...' with its reasoning")


class MemoryPlan(Report):
    model: str
    hardware: str
    engine: str = Field(description="The engine profile whose memory rule sized the KV cache")
    tensor_parallel: int
    pipeline_parallel: int
    expert_parallel: int
    weight_dtype: str
    kv_dtype: str
    context_tokens: int
    device_memory_gib: float = Field(description="Device memory as marketed")
    device_memory_reported_gib: float = Field(description="Device memory as the runtime reports it (what engines use)")
    usable_memory_gib: float = Field(description="What the engine lets itself use for weights, activations, runtime and "
                                     "KV cache (vLLM: reported memory x gpu_memory_utilization)")
    weights: WeightBreakdown
    activation_reserve_gib: float = Field(description="Activation peak the engine reserves before sizing the KV cache")
    runtime_overhead_gib: float = Field(description="Non-torch memory, CUDA context and graphs the engine subtracts")
    kv_cache_gib: float = Field(description="What is left for the KV cache (negative when it does not fit)")
    lines: list[MemoryLine] = Field(description="Every figure of the worst stage with its rule and source, in order")
    kv_bytes_per_token_model: int = Field(description="KV bytes per token, all layers, unsharded")
    kv_bytes_per_token_per_gpu: int
    block_size_tokens: int
    kv_bytes_per_block_per_gpu: int
    kv_cache_blocks: int
    kv_cache_tokens: int = Field(description="kv_cache_blocks x block_size_tokens (with sliding-window groups: tokens "
                                 "of one group's layers)")
    kv_layers_per_block: int = Field(description="Layers a KV block holds: every layer of the stage, or, with "
                                     "sliding-window groups, one group's")
    kv_window_groups: int = Field(0, description="Sliding-window groups sharing the pool, each holding only its window's "
                                  "blocks (0: every layer keeps every token)")
    kv_window_tokens: int | None = Field(None, description="Their window, tokens")
    max_concurrent_sequences: int = Field(description="Sequences of context_tokens the KV cache holds at once")
    max_concurrent_sequences_window_aware: int | None = Field(
        None, description="The same for an engine that frees blocks outside sliding windows (models with windows only)"
    )
    max_num_seqs: int
    fits: bool
    reason: str
    assumptions: list[str]


def plan_memory(model: ModelConfig, hw: HardwareProfile, dep: Deployment, context_tokens: int) -> MemoryPlan:
    """The per-GPU breakdown of one replica as `dep.engine` sizes it; the worst pipeline stage decides."""
    check_parallelism(model, dep)
    if context_tokens < 1:
        raise InputError("context_tokens", context_tokens, "must be at least 1 token")
    if context_tokens > model.max_position_embeddings:
        raise InputError(
            "context_tokens", context_tokens, f"exceeds the model's max_position_embeddings={model.max_position_embeddings}"
        )
    dep = resolve_deployment(dep, hw, max_model_len=context_tokens)
    engine = get_engine(dep.engine)
    sampler = dep.profile_sampler
    if sampler is not None and not engine.memory.sampler_in_profile:
        raise InputError("profile_sampler", sampler, f"{engine.name} does not sample in a profiling pass")
    knobs = dep.knobs.choices
    total = device.reported_total(hw)
    stages = stage_weights(model, dep, hw, engine)
    kv_per_token_per_layer = kv_bytes_per_token_per_layer_per_gpu(model, dep)
    captures = bool(engine.execution.cuda_graphs and hw.graph_capture and not dep.knobs.enforce_eager)
    graphs = activations.graph_pool(model, dep, engine, captures)
    runtime_parts = device.runtime(hw, dep.tensor_parallel * dep.pipeline_parallel, dep.peer_access)
    groups, why_not_groups = kv_groups(model, dep)

    worst = None
    for index, weights in enumerate(stages):
        last = index == len(stages) - 1
        stage_acts = activations.profiling_pass(model, dep, engine, sampler if last else None, samples=last)
        if engine.memory.activation_profile == "budget":
            stage_acts.extend(device.cublas_workspace(hw))
        budget = engine_budget(engine, hw, dep, total, list(weights.parts), stage_acts, runtime_parts, graphs)
        layers = groups.layers_per_group if groups is not None else weights.num_layers
        block_bytes = kv_per_token_per_layer * layers * knobs.block_size_tokens
        blocks = max(0, math.floor(budget.kv_bytes / block_bytes))
        if worst is None or blocks < worst[0]:
            worst = (blocks, budget, weights, block_bytes)
    assert worst is not None
    blocks, budget, weights, block_bytes = worst
    kv_budget = budget.kv_bytes
    block_size = knobs.block_size_tokens
    max_seqs = blocks // _blocks_per_sequence(context_tokens, block_size, groups)
    in_budget = [p for p in budget.parts if p.in_budget]
    activation = sum(p.bytes for p in in_budget if p.key.startswith("activation."))
    runtime = sum(p.bytes for p in in_budget if not p.key.startswith(("activation.", "weights.")))
    fits, reason = _verdict(budget, total, weights, activation + runtime, kv_budget, blocks, max_seqs, block_size,
                            context_tokens)
    kv_line = Part("kv", "KV cache", kv_budget, f"{gib(budget.usable.bytes)} - every line counted in the budget; "
                   f"{blocks:,} blocks of {block_size} tokens x {int(block_bytes):,} B", budget.usable.source)
    lines = [total, budget.usable, *in_budget, kv_line, *(p for p in budget.parts if not p.in_budget)]
    return MemoryPlan(
        model=model.name,
        hardware=hw.name,
        engine=engine.name,
        tensor_parallel=dep.tensor_parallel,
        pipeline_parallel=dep.pipeline_parallel,
        expert_parallel=dep.expert_parallel,
        weight_dtype=dep.weight_dtype,
        kv_dtype=dep.kv_dtype,
        context_tokens=context_tokens,
        device_memory_gib=hw.memory_gib,
        device_memory_reported_gib=total.gib,
        usable_memory_gib=budget.usable.gib,
        weights=WeightBreakdown(transformer_layers_gib=weights.layers / GIB, embedding_gib=weights.embedding / GIB,
                                lm_head_gib=weights.lm_head / GIB, buffers_gib=weights.buffers / GIB,
                                total_gib=weights.total / GIB),
        activation_reserve_gib=activation / GIB,
        runtime_overhead_gib=runtime / GIB,
        kv_cache_gib=kv_budget / GIB,
        lines=[MemoryLine(key=p.key, label=p.label, gib=p.gib, in_budget=p.in_budget, rule=p.rule, source=p.source)
               for p in lines],
        kv_bytes_per_token_model=model.num_layers * kv_bytes_per_token_per_layer(model, dep),
        kv_bytes_per_token_per_gpu=int(kv_per_token_per_layer * weights.num_layers),
        block_size_tokens=block_size,
        kv_bytes_per_block_per_gpu=int(block_bytes),
        kv_cache_blocks=blocks,
        kv_cache_tokens=blocks * block_size,
        kv_layers_per_block=groups.layers_per_group if groups is not None else weights.num_layers,
        kv_window_groups=groups.window.groups if groups is not None else 0,
        kv_window_tokens=groups.window.window_tokens if groups is not None else None,
        max_concurrent_sequences=max_seqs,
        max_concurrent_sequences_window_aware=window_aware_sequences(model, dep, kv_budget, weights.num_layers,
                                                                     context_tokens),
        max_num_seqs=knobs.max_num_seqs,
        fits=fits,
        reason=reason,
        assumptions=_assumptions(model, dep, hw, budget, groups, why_not_groups),
    )


def _blocks_per_sequence(context_tokens: int, block_size: int, groups: KVGroups | None) -> int:
    """Blocks one sequence of context_tokens holds while it decodes its last token."""
    full = math.ceil(context_tokens / block_size)
    if groups is None:
        return full
    first, end = groups.window.live_blocks(context_tokens - 1, context_tokens, block_size)
    return full + groups.window.groups * (end - first)


def check_parallelism(model: ModelConfig, dep: Deployment) -> None:
    """Reject parallel layouts the model's shapes cannot be split into."""
    tp = dep.tensor_parallel
    if model.num_attention_heads % tp:
        raise InputError("tensor_parallel", tp, f"must divide the {model.num_attention_heads} attention heads of {model.name or model.model_type}")
    if model.mla is None and model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise InputError("tensor_parallel", tp, f"must divide, or be a multiple of, the {model.num_kv_heads} KV heads")
    if dep.pipeline_parallel > model.num_layers:
        raise InputError("pipeline_parallel", dep.pipeline_parallel, f"exceeds the model's {model.num_layers} layers")
    attn_tp = tp // dep.attention_data_parallel
    if dep.attention_data_parallel > 1 and model.mla is None and model.num_kv_heads % attn_tp and attn_tp % model.num_kv_heads:
        raise InputError("attention_data_parallel", dep.attention_data_parallel,
                         f"leaves {attn_tp} GPUs per attention group, which must divide, or be a multiple of, the "
                         f"{model.num_kv_heads} KV heads")
    if dep.expert_parallel > 1:
        if not model.is_moe:
            raise InputError("expert_parallel", dep.expert_parallel, "expert parallelism needs a mixture-of-experts model")
        assert model.moe is not None
        if model.moe.num_experts % dep.expert_parallel or tp % dep.expert_parallel:
            raise InputError(
                "expert_parallel", dep.expert_parallel, f"must divide both the {model.moe.num_experts} experts and tp={tp}"
            )


def _verdict(budget: Budget, total: Part, weights: StageWeights, other: float, kv_budget: float, blocks: int,
             max_seqs: int, block_size: int, context_tokens: int) -> tuple[bool, str]:
    held = budget.usable.bytes + sum(p.bytes for p in budget.parts if not p.in_budget)
    if held > total.bytes:  # an explicit KV-cache size, or a share near 1, with what must fit beside it
        return False, (f"does not fit: {budget.usable.rule} and the lines outside it come to {gib(held)} per GPU, "
                       f"more than the {gib(total.bytes)} the device reports")
    if kv_budget <= 0:
        return False, (f"does not fit: needs {gib(weights.total + other)} per GPU before any KV cache (weights "
                       f"{gib(weights.total)} + activations and runtime {gib(other)}), has {gib(budget.usable.bytes)} "
                       f"({budget.usable.rule})")
    if max_seqs < 1:
        return False, (f"does not fit: the KV cache holds {blocks * block_size:,} tokens per replica, less than one "
                       f"sequence of {context_tokens:,} tokens")
    return True, f"fits: {max_seqs:,} sequences of {context_tokens:,} tokens in the KV cache"


def _assumptions(model: ModelConfig, dep: Deployment, hw: HardwareProfile, budget: Budget,
                 groups: KVGroups | None, why_not: str | None) -> list[str]:
    knobs = dep.knobs
    notes = [
        "memory in GiB (2^30 bytes), per GPU of the worst pipeline stage; every line shows its rule and source",
        f"engine {dep.engine}: {budget.usable.rule}",
        f"transformer-layer weights in {dep.weight_dtype} at {WEIGHT_BYTES_PER_PARAM[dep.weight_dtype]:.4g} bytes/param "
        "(quantisation scales included); embeddings, LM head, norms and routers unquantised",
        f"token budget max_num_batched_tokens={knobs.max_num_batched_tokens}, max_num_seqs={knobs.max_num_seqs}",
        f"paged KV cache in {dep.kv_dtype}, block of {knobs.block_size_tokens} tokens",
    ]
    if hw.memory_reported_gib is None:
        notes.append(f"{hw.name} has no reported-memory figure: the marketed {hw.memory_gib:g} GiB is assumed visible")
    outside = sum(p.bytes for p in budget.parts if not p.in_budget)
    if outside:
        notes.append(f"outside the budget: {gib(outside)} (CUDA context, graphs, activations of engines without a "
                     f"profiling pass) must fit in what the engine leaves unused")
    if groups is not None:
        w = groups.window
        notes.append(f"sliding-window layers ({w.window_tokens}-token window) in {w.groups} group(s) of "
                     f"{groups.layers_per_group} layers beside one full-attention group, over one pool whose block holds "
                     "one group's layers; a window group keeps only its window's blocks (vLLM's hybrid KV cache manager)")
    else:
        notes.append("every layer stores every token" + (f" ({why_not}; max_concurrent_sequences_window_aware: "
                                                          "what windowed allocation would hold)" if why_not else ""))
    if dep.attention_data_parallel > 1:
        notes.append(f"data-parallel attention over {dep.attention_data_parallel} groups of "
                     f"{dep.tensor_parallel // dep.attention_data_parallel} GPUs: each group keeps its own requests' KV "
                     "cache and whole attention weights (split over its GPUs); the MLP and experts span all "
                     "tensor-parallel GPUs")
    if dep.context_parallel > 1:
        notes.append(f"context parallelism over {dep.context_parallel} GPUs: each stores 1/{dep.context_parallel} of "
                     "every sequence's KV cache and holds the same weights")
    if model.mla is not None and dep.attention_data_parallel == 1:
        notes.append("MLA: the compressed KV latent is replicated on every tensor-parallel rank")
    elif model.num_kv_heads < dep.tensor_parallel:
        notes.append(f"{model.num_kv_heads} KV heads over tp={dep.tensor_parallel}: each rank keeps one replicated head")
    return notes
