"""Scatter the step's new K/V rows into the paged cache (one program per token).

Reference: engine.model.attention.write_kv_cache. The kernel reads k and v through their
strides, so the views split off a fused qkv projection are written without a copy, and a
padding token (slot -1) costs one load and an early exit instead of a boolean-mask gather.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_h,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    dst = (
        cache_ptr
        + (slot // block_size) * stride_c_block
        + (slot % block_size) * stride_c_slot
        + offs_h[:, None] * stride_c_h
        + offs_d[None, :]
    )
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(kv_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store k, v [T, num_kv_heads, head_dim] at their slots of kv_cache
    [2, num_blocks, block_size, num_kv_heads, head_dim]; rows whose slot is -1 are skipped."""
    tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or slot_mapping.shape != (tokens,) or kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)} "
                         f"do not fit cache {tuple(kv_cache.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("head_dim must be the contiguous dimension of k, v and the cache")
    if tokens == 0:
        return
    _write_kv_cache_kernel[(tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
