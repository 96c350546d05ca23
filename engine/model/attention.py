"""Paged attention over one flat batch that mixes prefill chunks and decodes.

Every token of the step sits in one flat batch of T tokens; sequence b owns the query rows
query_start_loc[b]:query_start_loc[b+1]. Its keys and values live in a paged cache: per layer
one tensor [2, num_blocks, block_size, num_kv_heads, head_dim], addressed through the
sequence's block table. A query row at position p attends to keys at positions <= p (and,
with a sliding window w, > p - w).

`paged_attention` and `write_kv_cache` run the Triton kernels of engine.kernels on CUDA
tensors (imported lazily, so the CPU path never imports triton); elsewhere they run the torch
reference here, which is also what the kernels are checked against.
"""

from __future__ import annotations


import torch
from torch import Tensor
import torch.nn.functional as F

from engine import kernels
from engine.kernels.metadata import AttentionMetadata
from engine.config import ModelConfig
from engine.quant import native
from engine.quant.kv import dequantize_kv, is_quantized_kv, kv_last_dim, quantize_kv


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Tensor:
    """One layer's paged cache: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim].

    A quantised dtype (torch.int8, torch.float8_e4m3fn) gets head_dim + 4: each head's
    values followed by its fp32 scale (engine.quant.kv).
    """
    last = kv_last_dim(head_dim, dtype)
    return torch.zeros(2, num_blocks, block_size, num_kv_heads, last, dtype=dtype, device=device)


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[Tensor]:
    """One zeroed paged cache per layer of `config` (allocate_kv_cache for each)."""
    return [
        allocate_kv_cache(num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device)
        for _ in range(config.num_layers)
    ]


def write_kv_cache(kv_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store the new tokens' K/V [T, num_kv_heads, head_dim] at their slots; padding rows (-1) are skipped."""
    if kernels.use_triton(kv_cache) and not is_quantized_kv(kv_cache.dtype):  # quantised caches: torch path only
        from engine.kernels.kv_cache import write_kv_cache_triton

        write_kv_cache_triton(kv_cache, k, v, slot_mapping)
        return
    rows = (slot_mapping >= 0).nonzero().squeeze(1)
    _store_kv(kv_cache, k, v, rows, slot_mapping[rows])


def _store_kv(kv_cache: Tensor, k: Tensor, v: Tensor, rows: Tensor | None, slots: Tensor) -> None:
    """kv_cache[:, slot] = (k, v)[row] for the given rows (None: every row) and their slots."""
    if rows is not None:
        k, v = k[rows], v[rows]
    if is_quantized_kv(kv_cache.dtype):  # quantise per (token, head); scales stored in-line
        raw = kv_cache.view(torch.uint8)
        raw[0].flatten(0, 1)[slots] = quantize_kv(k, kv_cache.dtype)
        raw[1].flatten(0, 1)[slots] = quantize_kv(v, kv_cache.dtype)
        return
    kv_cache.flatten(1, 2).index_copy_(1, slots, torch.stack((k, v)).to(kv_cache.dtype))


def _rows_to_store(m: AttentionMetadata) -> tuple[Tensor | None, Tensor]:
    """(rows, their slots) of the step's tokens that have a slot (rows None: all of them), once per step."""
    if "store" not in m.derived:
        valid = m.slot_mapping >= 0
        if bool(valid.all()):
            m.derived["store"] = (None, m.slot_mapping)
        else:
            rows = valid.nonzero().squeeze(1)
            m.derived["store"] = (rows, m.slot_mapping[rows])
    return m.derived["store"]  # type: ignore[return-value]


def paged_attention(
    q: Tensor, kv_cache: Tensor, metadata: AttentionMetadata, scale: float, window: int | None
) -> Tensor:
    """Causal GQA attention of q [T, num_heads, head_dim] over the cache -> [T, num_heads, head_dim].

    The new tokens' K/V must already be in the cache. Rows past the last sequence
    (padding) come back as zeros.
    """
    if kernels.use_triton(q) and not is_quantized_kv(kv_cache.dtype):
        from engine.kernels.paged_attention import paged_attention_triton

        return paged_attention_triton(q, kv_cache, metadata, scale, window)
    return _reference_paged_attention(q, kv_cache, metadata, scale, window)


# write_kv_cache, then paged_attention, as one operator that torch.compile keeps opaque. Traced
# through, the in-place write into the paged cache made inductor copy the whole cache every step
# (5x slower than eager on the CPU); vLLM registers its attention the same way. Defined with
# torch.library's schema API rather than torch.library.custom_op, whose Python wrappers cost ~0.1 ms
# a call on the CPU (3 ms a SmolLM2 step); under inference mode the dispatcher calls the kernel below
# directly.
_LIBRARY = torch.library.Library("serveplan", "DEF")
_LIBRARY.define(
    "cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, int block_size, int max_query_len, "
    "int max_seq_len, float scale, int? window) -> Tensor"
)


@torch.library.impl(_LIBRARY, "cached_attention", "CompositeExplicitAutograd")
def _cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    block_size: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    window: int | None,
) -> Tensor:
    """A captured decode step carries max_model_len as its max_seq_len (engine/graphs.py): the Triton
    kernels need that static bound, but the torch reference would pad every sequence's keys to it
    (3x the eager step's attention time for SmolLM2 at max_model_len 512), so it reads the real
    maximum back from seq_lens (a host read: free on the CPU, where the reference runs)."""
    if not kernels.use_triton(q) or is_quantized_kv(kv_cache.dtype):
        max_seq_len = int(seq_lens.max())
    metadata = AttentionMetadata(slot_mapping, query_start_loc, seq_lens, block_tables, block_size, max_query_len, max_seq_len)
    return _write_and_attend(q, k, v, kv_cache, metadata, scale, window)


