"""Rotary position embedding of q and k in one launch, in place or out of place.

Reference: engine.model.rotary.apply_rotary, with its HF "rotate_half" layout: dimension i of
the first half pairs with dimension i + head_dim / 2, out = x * cos + rotate_half(x) * sin.
One program per token rotates all of its q and k heads, so the token's cos/sin row is read
once. In place, q and k can be the views split off the fused qkv projection: no copies.
The kernel computes in fp32 from the fp32 angles; in fp16/bf16 it is therefore within one
rounding of the reference, which rounds cos, sin and each product to x's dtype first.
Used on CUDA once wired into the decoder (the decoder runs the torch reference today).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    token,
    stride_x_t,
    stride_x_h,
    stride_o_t,
    stride_o_h,
    cos_lo,
    sin_lo,
    cos_hi,
    sin_hi,
    offs_d,
    d_mask,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < NUM_HEADS) & d_mask[None, :]
    src = x_ptr + token * stride_x_t + offs_h[:, None] * stride_x_h + offs_d[None, :]
    x_lo = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = (-x_hi, x_lo)
    out_lo = x_lo * cos_lo[None, :] - x_hi * sin_lo[None, :]
    out_hi = x_hi * cos_hi[None, :] + x_lo * sin_hi[None, :]
    dst = out_ptr + token * stride_o_t + offs_h[:, None] * stride_o_h + offs_d[None, :]
    tl.store(dst, out_lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out_hi.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_out_ptr,
    k_out_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_qo_t,
    stride_qo_h,
    stride_ko_t,
    stride_ko_h,
    stride_cos,
    stride_sin,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    # Both halves of cos/sin are read, so no assumption that they repeat (they do for RoPE).
    cos_lo = tl.load(cos_ptr + token * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + token * stride_cos + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + token * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + token * stride_sin + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    # Each program loads its token's heads before storing them, so out may alias the input.
    _rotate_heads(q_ptr, q_out_ptr, token, stride_q_t, stride_q_h, stride_qo_t, stride_qo_h,
                  cos_lo, sin_lo, cos_hi, sin_hi, offs_d, d_mask, NUM_Q_HEADS, BLOCK_HQ, HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_k_t, stride_k_h, stride_ko_t, stride_ko_h,
                  cos_lo, sin_lo, cos_hi, sin_hi, offs_d, d_mask, NUM_K_HEADS, BLOCK_HK, HALF)


def rotary_embedding(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, inplace: bool = False
) -> tuple[Tensor, Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by cos, sin [T, D] (RotaryEmbedding's output).

    With inplace=True, q and k are overwritten and returned; otherwise new tensors are.
    """
    tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if head_dim % 2 or k.shape[::2] != (tokens, head_dim) or cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do not fit")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("head_dim must be the contiguous dimension of q, k, cos and sin")
    q_out = q if inplace else torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = k if inplace else torch.empty_like(k, memory_format=torch.contiguous_format)
    if tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        q_out, k_out, q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out, k_out
