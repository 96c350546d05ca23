"""Speculative decoding in the engine: greedy outputs are token-identical with every proposer,
the statistics add up, and bad settings are refused with the field, value and what is allowed."""

from pathlib import Path
import random

import pytest

from engine.core import SamplingParams
from engine.errors import InputError
from engine.llm import LLM

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def make_llm(model_dir: Path, **knobs: object) -> LLM:
    knobs = {"max_num_batched_tokens": 512, "max_num_seqs": 8, "block_size_tokens": 4, **knobs}
    return LLM(str(model_dir), random_weights=True, seed=7, **knobs)


def prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (a short random phrase said several times), so n-grams recur."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(256) for _ in range(rng.randrange(3, 7))]
        out.append(phrase * rng.randrange(3, 6))
    return out


def tokens(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(ps, params)]


@pytest.fixture(scope="module")
def reference(target_dir) -> list[list[int]]:
    return tokens(make_llm(target_dir), prompts())


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "ngram", "num_speculative_tokens": 5, "ngram_min_n": 1, "ngram_max_n": 2},
    {"method": "self", "num_speculative_tokens": 3, "draft_layers": 2},
], ids=["ngram-k3", "ngram-k5-n1", "self-2-of-4"])
def test_greedy_speculation_is_token_identical(target_dir, reference, spec) -> None:
    llm = make_llm(target_dir, speculative=spec)
    assert tokens(llm, prompts()) == reference
    stats = llm.spec_stats
    assert stats is not None and stats.num_verifications > 0 and stats.num_steps > 0
    assert stats.draft_s > 0 and stats.verify_s > 0
    if spec["method"] == "ngram":  # the prompts repeat, so lookups must hit and be accepted
        assert stats.acceptance_rate > 0 and stats.mean_accepted_length > 1
        assert stats.acceptance_profile[0] > 0


def test_draft_model_is_token_identical(target_dir, draft_dir, reference) -> None:
    llm = make_llm(target_dir, speculative={"method": "draft", "num_speculative_tokens": 4,
                                            "draft_model": str(draft_dir)})
    assert tokens(llm, prompts()) == reference
    assert llm.spec_stats is not None and llm.spec_stats.num_drafts > 0


def test_speculation_survives_preemption_and_small_budgets(target_dir) -> None:
    ps = prompts(n=6, seed=3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = tokens(make_llm(target_dir), ps, params)
    spec = {"method": "self", "num_speculative_tokens": 4, "draft_layers": 1}
    # 24 blocks of 4 slots for 6 requests of up to 60 tokens: preemption is forced; a budget of
    # 24 tokens cuts drafts and chunks prompts.
    tight = make_llm(target_dir, num_kv_blocks=24, max_num_batched_tokens=24, speculative=spec)
    assert tokens(tight, ps, params) == expected
    assert tight.scheduler.stats().num_preemptions > 0


def test_stats_add_up(target_dir) -> None:
    llm = make_llm(target_dir, speculative={"method": "ngram", "num_speculative_tokens": 4})
    outs = llm.generate(prompts(n=1), GREEDY)
    s = llm.spec_stats
    assert s is not None
    # Every decode step with room for a draft is one verification emitting accepted + 1 tokens;
    # the prefill step emitted the first token, and a last step with no room may emit one more.
    assert len(outs[0].token_ids) - 2 <= s.num_emitted <= len(outs[0].token_ids) - 1
    assert sum(s.accepted) <= s.num_drafts
    assert all(0.0 <= a <= 1.0 for a in s.acceptance_profile)
    assert s.reached[0] == s.num_proposals <= s.num_verifications
    assert s.as_dict()["acceptance_profile"] == list(s.acceptance_profile)


def test_seeded_sampling_with_speculation_is_reproducible(target_dir) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=i) for i in range(4)]
    first = tokens(make_llm(target_dir, speculative=spec), prompts(), params)
    again = tokens(make_llm(target_dir, speculative=spec), prompts(), params)
    assert first == again
    assert all(len(t) == 16 for t in first)


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "knobs", "field", "message"), [
    ({"method": "ngram", "num_speculative_tokens": 0}, {}, "speculative.num_speculative_tokens", "greater than or equal to 1"),
    ({"method": "ngram", "num_speculative_tokens": 17}, {}, "speculative.num_speculative_tokens", "less than or equal to 16"),
    ({"method": "ngram", "num_speculative_tokens": 15}, {"max_model_len": 16},
     "speculative.num_speculative_tokens", "must be <= max_model_len - 2 = 14"),
    ({"method": "self", "num_speculative_tokens": 2, "draft_layers": 4}, {}, "speculative.draft_layers", "must be in 1..3"),
    ({"method": "self", "num_speculative_tokens": 2}, {}, "speculative", "needs draft_layers"),
    ({"method": "draft", "num_speculative_tokens": 2}, {}, "speculative", "needs draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "ngram_min_n": 3, "ngram_max_n": 2}, {}, "speculative",
     "ngram_min_n=3 must be <= ngram_max_n=2"),
    ({"method": "medusa", "num_speculative_tokens": 2}, {}, "speculative.method", "'ngram', 'draft' or 'self'"),
])
def test_bad_settings_are_refused(target_dir, spec, knobs, field, message) -> None:
    with pytest.raises(InputError, match=message) as info:
        make_llm(target_dir, speculative=spec, **knobs)
    assert info.value.field == field


def test_draft_with_another_vocabulary_is_refused(target_dir, other_vocab_dir) -> None:
    with pytest.raises(InputError, match="vocab_size=300 differs from the target's 256") as info:
        make_llm(target_dir, speculative={"method": "draft", "num_speculative_tokens": 2,
                                          "draft_model": str(other_vocab_dir)})
    assert info.value.field == "speculative.draft_model"
    assert info.value.value == str(other_vocab_dir)
