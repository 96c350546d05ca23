"""Verification of draft tokens against the target model's distributions.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) keeps the output distribution
exactly the target's: accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the
first rejection draw from norm(max(p_i - q_i, 0)) and stop; after all d accepted draw a bonus
token from p_d. Deterministic proposers (n-gram, greedy drafts) have a one-hot q: acceptance
is then p_i(x_i), and the residual is p_i with x_i removed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def greedy_verify(target_argmax: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Accept drafts while they equal the target's argmax; then emit the argmax at the first
    mismatch, or the bonus argmax after the last draft. len(target_argmax) == len(drafts) + 1."""
    out: list[int] = []
    for draft, best in zip(drafts, target_argmax, strict=False):
        out.append(best)
        if draft != best:
            return out
    out.append(target_argmax[len(drafts)])
    return out


def rejection_sample(
    target_probs: Tensor, drafts: Sequence[int], draft_probs: Tensor | None, generator: torch.Generator
) -> list[int]:
    """target_probs [d+1, V], drafts d token ids, draft_probs [d, V] (None: one-hot at the
    drafts) -> the accepted drafts plus one corrected or bonus token, drawn with `generator`."""
    d = len(drafts)
    if target_probs.shape[0] != d + 1 or (draft_probs is not None and draft_probs.shape[0] != d):
        raise ValueError(f"need {d + 1} target rows and {d} draft rows for {d} drafts, got "
                         f"{target_probs.shape[0]} and {None if draft_probs is None else draft_probs.shape[0]}")
    out: list[int] = []
    # One uniform per draft, drawn up front: the number of draws per step is then fixed by d,
    # not by where rejection happens, which keeps a request's stream easy to reason about.
    uniforms = torch.rand(d, generator=generator, device=target_probs.device).tolist() if d else []
    for i, x in enumerate(drafts):
        p = target_probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if uniforms[i] < float(p[x]) / q_x:  # q_x > 0: x was drawn from q
            out.append(x)
            continue
        q = torch.zeros_like(p) if draft_probs is None else draft_probs[i]
        if draft_probs is None:
            q[x] = 1.0
        residual = torch.clamp(p - q, min=0.0)
        # Rejection has probability sum(max(p - q, 0)) > 0 in exact arithmetic; should rounding
        # leave an all-zero residual anyway, p itself is the right distribution (then p == q).
        dist = residual if float(residual.sum()) > 0.0 else p
        out.append(_draw(dist, generator))
        return out
    out.append(_draw(target_probs[d], generator))
    return out


def _draw(probs: Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())
