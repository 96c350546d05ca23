"""A tiny paged driver: run a CausalLM over a prompt and some decode steps, return all logits."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kernels.metadata import build_attention_metadata
from engine.model.decoder import CausalLM


def run_logits(
    model: CausalLM, prompt: list[int], decode: list[int], *, kv_dtype: torch.dtype | None = None, block_size: int = 4
) -> Tensor:
    """Prefill `prompt`, then feed `decode` one token per step; logits [len(prompt) + len(decode), V]."""
    total = len(prompt) + len(decode)
    num_blocks = -(-total // block_size)
    caches = model.allocate_kv_caches(num_blocks + 2, block_size, kv_dtype)
    table = list(range(num_blocks + 1, 0, -1))[:num_blocks]  # out of order, block 0 unused
    out = []
    steps = [prompt] + [[t] for t in decode]
    seen = 0
    with torch.inference_mode():
        for tokens in steps:
            seen += len(tokens)
            positions, metadata = build_attention_metadata([len(tokens)], [seen], [table], block_size)
            hidden = model(torch.tensor(tokens), positions, metadata, caches)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine similarity of two [N, V] tensors."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
