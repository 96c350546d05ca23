"""The batch layout every attention implementation reads: where the step's new tokens go in the
paged cache and which keys each query sees. Built once per step by the runner; read by the
torch reference (engine/model/attention.py) and the Triton kernels alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the step's tokens go in the paged cache and which keys each query sees."""

    slot_mapping: Tensor  # [T] int64: block_id * block_size + offset of each new token; -1 = padding
    query_start_loc: Tensor  # [B+1] int32: cumulative query lengths
    seq_lens: Tensor  # [B] int32: context length of each sequence after this step (cached + new)
    block_tables: Tensor  # [B, max_blocks] int32, padded with 0
    block_size: int
    # Host-side maxima, so choosing a code path never waits on the device.
    max_query_len: int
    max_seq_len: int
    # Tensors the torch reference attention derives from the fields above (gather indices, masks,
    # the rows to store): built by the first layer that needs them, reused by the others. Whoever
    # rewrites the tensors above in place (engine/graphs.py's static buffers) must clear it.
    derived: dict[object, object] = field(default_factory=dict, compare=False, repr=False)


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, AttentionMetadata]:
    """Positions [T] and metadata for sequences that each add query_lens[b] tokens to reach seq_lens[b]."""
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables must list the same sequences")
    positions: list[int] = []
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
        if not 0 < q_len <= s_len or len(table) * block_size < s_len:
            raise ValueError(f"query_len={q_len}, seq_len={s_len} and {len(table)} blocks do not fit together")
        for pos in range(s_len - q_len, s_len):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max(len(t) for t in block_tables)
    padded_tables = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded_tables, dtype=torch.int32, device=device),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return torch.tensor(positions, dtype=torch.int64, device=device), metadata
