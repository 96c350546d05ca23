"""Memory plan: each engine's rule for its KV cache, each part with a hand-computed expectation, and
the plan's invariants (sharding, rounding, the does-not-fit answer)."""

import dataclasses
import math

import pytest

from engine.catalog import resolve_model
from engine.config import ModelConfig
from engine.errors import InputError
from planner.engines import engine_catalog, get_engine, resolve_deployment
from planner.hardware import get_hardware
from planner.memory import GIB, SAMPLERS, WEIGHT_BYTES_PER_PARAM, plan_memory
from planner.memory.activations import fused_forward_bytes, profiling_pass
from planner.memory.engines import engine_budget
from planner.memory.parts import MIB, Part
from planner.specs import Deployment, EngineKnobs

LLAMA_8B = resolve_model("llama-3.1-8b")
H100 = get_hardware("h100-sxm")


def plan(model: str = "llama-3.1-70b", hw: str = "h100-sxm", context: int = 8192, **dep):
    return plan_memory(resolve_model(model), get_hardware(hw), Deployment(hardware=hw, **dep), context)


def line(p, key: str) -> float:
    """GiB of the plan's line `key` (0 when the plan has no such line)."""
    return sum(x.gib for x in p.lines if x.key == key)


# --------------------------------------------------------------------------- engine rules


def test_vllm_rule_reproduces_a_logged_kv_cache_from_the_logged_parts() -> None:
    # vLLM 0.11, Llama-3.1-8B on one H100 (llm-d config explorer): 0.9 x 79.18 - 14.99 - 4.76 - 0.13 = 51.38 GiB.
    logged = {key: Part(key, key, gib * GIB, "", "") for key, gib in (
        ("device.reported", 79.18), ("weights.all", 14.99), ("activation.peak", 4.76), ("runtime.modules", 0.13),
        ("runtime.context", 0.61))}  # the context is before vLLM's start-up snapshot: not counted
    dep = resolve_deployment(Deployment(hardware="h100-sxm", engine="vllm-0.11",
                                        knobs=EngineKnobs(gpu_memory_utilization=0.9)), H100)
    budget = engine_budget(get_engine("vllm-0.11"), H100, dep, logged["device.reported"], [logged["weights.all"]],
                           [logged["activation.peak"]], [logged["runtime.context"], logged["runtime.modules"]], [])
    assert budget.kv_bytes / GIB == pytest.approx(51.382, abs=1e-9)


def test_vllm_plan_of_llama_8b_on_h100_line_by_line() -> None:
    dep = Deployment(hardware="h100-sxm", engine="vllm-0.11", knobs=EngineKnobs(block_size_tokens=128))
    p = plan_memory(LLAMA_8B, H100, dep, 16000)
    layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # q, o; k, v; gate/up/down; 2 norms
    weights = 32 * layer * 2 + 2 * 128256 * 4096 * 2 + 131072 * 128 * 2  # layers, embedding + head, rotary cache
    # The profiling pass: 8192 tokens over 1024 dummy requests (H100 defaults), then 1024 rows sampled with
    # torch's sort: 38 bytes per logit, with the hidden states [8192, 4096] and two [1024, 4096] copies held.
    sampler = 1024 * 128256 * 38 + 8192 * 4096 * 2 + 2 * 1024 * 4096 * 2
    kv = 0.9 * 79.18 * GIB - weights - sampler - 32 * MIB - 0.15 * GIB
    assert p.usable_memory_gib == pytest.approx(0.9 * 79.18)
    assert p.weights.total_gib * GIB == pytest.approx(weights, rel=1e-12)
    assert line(p, "activation.sampler") * GIB == pytest.approx(sampler, rel=1e-12)
    assert p.kv_cache_gib * GIB == pytest.approx(kv, rel=1e-12)
    assert p.kv_cache_blocks == math.floor(kv / (128 * 32 * 2 * 8 * 128 * 2))
    # Checked, not fitted: the log printed 14.99 GiB of weights, a 4.76 GiB peak and 51.38 GiB of KV cache.
    assert p.weights.total_gib == pytest.approx(14.99, abs=0.01)
    assert p.activation_reserve_gib == pytest.approx(4.76, abs=0.03)
    assert p.kv_cache_gib == pytest.approx(51.38, abs=0.05)