@torch.library.register_fake("serveplan::cached_attention", lib=_LIBRARY)
def _(q: Tensor, *args: object) -> Tensor:
    return torch.empty_like(q)


cached_attention = torch.ops.serveplan.cached_attention


def attend(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, m: AttentionMetadata, scale: float, window: int | None) -> Tensor:
    """Store the step's K/V [T, Hkv, D] in the cache and attend q [T, H, D] over it: through the
    cached_attention operator under torch.compile, directly otherwise (no dispatch at all)."""
    if torch.compiler.is_compiling():
        return cached_attention(q, k, v, kv_cache, m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables,
                                m.block_size, m.max_query_len, m.max_seq_len, scale, window)
    return _write_and_attend(q, k, v, kv_cache, m, scale, window)


def _write_and_attend(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, m: AttentionMetadata, scale: float,
                      window: int | None) -> Tensor:
    if kernels.use_triton(q) and not is_quantized_kv(kv_cache.dtype):
        write_kv_cache(kv_cache, k, v, m.slot_mapping)
    else:
        _store_kv(kv_cache, k, v, *_rows_to_store(m))
    return paged_attention(q, kv_cache, m, scale, window)


def _reference_paged_attention(
    q: Tensor, kv_cache: Tensor, metadata: AttentionMetadata, scale: float, window: int | None
) -> Tensor:
    starts = metadata.query_start_loc
    if metadata.max_query_len == 1 and q.shape[0] == metadata.seq_lens.shape[0]:  # decode only: no row gathers
        tables, visible = _decode_layout(metadata, window)
        return _attend(q.unsqueeze(1), kv_cache, tables, visible, metadata.max_seq_len, scale).squeeze(1)
    query_lens = starts[1:] - starts[:-1]
    out = torch.zeros_like(q)
    # Decodes are the common case in a mixed batch: all of them go through one padded batched
    # call, and each prefill chunk gets its own call, so no chunk pads the others.
    is_decode = query_lens == 1
    decodes = is_decode.nonzero().squeeze(1)
    if decodes.numel():
        rows = starts[decodes].long()
        out[rows] = _attend_padded(
            q[rows].unsqueeze(1),
            kv_cache,
            metadata.block_tables[decodes],
            metadata.seq_lens[decodes],
            query_lens[decodes],
            metadata.max_seq_len,
            metadata.block_size,
            scale,
            window,
        ).squeeze(1)
    for b in (~is_decode).nonzero().squeeze(1).tolist():
        start, end = int(starts[b]), int(starts[b + 1])
        out[start:end] = _attend_padded(
            q[start:end].unsqueeze(0),
            kv_cache,
            metadata.block_tables[b : b + 1],
            metadata.seq_lens[b : b + 1],
            query_lens[b : b + 1],
            int(metadata.seq_lens[b]),
            metadata.block_size,
            scale,
            window,
        ).squeeze(0)
    return out


