"""Rejection sampling keeps the target distribution exactly (chi-square on a small vocabulary,
fixed seeds), for drafts drawn from a full q and for one-hot (deterministic) drafts; the same
test rejects a deliberately biased verifier, so it can fail. Greedy verification by hand."""

from collections.abc import Callable

import pytest
from scipy.stats import chisquare
import torch

from engine.spec.verify import greedy_verify, rejection_sample

TRIALS = 20_000
ALPHA = 1e-3  # a correct sampler fails one run in a thousand at most; these seeds are fixed


def dist(*weights: float) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float64)
    return t / t.sum()


P = torch.stack([dist(5, 1, 3, 0.5, 2, 0), dist(1, 4, 1, 1, 0.2, 2), dist(2, 2, 1, 3, 1, 1)])
Q = torch.stack([dist(1, 3, 1, 2, 0.5, 1), dist(3, 1, 0.5, 1, 2, 1)])


def biased(target: torch.Tensor, drafts: list[int], q: torch.Tensor | None, gen: torch.Generator) -> list[int]:
    """The classic bug: on rejection resample from p instead of norm(max(p - q, 0))."""
    for i, x in enumerate(drafts):
        q_x = 1.0 if q is None else float(q[i, x])
        if torch.rand(1, generator=gen).item() >= float(target[i, x]) / q_x:
            return [int(torch.multinomial(target[i], 1, generator=gen))]
    return list(drafts) + [int(torch.multinomial(target[len(drafts)], 1, generator=gen))]


def first_tokens(verify: Callable, d: int, one_hot_draft: int | None, seed: int) -> tuple[list[int], list[int]]:
    """(first emitted token, second emitted token when the first draft was accepted) over TRIALS runs."""
    gen = torch.Generator().manual_seed(seed)
    draft_gen = torch.Generator().manual_seed(seed + 1)
    firsts, seconds = [], []
    for _ in range(TRIALS):
        if one_hot_draft is None:
            drafts = [int(torch.multinomial(Q[i], 1, generator=draft_gen)) for i in range(d)]
            q = Q[:d]
        else:
            drafts, q = [one_hot_draft] * d, None
        out = verify(P[: d + 1], drafts, q, gen)
        firsts.append(out[0])
        if len(out) > 1:
            seconds.append(out[1])
    return firsts, seconds


def p_value(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the target gives probability 0"
    expected = probs[support] * len(samples)
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize(("d", "one_hot"), [(1, None), (2, None), (2, 0), (1, 5)],
                         ids=["q-d1", "q-d2", "one-hot-d2", "one-hot-zero-prob"])
def test_rejection_sampling_matches_the_target(d: int, one_hot: int | None) -> None:
    firsts, seconds = first_tokens(rejection_sample, d, one_hot, seed=11)
    assert p_value(firsts, P[0]) > ALPHA
    if seconds:  # given draft 1 accepted, the next token follows the target's next row
        assert p_value(seconds, P[1]) > ALPHA


@pytest.mark.parametrize("one_hot", [None, 0], ids=["q", "one-hot"])
def test_chi_square_rejects_a_biased_verifier(one_hot: int | None) -> None:
    firsts, _ = first_tokens(biased, 1, one_hot, seed=11)
    assert p_value(firsts, P[0]) < 1e-6


def test_rejection_sampling_is_reproducible_per_generator() -> None:
    def run() -> list[list[int]]:
        gen = torch.Generator().manual_seed(3)
        return [rejection_sample(P, [0, 1], None, gen) for _ in range(20)]

    assert run() == run()


def test_certain_drafts_are_always_accepted() -> None:
    certain = torch.eye(6, dtype=torch.float64)[[2, 4, 1]]
    gen = torch.Generator().manual_seed(0)
    assert all(rejection_sample(certain, [2, 4], None, gen) == [2, 4, 1] for _ in range(50))


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="need 3 target rows and 2 draft rows"):
        rejection_sample(P[:2], [0, 1], None, torch.Generator())


@pytest.mark.parametrize(("argmax", "drafts", "expected"), [
    ([5, 6, 7], [5, 6], [5, 6, 7]),  # all accepted + bonus
    ([5, 6, 7], [5, 9], [5, 6]),  # second rejected: the target's token replaces it
    ([5, 6, 7], [4, 6], [5]),  # first rejected
    ([5], [], [5]),  # no drafts: plain greedy
])
def test_greedy_verify(argmax: list[int], drafts: list[int], expected: list[int]) -> None:
    assert greedy_verify(argmax, drafts) == expected
