"""Reference quantise / dequantise functions for the weight formats, in plain torch.

These are the numerics every quantised module is checked against. All maths runs in fp32
whatever the input dtype; results come back as fp32 unless stated.

- int8: symmetric, one scale per output channel (row): w ~= q * scale, q in [-127, 127].
- int4: asymmetric, one (scale, zero) per group of `group_size` input columns, with the
  mid-point convention of torch's int4pack kernels (and gpt-fast):
      w ~= (q - 8) * scale + zero,  q in [0, 15],  scale = (max - min) / 15,  zero = min + 8 * scale
  so q = round((w - min) / scale). When in_features is not a multiple of group_size the
  columns are zero-padded up to one (SmolLM2's 576 with group 128 pads to 640).
- fp8: float8_e4m3fn with one scale per output channel: w ~= q * scale, scale = amax / 448.
- activations, for the native W4A8 / W8A8 kernel: int8 per block of 32 with scale amax / 127
  (quantize_activations), and that kernel's product (block_matmul).
"""

from __future__ import annotations

import torch
from torch import Tensor
import torch.nn.functional as F

INT8_MAX = 127
INT4_LEVELS = 15
INT4_MID = 8
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def _safe_scale(amax: Tensor, qmax: float) -> Tensor:
    """amax / qmax, with all-zero rows given scale 1 so they quantise to exact zeros."""
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


# ------------------------------------------------------------------ int8, per output channel


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (q int8 [N, K], scales fp32 [N])."""
    w = weight.float()
    scales = _safe_scale(w.abs().amax(dim=1), INT8_MAX)
    q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    """q [N, K] with scales [N] (per channel) or [N, K / g] (per group of g columns, as GGUF Q8_0) -> fp32 [N, K]."""
    if scales.dim() == 2:
        return q.float() * scales.float().repeat_interleave(q.shape[1] // scales.shape[1], dim=1)
    return q.float() * scales.float()[:, None]


# ------------------------------------------------------------------ int8 activations per block (W4A8 / W8A8)

ACTIVATION_BLOCK = 32


def quantize_activations(x: Tensor, padded: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows x [M, K] -> (xq int8 [M, padded], xd fp32 [M, padded / 32], xs fp32 [M, padded / 32]): per
    block of 32 (K zero-padded), xd = amax / 127, xq = round(x * (1 / xd)) in fp32 with ties to even,
    xs = xd * sum(xq) (llama.cpp's Q8_1). The native kernel's arithmetic, bit for bit."""
    m, k = x.shape
    blocks = F.pad(x.float(), (0, padded - k)).reshape(m, padded // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    xd = amax / INT8_MAX
    inv = torch.where(amax > 0, 1 / xd, torch.zeros_like(xd))
    xq = torch.round(blocks * inv[..., None])
    return xq.to(torch.int8).reshape(m, padded), xd, xd * xq.sum(dim=-1)


def block_matmul(x: Tensor, q: Tensor, d: Tensor, m: Tensor | None) -> Tensor:
    """The native kernel's result in float64: rows x [M, K] quantised by quantize_activations, times
    weights w = d * q + m in blocks of 32 (q [N, Kp] integer codes, d and m [N, Kp / 32]; m None = 0):
    y[r, n] = sum_b d[n, b] * xd[r, b] * (q[n, b] . xq[r, b]) + m[n, b] * xs[r, b]."""
    n, kp = q.shape
    xq, xd, xs = quantize_activations(x, kp)
    nb = kp // ACTIVATION_BLOCK
    dots = torch.einsum("rbj,nbj->rnb", xq.double().reshape(-1, nb, ACTIVATION_BLOCK),
                        q.double().reshape(n, nb, ACTIVATION_BLOCK))
    y = (dots * d.double()[None] * xd.double()[:, None]).sum(-1)
    return y if m is None else y + xs.double() @ m.double().t()


# ------------------------------------------------------------------ int4, group-wise asymmetric


def padded_in_features(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size) * group_size


def quantize_int4(weight: Tensor, group_size: int = 128) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] -> (q uint8 values in [0, 15] [N, Kp], scales fp32 [N, Kp/g], zeros fp32 [N, Kp/g]).

    Kp is K rounded up to a multiple of group_size; the padding columns are zeros.
    """
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even number >= 2, got {group_size}")
    n, k = weight.shape
    kp = padded_in_features(k, group_size)
    w = F.pad(weight.float(), (0, kp - k)).reshape(n, kp // group_size, group_size)
    w_min, w_max = w.amin(dim=-1), w.amax(dim=-1)
    scales = _safe_scale(w_max - w_min, INT4_LEVELS)
    zeros = w_min + INT4_MID * scales
    q = torch.round((w - w_min[..., None]) / scales[..., None]).clamp(0, INT4_LEVELS)
    return q.to(torch.uint8).reshape(n, kp), scales, zeros


def dequantize_int4(q: Tensor, scales: Tensor, zeros: Tensor, in_features: int | None = None) -> Tensor:
    """(q [N, Kp], scales/zeros [N, Kp/g]) -> fp32 [N, in_features] (padding columns dropped)."""
    n, kp = q.shape
    groups = scales.shape[1]
    w = (q.float().reshape(n, groups, kp // groups) - INT4_MID) * scales[..., None].float() + zeros[..., None].float()
    return w.reshape(n, kp)[:, : in_features or kp]


def pack_int4(q: Tensor) -> Tensor:
    """uint8 values in [0, 15] [N, K] (K even) -> [N, K/2]: column 2j in the low nibble, 2j+1 in the high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


# ------------------------------------------------------------------ fp8 e4m3, per output channel


def quantize_fp8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (q float8_e4m3fn [N, K], scales fp32 [N])."""
    w = weight.float()
    scales = _safe_scale(w.abs().amax(dim=1), FP8_MAX)
    q = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def dequantize_fp8(q: Tensor, scales: Tensor) -> Tensor:
    return q.float() * scales.float()[:, None]
