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
