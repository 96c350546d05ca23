"""The paged attention reference against plain dense attention, one sequence at a time."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import Tensor

from engine.kernels.metadata import build_attention_metadata
from engine.model.attention import allocate_kv_cache, paged_attention, write_kv_cache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def dense_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
    """q [Lq, H, D] are the last Lq positions of a sequence whose keys are k, v [L, Hkv, D]."""
    groups = HEADS // KV_HEADS
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("window", [None, 3])
def test_mixed_batch_with_padding_matches_dense_attention(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    # (tokens already cached, tokens added this step): decodes, a fresh prompt, a later chunk.
    shapes = [(9, 1), (0, 6), (5, 1), (7, 5), (2, 1)]
    blocks = list(range(32))
    random.Random(0).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-(c + n) // BLOCK))] for c, n in shapes]
    keys = [torch.randn(c + n, KV_HEADS, HEAD_DIM, generator=gen) for c, n in shapes]
    values = [torch.randn(c + n, KV_HEADS, HEAD_DIM, generator=gen) for c, n in shapes]

    cache = allocate_kv_cache(32, BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    _, prefix = build_attention_metadata([c for c, _ in shapes if c], [c for c, _ in shapes if c],
                                         [t for t, (c, _) in zip(tables, shapes) if c], BLOCK)
    write_kv_cache(cache, torch.cat([k[:c] for k, (c, _) in zip(keys, shapes)]),
                   torch.cat([v[:c] for v, (c, _) in zip(values, shapes)]), prefix.slot_mapping)

    _, step = build_attention_metadata([n for _, n in shapes], [c + n for c, n in shapes], tables, BLOCK)
    # Two padding tokens at the end, as a CUDA-graph batch would have: never written, output 0.
    slots = torch.cat([step.slot_mapping, torch.tensor([-1, -1])])
    new_k = torch.cat([k[c:] for k, (c, _) in zip(keys, shapes)] + [torch.full((2, KV_HEADS, HEAD_DIM), 99.0)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(values, shapes)] + [torch.full((2, KV_HEADS, HEAD_DIM), 99.0)])
    before = cache.clone()
    write_kv_cache(cache, new_k, new_v, slots)
    assert (cache == 99.0).sum() == 0 and (cache != before).any()

    q = torch.randn(new_k.shape[0], HEADS, HEAD_DIM, generator=gen)
    out = paged_attention(q, cache, step, HEAD_DIM**-0.5, window)
    start = 0
    for (cached, new), k, v in zip(shapes, keys, values):
        expected = dense_attention(q[start : start + new], k, v, window)
        assert torch.allclose(out[start : start + new], expected, atol=1e-5)
        start += new
    assert torch.all(out[start:] == 0)


def per_token_layout(query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int):
    """The batch layout written out token by token: the known answer for build_attention_metadata."""
    positions, slots = [], []
    for q_len, s_len, table in zip(query_lens, seq_lens, tables):
        for pos in range(s_len - q_len, s_len):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return positions, slots


@pytest.mark.parametrize("seed", range(20))
def test_batch_layout_equals_the_per_token_answer(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    query_lens, seq_lens, tables = [], [], []
    for _ in range(rng.randint(1, 6)):
        s_len = rng.randint(1, 70)
        query_lens.append(rng.choice([1, rng.randint(1, s_len)]))
        seq_lens.append(s_len)
        blocks = -(-s_len // block_size) + rng.randint(0, 2)  # tables may hold spare blocks
        tables.append(rng.sample(range(200), blocks))
    positions, m = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    expected_positions, expected_slots = per_token_layout(query_lens, seq_lens, tables, block_size)
    assert positions.tolist() == expected_positions and m.slot_mapping.tolist() == expected_slots
    assert m.query_start_loc.tolist() == [0, *itertools.accumulate(query_lens)]
    assert m.seq_lens.tolist() == seq_lens and (m.max_query_len, m.max_seq_len) == (max(query_lens), max(seq_lens))
    width = max(len(t) for t in tables)
    assert m.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert (positions.dtype, m.slot_mapping.dtype, m.block_tables.dtype) == (torch.int64, torch.int64, torch.int32)


def test_batch_layout_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="query_len=5, seq_len=4 and 1 blocks do not fit together"):
        build_attention_metadata([1, 5], [3, 4], [[0], [1]], 4)
    with pytest.raises(ValueError, match="query_len=1, seq_len=9 and 2 blocks do not fit together"):
        build_attention_metadata([1], [9], [[0, 1]], 4)
    with pytest.raises(ValueError, match="must list the same sequences"):
        build_attention_metadata([1], [1, 2], [[0]], 4)
