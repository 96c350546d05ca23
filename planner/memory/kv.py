"""KV-cache bytes per token as each engine lays them out, and the pool's rounding to whole pages.

Every engine here stores every token of every layer in a paged pool: K and V per KV head (one latent
vector per token for MLA), with KV heads replicated when tensor parallelism exceeds their count and
the MLA latent replicated on every rank. 8-bit caches cost one byte per value; ServePlan's own
engine adds an fp32 scale per (token, head), the others keep one scale per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.core import WindowGroups
from engine.dtypes import KV_DTYPE_BYTES
from planner.engines import get_engine
from planner.specs import Deployment


def kv_bytes_per_token_per_layer(model: ModelConfig, dep: Deployment) -> int:
    """One token in one layer, all KV heads, as the deployment's engine stores it."""
    if get_engine(dep.engine).execution.kv_scale_format == "per_token_head":
        return model.kv_bytes_per_token_per_layer(dep.kv_dtype)  # values and their per-(token, head) scales
    return model.kv_elements_per_token_per_layer() * KV_DTYPE_BYTES[dep.kv_dtype]


def kv_bytes_per_token_per_layer_per_gpu(model: ModelConfig, dep: Deployment) -> float:
    """KV bytes one GPU holds per token of the replica in one layer: its KV heads' share (the MLA latent
    whole), over the data-parallel attention groups (each holds only its own requests' tokens) and the
    context-parallel ranks (each holds 1/cp of every sequence's tokens)."""
    whole: float = kv_bytes_per_token_per_layer(model, dep)
    attn_tp = dep.tensor_parallel // dep.attention_data_parallel
    if model.mla is None:  # fewer KV heads than ranks: each keeps one, replicated
        whole = whole * max(1, model.num_kv_heads // attn_tp) / model.num_kv_heads
    return whole / (dep.attention_data_parallel * dep.context_parallel)


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


@dataclass(frozen=True)
class KVGroups:
    """A hybrid model's layers as vLLM's hybrid KV cache manager groups them: groups of
    `layers_per_group` layers (the last of a type padded), one of them full attention, the others
    `window.groups` sliding-window groups; a pool block holds block_size tokens of one group's layers."""

    layers_per_group: int
    window: WindowGroups


def kv_groups(model: ModelConfig, dep: Deployment) -> tuple[KVGroups | None, str | None]:
    """The KV groups of `model` under `dep.engine`, or None where every layer keeps every token, with
    the reason when the model has windows (None: it has none)."""
    windows = model.layer_windows
    if not any(windows):
        return None, None
    if get_engine(dep.engine).memory.sliding_window_kv != "window_groups":
        return None, f"{dep.engine} keeps every token of its sliding-window layers"
    sizes = {w for w in windows if w}
    if len(sizes) > 1:
        return None, f"windows of {len(sizes)} sizes are not modelled: every layer keeps every token"
    if dep.pipeline_parallel > 1:
        return None, "sliding-window groups under pipeline parallelism are not modelled: every layer keeps every token"
    num_window = sum(1 for w in windows if w)
    num_full = len(windows) - num_window
    if not num_full:
        return None, "every layer is a sliding-window layer, not modelled as groups: every layer keeps every token"
    # vLLM 0.10-0.11 kv_cache_utils._get_kv_cache_groups_uniform_page_size: the group size is the
    # smaller type's layer count, or the larger one's when within 1.25x of it (less padding).
    size = min(num_full, num_window)
    if max(num_full, num_window) < 1.25 * size:
        size = max(num_full, num_window)
    if -(-num_full // size) != 1:
        return None, (f"{num_full} full-attention layers in groups of {size} make {-(-num_full // size)} full groups, "
                      "not modelled: every layer keeps every token")
    return KVGroups(size, WindowGroups(-(-num_window // size), sizes.pop())), None
