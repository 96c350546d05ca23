"""Rotary position embeddings (RoPE), with Llama-3 frequency scaling.

Positions are given per token, so a flat batch of prefill chunks and decodes needs no
special casing. The halves convention (rotate_half) matches HF checkpoints.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from engine import kernels
from engine.errors import InputError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """inv_freq [head_dim / 2] in fp32, as the model was trained with."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    raise InputError("rope_scaling.rope_type", rope_type, f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_scaling(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    try:
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
    except KeyError as exc:
        raise InputError(f"rope_scaling.{exc.args[0]}", None, "required for rope_type llama3") from None
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    inv_freq: Tensor  # a buffer (register_buffer), declared for the type checker

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, head_dim] in fp32 for the given token positions [T]."""
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def rotate_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate queries and keys [T, heads, head_dim] by their tokens' angles (one Triton kernel on CUDA;
    elsewhere one apply_rotary over both, which halves the small ops a layer dispatches)."""
    if kernels.use_triton(q):
        from engine.kernels.rotary import rotary_embedding

        return rotary_embedding(q, k, cos, sin)
    qk = apply_rotary(torch.cat((q, k), dim=1), cos, sin)
    return qk[:, : q.shape[1]], qk[:, q.shape[1] :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] by the angles of its token: x * cos + rotate_half(x) * sin, with
    rotate_half(x) = [-x2, x1] written as the swapped halves [x2, x1] times sin with its first half
    negated (the same products, so the same rounding; views and one flip instead of slices and a cat)."""
    tokens, heads, dim = x.shape
    swapped = x.view(tokens, heads, 2, dim // 2).flip(2).view(tokens, heads, dim)
    signed_sin = (sin.view(tokens, 1, 2, dim // 2) * _HALF_SIGNS.to(sin.device)).view(tokens, 1, dim).to(x.dtype)
    return x * cos.view(tokens, 1, dim).to(x.dtype) + swapped * signed_sin


_HALF_SIGNS = torch.tensor([[-1.0], [1.0]])
