"""The RMSNorm and rotary kernels against the torch modules the decoder runs."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from engine.kernels.rotary import rotary_embedding
from engine.model.layers import RMSNorm
from engine.model.rotary import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.float16]


def assert_same_roundings(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to fp32 sum order and rsqrt: a few fp32 ulp, which may flip a rare final fp16
    rounding by 1 ulp. Skipping the module's intermediate rounding to x's dtype would change
    about a third of the fp16 outputs."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=0, rtol=1e-6)
    else:
        torch.testing.assert_close(out, expected, atol=0, rtol=1e-3)
        assert (out != expected).float().mean() < 0.02


def reference_norm(hidden: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=gen))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_module(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = reference_norm(48, dtype, gen)  # 48 is padded to a 64-wide block
    x = (3 * torch.randn(2, 3, 48, generator=gen)).to(dtype)
    out = rms_norm(x, norm.weight.detach(), norm.eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert_same_roundings(out, norm(x).detach())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_add_then_module(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    norm = reference_norm(64, dtype, gen)
    x, residual = torch.randn(2, 5, 64, generator=gen).to(dtype), torch.randn(2, 5, 64, generator=gen).to(dtype)
    # A strided residual (a column slice): the kernel reads it through its row stride.
    residual = torch.cat([residual, residual], dim=-1)[..., 64:]
    normed, new_residual = fused_add_rms_norm(x, residual, norm.weight.detach(), norm.eps)
    expected_residual = x + residual
    assert torch.equal(new_residual, expected_residual)
    assert_same_roundings(normed, norm(expected_residual).detach())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary_matches_apply_rotary(dtype: torch.dtype, inplace: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 16
    rope = RotaryEmbedding(head_dim, theta=10000.0, scaling=None)
    cos, sin = rope(torch.tensor([0, 7, 8, 9, 300]))  # a decode far along, a prefill chunk
    # q and k as the decoder has them: views of one fused projection.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    untouched = qkv.clone()

    out_q, out_k = rotary_embedding(q, k, cos, sin, inplace=inplace)
    # fp16: the reference rounds cos, sin and both products to fp16, the kernel only the result.
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=4e-3, rtol=0)
    torch.testing.assert_close(out_q, expected_q, **tolerance)
    torch.testing.assert_close(out_k, expected_k, **tolerance)
    if inplace:
        assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
        assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], untouched[:, (heads + kv_heads) * head_dim :])
    else:
        assert torch.equal(qkv, untouched)
