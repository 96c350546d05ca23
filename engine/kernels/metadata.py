"""The batch layout every attention implementation reads: where the step's new tokens go in the
paged cache and which keys each query sees. Built once per step by the runner; read by the
torch reference (engine/model/attention.py) and the Triton kernels alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
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
    """Positions [T] and metadata for sequences that each add query_lens[b] tokens to reach seq_lens[b].

    Built with numpy, one array operation per field rather than a Python loop over tokens (a
    prefill chunk of hundreds of tokens costs what a decode step does)."""
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables must list the same sequences")
    q_lens, s_lens = np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
    num_blocks = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
    bad = np.flatnonzero((q_lens <= 0) | (q_lens > s_lens) | (num_blocks * block_size < s_lens))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"query_len={q_lens[b]}, seq_len={s_lens[b]} and {num_blocks[b]} blocks do not fit together")
    tables = np.zeros((len(block_tables), int(num_blocks.max())), dtype=np.int64)
    for row, table in zip(tables, block_tables):
        row[: len(table)] = table
    starts = np.concatenate(([0], np.cumsum(q_lens)))
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = np.arange(starts[-1]) - starts[seq_of_token] + (s_lens - q_lens)[seq_of_token]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    def tensor(array: np.ndarray, dtype: torch.dtype) -> Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    metadata = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64),
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor(s_lens, torch.int32),
        block_tables=tensor(tables, torch.int32),
        block_size=block_size,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(s_lens.max()),
    )
    return tensor(positions, torch.int64), metadata
