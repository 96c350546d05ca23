"""The paged attention and KV-cache write kernels against the torch reference, on tiny shapes."""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from engine.kernels.kv_cache import write_kv_cache_triton
from engine.kernels.paged_attention import num_kv_splits, paged_attention_triton
from engine.kernels.metadata import AttentionMetadata, build_attention_metadata
from engine.model.attention import _reference_paged_attention, allocate_kv_cache, write_kv_cache

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
NUM_BLOCKS = 64
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


def filled_cache(
    shapes: list[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    padding: int = 0,
    heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
    seed: int = 0,
) -> tuple[Tensor, Tensor, AttentionMetadata]:
    """A cache holding every sequence's context (cached + new tokens, written by the reference),
    the step's queries [T + padding, H, D] and the step's metadata, for (cached, new) shapes."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)  # scattered, non-monotonic block tables
    tables = [[blocks.pop() for _ in range(-(-(c + n) // block_size))] for c, n in shapes]
    seq_lens = [c + n for c, n in shapes]
    cache = allocate_kv_cache(NUM_BLOCKS, block_size, num_kv_heads, head_dim, dtype)
    _, everything = build_attention_metadata(seq_lens, seq_lens, tables, block_size)
    total = sum(seq_lens)
    write_kv_cache(
        cache,
        torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype),
        torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype),
        everything.slot_mapping,
    )
    _, step = build_attention_metadata([n for _, n in shapes], seq_lens, tables, block_size)
    q = torch.randn(sum(n for _, n in shapes) + padding, num_heads, head_dim, generator=gen).to(dtype)
    return q, cache, step


def check_against_reference(
    shapes: list[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    window: int | None,
    padding: int = 0,
    kv_splits: int | None = None,
    heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
) -> None:
    q, cache, metadata = filled_cache(shapes, block_size, dtype, padding, heads)
    scale = heads[2] ** -0.5
    # The fp32 reference on the same (rounded) inputs: the kernel accumulates in fp32 too.
    expected = _reference_paged_attention(q.float(), cache.float(), metadata, scale, window)
    out = paged_attention_triton(q, cache, metadata, scale, window, kv_splits=kv_splits)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)
    if padding:
        assert torch.all(out[-padding:] == 0)


# (tokens already cached, tokens added this step): decodes, a fresh prompt, a chunk over a cached
# prefix. Contexts span two 32-key tiles, so a window of 10 puts the first visible key of
# the (40, 1) decode at 31, one before a tile boundary.
MIXED = [(9, 1), (0, 6), (40, 1), (45, 11), (2, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 10])
def test_mixed_batch_with_padding(dtype: torch.dtype, window: int | None) -> None:
    check_against_reference(MIXED, block_size=4, dtype=dtype, window=window, padding=3)


def test_block_size_16_and_long_prefill_chunk() -> None:
    # 40 new tokens x 2 query heads per KV head fill 64-row tiles over a 24-token cached prefix.
    check_against_reference([(24, 40), (30, 1)], block_size=16, dtype=torch.float32, window=None)


@pytest.mark.parametrize("kv_splits", [1, 2])
def test_three_query_heads_per_kv_head_and_padded_head_dim(kv_splits: int) -> None:
    # SmolLM-like GQA: groups of 3 leave the 16th tile row unused; head_dim 24 is padded to 32.
    shapes = [(17, 1), (5, 1)] if kv_splits > 1 else [(17, 1), (0, 7), (5, 3)]
    check_against_reference(shapes, block_size=4, dtype=torch.float32, window=None, padding=1,
                            kv_splits=kv_splits, heads=(6, 2, 24))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 23])
@pytest.mark.parametrize("kv_splits", [1, 3])
def test_decode_batch(dtype: torch.dtype, window: int | None, kv_splits: int) -> None:
    # kv_splits=3 forces split-KV: slices of 16-key tiles over up to 70 keys, so a slice may be
    # empty, partial or cut by the window (whose first key, 47 or 15, sits one before a tile
    # boundary, so an off-by-one in the slice start shows). kv_splits=1: the main kernel's decode tiling.
    check_against_reference([(69, 1), (20, 1), (37, 1)], block_size=4, dtype=dtype, window=window,
                            padding=2, kv_splits=kv_splits)


def test_split_kv_heuristic_reads_host_ints_only() -> None:
    def decode_metadata(num_seqs: int, seq_len: int) -> AttentionMetadata:
        # On the meta device any read of a tensor's values (a device sync on CUDA) would raise.
        blocks = [[0] * -(-seq_len // 16)] * num_seqs
        return build_attention_metadata([1] * num_seqs, [seq_len] * num_seqs, blocks, 16, device="meta")[1]

    assert num_kv_splits(decode_metadata(2, 8192), KV_HEADS, None) == 32
    assert num_kv_splits(decode_metadata(2, 8192), KV_HEADS, 1024) == 4  # the window bounds the keys
    assert num_kv_splits(decode_metadata(2, 300), KV_HEADS, None) == 1  # short contexts
    assert num_kv_splits(decode_metadata(200, 8192), KV_HEADS, None) == 1  # enough programs already
    _, prefill = build_attention_metadata([5, 1], [4096, 4096], [[0] * 256] * 2, 16)
    assert num_kv_splits(prefill, KV_HEADS, None) == 1
    with pytest.raises(ValueError, match="pure-decode"):
        q = torch.zeros(6, HEADS, HEAD_DIM)
        paged_attention_triton(q, torch.zeros(2, 1, 16, KV_HEADS, HEAD_DIM), prefill, 1.0, None, kv_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_cache_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    block_size, tokens = 4, 7
    # k and v as strided views of a fused projection, the way the decoder produces them.
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    _, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    k, v = k.view(tokens, KV_HEADS, HEAD_DIM), v.view(tokens, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([13, -1, 0, 22, 5, -1, 31])
    expected = torch.randn(2, 8, block_size, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    actual = expected.clone()
    write_kv_cache(expected, k, v, slots)
    write_kv_cache_triton(actual, k, v, slots)
    assert torch.equal(actual, expected)
