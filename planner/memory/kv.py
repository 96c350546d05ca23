"""KV-cache bytes per token as each engine lays them out, and the pool's rounding to whole pages.

Every engine here stores every token of every layer in a paged pool: K and V per KV head (one latent
vector per token for MLA), with KV heads replicated when tensor parallelism exceeds their count and
the MLA latent replicated on every rank. 8-bit caches cost one byte per value; ServePlan's own
engine adds an fp32 scale per (token, head), the others keep one scale per tensor.
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.dtypes import KV_DTYPE_BYTES
from planner.engines import get_engine
from planner.specs import Deployment


def kv_bytes_per_token_per_layer(model: ModelConfig, dep: Deployment) -> int:
    """One token in one layer, all KV heads, as the deployment's engine stores it."""
    if get_engine(dep.engine).execution.kv_scale_format == "per_token_head":
        return model.kv_bytes_per_token_per_layer(dep.kv_dtype)  # values and their per-(token, head) scales
    return model.kv_elements_per_token_per_layer() * KV_DTYPE_BYTES[dep.kv_dtype]


def kv_bytes_per_token_per_layer_per_gpu(model: ModelConfig, dep: Deployment) -> float:
    whole = kv_bytes_per_token_per_layer(model, dep)
    if model.mla is not None:  # the latent is replicated on every tensor-parallel rank
        return whole
    kv_heads_per_gpu = max(1, model.num_kv_heads // dep.tensor_parallel)  # fewer heads than ranks: replicated
    return whole * kv_heads_per_gpu // model.num_kv_heads


def window_aware_sequences(model: ModelConfig, dep: Deployment, kv_budget_bytes: float, num_layers: int,
                           context_tokens: int) -> int | None:
    """Sequences of context_tokens the budget holds when sliding-window layers keep only their window, as
    vLLM V1's hybrid KV-cache manager allocates them (None for models without windows)."""
    if not any(model.layer_windows) or kv_budget_bytes <= 0:
        return None
    whole = kv_bytes_per_token_per_layer(model, dep)
    per_gpu = kv_bytes_per_token_per_layer_per_gpu(model, dep)
    seq_bytes = sum(min(context_tokens, w) if w else context_tokens for w in model.layer_windows) * whole
    return int(kv_budget_bytes // (seq_bytes * per_gpu * num_layers / (whole * model.num_layers)))
