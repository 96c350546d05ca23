"""N-gram (prompt lookup) proposer: copy what followed the latest earlier occurrence of the
request's last n tokens. Free to run (no model), and strong wherever output repeats its
context: code edits, extraction, summaries quoting their source, lists being repeated."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.core import Request
from engine.errors import InputError


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise InputError("speculative.ngram_min_n", min_n, f"must be in 1..ngram_max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for request, k in zip(requests, num_drafts, strict=True):
            drafts = self.lookup(request.all_token_ids, k)
            if drafts:
                out[request.request_id] = drafts
        return out

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Longest n first (more context, better guesses); the latest match first (recent
        text predicts the continuation best). Returns [] when no n-gram recurs."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Right to left; a match must start before the suffix does, so that at least one
            # token follows it (overlapping the suffix is fine: "a b a b a" -> "b a").
            for start in range(length - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = start + n
                    return tokens[follow : follow + k]
        return []

    def forget(self, request_ids: Iterable[str]) -> None:
        pass  # stateless
