"""Paged attention over a flat batch that mixes prefill chunks and decodes, as Triton kernels.

Reference: engine.model.attention._reference_paged_attention (same inputs, same result).

Main kernel: one program per (query block of one sequence, KV head). Its tile holds BLOCK_Q
query tokens x the NUM_QUERIES_PER_KV query heads that share that KV head (GQA), so each K/V
tile is loaded once for the whole group and the tile is tall enough for tl.dot. The program
walks the sequence's keys TILE_N at a time, gathering each key's physical block through the
block table, with an online (flash) softmax in fp32. Programs find their sequence by binary
search over query_start_loc, so launching needs no device-to-host sync.

Split-KV variant, for pure-decode batches with few sequences and long contexts: there the
main kernel launches only num_seqs x num_kv_heads programs, too few to fill the GPU, each
walking a long context alone. The split kernel gives every (sequence, KV head) NUM_SPLITS
programs over disjoint slices of the keys; each stores its normalised partial output and
log-sum-exp, and a small reduce kernel merges them (flash-decoding).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.metadata import AttentionMetadata

# Decode heuristics, sized for a datacenter GPU (~100-140 SMs): split only when the main
# kernel would launch fewer programs than that, and never below a few hundred keys a split.
_SPLIT_KV_TARGET_PROGRAMS = 256
_SPLIT_KV_MIN_KEYS_PER_SPLIT = 256
_SPLIT_KV_MAX_SPLITS = 64


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query block q_block_idx; sequence s owns the blocks from
    query_start_loc[s] // BLOCK_Q + s on (the + s absorbs each sequence's partial last block)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(
    q,
    q_pos,
    m_i,
    l_i,
    acc,
    k_base,
    v_base,
    table_ptr,
    kv_start,
    kv_end,
    window,
    scale_log2,
    stride_c_block,
    stride_c_slot,
    block_size,
    offs_d,
    d_mask,
    TILE_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the rows q [M, D] (at positions q_pos [M]) over keys kv_start..kv_end-1
    (kv_start a multiple of TILE_N), folded into the running max m_i, sum l_i and output acc."""
    offs_n = tl.arange(0, TILE_N)
    for tile_start in range(kv_start, kv_end, TILE_N):
        k_pos = tile_start + offs_n
        k_mask = k_pos < kv_end
        block = tl.load(table_ptr + k_pos // block_size, mask=k_mask, other=0).to(tl.int64)
        slot_offset = block * stride_c_block + (k_pos % block_size) * stride_c_slot
        k = tl.load(
            k_base + slot_offset[None, :] + offs_d[:, None], mask=k_mask[None, :] & d_mask[:, None], other=0.0
        )  # [D, TILE_N]
        v = tl.load(
            v_base + slot_offset[:, None] + offs_d[None, :], mask=k_mask[:, None] & d_mask[None, :], other=0.0
        )  # [TILE_N, D]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_mask[None, :]
        if HAS_WINDOW:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    window,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_h,
    stride_bt,
    block_size,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(1)
    q_block_idx = tl.program_id(0)
    seq = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_idx - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - query_len

    # Row m: query token q_block * BLOCK_Q + m // G of the sequence, in query head kv_head * G + m % G.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_mask = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < query_len)
    d_mask = offs_d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    token = (q_start + q_idx).to(tl.int64)
    q_offset = token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptr + q_offset, mask=io_mask, other=0.0)
    q_pos = context_len + q_idx

    # The tile's keys: from its first query's window start through its last query's position.
    kv_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, query_len)
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0) // TILE_N * TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = cache_ptr + kv_head * stride_c_h
    m_i, l_i, acc = _attend_tiles(
        q, q_pos, m_i, l_i, acc, k_base, k_base + stride_c_kv, block_tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_start, kv_end, window, scale_log2, stride_c_block, stride_c_slot, block_size, offs_d, d_mask,
        TILE_N, HAS_WINDOW, DOT_PRECISION,
    )
    # Every stored row sees at least its own key; only masked-off rows can have l_i == 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


