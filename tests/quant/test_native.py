"""The native W4A8 / W8A8 kernel (engine/quant/csrc/native.c) against its torch reference
(formats.block_matmul, in float64) on every instruction-set path this CPU has (AMX, AVX-512 VNNI,
AVX2, plain C), and the Linears that run it against F.linear on their own dequantised weights; the
per-channel W8A8 kernel against its float64 definition, every path bit for bit with plain C.

Tolerances: the kernel adds the reference's fp32 block products in another order, so it is held to
1e-4 of the largest output (a wrong code, nibble order, scale or minimum is off by percents). Against
F.linear on the dequantised weight the difference is the activations' int8 rounding (half a step of
amax / 127 per block), held to 2 % of the largest output.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from engine.quant import formats, native
from engine.quant.linear import Int4Linear, Int8Linear
from tests.quant.test_linear import assert_matches, inputs, make_linear

# CI builds the library (make test depends on it): there a missing one fails rather than skips.
pytestmark = pytest.mark.skipif(not native.available() and not os.environ.get("CI"),
                                reason="the native kernel is not built: make native")

PATHS = list(range(native.detected_isa_level() + 1)) if native.available() else [0]
KERNEL_TOL = 1e-4
ACTIVATION_TOL = 0.02
SHAPES = [(1, 576, 48), (5, 100, 40), (16, 1536, 64), (3, 64, 17), (7, 2080, 130)]


def activations(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=g)
    x[:, 3] *= 30.0  # an outlier channel, as LLM activations have: its block gets a coarse grid
    x[0, 32:64] = 0.0  # an all-zero block (scale 0)
    return x


def int4_groups(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kg = -(-k // 32) * 32
    q = torch.randint(0, 16, (n, kg), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, kg // 32, generator=g) * 0.1 + 0.01
    return q, scales, torch.randn(n, kg // 32, generator=g) * 0.1


@pytest.mark.parametrize("level", PATHS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int4_kernel_matches_its_reference(level: int, m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * k + n)
    q, scales, zeros = int4_groups(n, k, g)
    codes, d, mins = native.pack_int4(q, scales, zeros)
    assert torch.equal(native.unpack_int4(codes)[:, : q.shape[1]], q)
    assert codes.shape[1] * 2 % 64 == 0 and d.dtype == mins.dtype == torch.float16
    x, bias = activations(m, k, g), torch.randn(n, generator=g)
    with native.forced_isa(level):
        y = native.matmul(x, codes, d, mins, k, bias)
    ref = formats.block_matmul(x, native.unpack_int4(codes), d, mins) + bias.double()
    assert_matches(y, ref.float(), KERNEL_TOL)


@pytest.mark.parametrize("level", PATHS)
@pytest.mark.parametrize("m,k,n", [s for s in SHAPES if s[1] % 32 == 0])
def test_int8_kernel_matches_its_reference(level: int, m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * k + n + 1)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    codes, d = native.pack_int8(q, torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3)
    x = activations(m, k, g)
    with native.forced_isa(level):
        y = native.matmul(x, codes, d, None, k, None)
    assert_matches(y, formats.block_matmul(x, codes, d, None).float(), KERNEL_TOL)


def per_token_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mul: torch.Tensor | None) -> torch.Tensor:
    """Per-token W8A8 as qmm_linear_channel defines it, in float64 after the fp32 steps it rounds."""
    v = x * mul if mul is not None else x
    amax = v.abs().amax(dim=1, keepdim=True)
    scale = amax / 127
    inv = torch.where(amax > 0, 1 / scale, torch.zeros_like(scale))
    xq = torch.round(v * inv)  # ties to even, as the kernel rounds
    return (xq.double() @ q.double().T) * (scales.double()[None, :] * scale.double())


@pytest.mark.parametrize("level", PATHS)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("smoothed", [False, True])
def test_per_channel_kernel_matches_its_reference_and_every_path_agrees_bit_for_bit(
        level: int, m: int, k: int, n: int, smoothed: bool) -> None:
    g = torch.Generator().manual_seed(m * k + n + 7)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.01 + 1e-3
    mul = torch.rand(k, generator=g) + 0.5 if smoothed else None
    codes, ws = native.pack_int8_channels(q, scales)
    assert codes.shape == (-(-n // 16), native.padded_k(k) // 4, 16, 4) and codes.dtype == torch.int8
    x, bias = activations(m, k, g), torch.randn(n, generator=g)
    with native.forced_isa(level):
        y = native.matmul_channels(x, codes, ws, k, bias, mul)
    assert_matches(y, (per_token_reference(x, q, scales, mul) + bias.double()).float(), KERNEL_TOL)
    with native.forced_isa(0):
        assert torch.equal(y, native.matmul_channels(x, codes, ws, k, bias, mul))


def test_per_channel_codes_at_their_limits_do_not_overflow() -> None:
    """The longest K the kernel takes, every code and activation at +-127: the integer sums are exact."""
    k = 65536
    q = torch.full((16, k), 127, dtype=torch.int8)
    q[1::2] = -127
    x = torch.ones(1, k)
    codes, ws = native.pack_int8_channels(q, torch.ones(16))
    y = native.matmul_channels(x, codes, ws, k, None)
    # 127 * 127 * k in the integers, times 1 (the weight's scale) and 1 / 127 (the row's) in fp32.
    torch.testing.assert_close(y[0], torch.tensor([127.0 * k, -127.0 * k] * 8), rtol=1e-6, atol=0)


def test_threads_split_the_columns_without_changing_a_bit() -> None:
    g = torch.Generator().manual_seed(3)
    codes, d, mins = native.pack_int4(*int4_groups(300, 576, g))
    x = activations(4, 576, g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.matmul(x, codes, d, mins, 576, None)
        torch.set_num_threads(3)
        assert torch.equal(native.matmul(x, codes, d, mins, 576, None), one)
    finally:
        torch.set_num_threads(threads)


def test_per_channel_threads_split_the_channel_groups_without_changing_a_bit() -> None:
    g = torch.Generator().manual_seed(4)
    codes, ws = native.pack_int8_channels(torch.randint(-127, 128, (300, 576), generator=g, dtype=torch.int8),
                                          torch.rand(300, generator=g) * 0.01 + 1e-3)
    x = activations(20, 576, g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.matmul_channels(x, codes, ws, 576, None)
        torch.set_num_threads(3)
        assert torch.equal(native.matmul_channels(x, codes, ws, 576, None), one)
    finally:
        torch.set_num_threads(threads)


def test_activation_quantisation_reference() -> None:
    x = torch.zeros(2, 40)
    x[0, :32] = torch.linspace(-2.0, 1.0, 32)
    x[1, 32:40] = 0.5
    xq, xd, xs = formats.quantize_activations(x, 64)
    assert xq.shape == (2, 64) and xd.shape == xs.shape == (2, 2)
    assert xq[0, 0] == -127 and xd[0, 0] == pytest.approx(2.0 / 127)
    assert xd[0, 1] == 0 and not xq[0, 32:].any()  # zero padding, zero scale
    assert torch.equal(xq[1, 32:40], torch.full((8,), 127, dtype=torch.int8)) and xs[1, 1] == pytest.approx(4.0)
    err = (xq.float().reshape(2, 2, 32) * xd[..., None] - F.pad(x, (0, 24)).reshape(2, 2, 32)).abs()
    assert (err <= xd[..., None] / 2 + 1e-7).all()


def test_int4_linear_runs_w4a8_on_groups_of_32() -> None:
    lin = make_linear(576, 64, bias=True)
    mod = Int4Linear.from_linear(lin, 32)
    assert mod.kernel == "w4a8"
    q, scales, zeros = formats.quantize_int4(lin.weight, 32)
    assert torch.equal(mod.codes(), q)
    # d and m are fp16 (as a GGUF file stores them): the reference weight to their rounding (2^-11 of
    # each, so within 2^-10 of the largest weight).
    atol = 2**-10 * lin.weight.abs().max().item()
    torch.testing.assert_close(mod.dequantized_weight(), formats.dequantize_int4(q, scales, zeros), rtol=0, atol=atol)
    w = mod.dequantized_weight()
    for x in inputs(576):
        y = mod(x)
        ref = formats.block_matmul(x.reshape(-1, 576), native.unpack_int4(mod.weight), mod.block_scales, mod.block_mins)
        assert_matches(y.reshape(-1, 64), (ref + lin.bias.double()).float(), KERNEL_TOL)
        assert_matches(y, F.linear(x, w, lin.bias), ACTIVATION_TOL)
    assert Int4Linear.from_linear(lin, 64).kernel != "w4a8"  # other group sizes keep torch's kernels
    with pytest.raises(ValueError, match="w4a8 needs a CPU weight, groups of 32"):
        Int4Linear.from_linear(lin, 64, kernel="w4a8")


def test_int8_groups_of_32_run_w8a8_and_keep_their_codes_and_scales() -> None:
    """A GGUF Q8_0 matrix kept under weight_dtype="int8" (Int8Linear.from_groups) runs w8a8."""
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-127, 128, (64, 96), generator=g, dtype=torch.int8)
    scales = (torch.rand(64, 3, generator=g) * 0.01 + 1e-3).half().float()  # fp16, as Q8_0 stores them
    lin = make_linear(96, 64, bias=True)
    mod = Int8Linear.from_groups(lin, q, scales)
    assert mod.kernel == "w8a8" and mod.weight.shape == (64, 128)  # K padded to a pair of blocks
    assert torch.equal(mod.weight[:, :96], q) and torch.equal(mod.scales[:, :3].float(), scales)
    w = formats.dequantize_int8(q, scales)
    torch.testing.assert_close(mod.dequantized_weight(), w, rtol=0, atol=0)
    for x in inputs(96):
        y = mod(x)
        ref = formats.block_matmul(x.reshape(-1, 96), mod.weight, mod.scales, None) + lin.bias.double()
        assert_matches(y.reshape(-1, 64), ref.float(), KERNEL_TOL)
        assert_matches(y, F.linear(x, w, lin.bias), ACTIVATION_TOL)
    assert Int8Linear.from_groups(lin, q, scales, "dequant").kernel == "dequant"
    with pytest.raises(ValueError, match="w8a8 needs a CPU weight, scales per 32 columns"):
        Int8Linear(q, torch.rand(64, 2), None, kernel="w8a8")  # groups of 48


def test_bf16_rows_come_back_in_bf16() -> None:
    lin = make_linear(128, 32, bias=True, dtype=torch.bfloat16)
    mod = Int4Linear.from_linear(lin, 32)
    x = inputs(128, torch.bfloat16)[1]
    y = mod(x)
    assert y.dtype == torch.bfloat16
    assert_matches(y, mod(x.float()).to(torch.bfloat16), 2**-7)


@pytest.mark.parametrize("level", PATHS)
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_matches_the_torch_path(level: int, window: int | None) -> None:
    """Rotary, cache write and GQA attention over out-of-order paged blocks, as the torch reference
    does them (the same products for rotary and the write: equal to 1e-6; attention sums in another
    order: within 1e-5)."""
    from engine.kernels.metadata import build_attention_metadata
    from engine.model.attention import attend
    from engine.model.rotary import RotaryEmbedding, rotate_qk

    g = torch.Generator().manual_seed(9)
    heads, kv_heads, dim, block, blocks = 6, 2, 32, 4, 16
    seq_lens = [1, 7, 13, 4]
    order, tables = (torch.randperm(blocks - 1, generator=g) + 1).tolist(), []
    for n in seq_lens:
        used = -(-n // block)
        tables.append(order[:used])
        order = order[used:]
    positions, meta = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block)
    cache = torch.randn(2, blocks, block, kv_heads, dim, generator=g)  # the earlier tokens' K and V
    expected_cache = cache.clone()
    qkv = torch.randn(len(seq_lens), (heads + 2 * kv_heads) * dim, generator=g)
    cos, sin = RotaryEmbedding(dim, 10000.0, None)(positions)
    q, k, v = (t.reshape(len(seq_lens), -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    q, k = rotate_qk(q, k, cos, sin)
    expected = attend(q, k, v, expected_cache, meta, dim**-0.5, window).reshape(len(seq_lens), -1)
    with native.forced_isa(level):
        got = native.decode_attention(qkv, cos, sin, cache, meta, heads, kv_heads, dim**-0.5, window)
    torch.testing.assert_close(cache, expected_cache, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["int4 groups of 32", "int8 per channel"])
def test_a_decoder_layer_in_one_call_matches_it_op_by_op(model_dirs, monkeypatch: pytest.MonkeyPatch, weights: str) -> None:
    """A whole layer per native call (native.DecodeLayer) gives the logits of the same model run op by op
    (the same native matmuls and attention, torch's norms and SiLU between them). The int8 rounding of
    activations can flip on the last-ulp differences of those, so: within 1e-3 of the largest logit."""
    from engine.model.decoder import DecoderLayer
    from engine.model.loader import load_model
    from engine.model.quantize import quantize_model
    from tests.quant.helpers import run_logits

    model = load_model(str(model_dirs["llama"]), random_weights=True, seed=3).model
    if weights == "int4 groups of 32":
        quantize_model(model, "int4", group_size=32)
    else:
        quantize_model(model, "int8", int8_kernel="dynamic")
        if not native.per_channel_is_fast():  # fbgemm's weights there: no layer may run as one native call
            assert all(layer.native_decode_layer() is None for layer in model.model.layers)
            return
    prompt, decode = [5, 17, 99, 3, 41], [7, 200, 9, 4, 120, 33]
    fused = run_logits(model, prompt, decode)
    assert all(layer.native_decode_layer() is not None for layer in model.model.layers)
    monkeypatch.setattr(DecoderLayer, "native_decode_layer", lambda self: None)
    assert_matches(fused, run_logits(model, prompt, decode), 1e-3)
