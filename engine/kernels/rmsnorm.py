"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

Reference: engine.model.layers.RMSNorm, whose rounding these kernels reproduce: normalise in
fp32, round to the activation dtype, then multiply by the weight (one more rounding). Fusing
the add saves a full read and write of the hidden states per norm; used on CUDA once wired
into the decoder (the decoder runs the torch modules today).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    """One program per row: h = x (+ residual, rounded to x's dtype), out = w * (h * rsqrt(mean(h^2) + eps))."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} do not fit")
    rows = x.reshape(-1, hidden)  # a view for the usual [T, H] or contiguous input
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    # The reference's result dtype: weight (dtype w) times the normalised x (dtype x).
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_rows = new_residual = None
    if residual is not None:
        res_rows = residual.reshape(-1, hidden)
        if res_rows.stride(-1) != 1:
            res_rows = res_rows.contiguous()
        new_residual = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            out,
            new_residual if new_residual is not None else out,
            rows,
            res_rows if res_rows is not None else rows,
            weight,
            rows.stride(0),
            res_rows.stride(0) if res_rows is not None else 0,
            out.stride(0),
            new_residual.stride(0) if new_residual is not None else 0,
            eps,
            HIDDEN=hidden,
            BLOCK=block,
            ADD_RESIDUAL=residual is not None,
            num_warps=min(max(block // 256, 1), 16),  # ~8 elements a thread for wide rows
        )
    return out.view(x.shape), None if new_residual is None else new_residual.view(x.shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., hidden] with weight [hidden], as engine.model.layers.RMSNorm computes it."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; the sum is rounded to x's dtype
    first, exactly as `h = x + residual; norm(h)` does in torch."""
    normed, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return normed, new_residual
