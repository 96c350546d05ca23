"""The int8 / int4 weight-only matmul kernels against their torch dequantise-then-matmul references."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.quant_matmul import int4_weight_matmul, int8_weight_matmul
from engine.quant.formats import dequantize_int4, dequantize_int8, pack_int4, quantize_int4, quantize_int8

# 20 rows span two 16-row tiles and 80 outputs two 64-column tiles, both with a ragged edge.
M, N, K, GROUP = 20, 80, 128, 32
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_weight_matmul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    w_int8, scales = quantize_int8(torch.randn(N, K, generator=gen))
    x = torch.randn(M, K, generator=gen).to(dtype)
    expected = x.float() @ dequantize_int8(w_int8, scales).T
    out = int8_weight_matmul(x, w_int8, scales)
    assert out.dtype == dtype and out.shape == (M, N)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_weight_matmul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    q, scales, zeros = quantize_int4(torch.randn(N, K, generator=gen), GROUP)
    x = torch.randn(2, M // 2, K, generator=gen).to(dtype)  # leading dims are flattened
    expected = x.float() @ dequantize_int4(q, scales, zeros).T
    out = int4_weight_matmul(x, pack_int4(q), scales, zeros, GROUP)
    assert out.dtype == dtype and out.shape == (2, M // 2, N)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


def test_int4_rejects_groups_a_tile_cannot_sit_in() -> None:
    q, scales, zeros = quantize_int4(torch.randn(4, 48), 24)
    with pytest.raises(ValueError, match="power of two"):
        int4_weight_matmul(torch.randn(1, 48), pack_int4(q), scales, zeros, 24)