@triton.jit
def _paged_decode_split_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    window,
    num_heads,
    stride_q_t,
    stride_q_h,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_h,
    stride_bt,
    block_size,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One decode token per sequence: program (seq, kv head, split) attends its group's query
    heads over one slice of the keys and stores output / sum and log2-sum-exp for the reduce."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_start:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - 1

    # Split whole tiles evenly, so every slice but the last starts and ends on a tile boundary.
    first_tile = 0
    if HAS_WINDOW:
        first_tile = tl.maximum(q_pos - window + 1, 0) // TILE_N
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N) - first_tile, NUM_SPLITS)
    kv_start = (first_tile + split * tiles_per_split) * TILE_N
    kv_end = tl.minimum(kv_start + tiles_per_split * TILE_N, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * NUM_QUERIES_PER_KV + offs_h
    h_mask = offs_h < NUM_QUERIES_PER_KV
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = cache_ptr + kv_head * stride_c_h
    m_i, l_i, acc = _attend_tiles(
        q, tl.zeros([BLOCK_H], tl.int32) + q_pos, m_i, l_i, acc, k_base, k_base + stride_c_kv,
        block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_start, kv_end, window, scale_log2,
        stride_c_block, stride_c_slot, block_size, offs_d, d_mask, TILE_N, HAS_WINDOW, DOT_PRECISION,
    )

    # An empty slice (past the end, or wholly outside the window) stores lse = -inf, output 0.
    has_keys = l_i > 0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    row = (seq * num_heads + head).to(tl.int64) * NUM_SPLITS + split
    tl.store(partial_lse_ptr + row, lse, mask=h_mask)
    tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_loc_ptr,
    num_heads,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out = sum_s 2^(lse_s - max lse) * out_s / sum_s 2^(lse_s - max lse), per (seq, head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_start:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    row = (seq * num_heads + head).to(tl.int64) * NUM_SPLITS + offs_s
    lse = tl.load(partial_lse_ptr + row, mask=s_mask, other=float("-inf"))
    # The slice holding the query's own key has a finite lse, so the max is finite.
    weight = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    out = tl.sum(weight[:, None] * parts, 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_o_t + head * stride_o_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def num_kv_splits(metadata: AttentionMetadata, num_kv_heads: int, window: int | None) -> int:
    """How many slices to split each decode's keys into (1 = use the main kernel).

    Host-side ints only: the batch size is a shape, the context length metadata's max_seq_len.
    """
    num_seqs = metadata.query_start_loc.shape[0] - 1
    if metadata.max_query_len != 1 or num_seqs == 0:
        return 1
    keys = min(metadata.max_seq_len, window) if window is not None else metadata.max_seq_len
    splits = min(
        _SPLIT_KV_TARGET_PROGRAMS // (num_seqs * num_kv_heads),
        keys // _SPLIT_KV_MIN_KEYS_PER_SPLIT,
        _SPLIT_KV_MAX_SPLITS,
    )
    # A power of two bounds the number of compiled variants.
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


def paged_attention_triton(
    q: Tensor,
    kv_cache: Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None,
    *,
    kv_splits: int | None = None,
) -> Tensor:
    """Causal GQA attention of q [T, num_heads, head_dim] over the paged cache -> [T, num_heads, head_dim].

    The new tokens' K/V must already be in the cache; rows past query_start_loc[-1] (padding)
    come back as zeros. kv_splits overrides the split-KV heuristic (num_kv_splits); more than
    1 is only valid for a pure-decode batch (max_query_len == 1).
    """
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(kv_cache.shape)}")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {kv_cache.dtype}")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("head_dim must be the contiguous dimension of q and the cache")
    num_seqs = metadata.query_start_loc.shape[0] - 1
    splits = num_kv_splits(metadata, num_kv_heads, window) if kv_splits is None else kv_splits
    if splits > 1 and metadata.max_query_len != 1:
        raise ValueError(f"split-KV needs a pure-decode batch, not max_query_len={metadata.max_query_len}")

    out = torch.zeros_like(q)  # padding rows are never visited by a program
    if tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16
    # fp32 runs as the exact reference path; TF32 would cost ~1e-3 relative error.
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    scale_log2 = scale * math.log2(math.e)
    cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, HAS_WINDOW=window is not None, DOT_PRECISION=dot_precision)
    window_arg = window if window is not None else 0

    if splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        _paged_decode_split_kernel[(num_seqs, num_kv_heads, splits)](
            partial_out, partial_lse, q, kv_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, scale_log2, window_arg, num_heads, q.stride(0), q.stride(1),
            *cache_strides, metadata.block_tables.stride(0), metadata.block_size,
            NUM_QUERIES_PER_KV=group, BLOCK_H=max(16, triton.next_power_of_2(group)), TILE_N=16,
            NUM_SPLITS=splits, **common,
        )
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, metadata.query_start_loc, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
        )
        return out

    # Taller tiles amortise K/V loads over more queries in prefill; 16 rows is tl.dot's minimum.
    block_m = 64 if metadata.max_query_len * group >= 64 else 16
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    tile_n = 32 if metadata.max_query_len > 1 else 16
    # Sequence s owns at most ceil(len_s / BLOCK_Q) blocks, and all of them fit in T // BLOCK_Q + num_seqs.
    grid = (tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
        scale_log2, window_arg, num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *cache_strides, metadata.block_tables.stride(0), metadata.block_size,
        NUM_QUERIES_PER_KV=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, **common,
    )
    return out
