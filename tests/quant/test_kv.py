"""Quantised KV cache: per-(token, head) round trips, attention over a quantised cache, the
byte accounting that sizes the cache, and the untouched unquantised path."""

import pytest
import torch

from engine.config import ModelConfig
from engine.kernels.metadata import build_attention_metadata
from engine.model.attention import allocate_kv_cache, paged_attention, write_kv_cache
from engine.model.loader import load_model
from engine.quant import kv

from .helpers import cosine, run_logits
from .test_swap import DECODE, PROMPT

KV_DTYPES = [torch.int8, torch.float8_e4m3fn]
# 2 KV heads of 16 dims: the shapes of the caches allocated below.
TWO_HEADS_OF_16 = ModelConfig.from_hf_config({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
                                              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8,
                                              "intermediate_size": 128})


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_round_trip_per_token_and_head(dtype: torch.dtype) -> None:
    x = randn(10, 3, 64)
    x[2, 1] *= 100  # one loud head must not cost the others precision
    x[4, 0] = 0.0
    raw = kv.quantize_kv(x, dtype)
    assert raw.dtype == torch.uint8 and raw.shape == (10, 3, 64 + kv.KV_SCALE_BYTES)
    back = kv.dequantize_kv(raw, dtype, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        bound = amax / 127 / 2 + 1e-7
    else:  # 3 mantissa bits; subnormal steps below 2^-6 of the scale unit
        bound = x.abs() * 2**-4 + amax / 448 * 2**-10 + 1e-7
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[4, 0], torch.zeros(64))
    # Without per-head scales the quiet heads of token 2 would round to ~zero.
    assert (back[2, 0] - x[2, 0]).abs().max() < (0.05 if dtype == torch.int8 else 0.3)


def test_allocation_shape_and_auto_path_unchanged() -> None:
    assert allocate_kv_cache(3, 4, 2, 16, torch.float32).shape == (2, 3, 4, 2, 16)
    assert allocate_kv_cache(3, 4, 2, 16, torch.bfloat16).dtype == torch.bfloat16
    for dtype in KV_DTYPES:
        cache = allocate_kv_cache(3, 4, 2, 16, dtype)
        assert cache.shape == (2, 3, 4, 2, 16 + 4) and cache.dtype == dtype
        assert TWO_HEADS_OF_16.kv_bytes_per_token_per_layer(kv.kv_dtype_name(dtype)) == cache[:, 0, 0].numel() * 1
    fp32 = allocate_kv_cache(3, 4, 2, 16, torch.float32)
    assert TWO_HEADS_OF_16.kv_bytes_per_token_per_layer("fp32") == fp32[:, 0, 0].numel() * 4 == 2 * 2 * 16 * 4


def test_kv_cache_torch_dtype() -> None:
    assert kv.kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv.kv_cache_torch_dtype("int8", torch.float32) == torch.int8
    assert kv.kv_cache_torch_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, int8 or fp8"):
        kv.kv_cache_torch_dtype("int4", torch.float32)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_paged_attention_over_a_quantised_cache(dtype: torch.dtype) -> None:
    # Two sequences: a 7-token prefill and a decode at position 9, padded slot included.
    heads, kv_heads, dim, block = 4, 2, 16, 4
    tables = [[5, 2], [1, 4, 3]]
    positions, meta = build_attention_metadata([7, 1], [7, 10], tables, block)
    # Fill every position of both sequences (the decode's earlier keys were written before).
    k_all, v_all = randn(17, kv_heads, dim, seed=1), randn(17, kv_heads, dim, seed=2)
    _, full = build_attention_metadata([7, 10], [7, 10], tables, block)
    q = randn(8, heads, dim, seed=3)
    outs = {}
    for cache_dtype in (torch.float32, dtype):
        cache = allocate_kv_cache(6, block, kv_heads, dim, cache_dtype)
        slots = torch.cat([full.slot_mapping, torch.tensor([-1])])  # a padding row is skipped
        write_kv_cache(cache, torch.cat([k_all, k_all[:1]]), torch.cat([v_all, v_all[:1]]), slots)
        outs[cache_dtype] = paged_attention(q, cache, meta, dim**-0.5, None)
    exact, approx = outs[torch.float32], outs[dtype]
    # int8 keeps ~7 bits per value, e4m3 ~4: fp8 is the coarser of the two.
    min_cos, max_err = (0.9995, 0.03) if dtype == torch.int8 else (0.998, 0.1)
    assert (cosine(approx.flatten(1), exact.flatten(1)) > min_cos).all()
    assert (approx - exact).abs().max() < max_err
    # The cache holds the quantised bytes of K at the first sequence's first slot (block 5).
    assert torch.equal(cache.view(torch.uint8)[0, 5, 0], kv.quantize_kv(k_all[0], dtype))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_model_logits_with_a_quantised_cache(model_dirs, kv_cache_dtype: str) -> None:
    model = load_model(str(model_dirs["llama"]), random_weights=True, seed=3).model
    exact = run_logits(model, PROMPT, DECODE)
    approx = run_logits(model, PROMPT, DECODE, kv_dtype=kv.kv_cache_torch_dtype(kv_cache_dtype, torch.float32))
    sims = cosine(approx, exact)
    assert sims.min() > 0.999, sims
