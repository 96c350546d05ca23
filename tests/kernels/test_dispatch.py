"""Which path runs: Triton only for CUDA tensors in the model, the interpreter only when asked."""

from __future__ import annotations

import pytest
import torch

import engine.kernels.kv_cache
import engine.kernels.paged_attention
from engine.kernels import triton_available
from engine.model.attention import allocate_kv_cache, build_attention_metadata, paged_attention, write_kv_cache


def test_triton_available_on_cpu_only_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert triton_available("cpu")  # conftest set TRITON_INTERPRET=1
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_available("cpu")
    assert not triton_available(torch.device("meta"))


def test_model_attention_on_cpu_never_runs_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("Triton kernel called for CPU tensors")

    monkeypatch.setattr(engine.kernels.paged_attention, "paged_attention_triton", fail)
    monkeypatch.setattr(engine.kernels.kv_cache, "write_kv_cache_triton", fail)
    _, metadata = build_attention_metadata([2], [2], [[0]], 4)
    cache = allocate_kv_cache(1, 4, 1, 16, torch.float32)
    write_kv_cache(cache, torch.ones(2, 1, 16), torch.ones(2, 1, 16), metadata.slot_mapping)
    out = paged_attention(torch.ones(2, 1, 16), cache, metadata, 1.0, None)
    assert torch.allclose(out, torch.ones(2, 1, 16))
