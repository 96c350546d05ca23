"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator per request.

A request's draws depend only on its own seed and how many tokens it has drawn, never on which
other requests share the batch, so seeded sampling is reproducible under continuous batching.
Requests with a structured output have their logits masked by their grammar first
(engine/structured_output.py), whichever way they sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
import zlib

import torch

from engine.core import SamplingParams
from engine.spec.verify import greedy_verify, rejection_sample

if TYPE_CHECKING:  # xgrammar takes seconds to import: only engines that constrain a request load it
    from engine.structured_output import GrammarMasks


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.seed = seed  # engine-wide seed for requests that bring none of their own
        self._generators: dict[str, torch.Generator] = {}
        self.grammars: GrammarMasks | None = None  # set by the engine on its first structured request

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.forget(request_id)

    def __call__(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """One token per row of fp32 logits [N, V] (constrained rows are masked in place)."""
        grammars = self.grammars
        constrained = grammars.apply(logits, request_ids, params) if grammars is not None else []
        tokens = logits.argmax(dim=-1).tolist()  # every greedy row at once
        for row in [row for row, p in enumerate(params) if p.temperature != 0.0]:
            p = params[row]
            probs = self.probabilities(logits[row], p)
            tokens[row] = int(torch.multinomial(probs, 1, generator=self._generator(request_ids[row], p)).item())
        for row in constrained:
            assert grammars is not None
            grammars.accept(request_ids[row], tokens[row])
        return tokens

    def verify(self, logits: torch.Tensor, request_id: str, p: SamplingParams, drafts: list[int]) -> list[int]:
        """Score d drafts with the target's fp32 logits [d+1, V] of their positions (and the one
        before them): the accepted drafts plus one corrected or bonus token. Greedy requests
        accept on argmax equality; others by rejection sampling with the request's generator."""
        if p.temperature == 0.0:
            return greedy_verify(logits.argmax(dim=-1).tolist(), drafts)
        probs = torch.stack([self.probabilities(row, p) for row in logits])
        return rejection_sample(probs, drafts, None, self._generator(request_id, p))

    @staticmethod
    def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """The distribution a request samples from: temperature, then top-k, then top-p."""
        scaled = logits.float() / p.temperature
        if p.top_k > 0 and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays).
            outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs = probs / probs.sum()
        return probs

    def _generator(self, request_id: str, p: SamplingParams) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(p.seed if p.seed is not None else (self.seed << 32) ^ zlib.crc32(request_id.encode()))
            self._generators[request_id] = gen
        return gen