def test_sampler_bytes_per_logit_count_the_tensors_alive_at_the_peak() -> None:
    # bf16 logits 2 + fp32 copy 4 + sorted values 4 + int64 indices 8 + sort scratch (int64 positions 8,
    # radix-sort alternate keys 4 and values 8).
    assert SAMPLERS["torch_sort"].bytes_per_logit == 2 + 4 + 4 + 8 + 8 + 12
    # V0 to 0.6.4 re-gathers: after the sort, masks 1 + 1, probabilities 4, cumulative sums 4, the inverse
    # permutation 8 and the gathered logits 4 are alive with the sorted pair.
    assert SAMPLERS["torch_sort_gather"].bytes_per_logit == 2 + 4 + 4 + 8 + 1 + 4 + 4 + 1 + 8 + 4
    # FlashInfer masks the top-k without sorting: logits, fp32 copy, masked logits, probabilities.
    assert SAMPLERS["flashinfer"].bytes_per_logit == 2 + 4 + 4 + 4


def test_flashinfer_sampler_on_an_a100_reserves_a_third() -> None:
    # vLLM 0.10 on an A100 80GB: 256 requests and 2048 tokens (no large defaults on A100s).
    qwen = resolve_model("qwen2.5-7b")
    a100 = get_hardware("a100-80gb-sxm")
    dep = Deployment(hardware="a100-80gb-sxm", knobs=EngineKnobs(gpu_memory_utilization=0.25))
    p = plan_memory(qwen, a100, dep.model_copy(update={"profile_sampler": "flashinfer"}), 16384)
    sampler = 256 * 152064 * 14 + 2048 * 3584 * 2 + 2 * 256 * 3584 * 2
    assert line(p, "activation.sampler") * GIB == pytest.approx(sampler, rel=1e-12)
    assert line(p, "activation.cublas") * GIB == 12 * MIB  # cuBLAS 8 MiB + cuBLASLt 4 MiB before Hopper
    native = plan_memory(qwen, a100, dep, 16384)
    assert native.activation_reserve_gib - p.activation_reserve_gib == pytest.approx(256 * 152064 * 24 / GIB)


def test_sglang_takes_its_fraction_of_the_memory_free_at_start() -> None:
    p = plan(model="llama-3.1-8b", engine="sglang-0.5", context=16000)
    fraction = round((81920 - (512 + 1.5 * 8192 + 2 * 256 + 128)) / 81920, 3)  # its default on an 80 GiB device
    weights = p.weights.total_gib
    assert p.usable_memory_gib == pytest.approx(fraction * (79.18 - 0.5))  # less the CUDA context
    assert p.kv_cache_gib == pytest.approx(fraction * (79.18 - 0.5) - weights)
    assert p.activation_reserve_gib == 0  # no profiling pass: activations live outside the budget
    assert p.kv_cache_blocks == math.floor(p.kv_cache_gib * GIB / (32 * 2 * 8 * 128 * 2))  # one token per page


def test_trtllm_takes_its_fraction_of_what_is_free_after_the_profiled_peak() -> None:
    p = plan(model="llama-3.1-8b", engine="trtllm-1.2", context=8192)
    peak = sum(x.gib for x in p.lines if x.in_budget and x.key not in ("device.reported", "budget", "kv"))
    assert p.kv_cache_gib == pytest.approx(0.9 * (79.18 - peak))
    assert line(p, "graphs.pool") > 0 and line(p, "runtime.context") == 0.5  # captured graphs and context counted
    assert p.kv_cache_blocks == math.floor(p.kv_cache_gib * GIB / (32 * 32 * 2 * 8 * 128 * 2))  # 32-token blocks


def test_serveplan_engine_keeps_one_gib_off_cuda_and_its_share_on_cuda() -> None:
    cpu = plan(model="llama-3.1-8b", hw="cpu-amd-epyc-1t", engine="serveplan", context=4096)
    assert cpu.kv_cache_gib == pytest.approx(1.0)
    gpu = plan(model="llama-3.1-8b", engine="serveplan", context=4096)
    assert gpu.kv_cache_gib == pytest.approx(0.9 * 79.18 - 0.5 - gpu.weights.total_gib)  # free - total x 0.1


