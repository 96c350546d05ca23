"""Quantised KV cache: int8 or fp8 (e4m3) values with one fp32 scale per (token, head).

Layout. A quantised layer cache keeps the engine's single-tensor shape, with the scale
stored in-line after each head's values:

    [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim + 4]   dtype int8 / float8_e4m3fn

bytes [..., :head_dim] are the quantised values and bytes [..., head_dim:] the fp32 scale
(its 4 bytes, read back through a uint8 view). Keeping the scale beside its values means
block copies, gathers and the block manager need no second tensor, and the scale travels
with its token. The cache dtype alone says whether a cache is quantised (float dtypes are
the unquantised path, untouched).

Per-(token, head) scales: a token's K (or V) vector for one head is quantised on its own,
scale = amax(|x|) / qmax (127 for int8, 448 for e4m3), so no later token can overflow an
earlier scale and no calibration is needed. Cost: 4 bytes per 64-value head
(head_dim 64: 68 bytes instead of 128 in bf16 or 256 in fp32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.config import KV_SCALE_BYTES

KV_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max)}


def is_quantized_kv(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """"auto" -> the model dtype; "int8" / "fp8" -> the quantised cache dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, {' or '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def kv_last_dim(head_dim: int, dtype: torch.dtype) -> int:
    """Size of the cache's last dimension: head_dim, plus the in-line scale when quantised."""
    return head_dim + KV_SCALE_BYTES if is_quantized_kv(dtype) else head_dim


# The name each cache dtype has in ModelConfig.kv_bytes_per_token_per_layer, the one count of KV
# bytes that the engine's allocation and the planner's memory plan share.
_KV_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                   torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


def kv_dtype_name(dtype: torch.dtype) -> str:
    return _KV_DTYPE_NAMES[dtype]


def quantize_kv(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x [..., head_dim] float -> uint8 [..., head_dim + 4]: quantised values, then the fp32 scale's bytes."""
    x32 = x.float()
    qmax = _QMAX[dtype]
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = (x32 / scale).clamp(-qmax, qmax)
    values = (scaled.round().to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)).view(torch.uint8)
    return torch.cat([values, scale.view(torch.uint8)], dim=-1)


def dequantize_kv(raw: Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> Tensor:
    """uint8 [..., head_dim + 4] (as quantize_kv writes it) -> out_dtype [..., head_dim]."""
    values = raw[..., :-KV_SCALE_BYTES].view(dtype)
    scale = raw[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return (values.float() * scale).to(out_dtype)
