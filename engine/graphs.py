"""Decode steps replayed from captured CUDA graphs.

An eager decode step of a small model spends more time launching kernels than running them. A
decode-only step has a shape fixed by its batch size alone, so the forward pass of each batch
size in engine.config.graph_capture_sizes is captured once and replayed: the step's inputs are
copied into static buffers the graph reads, and its first B output rows are the real ones.
Padding rows (B up to the captured size) write no KV (slot -1) and attend to one key of block 0,
whose output nobody reads. Attention is captured at max_model_len, so the kernels' launch
shapes (split-KV count) never depend on the step.

The capture itself needs CUDA; everything else here (padding, static buffers, which steps
qualify) is device-independent, and `record` lets the CPU tests run it with a plain call in
place of the captured graph. The same static shapes suit torch.compile (`compile_recorder`),
on any device, alone or under a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from engine.config import graph_batch_size, graph_capture_sizes
from engine.kernels.metadata import AttentionMetadata

Forward = Callable[[Tensor, Tensor, AttentionMetadata], Tensor]
# How a forward pass over the static buffers becomes replayable: returns the replay callable.
Recorder = Callable[[Callable[[], None]], Callable[[], None]]


def cuda_graph_recorder(device: torch.device) -> Recorder:
    """Capture into CUDA graphs that share one memory pool (largest first, so smaller ones fit in it)."""
    pool = torch.cuda.graph_pool_handle()

    def record(run: Callable[[], None]) -> Callable[[], None]:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run()  # warm-up outside the graph: lazy initialisation, Triton autotuning and compilation
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            run()
        return graph.replay

    return record


def compile_recorder(then: Recorder | None = None) -> Recorder:
    """torch.compile each captured size's forward (static shapes: one specialised graph per size),
    compiled at capture rather than on the first step, then recorded by `then` (CUDA graphs) if given."""

    def record(run: Callable[[], None]) -> Callable[[], None]:
        compiled = torch.compile(run, dynamic=False)
        if then is not None:
            return then(compiled)  # its warm-up run compiles
        compiled()
        return compiled

    return record


class DecodeGraphs:
    """Captured forward passes of decode-only steps, one per captured batch size."""

    def __init__(
        self,
        forward: Forward,
        hidden_size: int,
        dtype: torch.dtype,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        record: Recorder,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.sizes = graph_capture_sizes(max_batch_size)
        n, blocks = max_batch_size, -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self._replays: dict[int, Callable[[], None]] = {}
        self._metadata: dict[int, AttentionMetadata] = {}
        for size in reversed(self.sizes):
            metadata = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens[:size],
                block_tables=self.block_tables[:size],
                block_size=block_size,
                max_query_len=1,
                max_seq_len=max_model_len,
            )
            self._metadata[size] = metadata

            def run(size: int = size, metadata: AttentionMetadata = metadata) -> None:
                self.hidden[:size] = forward(self.input_ids[:size], self.positions[:size], metadata)

            self._replays[size] = record(run)

    def can_run(self, query_lens: list[int]) -> bool:
        """Decode-only steps (one token per request, no drafts) of at most max_batch_size requests."""
        return 0 < len(query_lens) <= self.max_batch_size and all(q == 1 for q in query_lens)

    def run(self, input_ids: Tensor, positions: Tensor, metadata: AttentionMetadata) -> Tensor:
        """Hidden states [B, H] of a decode-only step (can_run), through the graph of its padded size."""
        b = input_ids.shape[0]
        size = graph_batch_size(b, self.max_batch_size)
        assert size is not None and metadata.max_query_len == 1, "DecodeGraphs.run needs a step can_run accepts"
        width = metadata.block_tables.shape[1]
        self.input_ids[:b] = input_ids
        self.positions[:b] = positions
        self.slot_mapping[:b] = metadata.slot_mapping
        self.seq_lens[:b] = metadata.seq_lens
        self.block_tables[:b, :width] = metadata.block_tables
        # Padding rows: a stale table row or length from an earlier, larger step would be harmless
        # too, but resetting them keeps every step's reads within blocks the step owns or block 0.
        self.slot_mapping[b:size] = -1
        self.seq_lens[b:size] = 1
        self.block_tables[b:size] = 0
        self._metadata[size].derived.clear()  # its tensors were just rewritten
        self._replays[size]()
        return self.hidden[:b]