def test_every_engine_subtracts_exactly_its_counted_lines() -> None:
    for engine in engine_catalog():
        for model, tp in (("llama-3.1-8b", 1), ("qwen3-235b-a22b", 8), ("deepseek-v3", 8)):
            hw = "h200"
            p = plan(model=model, hw=hw, engine=engine, tensor_parallel=tp, weight_dtype="fp8", context=4096)
            counted = sum(x.gib for x in p.lines if x.in_budget and x.key not in ("device.reported", "budget", "kv"))
            assert p.kv_cache_gib == pytest.approx(p.usable_memory_gib - counted), (engine, model)
            assert p.kv_cache_gib == pytest.approx(
                p.usable_memory_gib - p.weights.total_gib - p.activation_reserve_gib - p.runtime_overhead_gib)


def test_sampler_override_only_for_engines_that_sample_while_profiling() -> None:
    with pytest.raises(InputError, match="^profile_sampler='flashinfer' is invalid: sglang-0.5 does not sample"):
        plan_memory(LLAMA_8B, H100, Deployment(hardware="h100-sxm", engine="sglang-0.5", profile_sampler="flashinfer"),
                    4096)


# --------------------------------------------------------------------------- device, weights, activations


def test_engines_see_the_memory_the_device_reports() -> None:
    p = plan(model="llama-3.1-8b", hw="l40s", context=4096)
    assert p.device_memory_gib == 48 and p.device_memory_reported_gib == 44.4
    assert p.usable_memory_gib == pytest.approx(0.9 * 44.4)
    tpu = plan(model="llama-3.1-8b", hw="tpu-v5p", context=4096)
    assert tpu.device_memory_reported_gib == 95 and any("no reported-memory figure" in a for a in tpu.assumptions)


def test_issue_example_70b_fp8_on_four_h100() -> None:
    p = plan(tensor_parallel=4, weight_dtype="fp8", kv_dtype="fp8")
    layer = (8192 * 8192 * 2 / 4 + 2 * 8192 * 2 * 128 + 3 * 8192 * 28672 / 4) * 1.0 + 2 * 8192 * 2.0  # norms replicated
    expected = 80 * layer + 2 * 128256 / 4 * 8192 * 2.0 + 131072 * 128 * 2.0
    assert p.weights.total_gib * GIB == pytest.approx(expected, rel=1e-12)
    assert p.kv_bytes_per_token_model == 80 * 2 * 8 * 128  # fp8, one scale per tensor: a byte per element
    assert p.kv_bytes_per_token_per_gpu == p.kv_bytes_per_token_model // 4
    assert p.fits and p.max_concurrent_sequences == p.kv_cache_blocks // math.ceil(8192 / 16)


def test_serveplan_engine_stores_a_scale_per_token_and_head() -> None:
    p = plan(tensor_parallel=4, weight_dtype="fp8", kv_dtype="fp8", engine="serveplan")
    assert p.kv_bytes_per_token_model == 80 * 2 * 8 * (128 + 4)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_splits_what_is_split_and_replicates_the_rest(tp: int) -> None:
    one = plan(model="llama-3.1-8b", tensor_parallel=1)
    many = plan(model="llama-3.1-8b", tensor_parallel=tp)
    norms = 32 * 2 * 4096 * 2 / GIB  # on every rank
    kv_heads = min(tp, 8) // tp  # 8 KV heads: split up to tp=8
    assert kv_heads == 1
    assert (many.weights.transformer_layers_gib - norms) * tp == pytest.approx(one.weights.transformer_layers_gib - norms)
    assert many.weights.buffers_gib == one.weights.buffers_gib  # the rotary cache is on every GPU


def test_vocabulary_is_padded_to_64_before_it_is_split() -> None:
    cfg = ModelConfig.from_hf_config({"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2048,
                                      "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 32001,
                                      "max_position_embeddings": 4096}, name="odd-vocab")
    p = plan_memory(cfg, H100, Deployment(hardware="h100-sxm", tensor_parallel=2), 1024)
    assert p.weights.embedding_gib * GIB == 32064 / 2 * 1024 * 2


