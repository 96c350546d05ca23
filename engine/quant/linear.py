"""Quantised drop-ins for a float Linear (engine.model.layers.Linear): Int8Linear, Int4Linear, Fp8Linear.

Each is built from a float Linear with `from_linear` and keeps its weight in the quantised
format as buffers (the bias, when there is one, stays in the activation dtype). Its output equals
F.linear(x, dequantized_weight(), bias) up to float rounding, except on the kernels that quantise
activations too: fbgemm's "dynamic" (below) and, on a CPU with the native library built
(engine/quant/native.py), "w4a8" / "w8a8" for weights in GGUF's blocks of 32 (a Q4_0 / Q4_1 / Q8_0
file's own groups): int8 activations per block of 32, llama.cpp's arithmetic, which "auto" picks
there.

CPU kernels (torch 2.13, measured on 2-core x86 machines; see engine/quant/README.md): torch's
packed weight-only kernels `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` have SIMD code
(AVX2, AVX-512, NEON) for bfloat16 activations only; with fp32 or fp16 activations they run a
scalar loop, 5-20x slower than an fp32 F.linear. So on a CPU these modules run them in bf16
(`packed_matmul`): the activations are rounded to bf16 on the way in, the products accumulate in
fp32, and the kernel rounds its output to bf16, 2^-9 relative each, far below the weights' own
quantisation error (docs/quantisation.md measures the cost). fbgemm's dynamic-quantised linear
(Int8Linear kernel="dynamic") also quantises the activations, to 7 bits per token, and is opt-in:
it costs more quality than weight-only int8, and as fbgemm's asymmetric range spans all rows, a
token's grid still depends slightly on which rows share its batch.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
import functools
from typing import Literal, Protocol
import warnings

import torch
from torch import Tensor, nn
import torch.nn.functional as F

from engine import kernels
from engine.quant import formats, native

Int8Kernel = Literal["auto", "triton", "int8pack", "dynamic", "w8a8", "dequant"]
Int4Kernel = Literal["auto", "w4a8", "int4pack", "dequant"]


class FloatLinear(Protocol):
    """What the quantised drop-ins are built from: a float Linear (engine.model.layers.Linear)."""

    # Read-only (properties), so that a Linear's Parameters match: an attribute would be invariant.
    @property
    def weight(self) -> Tensor: ...  # [out_features, in_features]

    @property
    def bias(self) -> Tensor | None: ...


# The activation dtype torch's packed CPU kernels are vectorised for (int4mm_kernel.cpp and
# int8mm_kernel.cpp specialise their AVX2 / AVX-512 / NEON micro-kernels for it).
PACKED_KERNEL_DTYPE = torch.bfloat16
# torch 2.13's AVX-512 bf16 _weight_int8pack_mm walks K in steps of 16 with no tail: other K
# return garbage or crash (seen with K = 72 and 100), so int8pack needs K a multiple of this.
INT8PACK_K_MULTIPLE = 16


def cpu_packed_kernels_vectorised() -> bool:
    """Whether torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu have SIMD code for this CPU
    (for bf16 activations): ARM, and x86 with AVX2 or AVX-512; older x86 runs their scalar loop."""
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return torch.backends.cpu.get_cpu_capability() != "DEFAULT"
    return True


@functools.cache
def _unit_scales(n: int) -> Tensor:
    """bf16 ones [n] on the CPU, shared by every int8pack call of that width (never written)."""
    return torch.ones(n, dtype=PACKED_KERNEL_DTYPE)


def packed_matmul(kernel: Callable[[Tensor], Tensor], x2: Tensor) -> Tensor:
    """Run a packed CPU kernel on rows x2 in its vectorised dtype (bf16), returning x2's dtype."""
    return kernel(x2.to(PACKED_KERNEL_DTYPE).contiguous()).to(x2.dtype)