def _decode_layout(m: AttentionMetadata, window: int | None) -> tuple[Tensor, Tensor]:
    """A decode-only step's block tables (int64) and key mask [B, 1, 1, keys]: the same for every
    layer of one sliding window, so built once per step."""
    key = ("decode", window)
    if key not in m.derived:
        tables = m.block_tables[:, : -(-m.max_seq_len // m.block_size)].long()
        k_pos = torch.arange(m.max_seq_len, device=m.seq_lens.device)
        visible = k_pos < m.seq_lens[:, None]  # [B, keys]: the query is each sequence's last position
        if window is not None:
            visible &= k_pos > (m.seq_lens - 1 - window)[:, None]
        m.derived[key] = (tables, visible[:, None, None, :])
    return m.derived[key]  # type: ignore[return-value]


def _layout(
    block_tables: Tensor, seq_lens: Tensor, query_lens: Tensor, max_q: int, max_kv: int, block_size: int,
    window: int | None,
) -> tuple[Tensor, Tensor]:
    """The blocks holding the first max_kv keys of each sequence (int64 [B, blocks]) and which keys
    each query sees ([B, 1, Lq, max_kv]; queries are the last query_lens[b] positions, left-aligned)."""
    tables = block_tables[:, : -(-max_kv // block_size)].long()
    q_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_q, device=seq_lens.device)  # [B, Lq]
    k_pos = torch.arange(max_kv, device=seq_lens.device)
    visible = k_pos[None, None, :] <= q_pos[:, :, None]  # causal; also hides keys past seq_len
    if window is not None:
        visible &= k_pos[None, None, :] > q_pos[:, :, None] - window
    return tables, visible[:, None]


def _attend_padded(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_lens: Tensor,
    max_kv: int,
    block_size: int,
    scale: float,
    window: int | None,
) -> Tensor:
    """q [B, Lq, H, D] (each row's queries are the last query_lens[b] positions of its sequence,
    left-aligned in Lq) over the first max_kv >= max(seq_lens) cached keys -> [B, Lq, H, D]."""
    tables, visible = _layout(block_tables, seq_lens, query_lens, q.shape[1], max_kv, block_size, window)
    return _attend(q, kv_cache, tables, visible, max_kv, scale)


def _attend(q: Tensor, kv_cache: Tensor, tables: Tensor, visible: Tensor, max_kv: int, scale: float) -> Tensor:
    """q [B, Lq, H, D] over the first max_kv keys of the blocks in tables, masked by visible."""
    if is_quantized_kv(kv_cache.dtype):  # dequantise only the gathered blocks
        raw = kv_cache.view(torch.uint8)
        k = dequantize_kv(raw[0][tables], kv_cache.dtype, q.dtype)
        v = dequantize_kv(raw[1][tables], kv_cache.dtype, q.dtype)
    else:  # K and V in one gather: [2, B * blocks, block_size, Hkv, D]
        k, v = kv_cache.index_select(1, tables.flatten()).unflatten(1, tables.shape).unbind(0)
    # [B, blocks, block_size, Hkv, D] -> [B, Hkv, keys, D]
    k = k.flatten(1, 2)[:, :max_kv].transpose(1, 2)
    v = v.flatten(1, 2)[:, :max_kv].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def native_decode_applies(rows: Tensor, kv_cache: Tensor, m: AttentionMetadata) -> bool:
    """Whether a layer's decode step, given its input rows [T, ...], may run the native kernels
    (engine/quant/native.py: attention with its rotary and cache write in one call, or the whole layer):
    a decode-only step (one query per sequence, no padding rows) in fp32 on a CPU with an fp32 cache and
    the library built, eager (a compiled step keeps the cached_attention operator)."""
    return (m.max_query_len == 1 and rows.dtype == torch.float32 and kv_cache.dtype == torch.float32
            and rows.device.type == "cpu" and rows.shape[0] == m.seq_lens.shape[0] and native.available()
            and not torch.compiler.is_compiling())
