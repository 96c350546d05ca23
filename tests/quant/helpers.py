"""A tiny paged driver (run a CausalLM over a prompt and some decode steps, return all logits), and a
peak-memory counter for CPU tensors."""

from __future__ import annotations

from collections.abc import Iterable
import weakref

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside the block and still alive at once (CPU has no allocator
    statistics): every op's outputs are counted by storage until their last tensor dies; storages that
    existed before (weights, KV caches) are skipped even when an op returns them."""

    def __init__(self, existing: Iterable[Tensor]) -> None:
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors referring to it]
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._track(t)
        return out

    def _track(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.existing:
            return
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if not entry[1]:
            self.current -= entry[0]
            del self.live[key]