def test_mxfp4_experts_are_padded_for_marlin_and_attention_stays_bf16() -> None:
    # gpt-oss-120b on four A100s: Marlin pads the hidden size to 3072 and each rank's 720 intermediate to 768.
    p = plan(model="gpt-oss-120b", hw="a100-80gb-sxm", tensor_parallel=4, weight_dtype="fp4", context=16384)
    per_value = 0.5 + 1 / 32
    expert = 2 * 768 * 3072 * per_value + 3072 * 768 * per_value + 2 * (2 * 768 + 3072)  # + bf16 biases
    q, kv = 64 * 64 // 4, 2 * 64
    attention = (2880 * q + 2 * 2880 * kv + q * 2880 + q + 2 * kv + 2880 + 64 // 4) * 2  # biases, sinks; bf16
    router = (2880 * 128 + 128) * 2
    layer = 128 * expert + attention + router + 2 * 2880 * 2
    assert p.weights.transformer_layers_gib * GIB == pytest.approx(36 * layer, rel=1e-12)
    # Checked against the log (vLLM 0.10.1, Marlin): "Model loading took 17.2217 GiB".
    assert p.weights.total_gib == pytest.approx(17.2217, rel=0.01)


def test_mla_latent_is_replicated_over_tensor_parallel_ranks() -> None:
    p = plan(model="deepseek-v3", hw="h200", tensor_parallel=8, weight_dtype="fp8")
    assert p.kv_bytes_per_token_per_gpu == 61 * 576 * 2


def test_fewer_kv_heads_than_ranks_replicates_one_head_per_rank() -> None:
    p = plan(model="llama-3.1-70b", tensor_parallel=16)
    assert p.kv_bytes_per_token_per_gpu == 80 * 2 * 1 * 128 * 2


def test_only_the_last_pipeline_stage_samples() -> None:
    dep = resolve_deployment(Deployment(hardware="h100-sxm", knobs=EngineKnobs(max_num_batched_tokens=8192, max_num_seqs=1024)),
                             H100)
    engine = get_engine("vllm-0.11")
    first = profiling_pass(LLAMA_8B, dep, engine, None, samples=False)
    last = profiling_pass(LLAMA_8B, dep, engine, None, samples=True)
    assert [p.key for p in first] == ["activation.forward"] and [p.key for p in last] == ["activation.sampler"]
    # The dense layer's forward peak: residual + normed input [8192, 4096] and gate_up + SwiGLU [8192, 3 x 14336].
    assert first[0].bytes == fused_forward_bytes(LLAMA_8B, 1, 8192, 2.0)[0] == 8192 * (2 * 4096 + 3 * 14336) * 2


def test_the_profiling_pass_peak_follows_the_token_budget_not_the_context() -> None:
    short = plan(model="qwen3-0.6b", context=16000, knobs=EngineKnobs(max_num_seqs=64))
    long = plan(model="qwen3-0.6b", context=32000, knobs=EngineKnobs(max_num_seqs=64))
    more = plan(model="qwen3-0.6b", context=16000, knobs=EngineKnobs(max_num_seqs=64, max_num_batched_tokens=32768))
    assert short.activation_reserve_gib == long.activation_reserve_gib < more.activation_reserve_gib


# --------------------------------------------------------------------------- pool, verdicts, input checks


def test_kv_blocks_fill_what_is_left_and_no_more() -> None:
    p = plan(model="llama-3.1-8b")
    used = p.kv_cache_blocks * p.kv_bytes_per_block_per_gpu / GIB
    assert used <= p.kv_cache_gib < used + p.kv_bytes_per_block_per_gpu / GIB
    assert p.kv_cache_tokens == p.kv_cache_blocks * p.block_size_tokens


def test_quantised_weights_shrink_by_their_bytes_per_param() -> None:
    bf16 = plan(model="llama-3.1-8b", weight_dtype="bf16").weights.transformer_layers_gib
    int4 = plan(model="llama-3.1-8b", weight_dtype="int4").weights.transformer_layers_gib
    norms = 32 * 2 * 4096 * 2 / GIB  # unquantised
    assert (int4 - norms) / (bf16 - norms) == pytest.approx(WEIGHT_BYTES_PER_PARAM["int4"] / 2)


def test_windowed_model_reports_window_aware_concurrency() -> None:
    # vLLM groups gemma-2's 21 sliding and 21 full layers into two groups of 21 over one pool: its
    # concurrency is the window-aware figure, reached here by counting blocks. SGLang's profile keeps
    # every token of every layer, and reports what windowed allocation would hold beside it.
    vllm = plan(model="gemma-2-9b", context=8192)
    assert (vllm.kv_layers_per_block, vllm.kv_window_groups, vllm.kv_window_tokens) == (21, 1, 4096)
    assert vllm.max_concurrent_sequences == vllm.max_concurrent_sequences_window_aware
    sglang = plan(model="gemma-2-9b", context=8192, engine="sglang-0.5")
    assert sglang.kv_window_groups == 0 and sglang.kv_layers_per_block == 42
    assert sglang.max_concurrent_sequences_window_aware > sglang.max_concurrent_sequences


def test_gpt_oss_groups_follow_vllms_rule() -> None:
    # 12 full and 12 sliding (128-token) layers: groups of 12; a block holds half the layers' tokens.
    p = plan(model="gpt-oss-20b", weight_dtype="fp4", context=8192)
    assert (p.kv_layers_per_block, p.kv_window_groups, p.kv_window_tokens) == (12, 1, 128)
    assert p.kv_bytes_per_block_per_gpu * 2 == p.kv_bytes_per_token_per_gpu * p.block_size_tokens


@pytest.mark.parametrize("engine", ["vllm-0.11", "sglang-0.5", "trtllm-1.2", "serveplan"])
def test_an_explicit_kv_cache_size_is_the_cache_whatever_the_engines_rule(engine: str) -> None:
    """kv_cache_gib (vLLM --kv-cache-memory) sets the cache per GPU: every other line is as the rule
    counts it, and the blocks are what that size holds."""
    rule = plan(model="llama-3.1-8b", engine=engine)
    fixed = plan(model="llama-3.1-8b", engine=engine, knobs=EngineKnobs(kv_cache_gib=7.5))
    assert fixed.fits and fixed.kv_cache_gib == pytest.approx(7.5)
    assert fixed.kv_cache_blocks == math.floor(7.5 * GIB / fixed.kv_bytes_per_block_per_gpu)
    assert fixed.weights == rule.weights and fixed.activation_reserve_gib == rule.activation_reserve_gib


def test_a_kv_cache_beyond_the_device_does_not_fit() -> None:
    p = plan(model="llama-3.1-8b", knobs=EngineKnobs(kv_cache_gib=79.0))
    assert not p.fits
    assert p.reason.startswith("does not fit: kv_cache_gib 79 GiB") and "the device reports" in p.reason


def test_a_whole_device_share_leaves_no_room_for_what_vllm_keeps_outside_it() -> None:
    # vLLM's CUDA context and graphs live outside gpu_memory_utilization x total: at 1.0 they cannot fit.
    assert plan(model="llama-3.1-8b", knobs=EngineKnobs(gpu_memory_utilization=0.95)).fits
    whole = plan(model="llama-3.1-8b", knobs=EngineKnobs(gpu_memory_utilization=1.0))
    assert not whole.fits and "more than the" in whole.reason and "the device reports" in whole.reason


def test_gpus_without_peer_access_keep_the_pcie_share_of_nccl_buffers() -> None:
    nvlink, host = plan(tensor_parallel=4), plan(tensor_parallel=4, peer_access=False)
    assert line(host, "runtime.nccl") != line(nvlink, "runtime.nccl")
    assert line(host, "runtime.nccl") == line(plan(hw="h100-pcie", tensor_parallel=4), "runtime.nccl")


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


def test_every_line_says_its_rule_and_source() -> None:
    for engine in engine_catalog():
        p = plan(model="gpt-oss-20b", weight_dtype="fp4", engine=engine, context=8192)
        assert p.lines[0].key == "device.reported" and p.lines[1].key == "budget"
        assert all(x.rule and x.source for x in p.lines), engine
        assert sum(x.key == "kv" for x in p.lines) == 1


def test_a_model_of_sliding_window_layers_only_keeps_every_token() -> None:
    # vLLM would run one sliding-window group; the simulator's KV manager always has a full-attention group.
    oss = resolve_model("gpt-oss-20b")
    every_layer = dataclasses.replace(oss, layer_windows=(128,) * oss.num_layers)
    p = plan_memory(every_layer, get_hardware("h100-sxm"), Deployment(hardware="h100-sxm", weight_dtype="fp4"), 8192)
    assert p.kv_window_groups == 0 and p.kv_layers_per_block == oss.num_layers
    assert any("every layer is a sliding-window layer" in note for note in p.assumptions)