def _flat(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _add_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    return y if bias is None else y + bias


class _QuantLinear(nn.Module):
    bias: Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dequantized_weight(self) -> Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def reference_forward(self, x: Tensor) -> Tensor:
        """F.linear on the dequantised weight, in x's dtype: what forward must match."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(_QuantLinear):
    """int8 weight-only, symmetric per-output-channel scales: weight int8 [N, K], scales [N].

    kernel: "triton" = engine.kernels.quant_matmul's dequantising matmul (CUDA; reads int8 weights
    only), "int8pack" = torch._weight_int8pack_mm (CPU; run in bf16 by packed_matmul, the
    per-channel scales applied to its output in x's dtype), "dequant" = (x @ weight.to(x.dtype)^T)
    * scales (any device; exact in x's dtype, but it converts the whole weight on every call),
    "dynamic" = W8A8 on the CPU, each token's activations quantised on each call, a second, packed
    copy of the int8 weight kept: on an AVX-512 VNNI CPU the native per-channel kernel
    (native.matmul_channels, on AMX tiles where the CPU has them: 8-bit activations, one call, ~1 %
    relative output error), elsewhere fbgemm's quantized::linear_dynamic (7-bit activations, ~2 %),
    "auto" = triton where the model runs Triton kernels (engine.kernels.use_triton), int8pack on a
    CPU where it is vectorised (cpu_packed_kernels_vectorised), else dequant.

    smooth [K] (SmoothQuant, engine/quant/smooth.py): the stored weight is W * smooth per input
    column and forward divides x by smooth first, moving activation outliers into the weight,
    where per-channel scales absorb them. Same function, easier activations for W8A8.

    scales [N, K / g] instead of [N]: a scale per group of g input columns, as a pre-quantised
    checkpoint stores them (GGUF Q8_0, g = 32; Int8Linear.from_groups). Two
    kernels run that layout: "dequant", and for g = 32 on a CPU "w8a8" = the native kernel
    (engine/quant/native.py: activations quantised to int8 per block of 32 on each call, llama.cpp's
    Q8_0 x Q8_0; weight zero-padded to [N, Kp], scales kept in fp16 as Q8_0 stores them), which
    "auto" picks there when the library is built.
    """

    # Buffers (register_buffer), declared for the type checker: nn.Module.__getattr__ is untyped.
    weight: Tensor
    scales: Tensor
    smooth: Tensor | None

    def __init__(
        self,
        weight: Tensor,
        scales: Tensor,
        bias: Tensor | None,
        kernel: Int8Kernel = "auto",
        smooth: Tensor | None = None,
    ) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        grouped = scales.dim() == 2
        blocks_of_32 = grouped and scales.shape[1] * native.BLOCK == in_features
        packable = in_features % INT8PACK_K_MULTIPLE == 0
        on_cpu = weight.device.type == "cpu"
        if kernel == "auto":
            kernel = ("w8a8" if blocks_of_32 and on_cpu and native.available() else "dequant" if grouped else
                      "triton" if kernels.use_triton(weight) else
                      "int8pack" if on_cpu and hasattr(torch, "_weight_int8pack_mm") and packable
                      and cpu_packed_kernels_vectorised() else "dequant")
        if kernel not in ("triton", "int8pack", "dynamic", "w8a8", "dequant"):
            raise ValueError(f"kernel must be auto, triton, int8pack, dynamic, w8a8 or dequant, got {kernel!r}")
        if kernel == "int8pack" and not packable:
            raise ValueError(f"int8pack needs in_features a multiple of {INT8PACK_K_MULTIPLE}, got {in_features}")
        if grouped and kernel not in ("dequant", "w8a8"):
            raise ValueError(f"group-wise int8 scales {tuple(scales.shape)} run on the dequant and w8a8 kernels only, not {kernel!r}")
        if kernel == "w8a8":
            if not (blocks_of_32 and on_cpu and native.available()):
                raise ValueError(f"w8a8 needs a CPU weight, scales per {native.BLOCK} columns and the native library "
                                 f"(make native): weight {tuple(weight.shape)} on {weight.device}, scales {tuple(scales.shape)}, "
                                 f"library built: {native.available()}")
            weight, scales = native.pack_int8(weight, scales)
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("smooth", None if smooth is None else smooth.float().contiguous())
        self.kernel = kernel
        # "dynamic": the native kernel's packing where this CPU runs it, else fbgemm's.
        native_w8a8 = kernel == "dynamic" and on_cpu and native.per_channel_is_fast()
        self._channels = native.pack_int8_channels(self.weight, self.scales) if native_w8a8 else None
        self._inv_smooth = None if self.smooth is None or not native_w8a8 else self.smooth.reciprocal().contiguous()
        self._packed = self._fbgemm_pack() if kernel == "dynamic" and not native_w8a8 else None

    @classmethod
    def from_linear(cls, linear: FloatLinear, kernel: Int8Kernel = "auto", smooth: Tensor | None = None) -> Int8Linear:
        weight = linear.weight if smooth is None else linear.weight * smooth.to(linear.weight.dtype)
        q, scales = formats.quantize_int8(weight)
        return cls(q, scales.to(linear.weight.dtype), linear.bias, kernel, smooth)

    @classmethod
    def from_groups(cls, linear: FloatLinear, q: Tensor, scales: Tensor, kernel: Int8Kernel = "auto") -> Int8Linear:
        """Replace `linear` with given int8 codes q [N, K] and per-group scales [N, K / g] (a
        pre-quantised checkpoint's, e.g. GGUF Q8_0)."""
        if q.shape != linear.weight.shape or scales.dim() != 2 or scales.shape[0] != q.shape[0] or q.shape[1] % scales.shape[1]:
            raise ValueError(f"int8 groups q {tuple(q.shape)}, scales {tuple(scales.shape)} do not fit a Linear of "
                             f"weight {tuple(linear.weight.shape)}")
        device, dtype = linear.weight.device, linear.weight.dtype
        return cls(q.to(device), scales.to(device, dtype), linear.bias, kernel)

    def native_weight(self) -> native.PackedWeight | None:
        """This Linear as the native kernels take it, when it runs one (w8a8, or dynamic on AVX-512 VNNI)."""
        if self._channels is not None:
            return native.PackedWeight(*self._channels, None, self.bias, self.in_features, per_channel=True,
                                       column_multiplier=self._inv_smooth)
        return native.PackedWeight(self.weight, self.scales, None, self.bias, self.in_features) if self.kernel == "w8a8" else None

    def _fbgemm_pack(self) -> object:
        if self.weight.device.type != "cpu" or not ({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines)):
            raise ValueError("Int8Linear kernel='dynamic' needs a CPU tensor and torch's fbgemm/x86 quantized engine")
        with warnings.catch_warnings():  # torch 2.13 flags quantized tensors as deprecated
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(
                self.weight, self.scales.double(), torch.zeros(self.out_features, dtype=torch.long), 0
            )
            return torch.ops.quantized.linear_prepack(qweight, None)

    def dequantized_weight(self) -> Tensor:
        w = formats.dequantize_int8(self.weight, self.scales)[:, : self.in_features]  # w8a8 pads K
        return w if self.smooth is None else w / self.smooth

    def forward(self, x: Tensor) -> Tensor:
        x2 = _flat(x)
        if self.kernel == "w8a8":
            return native.matmul(x2, self.weight, self.scales, None, self.in_features, self.bias).reshape(
                *x.shape[:-1], self.out_features)
        if self._channels is not None:  # SmoothQuant's division happens inside, on the way to int8
            y = native.matmul_channels(x2, *self._channels, self.in_features, None, self._inv_smooth)
            return _add_bias(y.reshape(*x.shape[:-1], self.out_features), self.bias)
        if self.smooth is not None:
            x2 = x2 / self.smooth.to(x.dtype)
        if self.kernel == "triton":
            from engine.kernels.quant_matmul import int8_weight_matmul

            y = int8_weight_matmul(x2, self.weight, self.scales)
        elif self.kernel == "int8pack":
            # Unit scales inside the bf16 kernel, the real ones after it in x's dtype: not rounded to bf16.
            y = packed_matmul(lambda rows: torch._weight_int8pack_mm(rows, self.weight, _unit_scales(self.out_features)), x2)
            y = y * self.scales.to(x.dtype)
        elif self.kernel == "dynamic":
            # fbgemm quantises its whole input with one scale; dividing each row by its own max first
            # (and multiplying it back after) makes that one scale fit every token: per-token
            # quantisation. One scale across a prefill's tokens cost SmolLM2 +1.10 nats/token, this +0.09.
            # reduce_range: 7-bit activations; with 8 bits fbgemm's AVX2 int16 accumulation saturates.
            # abs().amax() is the inf-norm bit for bit; torch's vector_norm(inf) over rows is ~10x slower on CPU.
            rows = x2.float()
            row_max = rows.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)
            y = torch.ops.quantized.linear_dynamic(rows / row_max, self._packed, True).mul_(row_max).to(x.dtype)
        else:
            y = (F.linear(x2, self.dequantized_weight().to(x.dtype)) if self.scales.dim() == 2 else
                 F.linear(x2, self.weight.to(x.dtype)) * self.scales.to(x.dtype))
        return _add_bias(y.reshape(*x.shape[:-1], self.out_features), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel={self.kernel}"


class Int4Linear(_QuantLinear):
    """int4 weight-only, asymmetric per group of `group_size` input columns (see formats).

    kernel (chosen once, from the weight's device and layout):
    - "w4a8": the native kernel (engine/quant/native.py; CPU, groups of 32, the library built):
      activations quantised to int8 per block of 32 on each call, llama.cpp's Q4_1 x Q8_1. Buffers:
      weight = codes uint8 [N, Kp64 / 2] in its layout, block_scales and block_mins fp16 [N, Kp64 / 32]
      (w = d * q + m: a GGUF Q4_0 / Q4_1 file's d and m exactly, K padded to a multiple of 64).
    - "int4pack": torch's `_weight_int4pack_mm_for_cpu` (CPU, N a multiple of 16), run in bf16
      (packed_matmul). weight = torch's opaque CPU int4pack [N, Kp/2], scales_and_zeros bf16.
    - "dequant": weight = plain nibbles [N, Kp/2] (formats.pack_int4), scales_and_zeros in the
      activation dtype; forward runs engine.kernels.quant_matmul's int4 kernel on CUDA or
      dequantises then matmuls elsewhere (exact in x's dtype, slow).
    scales_and_zeros is [Kp/g, N, 2], torch's int4pack layout: [..., 0] = scale, [..., 1] = zero,
    w = (q - 8) * scale + zero. "auto" takes the first of w4a8, int4pack (where torch's kernel is
    vectorised: cpu_packed_kernels_vectorised) and dequant that applies.
    Inputs are zero-padded from K to Kp when K is not a multiple of group_size.
    """

    # Buffers (register_buffer), declared for the type checker: nn.Module.__getattr__ is untyped.
    # block_scales and block_mins exist on "w4a8" only, scales_and_zeros on the other kernels.
    weight: Tensor
    block_scales: Tensor
    block_mins: Tensor
    scales_and_zeros: Tensor

    def __init__(
        self,
        q: Tensor,
        scales: Tensor,
        zeros: Tensor,
        in_features: int,
        bias: Tensor | None,
        dtype: torch.dtype,
        kernel: Int4Kernel = "auto",
    ) -> None:
        out_features, padded = q.shape
        super().__init__(in_features, out_features, bias)
        self.padded_in_features, self.group_size = padded, padded // scales.shape[1]
        self.kernel = self._choose(kernel, q.device)
        if self.kernel == "w4a8":
            codes, d, m = native.pack_int4(q, scales, zeros)
            self.register_buffer("weight", codes)
            self.register_buffer("block_scales", d)
            self.register_buffer("block_mins", m)
            return
        sz_dtype = PACKED_KERNEL_DTYPE if self.kernel == "int4pack" else dtype
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(sz_dtype))
        if self.kernel == "int4pack":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        else:
            packed = formats.pack_int4(q)
        self.register_buffer("weight", packed)

    def _choose(self, kernel: Int4Kernel, device: torch.device) -> str:
        on_cpu = device.type == "cpu"
        w4a8 = on_cpu and self.group_size == native.BLOCK and native.available()
        int4pack = on_cpu and self.out_features % 16 == 0 and hasattr(torch, "_weight_int4pack_mm_for_cpu")
        if kernel == "auto":
            return "w4a8" if w4a8 else "int4pack" if int4pack and cpu_packed_kernels_vectorised() else "dequant"
        if kernel == "w4a8" and not w4a8:
            raise ValueError(f"w4a8 needs a CPU weight, groups of {native.BLOCK} and the native library (make native): "
                             f"{device}, groups of {self.group_size}, library built: {native.available()}")
        if kernel == "int4pack" and not int4pack:
            raise ValueError(f"int4pack needs a CPU weight and out_features a multiple of 16: {device}, {self.out_features}")
        if kernel not in ("w4a8", "int4pack", "dequant"):
            raise ValueError(f"kernel must be auto, w4a8, int4pack or dequant, got {kernel!r}")
        return kernel

    @classmethod
    def from_linear(cls, linear: FloatLinear, group_size: int = 128, kernel: Int4Kernel = "auto") -> Int4Linear:
        return cls.from_groups(linear, *formats.quantize_int4(linear.weight, group_size), kernel=kernel)

    @classmethod
    def from_groups(
        cls, linear: FloatLinear, q: Tensor, scales: Tensor, zeros: Tensor, kernel: Int4Kernel = "auto"
    ) -> Int4Linear:
        """Replace `linear` with given codes q [N, Kp] in 0..15, scales and zeros [N, Kp / group]
        (a pre-quantised checkpoint's groups, or formats.quantize_int4's)."""
        out_features, in_features = linear.weight.shape
        if q.shape[0] != out_features or q.shape[1] < in_features or scales.shape != zeros.shape or (
                scales.shape[0] != out_features or q.shape[1] % scales.shape[1]):
            raise ValueError(f"int4 groups q {tuple(q.shape)}, scales {tuple(scales.shape)}, zeros "
                             f"{tuple(zeros.shape)} do not fit a Linear of weight {tuple(linear.weight.shape)}")
        device = linear.weight.device
        return cls(q.to(device), scales.to(device), zeros.to(device), in_features, linear.bias, linear.weight.dtype, kernel)

    def native_weight(self) -> native.PackedWeight | None:
        """This Linear as the native kernel takes it, when it runs that kernel (w4a8)."""
        return (native.PackedWeight(self.weight, self.block_scales, self.block_mins, self.bias, self.in_features)
                if self.kernel == "w4a8" else None)

    def _pad(self, x2: Tensor) -> Tensor:
        return F.pad(x2, (0, self.padded_in_features - self.in_features)) if self.padded_in_features != self.in_features else x2

    def codes(self) -> Tensor:
        """The stored codes q [N, Kp] in 0..15, as uint8."""
        if self.kernel == "w4a8":
            return native.unpack_int4(self.weight)[:, : self.padded_in_features]
        if self.kernel == "dequant":
            return formats.unpack_int4(self.weight)
        # The CPU pack is opaque: read it back through the kernel itself, with scale 1 and zero 8 so
        # that it returns the codes (exact in bf16) rather than weights rounded to bf16.
        unit = torch.ones_like(self.scales_and_zeros)
        unit[..., 1] = formats.INT4_MID
        eye = torch.eye(self.padded_in_features, dtype=PACKED_KERNEL_DTYPE, device=self.weight.device)
        return torch._weight_int4pack_mm_for_cpu(eye, self.weight, self.group_size, unit).t().to(torch.uint8)

    def dequantized_weight(self) -> Tensor:
        """fp32 [N, K]: the weight the kernels multiply by (with bf16 scales and zeros on int4pack, fp16 d and m on w4a8)."""
        if self.kernel == "w4a8":
            q = native.unpack_int4(self.weight).float().reshape(self.out_features, -1, native.BLOCK)
            w = q * self.block_scales.float()[..., None] + self.block_mins.float()[..., None]
            return w.reshape(self.out_features, -1)[:, : self.in_features]
        sz = self.scales_and_zeros.float()
        return formats.dequantize_int4(self.codes(), sz[..., 0].t(), sz[..., 1].t(), self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        x2 = _flat(x)
        if self.kernel == "w4a8":
            y = native.matmul(x2, self.weight, self.block_scales, self.block_mins, self.in_features, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.kernel == "int4pack" and x.device.type == "cpu":
            y = packed_matmul(lambda rows: torch._weight_int4pack_mm_for_cpu(
                rows, self.weight, self.group_size, self.scales_and_zeros), self._pad(x2))
        elif self.kernel == "dequant" and kernels.use_triton(x):
            from engine.kernels.quant_matmul import int4_weight_matmul

            sz = self.scales_and_zeros
            y = int4_weight_matmul(self._pad(x2), self.weight, sz[..., 0].t(), sz[..., 1].t(), self.group_size)
        else:
            y = F.linear(x2, self.dequantized_weight().to(x.dtype))
        return _add_bias(y.reshape(*x.shape[:-1], self.out_features), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}, kernel={self.kernel}"


class Fp8Linear(_QuantLinear):
    """fp8 e4m3 weight with per-output-channel scales: weight float8_e4m3fn [N, K], scales [N].

    On the CPU (and any device without fp8 GEMMs) forward upcasts the weight to the
    activation dtype, matmuls and scales the output columns. The target on Hopper is a native
    fp8 GEMM, torch._scaled_mm(x_fp8, weight.t(), scale_a, scale_b) with activations
    quantised per token; that path is not implemented here.
    """

    # Buffers (register_buffer), declared for the type checker: nn.Module.__getattr__ is untyped.
    weight: Tensor
    scales: Tensor

    def __init__(self, weight: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scales", scales.contiguous())

    @classmethod
    def from_linear(cls, linear: FloatLinear) -> Fp8Linear:
        q, scales = formats.quantize_fp8(linear.weight)
        return cls(q, scales.to(linear.weight.dtype), linear.bias)

    def dequantized_weight(self) -> Tensor:
        return formats.dequantize_fp8(self.weight, self.scales)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return _add_bias(y, self.bias)
