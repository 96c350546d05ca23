"""Speculative decoding's torch-free bookkeeping: who may take drafts, the proposer interface,
and the counters the step loop keeps (acceptance per draft position, accepted length, time).

The engine's proposers (n-gram, draft model, early-exit self-draft, in engine/spec) and the
simulator's synthetic drafts implement the same `Proposer`, so the step loop drafts for exactly
the same requests in both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.request import Request


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


@dataclass
class SpecStats:
    k: int
    # Per position i, over verifications that had drafts: how often position i was reached
    # (every draft before it accepted, and the request had room for it), and how often it was
    # then accepted. A position past a short proposal counts as reached and rejected: that is
    # what it means for throughput. Verifications without any draft are counted apart
    # (proposal_rate), because they cost a plain decode step, not a verification of k drafts.
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    num_verifications: int = 0  # (request, step) pairs with room for at least one draft
    num_proposals: int = 0  # ... of which the proposer drafted at least one token
    num_drafts: int = 0  # draft tokens actually proposed and verified
    num_emitted: int = 0  # tokens those verifications emitted: accepted drafts + 1 each
    draft_s: float = 0.0  # proposer time on the loop's clock (0 on simulated time: priced in the step)
    verify_s: float = 0.0  # steps that carried drafts: target forward + verification
    num_steps: int = 0  # steps that carried drafts

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    def record(self, room: int, num_proposed: int, num_accepted: int) -> None:
        """One request in one step: `room` drafts it could take, `num_proposed` proposed,
        `num_accepted` of them accepted (a prefix)."""
        self.num_verifications += 1
        self.num_drafts += num_proposed
        self.num_emitted += num_accepted + 1
        if not num_proposed:
            return
        self.num_proposals += 1
        for i in range(min(room, num_accepted + 1)):
            self.reached[i] += 1
        for i in range(num_accepted):
            self.accepted[i] += 1

    @property
    def proposal_rate(self) -> float:
        """Share of verifications that had drafts; the simulator's `SpeculativeSettings.proposal_rate`."""
        return self.num_proposals / self.num_verifications if self.num_verifications else 0.0

    @property
    def acceptance_profile(self) -> tuple[float, ...]:
        """P(position i accepted | drafts proposed, every earlier one accepted), 0.0 where never
        reached; the simulator's `SpeculativeSettings.acceptance_profile`."""
        return tuple(a / r if r else 0.0 for a, r in zip(self.accepted, self.reached, strict=True))

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafts proposed."""
        return sum(self.accepted) / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification (accepted drafts + the bonus/correction token)."""
        return self.num_emitted / self.num_verifications if self.num_verifications else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "k": self.k,
            "acceptance_profile": list(self.acceptance_profile),
            "proposal_rate": self.proposal_rate,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "num_verifications": self.num_verifications,
            "num_proposals": self.num_proposals,
            "num_drafts": self.num_drafts,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "num_steps": self.num_steps,
        }
