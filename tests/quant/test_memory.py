"""Memory: the bytes the engine really allocates for weights and for KV per token, in every
weight and KV-cache mode, and its activation peak at the token budget, equal what the planner's
memory model counts."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.llm import LLM
from engine.model.loader import load_model
from engine.sampler import SamplingParams
from planner.hardware import get_hardware
from planner.memory import GIB, plan_memory
from planner.specs import Deployment, EngineKnobs
from .helpers import PeakTensorBytes

# Widths that are multiples of the int4 group (128), as real models' are.
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def wide_model(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("tiny-wide", **WIDE)


@pytest.fixture(scope="module")
def long_model(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("tiny-wide-long", **{**WIDE, "intermediate_size": 1024, "max_position_embeddings": 4096})


def planned(folder: Path, **dep) -> object:
    return plan_memory(ModelConfig.from_json_file(folder), get_hardware("h100-sxm"),
                       Deployment(hardware="h100-sxm", engine="serveplan", **dep), 256)


@pytest.mark.parametrize("weight_dtype", ["bf16", "int8", "int4", "fp8"])
def test_transformer_layer_weight_bytes_equal_the_planners(wide_model: Path, weight_dtype: str) -> None:
    engine_dtype = "auto" if weight_dtype == "bf16" else weight_dtype
    model = load_model(str(wide_model), dtype=torch.bfloat16, random_weights=True, weight_dtype=engine_dtype).model
    layers = model.model.layers
    measured = sum(t.numel() * t.element_size() for t in [*layers.parameters(), *layers.buffers()])
    plan = planned(wide_model, weight_dtype=weight_dtype)
    # The planner counts per-channel scales as free: well under 1 %.
    assert measured == pytest.approx(plan.weights.transformer_layers_gib * GIB, rel=0.01)


@pytest.mark.parametrize(("kv_cache_dtype", "kv_dtype"), [("auto", "bf16"), ("int8", "int8"), ("fp8", "fp8")])
def test_kv_bytes_per_token_equal_the_planners(wide_model: Path, kv_cache_dtype: str, kv_dtype: str) -> None:
    llm = LLM(str(wide_model), random_weights=True, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              num_kv_blocks=8, block_size_tokens=16)
    allocated = sum(c.numel() * c.element_size() for c in llm.runner.kv_caches)
    assert allocated / (8 * 16) == planned(wide_model, kv_dtype=kv_dtype).kv_bytes_per_token_per_gpu


# ServePlan's own engine on this machine (a CPU: the serveplan profile's rule off CUDA) against the plan for
# the `serveplan` profile: weights as loaded, the KV blocks it allocates, the activation peak of a step at the
# token budget split over min(max_num_seqs, budget) requests, as the profiling passes of other engines do.
@pytest.mark.parametrize(("tokens", "requests"), [(1024, 16), (512, 64), (2048, 8)])
def test_the_engines_own_memory_equals_the_serveplan_plan(long_model: Path, tokens: int, requests: int) -> None:
    llm = LLM(str(long_model), random_weights=True, dtype="bfloat16", max_num_seqs=requests,
              max_num_batched_tokens=tokens, enable_prefix_caching=False)
    dep = Deployment(hardware="cpu-amd-epyc-1t", engine="serveplan",
                     knobs=EngineKnobs(max_num_seqs=requests, max_num_batched_tokens=tokens))
    plan = plan_memory(llm.config, get_hardware("cpu-amd-epyc-1t"), dep, llm.max_model_len)

    weights = sum(t.numel() * t.element_size() for t in [*llm.model.parameters(), *llm.model.buffers()])
    assert weights == pytest.approx(plan.weights.total_gib * GIB, rel=1e-3)  # RoPE inv_freq aside
    allocated = sum(c.numel() * c.element_size() for c in llm.runner.kv_caches)
    assert llm.num_blocks == plan.kv_cache_blocks and allocated == plan.kv_cache_blocks * plan.kv_bytes_per_block_per_gpu

    for i in range(requests):
        llm.add_request([(7 * i + j) % 250 + 1 for j in range(tokens // requests)], SamplingParams(max_tokens=2))
    with PeakTensorBytes([*llm.model.parameters(), *llm.model.buffers(), *llm.runner.kv_caches]) as peak:
        llm.step()  # every prompt whole: one step of `tokens` tokens, every request samples
    step = next(line for line in plan.lines if line.key == "activation.step")
    assert not step.in_budget  # no profiling pass: the engine leaves activations to the 1 - utilisation share
    assert peak.peak == pytest.approx(step.gib * GIB, rel=0.01)
