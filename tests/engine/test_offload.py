"""KV offload in the real engine: swap preemption and host/disk prefix tiers change the work, never
the greedy tokens. Preemption and eviction are forced by construction: caches too small to hold
every request at once."""

from __future__ import annotations

from pathlib import Path
import random

import pytest

from engine.core import SamplingParams
from engine.errors import InputError
from engine.llm import LLM

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
BLOCK = 4


def make_llm(model_dir: Path, **knobs: object) -> LLM:
    knobs = {"max_num_batched_tokens": 512, "max_num_seqs": 16, "block_size_tokens": BLOCK, **knobs}
    return LLM(str(model_dir), random_weights=True, seed=7, **knobs)


def gib(llm: LLM, blocks: int) -> float:
    """The size of `blocks` KV blocks of this engine, in GiB."""
    return blocks * llm.kv_bytes_per_block(llm.runner.kv_caches[0].dtype) / 2**30


def computed_tokens(llm: LLM) -> list[int]:
    """Tokens each step computes, recorded from now on."""
    seen: list[int] = []
    llm.loop.on_step = lambda output, sample: seen.append(output.total_num_scheduled_tokens)
    return seen


def test_swap_and_recompute_preemption_give_the_same_tokens(model_dir: Path) -> None:
    rng = random.Random(3)
    ps = [[rng.randrange(256) for _ in range(rng.randrange(20, 40))] for _ in range(8)]
    base = make_llm(model_dir)
    expected = [o.token_ids for o in base.generate(ps, PARAMS)]
    recompute = base.with_settings(num_kv_blocks=40)  # 160 slots for 8 requests of up to 63 tokens
    work_recompute = computed_tokens(recompute)
    assert [o.token_ids for o in recompute.generate(ps, PARAMS)] == expected
    swap = base.with_settings(num_kv_blocks=40, preemption_mode="swap", kv_offload_host_gib=gib(base, 200))
    work_swap = computed_tokens(swap)
    assert [o.token_ids for o in swap.generate(ps, PARAMS)] == expected
    stats = swap.scheduler.stats()
    assert recompute.scheduler.stats().num_preemptions > 0 and stats.num_preemptions > 0
    assert stats.offload.swapped_out_requests == stats.num_preemptions  # every preemption swapped
    # Swapped requests resume where they stopped: no prompt or output is computed twice.
    assert sum(work_swap) == sum(len(p) + PARAMS.max_tokens - 1 for p in ps) < sum(work_recompute)


def _rounds_of_prefixes(n_prefixes: int = 4, prefix_tokens: int = 32) -> list[list[int]]:
    rng = random.Random(5)
    prefixes = [[rng.randrange(256) for _ in range(prefix_tokens)] for _ in range(n_prefixes)]
    return [prefix + [rng.randrange(256) for _ in range(5)] for _ in range(2) for prefix in prefixes]


def _serve_one_by_one(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([p], PARAMS)[0].token_ids for p in prompts]


def test_a_host_tier_keeps_evicted_prefixes_and_changes_no_token(model_dir: Path) -> None:
    ps = _rounds_of_prefixes()
    # 24 device blocks hold about two requests' prefixes: the second round misses on the device alone.
    device_only = make_llm(model_dir, num_kv_blocks=24)
    expected = _serve_one_by_one(device_only, ps)
    with_host = device_only.with_settings(kv_offload_host_gib=gib(device_only, 64))
    assert _serve_one_by_one(with_host, ps) == expected
    alone, tiered = device_only.scheduler.stats().prefix_cache, with_host.scheduler.stats().prefix_cache
    assert tiered.host_hit_tokens >= 4 * 24  # the second round finds each 32-token prefix's full blocks
    assert tiered.hit_rate > alone.hit_rate
    assert with_host.scheduler.stats().offload.loaded_host_blocks * BLOCK == tiered.host_hit_tokens


def test_a_disk_tier_catches_what_the_host_tier_evicts(model_dir: Path, tmp_path: Path) -> None:
    ps = _rounds_of_prefixes()
    device_only = make_llm(model_dir, num_kv_blocks=24)
    expected = _serve_one_by_one(device_only, ps)
    tiered = device_only.with_settings(kv_offload_host_gib=gib(device_only, 8), kv_offload_disk_gib=gib(device_only, 64),
                                       kv_offload_disk_path=str(tmp_path))
    assert _serve_one_by_one(tiered, ps) == expected
    stats = tiered.scheduler.stats()
    assert stats.prefix_cache.disk_hit_tokens > 0 and stats.offload.demoted_blocks > 0
    assert not list(tmp_path.iterdir())  # the tier's file is unlinked as soon as it is mapped


def test_offload_settings_are_checked(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="kv_offload_disk_path"):
        make_llm(model_dir, kv_offload_host_gib=0.01, kv_offload_disk_gib=0.01)
    with pytest.raises(InputError, match="kv_offload_host_gib"):
        make_llm(model_dir, kv_offload_disk_gib=0.01, kv_offload_disk_path=str(tmp_path))
    with pytest.raises(InputError, match="preemption_mode"):
        make_llm(model_dir, preemption_mode="swap")
    with pytest.raises(InputError, match="holds no KV block"):
        make_llm(model_dir, kv_offload_host_gib=1e-9)
    with pytest.raises(InputError, match="existing folder"):
        make_llm(model_dir, kv_offload_host_gib=0.01, kv_offload_disk_gib=0.01,
                 kv_offload_disk_path=str(tmp_path / "missing"))
