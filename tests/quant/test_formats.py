"""Round trips of the reference weight formats stay within their rounding bounds."""

import pytest
import torch

from engine.quant import formats


def weight(n: int = 48, k: int = 200, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[3] *= 50  # rows of very different magnitude: per-channel scales must handle both
    w[5] = 0.0  # an all-zero row
    return w


def test_int8_round_trip_within_half_a_step() -> None:
    w = weight()
    q, scales = formats.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scales.shape == (w.shape[0],)
    assert q.abs().max() <= 127
    err = (formats.dequantize_int8(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-6).all()
    assert torch.equal(formats.dequantize_int8(q, scales)[5], torch.zeros(w.shape[1]))
    # The largest entry of each non-zero row maps to +-127 exactly.
    assert (q[torch.arange(len(w)) != 5].abs().amax(dim=1) == 127).all()


@pytest.mark.parametrize("group_size,k", [(32, 200), (64, 192), (128, 576)])
def test_int4_round_trip_within_half_a_step(group_size: int, k: int) -> None:
    w = weight(k=k)
    q, scales, zeros = formats.quantize_int4(w, group_size)
    kp = formats.padded_in_features(k, group_size)
    assert q.shape == (w.shape[0], kp) and scales.shape == zeros.shape == (w.shape[0], kp // group_size)
    assert q.max() <= 15
    deq = formats.dequantize_int4(q, scales, zeros, k)
    assert deq.shape == w.shape
    step = scales.repeat_interleave(group_size, dim=1)[:, :k]
    assert ((deq - w).abs() <= step / 2 + 1e-5).all()
    # Mid-point convention of torch's int4pack: zero = min + 8 * scale.
    w_pad = torch.nn.functional.pad(w, (0, kp - k)).reshape(w.shape[0], -1, group_size)
    assert torch.allclose(zeros, w_pad.amin(-1) + 8 * scales)


def test_int4_pack_unpack_round_trip() -> None:
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    packed = formats.pack_int4(q)
    assert packed.shape == (16, 32)
    assert torch.equal(formats.unpack_int4(packed), q)
    assert torch.equal(packed[0, 0], q[0, 0] | (q[0, 1] << 4))


def test_fp8_round_trip_relative_error() -> None:
    w = weight()
    q, scales = formats.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn
    deq = formats.dequantize_fp8(q, scales)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for normals; subnormals
    # (below 2^-6 of the scale unit) have an absolute step of 2^-9 units.
    bound = w.abs() * 2**-4 + scales[:, None] * 2**-10
    assert ((deq - w).abs() <= bound + 1e-7).all()
    assert (deq.abs().amax(dim=1)[torch.arange(len(w)) != 5] - w.abs().amax(dim=1)[torch.arange(len(w)) != 5]).abs().max() < 1e-4 * w.abs().max()


def test_int4_rejects_odd_group() -> None:
    with pytest.raises(ValueError, match="group_size"):
        formats.quantize_int4(weight(), 7)
