"""Weight-only quantisation formats of the Triton matmuls in quant_matmul.py: torch reference
quantisers (the packers a checkpoint converter uses) and dequantisers (what the kernels are
checked against). Torch only, so CPU code can pack weights without triton.

int8, symmetric per output channel: engine.quant.formats.quantize_int8 (the engine's own format).
int4, asymmetric per group of `group_size` consecutive input channels (g = k // group_size):
    w[n, k] ~= (q[n, k] - zeros[n, g]) * scales[n, g];  q, zeros in 0..15;
    scales [N, K / group_size] fp32, zeros [N, K / group_size] uint8 (one zero point a byte).
    Packing: w_packed [N, K / 2] uint8, byte j of row n = q[n, 2j] | q[n, 2j + 1] << 4 (even k in
    the low nibble). Rows keep the [N, K] weight layout, so a K tile of a row is contiguous.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.quant.formats import pack_int4, unpack_int4


def quantize_int4(w: Tensor, group_size: int = 128) -> tuple[Tensor, Tensor, Tensor]:
    """w [N, K] -> (w_packed [N, K / 2] uint8, scales [N, G] fp32, zeros [N, G] uint8), G = K / group_size.

    Each group's range is widened to include 0 (as GPTQ does), so the zero point is an exact
    code in 0..15 and zero weights dequantise to exactly 0.
    """
    n, k = w.shape
    if group_size % 2 or k % group_size:
        raise ValueError(f"K={k} must be a multiple of an even group_size, not {group_size}")
    groups = w.float().reshape(n, k // group_size, group_size)
    lo = groups.amin(dim=-1).clamp(max=0)
    hi = groups.amax(dim=-1).clamp(min=0)
    scales = (hi - lo) / 15
    safe = torch.where(scales > 0, scales, 1.0)
    zeros = torch.round(-lo / safe).clamp(0, 15)
    q = (torch.round(groups / safe[..., None]) + zeros[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return pack_int4(q), scales, zeros.to(torch.uint8)


def dequantize_int4(w_packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int = 128) -> Tensor:
    """(w_packed [N, K / 2], scales [N, G], zeros [N, G]) -> w [N, K] fp32."""
    q = unpack_int4(w_packed).float()
    scales = scales.float().repeat_interleave(group_size, dim=1)
    zeros = zeros.float().repeat_interleave(group_size, dim=1)
    return (q - zeros) * scales
