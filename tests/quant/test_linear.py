"""Each quantised Linear computes F.linear on its own dequantised weight, and the stored
format dequantises to exactly what the reference formats give (torch's kernels included).
torch's packed CPU kernels compute in bf16: they match the same product with bf16 activations,
to bf16 output rounding."""

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers import Linear
from engine.quant import formats
from engine.quant.linear import PACKED_KERNEL_DTYPE, Fp8Linear, Int4Linear, Int8Linear, cpu_packed_kernels_vectorised


def make_linear(k: int, n: int, bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=bias)
    lin.weight.data = torch.randn(n, k, generator=g).to(dtype)
    if bias:
        lin.bias.data = torch.randn(n, generator=g).to(dtype)
    return lin.requires_grad_(False)


def inputs(k: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, k, generator=g).to(dtype) for shape in [(1,), (5,), (16,), (2, 3)]]


def assert_matches(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.float().abs().max().item(), f"max abs err {err:.3g}"


def reference(x: torch.Tensor, w_deq: torch.Tensor, lin: Linear, packed: bool = False) -> torch.Tensor:
    """F.linear in float64 on the dequantised weight; packed: on x rounded to the packed kernels' bf16."""
    x64 = x.to(PACKED_KERNEL_DTYPE).double() if packed else x.double()
    return F.linear(x64, w_deq.double(), None if lin.bias is None else lin.bias.double()).to(x.dtype)


# The packed kernels round their output to bf16 (half an ulp: up to 2^-8 of the largest output
# near the top of a binade) and accumulate in fp32 in their own order: within 2^-7 of the largest
# output, against 1e-5 for the float kernels (a wrong code or scale is off by whole percents).
PACKED_TOL = 2**-7


@pytest.mark.parametrize("kernel", ["int8pack", "dequant"])
@pytest.mark.parametrize("k,n,bias", [(96, 48, False), (80, 40, True)])
def test_int8_linear_matches_its_dequantised_weight(kernel: str, k: int, n: int, bias: bool) -> None:
    lin = make_linear(k, n, bias)
    q, scales = formats.quantize_int8(lin.weight)
    mod = Int8Linear.from_linear(lin, kernel)
    assert mod.kernel == kernel and mod.weight.dtype == torch.int8 and mod.weight.shape == (n, k)
    assert torch.equal(mod.weight, q) and torch.equal(mod.scales, scales)
    packed = kernel == "int8pack"
    for x in inputs(k):
        assert_matches(mod(x), reference(x, formats.dequantize_int8(q, scales), lin, packed), PACKED_TOL if packed else 1e-5)


def test_int8_auto_kernel_on_cpu() -> None:
    expected = "int8pack" if cpu_packed_kernels_vectorised() else "dequant"
    assert Int8Linear.from_linear(make_linear(64, 32, False)).kernel == expected
    # K = 72: torch's AVX-512 int8pack kernel has no tail loop, so it is never chosen, nor allowed.
    assert Int8Linear.from_linear(make_linear(72, 32, False)).kernel == "dequant"
    with pytest.raises(ValueError, match="int8pack needs in_features a multiple of 16, got 72"):
        Int8Linear.from_linear(make_linear(72, 32, False), "int8pack")


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_packed_kernels_agree_with_the_float_kernels_on_every_row(rows: int) -> None:
    """Rows are independent: a batch of 16 or 40 gives each row what it gets alone (the old int8
    weight-only path ran torch's scalar fp32 loop, 0.08x fp32 at batch 16; any batch shape now takes
    the bf16 kernels)."""
    lin = make_linear(128, 64, True)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2))
    for fast, exact in [(Int8Linear.from_linear(lin, "int8pack"), Int8Linear.from_linear(lin, "dequant")),
                        (Int4Linear.from_linear(lin, 32, kernel="int4pack"), Int4Linear.from_linear(lin, 32, kernel="dequant"))]:
        y = fast(x)
        assert_matches(y, exact(x.to(PACKED_KERNEL_DTYPE).float()), PACKED_TOL)
        for row in (0, rows - 1):
            assert torch.equal(fast(x[row : row + 1])[0], y[row])


def test_int8_dynamic_kernel_is_close() -> None:
    # fbgemm also quantises the activations (per tensor): close, not exact.
    lin = make_linear(128, 64, True)
    mod = Int8Linear.from_linear(lin, "dynamic")
    q, scales = formats.quantize_int8(lin.weight)
    for x in inputs(128):
        ref = reference(x, formats.dequantize_int8(q, scales), lin)
        assert ((mod(x) - ref).norm() / ref.norm()).item() < 0.03


