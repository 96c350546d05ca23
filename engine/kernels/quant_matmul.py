"""Weight-only quantised matmuls y = x @ dequantize(w).T, dequantising tiles in registers.

The formats are the engine's own (engine/quant/formats.py, the layouts of Int8Linear and
Int4Linear), whose torch dequantisers are the references. Decode is bound by reading weights,
so keeping them at 8 or 4 bits in memory is the point; the full precision weight never exists
in global memory.

Both kernels feed tl.dot small integers, which are exact in fp16/bf16 (int8 codes; int4 codes
minus 8), and apply the scales in fp32 afterwards: per output channel once at the end (int8),
per group once for each K tile (int4; a tile never straddles two groups). int4's zero is an
offset per group, w = (q - 8) * scale + zero, so a group adds zero x (the sum of its x).
Int8Linear and Int4Linear run them on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _int8_matmul_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    scales_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    scales = tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out = acc * scales[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_matmul_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    scales_ptr,
    zeros_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_byte = tl.arange(0, BLOCK_K // 2)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # K is a multiple of GROUP_SIZE, itself a multiple of BLOCK_K: no K masks, one group per tile.
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_mask[:, None], other=0.0)
        packed = tl.load(w_rows + (k0 // 2 + offs_byte)[None, :], mask=n_mask[:, None], other=0)
        codes = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K], even k from the low nibble
        group = k0 // GROUP_SIZE
        zeros = tl.load(zeros_ptr + offs_n * stride_zn + group, mask=n_mask, other=0.0).to(tl.float32)
        scales = tl.load(scales_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
        w = (codes.to(tl.float32) - 8.0).to(x.dtype)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION) * scales[None, :]
        acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * zeros[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _block_m(m: int) -> int:
    # Decode batches are a handful of rows; tl.dot needs at least 16.
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _dot_precision(x: Tensor) -> str:
    # fp32 activations get exact fp32 products; TF32 would cost ~1e-3 relative error.
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _rows(x: Tensor, k: int) -> Tensor:
    rows = x.reshape(-1, k)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def int8_weight_matmul(x: Tensor, w_int8: Tensor, scales: Tensor) -> Tensor:
    """x [..., K] @ (w_int8 [N, K] * scales[N, None]).T -> [..., N] in x's dtype."""
    n, k = w_int8.shape
    if x.shape[-1] != k or scales.shape != (n,) or w_int8.dtype != torch.int8 or w_int8.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)}, w {tuple(w_int8.shape)} {w_int8.dtype}, scales {tuple(scales.shape)}")
    rows, scales = _rows(x, k), scales.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _block_m(m), 64, 64
    if m:
        _int8_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            out, rows, w_int8, scales, m, n, k, rows.stride(0), w_int8.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=_dot_precision(x),
        )
    return out.view(*x.shape[:-1], n)


def int4_weight_matmul(
    x: Tensor, w_packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int = 128
) -> Tensor:
    """x [..., K] @ w.T -> [..., N] in x's dtype, w = (unpack_int4(w_packed) - 8) * scales + zeros per
    group of group_size input columns (engine.quant.formats.dequantize_int4): w_packed [N, K / 2]
    uint8, scales and zeros [N, K / group_size] float.

    group_size must be a power of two >= 16 dividing K (the kernel's K tiles sit inside groups).
    """
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    groups = k // group_size
    if group_size < 16 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"group_size={group_size} must be a power of two >= 16 dividing K={k}")
    if x.shape[-1] != k or scales.shape != (n, groups) or zeros.shape != (n, groups) or w_packed.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)}, w_packed {tuple(w_packed.shape)}, scales {tuple(scales.shape)}, "
                         f"zeros {tuple(zeros.shape)} do not fit")
    if w_packed.dtype != torch.uint8 or not (scales.is_floating_point() and zeros.is_floating_point()):
        raise ValueError("w_packed must be uint8, scales and zeros floating point")
    rows, scales, zeros = _rows(x, k), scales.contiguous(), zeros.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _block_m(m), 64, min(64, group_size)
    if m:
        _int4_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            out, rows, w_packed, scales, zeros, m, n, k, rows.stride(0), w_packed.stride(0), scales.stride(0),
            zeros.stride(0), out.stride(0), GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, DOT_PRECISION=_dot_precision(x),
        )
    return out.view(*x.shape[:-1], n)
