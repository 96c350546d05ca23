"""Memory plan: sharding conservation, KV sizing and the does-not-fit answer."""

import math

import pytest

from engine.catalog import resolve_model
from engine.errors import InputError
from planner.hardware import get_hardware
from planner.memory import GIB, WEIGHT_BYTES_PER_PARAM, plan_memory
from planner.specs import Deployment, EngineKnobs


def plan(model: str = "llama-3.1-70b", hw: str = "h100-sxm", context: int = 8192, **dep):
    return plan_memory(resolve_model(model), get_hardware(hw), Deployment(hardware=hw, **dep), context)


def test_issue_example_70b_fp8_on_four_h100() -> None:
    p = plan(tensor_parallel=4, weight_dtype="fp8", kv_dtype="fp8")
    m = resolve_model("llama-3.1-70b")
    layers = m.total_params - m.embedding_params - m.lm_head_params - m.hidden_size
    expected = (layers * 1.0 + (m.embedding_params + m.lm_head_params) * 2.0) / 4
    assert p.weights.total_gib == pytest.approx(expected / GIB, rel=1e-3)  # final norm aside
    assert p.kv_bytes_per_token_model == 80 * 2 * 8 * (128 + 4)  # fp8: a byte per element, an fp32 scale per head
    assert p.kv_bytes_per_token_per_gpu == p.kv_bytes_per_token_model // 4
    assert p.fits and p.max_concurrent_sequences == p.kv_cache_blocks // math.ceil(8192 / 16)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_shards_conserve_weight_bytes(tp: int) -> None:
    one = plan(model="llama-3.1-8b", tensor_parallel=1)
    many = plan(model="llama-3.1-8b", tensor_parallel=tp)
    assert many.weights.total_gib * tp == pytest.approx(one.weights.total_gib, rel=1e-6)


def test_pipeline_stages_split_layers_and_keep_embeddings_at_the_ends() -> None:
    p = plan(model="llama-3.1-8b", pipeline_parallel=2)
    whole = plan(model="llama-3.1-8b")
    assert p.weights.transformer_layers_gib == pytest.approx(whole.weights.transformer_layers_gib / 2, rel=1e-6)


def test_kv_blocks_fill_what_is_left_and_no_more() -> None:
    p = plan(model="llama-3.1-8b")
    used = p.kv_cache_blocks * p.kv_bytes_per_block_per_gpu / GIB
    assert used <= p.kv_cache_gib < used + p.kv_bytes_per_block_per_gpu / GIB
    budget = p.usable_memory_gib - p.weights.total_gib - p.activation_reserve_gib - p.runtime_overhead_gib
    assert p.kv_cache_gib == pytest.approx(budget)


def test_quantised_weights_shrink_by_their_bytes_per_param() -> None:
    bf16 = plan(model="llama-3.1-8b", weight_dtype="bf16").weights.transformer_layers_gib
    int4 = plan(model="llama-3.1-8b", weight_dtype="int4").weights.transformer_layers_gib
    assert int4 / bf16 == pytest.approx(WEIGHT_BYTES_PER_PARAM["int4"] / 2)


def test_mla_latent_is_replicated_over_tensor_parallel_ranks() -> None:
    p = plan(model="deepseek-v3", hw="h200", tensor_parallel=8, weight_dtype="fp8")
    assert p.kv_bytes_per_token_per_gpu == 61 * 576 * 2


def test_fewer_kv_heads_than_ranks_replicates_one_head_per_rank() -> None:
    p = plan(model="llama-3.1-70b", tensor_parallel=16)
    assert p.kv_bytes_per_token_per_gpu == 80 * 2 * 1 * 128 * 2


def test_windowed_model_reports_window_aware_concurrency() -> None:
    p = plan(model="gemma-2-9b", context=8192)
    assert p.max_concurrent_sequences_window_aware > p.max_concurrent_sequences


def test_does_not_fit_says_what_it_needs() -> None:
    p = plan(model="llama-3.1-405b", hw="l4")
    assert not p.fits
    assert p.reason.startswith("does not fit: needs") and "GiB per GPU" in p.reason and "has" in p.reason


def test_more_memory_utilisation_never_means_fewer_blocks() -> None:
    low = plan(model="llama-3.1-8b", knobs=EngineKnobs(gpu_memory_utilization=0.8))
    high = plan(model="llama-3.1-8b", knobs=EngineKnobs(gpu_memory_utilization=0.95))
    assert high.kv_cache_blocks > low.kv_cache_blocks


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tensor_parallel": 3}, "tensor_parallel"),
        ({"pipeline_parallel": 200}, "pipeline_parallel"),
        ({"expert_parallel": 2, "tensor_parallel": 2}, "expert_parallel"),
    ],
)
def test_impossible_layouts_are_rejected(kwargs: dict, field: str) -> None:
    # The field's own name, never a CLI flag: the CLI and the dashboard rename it in their own terms.
    with pytest.raises(InputError, match=f"^{field}=") as info:
        plan(model="llama-3.1-8b", **kwargs)
    assert info.value.field == field


def test_context_beyond_the_model_is_rejected() -> None:
    with pytest.raises(InputError, match="max_position_embeddings"):
        plan(model="llama-3.1-8b", context=10**7)
