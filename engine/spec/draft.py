"""Draft-model proposer: a small model (or the target's early-exit view) drafts k tokens
greedily, one forward pass per token, over its own paged KV cache.

Design: the draft keeps per request the tokens whose K/V sit in its cache (`fed`). Before
drafting it keeps the longest prefix of `fed` that the request's verified tokens confirm (its
own accepted drafts stay valid: same tokens, same positions) and feeds the rest ("catch-up":
the corrected or bonus token, plus the prompt on first sight) in one batched pass whose last
row yields draft 1; then k-1 single-token passes yield drafts 2..k. Cost per engine step:
k forward passes of the draft over the batch (the first one a few tokens wider), KV memory of
the draft's layers for every running request, and no recomputation of the context.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from engine.config import ModelConfig
from engine.core import BlockPool, KVCacheBlock, Request
from engine.kernels.metadata import AttentionMetadata, build_attention_metadata
from engine.model.attention import allocate_kv_caches


class DraftModel(Protocol):
    """The CausalLM interface the proposer runs: a CausalLM, or EarlyExitDraft's view of one."""

    def __call__(self, input_ids: Tensor, positions: Tensor, attn_metadata: AttentionMetadata,
                 kv_caches: list[Tensor]) -> Tensor: ...

    def compute_logits(self, hidden: Tensor) -> Tensor: ...


@dataclass
class _State:
    fed: list[int] = field(default_factory=list)  # tokens whose KV is in the draft cache, by position
    verified: int = 0  # leading entries of `fed` known to equal the request's verified tokens
    blocks: list[KVCacheBlock] = field(default_factory=list)


class DraftModelProposer:
    def __init__(
        self,
        model: DraftModel,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`model` has the CausalLM interface (forward over a paged cache, compute_logits) and
        `config` its shape; the cache holds num_blocks blocks of block_size tokens."""
        self.model, self.block_size, self.device = model, block_size, device
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, kv_dtype, device)
        # Block ids of the draft's own cache: the engine's block pool, without prefix caching.
        self._pool = BlockPool(num_blocks, enable_caching=False)
        self._states: dict[str, _State] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is not None:
                self._pool.free_blocks(reversed(state.blocks))

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> dict[str, list[int]]:
        batch: list[tuple[str, _State, int]] = []  # (request id, state, drafts wanted)
        query: list[list[int]] = []
        for request, k in zip(requests, num_drafts, strict=True):
            state = self._states.setdefault(request.request_id, _State())
            known = request.all_token_ids
            # Keep what the verified tokens confirm; the last known token is always fed, since
            # its logits give the first draft.
            keep, limit = state.verified, min(len(state.fed), len(known) - 1)
            while keep < limit and state.fed[keep] == known[keep]:
                keep += 1
            if not self._reserve(state, len(known) + k - 1):
                continue  # cache full: this request goes without drafts this step
            del state.fed[keep:]
            state.fed.extend(known[keep:])
            state.verified = len(known)
            batch.append((request.request_id, state, k))
            query.append(known[keep:])
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in batch}
        # Pass j feeds draft j (pass 0 feeds the catch-up) to every request that wants more.
        while batch:
            tables = [[b.block_id for b in s.blocks] for _, s, _ in batch]
            next_tokens = self._forward(query, [len(s.fed) for _, s, _ in batch], tables)
            still: list[tuple[str, _State, int]] = []
            query = []
            for (rid, state, k), token in zip(batch, next_tokens, strict=True):
                drafts[rid].append(token)
                if len(drafts[rid]) < k:
                    state.fed.append(token)
                    still.append((rid, state, k))
                    query.append([token])
            batch = still
        return drafts

    def _reserve(self, state: _State, num_tokens: int) -> bool:
        """Blocks for positions [0, num_tokens); False (nothing taken) when the cache is short."""
        missing = -(-num_tokens // self.block_size) - len(state.blocks)
        if missing > self._pool.num_free_blocks:
            return False
        if missing > 0:
            state.blocks.extend(self._pool.get_new_blocks(missing))
        return True

    def _forward(self, query: list[list[int]], seq_lens: list[int], tables: list[list[int]]) -> list[int]:
        """Feed each request its query tokens (ending at seq_lens) -> the argmax after each."""
        query_lens = [len(q) for q in query]
        positions, metadata = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, self.device)
        input_ids = torch.tensor([t for q in query for t in q], dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, metadata, self.kv_caches)
        last_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()
