"""The engine end to end on a tiny random-weight Llama: greedy outputs do not depend on how
requests were batched, chunked, cached or preempted, and bad input is refused up front."""

from pathlib import Path
import random

import pytest

from engine.core import SamplingParams
from engine.errors import InputError
from engine.llm import LLM

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def make_llm(model_dir: Path, **knobs) -> LLM:
    knobs = {"max_num_batched_tokens": 512, "max_num_seqs": 16, "block_size_tokens": 4, **knobs}
    return LLM(str(model_dir), random_weights=True, seed=7, **knobs)


def prompts(n: int = 6, shared_prefix: int = 0, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_batched_equals_one_at_a_time(model_dir) -> None:
    ps = prompts()
    batched = tokens(make_llm(model_dir).generate(ps, GREEDY))
    llm = make_llm(model_dir)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in ps]
    assert batched == alone
    assert all(len(t) == GREEDY.max_tokens for t in batched)


def test_chunked_prefill_equals_whole_prefill(model_dir) -> None:
    ps = prompts(seed=1)
    whole = tokens(make_llm(model_dir, enable_chunked_prefill=False, max_num_batched_tokens=256).generate(ps, GREEDY))
    chunked = make_llm(model_dir, max_num_batched_tokens=16)
    assert tokens(chunked.generate(ps, GREEDY)) == whole


def test_prefix_caching_changes_nothing_but_the_work(model_dir) -> None:
    ps = prompts(shared_prefix=24, seed=2)
    off = make_llm(model_dir, enable_prefix_caching=False)
    on = make_llm(model_dir)
    expected = [off.generate([p], GREEDY)[0] for p in ps]
    got = [on.generate([p], GREEDY)[0] for p in ps]
    assert tokens(got) == tokens(expected)
    assert sum(o.metrics.cached_prompt_tokens for o in got[1:]) >= 20 * (len(ps) - 1)
    assert all(o.metrics.cached_prompt_tokens == 0 for o in expected)


def test_forced_preemption_recomputes_to_the_same_tokens(model_dir) -> None:
    ps = prompts(n=8, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = tokens(make_llm(model_dir).generate(ps, params))
    tight = make_llm(model_dir, num_kv_blocks=40)  # 160 slots for 8 requests of up to 63 tokens
    assert tokens(tight.generate(ps, params)) == roomy
    assert tight.scheduler.stats().num_preemptions > 0


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dir) -> None:
    ps = prompts(n=4, seed=4)
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=i) for i in range(4)]
    together = tokens(make_llm(model_dir).generate(ps, params))
    llm = make_llm(model_dir)
    apart = [llm.generate([p], sp)[0].token_ids for p, sp in zip(ps, params)]
    assert together == apart
    assert len({tuple(t) for t in together}) > 1


def test_metrics_are_consistent(model_dir) -> None:
    [out] = make_llm(model_dir).generate(prompts(n=1), GREEDY)
    m = out.metrics
    assert 0 <= m.queueing_s <= m.ttft_s <= m.e2e_s
    assert len(m.itl_s) == GREEDY.max_tokens - 1 and m.finish_reason == "length"


def test_prompt_longer_than_the_context_is_rejected(model_dir) -> None:
    with pytest.raises(InputError, match="max_model_len"):
        make_llm(model_dir).generate([[1] * 300], GREEDY)


def test_prompt_larger_than_the_kv_pool_is_rejected(model_dir) -> None:
    with pytest.raises(InputError, match="block"):
        make_llm(model_dir, num_kv_blocks=4).generate([[1] * 40], GREEDY)


def test_bad_engine_settings_and_sampling_params(model_dir) -> None:
    with pytest.raises(InputError, match="max_num_seqs"):
        make_llm(model_dir, max_num_seqs=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(InputError, match="token ids"):
        make_llm(model_dir).generate([[999]], GREEDY)


def test_unreadable_checkpoint_is_an_input_error(tmp_path) -> None:
    with pytest.raises(InputError):
        LLM(str(tmp_path / "missing"))


def test_with_settings_reuses_the_weights_in_a_fresh_engine(model_dir) -> None:
    ps = prompts(seed=9)
    first = make_llm(model_dir)
    first.generate(ps[:2], GREEDY)
    other = first.with_settings(num_kv_blocks=40, max_num_batched_tokens=16)
    assert other.model is first.model and other.runner is not first.runner
    assert other.scheduler.stats().num_requests == 0 and other.num_blocks == 40
    expected = tokens(make_llm(model_dir, num_kv_blocks=40, max_num_batched_tokens=16).generate(ps, GREEDY))
    assert tokens(other.generate(ps, GREEDY)) == expected
    with pytest.raises(InputError, match="dtype.*decides the loaded weights"):
        first.with_settings(dtype="bfloat16")
    with pytest.raises(InputError, match="max_num_seqs"):
        first.with_settings(max_num_seqs=0)


def test_a_dropped_engine_frees_its_kv_cache_at_once(model_dir) -> None:
    """The engine and its step loop hold no reference cycle, so dropping the engine frees its KV
    cache (1 GiB on a CPU by default) by reference counting, without waiting for the cycle
    collector, which large tensors do not prompt: a test suite building engine after engine ran a
    worker out of memory that way."""
    import gc
    import weakref

    llm = LLM(str(model_dir), random_weights=True, seed=0)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.runner is not None
    kv_cache = weakref.ref(llm.runner.kv_caches[0])
    gc.disable()
    try:
        del llm
        assert kv_cache() is None
    finally:
        gc.enable()
