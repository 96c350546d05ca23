"""Sampler: the distribution each request draws from, and seeded reproducibility."""

import torch

from engine.core import SamplingParams
from engine.sampler import Sampler

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def test_greedy_takes_the_argmax() -> None:
    assert Sampler()(LOGITS[None], ["a"], [SamplingParams()]) == [0]


def test_top_k_keeps_only_the_k_largest() -> None:
    probs = Sampler.probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert probs[2:].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    full = torch.softmax(LOGITS, -1)
    probs = Sampler.probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    kept = (probs > 0).sum().item()
    assert full[: kept - 1].sum() < 0.7 <= full[:kept].sum()
    assert torch.allclose(probs[:kept], full[:kept] / full[:kept].sum())


def test_temperature_sharpens() -> None:
    cold = Sampler.probabilities(LOGITS, SamplingParams(temperature=0.5))
    hot = Sampler.probabilities(LOGITS, SamplingParams(temperature=2.0))
    assert cold[0] > torch.softmax(LOGITS, -1)[0] > hot[0]


def test_seeded_draws_repeat_and_follow_the_distribution() -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    logits = LOGITS[None]
    first = [Sampler()(logits, ["r"], [params])[0] for _ in range(1)]
    sampler_a, sampler_b = Sampler(), Sampler()
    draws_a = [sampler_a(logits, ["r"], [params])[0] for _ in range(2000)]
    draws_b = [sampler_b(logits, ["r"], [params])[0] for _ in range(2000)]
    assert draws_a == draws_b and draws_a[0] == first[0]
    freq = torch.bincount(torch.tensor(draws_a), minlength=5).float() / 2000
    assert torch.allclose(freq, torch.softmax(LOGITS, -1), atol=0.04)
