"""The native CPU kernels (engine/quant/csrc/native.c) through ctypes, and their weight layouts.

The matmul multiplies int8 activations, quantised per row in blocks of 32 on every call, by 4- or 8-bit
weights in blocks of 32 (w = d * c + m, fp16 d and m): llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0
arithmetic, on AVX-512 VNNI, AVX2 or plain C as the CPU allows (chosen at run time). GGUF Q4_0 /
Q4_1 / Q8_0 matrices map onto it exactly (their d and m are fp16), so a file's weights run as stored.
A second matmul takes int8 weights with one scale per output channel (Int8Linear's own layout) and
quantises each row once over all of K: per-token W8A8 with no float work inside the dot products, on
AMX tiles where the CPU has them (`matmul_channels`).

`make native` (part of `make setup`) builds the library with the C compiler alone, no torch headers,
in seconds. Where it is not built, `available()` is False and the quantised Linears keep torch's
kernels. engine/quant/formats.py has the torch reference of the same arithmetic (`block_matmul`),
which tests/quant/test_native.py compares every path this CPU has against.

The decode attention runs one decode step of a layer (rotary, KV-cache write, attention over the
paged fp32 cache) in one call, where torch takes a dozen small ops: on a small model those ops,
not the arithmetic, are most of a step's attention time.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import ctypes
from dataclasses import dataclass
import functools
from pathlib import Path

import torch
from torch import Tensor
import torch.nn.functional as F

from engine.kernels.metadata import AttentionMetadata
from engine.quant import formats

LIBRARY = Path(__file__).with_name("_native.so")
BLOCK = formats.ACTIVATION_BLOCK  # weights and activations share blocks of 32 along K
K_MULTIPLE = 2 * BLOCK  # K is padded to whole pairs of blocks (one 64-byte load of activations)
CHANNEL_COLS = 16  # the per-channel kernel's output channels per 64-byte group (native.c)
ISAS = ("plain C", "AVX2", "AVX-512 VNNI", "AVX-512 VNNI + AMX")  # AMX: the per-channel matmul's tiles
_ERRORS = {1: "bits must be 4 or 8", 2: "bad shape (matmul: Kp a multiple of 64 in [K, 65536], strides >= widths; attention: heads, lengths or slots)",
           3: "4-bit weights need their minima", 4: "out of memory for its scratch buffer"}


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not LIBRARY.exists():
        return None
    lib = ctypes.CDLL(str(LIBRARY))
    ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.qmm_linear.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, c_int, ptr, ptr, i64, c_int]
    lib.qmm_linear.restype = c_int
    lib.qmm_linear_channel.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, c_int]
    lib.qmm_linear_channel.restype = c_int
    lib.qmm_decode_attention.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, i64,
                                         ctypes.c_float, i64, ptr, c_int]
    lib.qmm_decode_attention.restype = c_int
    lib.qmm_decode_layer.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, ptr, c_int]
    lib.qmm_decode_layer.restype = c_int
    for name in ("qmm_isa", "qmm_detected_isa"):
        getattr(lib, name).restype = c_int
    lib.qmm_set_isa.argtypes, lib.qmm_set_isa.restype = [c_int], c_int
    return lib


def available() -> bool:
    """Whether the library is built (`make native`); any CPU runs it (plain C at worst)."""
    return _library() is not None


def isa() -> str:
    """The instruction set the kernel runs on here: AVX-512 VNNI (with AMX), AVX2 or plain C."""
    lib = _require()
    return ISAS[lib.qmm_isa()]


def per_channel_is_fast() -> bool:
    """Whether `matmul_channels` runs vectorised here (AVX-512 VNNI or AMX; elsewhere plain C)."""
    return available() and _require().qmm_isa() >= ISAS.index("AVX-512 VNNI")


def detected_isa_level() -> int:
    """The best path this CPU has: 0 plain C, 1 AVX2, 2 AVX-512 VNNI, 3 with AMX-INT8 too."""
    return _require().qmm_detected_isa()


@contextlib.contextmanager
def forced_isa(level: int) -> Iterator[None]:
    """Run the kernel on path `level` (0 plain C, 1 AVX2, 2 AVX-512 VNNI, 3 AMX) inside the block, so that
    tests check every path this CPU has; a level the CPU lacks is a ValueError."""
    lib = _require()
    before = lib.qmm_isa()
    if lib.qmm_set_isa(level) != level:
        raise ValueError(f"this CPU has no {ISAS[level] if 0 <= level < len(ISAS) else level} path "
                         f"(best: {ISAS[lib.qmm_detected_isa()]})")
    try:
        yield
    finally:
        lib.qmm_set_isa(before)


def _require() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native kernel library {LIBRARY} is not built: run `make native`")
    return lib


def padded_k(k: int) -> int:
    return -(-k // K_MULTIPLE) * K_MULTIPLE


def _fp16(values: Tensor, what: str) -> Tensor:
    out = values.half()
    if not torch.isfinite(out).all():
        raise ValueError(f"{what} must fit fp16 (the kernel stores them so), got a magnitude up to {values.abs().max():.3g}")
    return out.contiguous()


def pack_int4(q: Tensor, scales: Tensor, zeros: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Int4Linear groups of 32 (q [N, Kg] codes in 0..15, scales / zeros [N, Kg / 32], w = (q - 8) *
    scale + zero) -> (codes uint8 [N, Kp / 2], d fp16 [N, Kp / 32], m fp16 [N, Kp / 32]), w = d * q + m,
    K padded to Kp (a multiple of 64) with zero blocks. Per 64 codes, byte j = q[j] | q[32 + j] << 4."""
    n, kg = q.shape
    if scales.shape != (n, kg // BLOCK) or zeros.shape != scales.shape or kg % BLOCK:
        raise ValueError(f"the native int4 kernel takes groups of {BLOCK}: codes {tuple(q.shape)}, "
                         f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}")
    kp = padded_k(kg)
    pairs = F.pad(q.to(torch.uint8), (0, kp - kg)).reshape(n, kp // K_MULTIPLE, 2, BLOCK)
    codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, kp // 2)
    extra = (kp - kg) // BLOCK
    d = F.pad(scales.float(), (0, extra))
    m = F.pad(zeros.float() - formats.INT4_MID * scales.float(), (0, extra))
    return codes.contiguous(), _fp16(d, "int4 scales"), _fp16(m, "int4 minima")


def unpack_int4(codes: Tensor) -> Tensor:
    """pack_int4's codes [N, Kp / 2] -> q uint8 [N, Kp] in 0..15."""
    pairs = codes.reshape(codes.shape[0], -1, BLOCK)
    return torch.stack([pairs & 0x0F, pairs >> 4], dim=2).reshape(codes.shape[0], -1)


def pack_int8(q: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """int8 codes q [N, K] with a scale per 32 columns [N, K / 32] (w = q * scale, GGUF Q8_0's layout)
    -> (codes int8 [N, Kp], d fp16 [N, Kp / 32]), padded with zero blocks."""
    n, k = q.shape
    if scales.shape != (n, k // BLOCK) or k % BLOCK:
        raise ValueError(f"the native int8 kernel takes groups of {BLOCK}: codes {tuple(q.shape)}, scales {tuple(scales.shape)}")
    kp = padded_k(k)
    return F.pad(q, (0, kp - k)).contiguous(), _fp16(F.pad(scales.float(), (0, (kp - k) // BLOCK)), "int8 scales")


def matmul(x2: Tensor, codes: Tensor, d: Tensor, m: Tensor | None, in_features: int, bias: Tensor | None) -> Tensor:
    """x2 [M, K] times the packed weight's transpose (+ bias) -> [M, N] in x2's dtype. 4-bit weights
    (codes uint8 [N, Kp / 2]) come with their minima m, 8-bit ones (int8 [N, Kp]) without."""
    lib = _require()
    if x2.shape[-1] != in_features:
        raise ValueError(f"input rows of {x2.shape[-1]} features, the weight takes {in_features}")
    x = x2 if x2.dtype == torch.float32 and x2.stride(-1) == 1 else x2.float().contiguous()
    bits = 8 if codes.dtype == torch.int8 else 4
    n, kp = codes.shape[0], codes.shape[1] * (8 // bits)
    y = torch.empty(x.shape[0], n)
    fbias = None if bias is None else bias.float().contiguous()
    rc = lib.qmm_linear(x.data_ptr(), x.shape[0], in_features, x.stride(0), codes.data_ptr(), d.data_ptr(),
                        None if m is None else m.data_ptr(), n, kp, bits,
                        None if fbias is None else fbias.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"qmm_linear failed: {_ERRORS.get(rc, rc)} (x {tuple(x.shape)}, K {in_features}, "
                           f"codes {tuple(codes.shape)})")
    return y if x2.dtype == torch.float32 else y.to(x2.dtype)


def pack_int8_channels(q: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """int8 codes q [N, K] with one scale per output channel [N] (w = q * scale, Int8Linear's own layout)
    -> (codes int8 [Np / 16, Kp / 4, 16, 4], scales fp32 [N]) for `matmul_channels`: each 64 bytes are
    16 output channels x 4 consecutive k, N padded to a multiple of 16 and K to Kp with zero codes
    (native.c's per-channel section has why)."""
    n, k = q.shape
    if scales.shape != (n,):
        raise ValueError(f"the per-channel int8 kernel takes one scale per row: codes {tuple(q.shape)}, scales {tuple(scales.shape)}")
    padded = F.pad(q, (0, padded_k(k) - k, 0, -n % CHANNEL_COLS))
    groups = padded.reshape(-1, CHANNEL_COLS, padded.shape[1] // 4, 4).permute(0, 2, 1, 3)
    return groups.contiguous(), scales.float().contiguous()


def matmul_channels(x2: Tensor, codes: Tensor, scales: Tensor, in_features: int, bias: Tensor | None,
                    column_multiplier: Tensor | None = None) -> Tensor:
    """Per-token W8A8: x2 [M, K] (times column_multiplier [K], fp32, when given) quantised to int8 per row,
    times pack_int8_channels' weight transposed (+ bias) -> [M, N] in x2's dtype (qmm_linear_channel)."""
    lib = _require()
    if x2.shape[-1] != in_features:
        raise ValueError(f"input rows of {x2.shape[-1]} features, the weight takes {in_features}")
    x = x2 if x2.dtype == torch.float32 and x2.stride(-1) == 1 else x2.float().contiguous()
    n, kp = scales.shape[0], codes.shape[1] * 4
    y = torch.empty(x.shape[0], n)
    fbias = None if bias is None else bias.float().contiguous()
    rc = lib.qmm_linear_channel(x.data_ptr(), x.shape[0], in_features, x.stride(0),
                                None if column_multiplier is None else column_multiplier.data_ptr(), codes.data_ptr(),
                                scales.data_ptr(), n, kp, None if fbias is None else fbias.data_ptr(), y.data_ptr(), n,
                                torch.get_num_threads())
    if rc:
        raise RuntimeError(f"qmm_linear_channel failed: {_ERRORS.get(rc, rc)} (x {tuple(x.shape)}, K {in_features}, "
                           f"codes {tuple(codes.shape)})")
    return y if x2.dtype == torch.float32 else y.to(x2.dtype)


def decode_attention(qkv: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, metadata: AttentionMetadata,
                     num_heads: int, num_kv_heads: int, scale: float, window: int | None) -> Tensor:
    """One decode step of a layer's attention in one call: rotate q and k [T rows of qkv] by cos / sin
    [T, D], store k and v at metadata.slot_mapping in the fp32 paged cache [2, blocks, block_size,
    Hkv, D], and attend each row's query (sequence t = row t, one query each) over its cached keys
    -> [T, H * D]. engine/model/attention.py's torch path is the reference (tests/quant/test_native.py)."""
    lib = _require()
    tokens, head_dim = qkv.shape[0], cos.shape[1]
    out = torch.empty(tokens, num_heads * head_dim)
    rc = lib.qmm_decode_attention(
        qkv.data_ptr(), tokens, qkv.stride(0), cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(), kv_cache.shape[1],
        kv_cache.shape[2], metadata.slot_mapping.data_ptr(), metadata.block_tables.data_ptr(),
        metadata.block_tables.shape[1], metadata.seq_lens.data_ptr(), num_heads, num_kv_heads, head_dim, scale,
        window or 0, out.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"qmm_decode_attention failed: {_ERRORS.get(rc, rc)} (qkv {tuple(qkv.shape)}, cache "
                           f"{tuple(kv_cache.shape)}, seq_lens {metadata.seq_lens.tolist()})")
    return out


class _Weight(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("Kp", ctypes.c_int64), ("bits", ctypes.c_int64),
                ("per_channel", ctypes.c_int64), ("ws", ctypes.c_void_p), ("mul", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("window", ctypes.c_int64),
                ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("scale", ctypes.c_float),
                ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p),
                ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight)]


@dataclass(frozen=True)
class PackedWeight:
    """A Linear as the native matmuls take it: blocks of 32 (`matmul`: codes, fp16 scales d, minima m
    for 4-bit) or per channel (`matmul_channels`: pack_int8_channels' codes and fp32 scales, and the
    column multiplier 1 / smooth)."""

    codes: Tensor
    scales: Tensor
    mins: Tensor | None
    bias: Tensor | None
    in_features: int
    per_channel: bool = False
    column_multiplier: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.codes, self.scales, self.mins, self.bias, self.column_multiplier) if t is not None]

    def as_struct(self) -> _Weight:
        if self.bias is not None and self.bias.dtype != torch.float32:
            raise ValueError(f"the native decode layer takes fp32 biases, got {self.bias.dtype}")
        bias = None if self.bias is None else self.bias.data_ptr()
        if self.per_channel:
            mul = None if self.column_multiplier is None else self.column_multiplier.data_ptr()
            return _Weight(self.codes.data_ptr(), None, None, bias, self.scales.shape[0], self.in_features,
                           self.codes.shape[1] * 4, 8, 1, self.scales.data_ptr(), mul)
        bits = 8 if self.codes.dtype == torch.int8 else 4
        return _Weight(self.codes.data_ptr(), self.scales.data_ptr(), None if self.mins is None else self.mins.data_ptr(),
                       bias, self.codes.shape[0], self.in_features, self.codes.shape[1] * (8 // bits), bits, 0, None, None)


class DecodeLayer:
    """A Llama-family decoder layer whose four Linears all run the native kernel, as one native call per
    decode step (qmm_decode_layer: add + RMSNorm, qkv, decode attention, o, add + RMSNorm, gate_up,
    SiLU * up, down). It holds the tensors it points into, so they outlive it whatever the module does;
    `source` is what its owner built it from (to tell when to build another)."""

    def __init__(self, *, source: object, heads: int, kv_heads: int, head_dim: int, window: int | None, scale: float,
                 norms: tuple[tuple[Tensor, float], tuple[Tensor, float]], qkv: PackedWeight, o: PackedWeight,
                 gate_up: PackedWeight, down: PackedWeight) -> None:
        (norm1, eps1), (norm2, eps2) = norms
        self.tensors = [norm1, norm2] + [t for w in (qkv, o, gate_up, down) for t in w.tensors()]
        self.source = source
        self.struct = _Layer(norm1.shape[0], down.in_features, heads, kv_heads, head_dim, window or 0, eps1, eps2, scale,
                             norm1.data_ptr(), norm2.data_ptr(), *(w.as_struct() for w in (qkv, o, gate_up, down)))
        self.address = ctypes.addressof(self.struct)

    def __call__(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                 metadata: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """(this layer's MLP output, the residual stream after attention), as DecoderLayer.forward
        returns them, for a decode-only step in fp32 (engine.model.attention.native_decode_applies)."""
        lib = _require()
        x_out, residual_out = torch.empty_like(x), torch.empty_like(x)
        rc = lib.qmm_decode_layer(
            self.address, x.data_ptr(), None if residual is None else residual.data_ptr(), x_out.data_ptr(),
            residual_out.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(),
            kv_cache.shape[1], kv_cache.shape[2], metadata.slot_mapping.data_ptr(), metadata.block_tables.data_ptr(),
            metadata.block_tables.shape[1], metadata.seq_lens.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"qmm_decode_layer failed: {_ERRORS.get(rc, rc)} (x {tuple(x.shape)}, cache "
                               f"{tuple(kv_cache.shape)}, seq_lens {metadata.seq_lens.tolist()})")
        return x_out, residual_out
