"""Speculative decoding in the simulator: synthetic drafts on the requests the engine would
draft for (the shared step loop picks them), and how many of them are accepted, drawn from a
per-position acceptance profile.

A decoding request gets k drafts with probability proposal_rate (an n-gram lookup can miss;
then the step is a plain decode for it). Position i is accepted with probability profile[i]
given that every earlier draft was; the first rejection ends the run, as in the engine's
verification. One seeded generator per replica: same inputs, same draws.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from engine.core import Request, SchedulerOutput


class SyntheticDrafts:
    def __init__(self, k: int, profile: Sequence[float], seed: Sequence[int], token_id: int,
                 proposal_rate: float = 1.0) -> None:
        if len(profile) != k:
            raise ValueError(f"acceptance profile has {len(profile)} entries, k={k}")
        self.k, self.token_id, self.proposal_rate = k, token_id, proposal_rate
        self._profile = np.asarray(profile, dtype=float)
        self._rng = np.random.default_rng(list(seed))

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> dict[str, list[int]]:
        """The step loop's Proposer: all the drafts each request has room for, or none (a miss)."""
        out: dict[str, list[int]] = {}
        for request, room in zip(requests, num_drafts, strict=True):
            if self.proposal_rate >= 1.0 or self._rng.random() < self.proposal_rate:
                out[request.request_id] = [self.token_id] * room
        return out

    def forget(self, request_ids: Iterable[str]) -> None:
        """Nothing to drop: drafts are drawn afresh every step."""

    def sampled(self, output: SchedulerOutput) -> dict[str, tuple[int, ...]]:
        """Per sampling request: its accepted drafts plus the bonus/correction token."""
        out: dict[str, tuple[int, ...]] = {}
        for s in output.scheduled:
            if s.samples:
                out[s.request_id] = (self.token_id,) * (self.accepted(s.num_draft_tokens) + 1)
        return out

    def accepted(self, num_drafts: int) -> int:
        """Leading drafts accepted out of num_drafts."""
        if not num_drafts:
            return 0
        passed = self._rng.random(num_drafts) < self._profile[:num_drafts]
        return num_drafts if passed.all() else int(passed.argmin())
