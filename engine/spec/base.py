"""The proposer interface, and which running requests may take draft tokens this step.

Torch-free: the simulator uses `draft_budget` to put synthetic drafts on exactly the requests
the engine would draft for.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import Protocol

from engine.core import Request


def draft_budget(request: Request, k: int) -> int:
    """How many drafts `request` can use in the next step: 0 unless it is decoding (all known
    tokens but the last sampled one are in the KV cache), and never past max_tokens (the
    scheduler would drop such drafts anyway; not proposing them saves the proposer's work)."""
    if not request.output_token_ids or request.num_computed_tokens != request.num_tokens - 1:
        return 0  # prefilling (or re-prefilling after preemption): nothing to speculate from yet
    return max(0, min(k, request.max_tokens - request.num_output_tokens - 1))


class Proposer(Protocol):
    """Guesses the next tokens of running requests; the target model then verifies them.

    Proposals are deterministic (greedy or lookup), so the verifier treats the draft
    distribution q as one-hot at each proposed token.
    """

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> dict[str, list[int]]:
        """Up to num_drafts[i] (>= 1) tokens to follow requests[i]'s known tokens (prompt +
        output). A request may get fewer, or be left out when there is nothing to propose."""
        ...

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop per-request state of finished requests."""
        ...


class HeadProposer(abc.ABC):
    """Hook for checkpoints that ship their own draft heads: Medusa (k extra LM heads on the
    last hidden state), EAGLE (a one-layer autoregressive head over hidden states and token
    embeddings) and MTP (DeepSeek-V3's multi-token-prediction modules).

    They differ from `Proposer` in what they read: the target's final hidden state of each
    request's last verified token, which only the runner has. A subclass receives it after
    every target forward pass through `observe` and proposes from it; the engine's wiring for
    this (the runner handing hidden rows to the proposer) is the part still to build when the
    first such checkpoint is supported: the loader must then also load the head weights.
    """

    @abc.abstractmethod
    def observe(self, request_ids: Sequence[str], last_hidden: object) -> None:
        """The target's final hidden states [len(request_ids), hidden] of each request's last
        accepted token, from the step just verified (a torch.Tensor)."""

    @abc.abstractmethod
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> dict[str, list[int]]:
        """As Proposer.propose, from the hidden states last observed."""

    @abc.abstractmethod
    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop per-request state of finished requests."""
