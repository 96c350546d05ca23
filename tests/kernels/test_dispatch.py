"""Which path runs: Triton only for CUDA tensors in the model, the interpreter only when asked."""

from __future__ import annotations

import pytest
import torch

import engine.kernels
import engine.kernels.kv_cache
import engine.kernels.paged_attention
from engine.kernels import triton_available
from engine.kernels.metadata import build_attention_metadata
from engine.model.attention import allocate_kv_cache, paged_attention, write_kv_cache


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


@pytest.mark.parametrize("weight_dtype", [None, "int8", "int4"])
def test_the_model_on_its_triton_kernels_matches_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, tiny_model, weight_dtype: str | None
) -> None:
    """What CUDA runs (paged attention, KV write, fused add+RMSNorm, rotary, int8 / int4 matmuls), here
    under the interpreter on a mixed prefill + decode step, against the engine's CPU path."""
    import engine.quant.linear
    from engine.model.loader import load_model
    from engine.model.quantize import quantize_model

    # The CPU path to compare with is the exact float one, not torch's bf16 packed CPU kernels.
    monkeypatch.setattr(engine.quant.linear, "cpu_packed_kernels_vectorised", lambda: False)
    model = load_model(str(tiny_model(num_hidden_layers=1)), random_weights=True, seed=3).model
    if weight_dtype:
        quantize_model(model, weight_dtype)
    caches = model.allocate_kv_caches(8, 4)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (9,))
    # A 6-token prefill chunk after 2 cached tokens, then three decodes.
    positions, metadata = build_attention_metadata([6, 1, 1, 1], [8, 3, 5, 2], [[0, 1], [2], [3, 4], [5]], 4)
    for cache in caches:  # the cached tokens the metadata says are there
        cache.normal_()
    reference_caches = [c.clone() for c in caches]
    expected = model(ids, positions, metadata, reference_caches)

    monkeypatch.setattr(engine.kernels, "use_triton", lambda x: True)
    if weight_dtype:  # Int8Linear chose its kernel at construction: rebuild with the dispatch forced
        model = load_model(str(tiny_model(num_hidden_layers=1)), random_weights=True, seed=3).model
        quantize_model(model, weight_dtype)
        if weight_dtype == "int8":
            assert {m.kernel for m in model.modules() if hasattr(m, "kernel")} == {"triton"}
    got = model(ids, positions, metadata, caches)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(caches, reference_caches, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