@pytest.mark.parametrize("k,n,group", [(256, 48, 128), (200, 32, 64), (96, 40, 32)])
def test_int4_linear_matches_its_dequantised_weight(k: int, n: int, group: int) -> None:
    # N=40 is not a multiple of 16: torch's CPU int4pack refuses it, so only the nibble layout runs.
    # (The native w4a8 kernel, which quantises activations, is checked in test_native.)
    lin = make_linear(k, n, bias=True)
    q, scales, zeros = formats.quantize_int4(lin.weight, group)
    for kernel in ("int4pack", "dequant") if n % 16 == 0 else ("dequant",):
        mod = Int4Linear.from_linear(lin, group, kernel=kernel)
        packed = kernel == "int4pack"
        assert mod.group_size == group and mod.kernel == kernel
        # The stored weight reads back as our reference dequantisation: torch's packing and
        # its (q - 8) * scale + zero convention agree with engine.quant.formats (the packed
        # kernel with its scales and zeros in bf16, as it takes them).
        assert torch.equal(mod.codes()[:, :k], q[:, :k])
        sz = mod.scales_and_zeros.float()
        w_deq = formats.dequantize_int4(q, sz[..., 0].t(), sz[..., 1].t(), k)
        assert sz.dtype == torch.float32 and torch.allclose(mod.dequantized_weight(), w_deq, atol=1e-5)
        if not packed:
            torch.testing.assert_close(w_deq, formats.dequantize_int4(q, scales, zeros, k), rtol=0, atol=0)
        for x in inputs(k):
            assert_matches(mod(x), reference(x, w_deq, lin, packed), PACKED_TOL if packed else 1e-5)
    if n % 16:
        with pytest.raises(ValueError, match="int4pack needs a CPU weight and out_features a multiple of 16"):
            Int4Linear.from_linear(lin, group, kernel="int4pack")


@pytest.mark.parametrize("k,n,bias", [(96, 48, False), (72, 40, True)])
def test_fp8_linear_matches_its_dequantised_weight(k: int, n: int, bias: bool) -> None:
    lin = make_linear(k, n, bias)
    q, scales = formats.quantize_fp8(lin.weight)
    mod = Fp8Linear.from_linear(lin)
    assert mod.weight.dtype == torch.float8_e4m3fn
    for x in inputs(k):
        assert_matches(mod(x), reference(x, formats.dequantize_fp8(q, scales), lin), 1e-5)


@pytest.mark.parametrize("make", [
    lambda lin: Int8Linear.from_linear(lin),
    lambda lin: Int8Linear.from_linear(lin, "dequant"),
    lambda lin: Int4Linear.from_linear(lin, 64, kernel="int4pack"),
    lambda lin: Int4Linear.from_linear(lin, 64, kernel="dequant"),
    lambda lin: Fp8Linear.from_linear(lin),
], ids=["int8-auto", "int8-dequant", "int4-cpu-kernel", "int4-nibbles", "fp8"])
def test_bf16_activations(make) -> None:
    lin = make_linear(128, 64, True, torch.bfloat16)
    mod = make(lin)
    assert mod.bias.dtype == torch.bfloat16
    for x in inputs(128, torch.bfloat16):
        # bf16 output rounding (2^-8 relative) plus bf16 scales/zeros.
        assert_matches(mod(x), mod.reference_forward(x.float()).to(torch.bfloat16), 0.02)


def test_quantised_output_is_close_to_the_float_linear() -> None:
    lin = make_linear(256, 64, False)
    x = inputs(256)[2]
    exact = F.linear(x, lin.weight)
    for mod, tol in [(Int8Linear.from_linear(lin), 0.01), (Fp8Linear.from_linear(lin), 0.05), (Int4Linear.from_linear(lin), 0.15)]:
        err = (mod(x) - exact).norm() / exact.norm()
        assert err < tol, (type(mod).__name__, err.item())


def test_smoothing_moves_activation_outliers_into_the_weight_without_changing_the_function() -> None:
    from engine.quant.smooth import smoothing_factors

    lin = make_linear(64, 32, bias=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=g)
    x[:, 5] *= 40.0  # an outlier channel, in every token, as LLM activations have
    smooth = smoothing_factors(lin.weight, x.abs().amax(0))
    plain = Int8Linear.from_linear(lin, "dynamic")
    smoothed = Int8Linear.from_linear(lin, "dynamic", smooth)
    exact = reference(x, lin.weight, lin)
    # forward is F.linear on the effective weight (the stored one with the smoothing undone), up to
    # activation quantisation.
    assert_matches(smoothed(x), smoothed.reference_forward(x), 0.03)
    err_plain = (plain(x) - exact).norm() / exact.norm()
    err_smooth = (smoothed(x) - exact).norm() / exact.norm()
    assert err_smooth < err_plain / 2, (err_smooth, err_plain)
    assert smooth[5] > 3 * smooth.median()  # the outlier channel is the one divided most


def test_group_wise_int8_from_a_checkpoint_on_the_dequant_kernel() -> None:
    lin = make_linear(64, 16, bias=True)
    q = torch.randint(-127, 128, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(4))
    scales = torch.rand(16, 2, generator=torch.Generator().manual_seed(5))  # groups of 32 columns
    mod = Int8Linear.from_groups(lin, q, scales, "dequant")  # w8a8 (fp16 scales): test_native
    expected_weight = q.float() * scales.repeat_interleave(32, dim=1)
    torch.testing.assert_close(mod.dequantized_weight(), expected_weight)
    for x in inputs(64):
        assert_matches(mod(x), reference(x, expected_weight, lin), 1e-5)
    with pytest.raises(ValueError, match="dequant and w8a8 kernels only"):
        Int8Linear(q, scales, None, kernel="dynamic")
    with pytest.raises(ValueError, match="do not fit"):
        Int8Linear.from_groups(lin, q[:, :48], scales)
