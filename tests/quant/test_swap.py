"""quantize_model swaps exactly the transformer layers' Linears, and a quantised tiny model
still computes nearly the same logits."""

import pytest
import torch

from engine.model.layers import Embedding, Linear
from engine.model.loader import load_model
from engine.model.quantize import quantize_model
from engine.quant.linear import Fp8Linear, Int4Linear, Int8Linear

from .helpers import cosine, run_logits

SWAPPED = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}
PROMPT, DECODE = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46], [26, 43, 38, 32, 79, 50]


def load(model_dirs, arch: str, dtype: torch.dtype = torch.float32):
    return load_model(str(model_dirs[arch]), dtype=dtype, random_weights=True, seed=3).model


def expected_swaps(model) -> set[str]:
    names = set()
    for i, layer in enumerate(model.model.layers):
        names |= {f"model.layers.{i}.self_attn.qkv_proj", f"model.layers.{i}.self_attn.o_proj"}
        if hasattr(layer.mlp, "gate_up_proj"):  # dense MLP; an MoE block keeps its router and stacked experts
            names |= {f"model.layers.{i}.mlp.gate_up_proj", f"model.layers.{i}.mlp.down_proj"}
    return names


@pytest.mark.parametrize("weight_dtype", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_swaps_exactly_the_transformer_linears(model_dirs, arch: str, weight_dtype: str) -> None:
    model = load(model_dirs, arch)
    embed, head = model.model.embed_tokens.weight.clone(), model.lm_head.weight.clone()
    expected = expected_swaps(model)
    experts = {n: p.clone() for n, p in model.named_parameters() if ".experts." in n}
    originals = {n: m for n, m in model.named_modules() if n in expected}
    biases = {n: m.bias.clone() for n, m in originals.items() if m.bias is not None}
    assert quantize_model(model, weight_dtype) is model
    swapped = {n for n, m in model.named_modules() if isinstance(m, SWAPPED[weight_dtype])}
    assert swapped == expected
    # Nothing but the swapped modules changed type; embedding and lm_head stay float.
    assert type(model.model.embed_tokens) is Embedding and type(model.lm_head) is Linear
    assert torch.equal(model.model.embed_tokens.weight, embed) and torch.equal(model.lm_head.weight, head)
    remaining = {n for n, m in model.named_modules() if type(m) is Linear}
    if arch == "mixtral":  # the routers stay float
        assert remaining == {"lm_head"} | {f"model.layers.{i}.mlp.gate" for i in range(len(model.model.layers))}
        for n, p in model.named_parameters():
            if ".experts." in n:
                assert p.dtype == torch.float32 and torch.equal(p, experts[n])
    else:
        assert remaining == {"lm_head"}
    if arch == "qwen2":  # q/k/v biases carried over unchanged, in the activation dtype
        assert biases
        for n, b in biases.items():
            assert torch.equal(model.get_submodule(n).bias, b)
    if arch == "qwen2":  # tied embeddings stay tied
        assert model.lm_head.weight is model.model.embed_tokens.weight


# int4 on Gaussian weights: 16 levels over a group's range is ~10% relative error per matmul.
@pytest.mark.parametrize("weight_dtype,min_cos", [("int8", 0.999), ("fp8", 0.99), ("int4", 0.9)])
def test_quantised_logits_stay_close(model_dirs, weight_dtype: str, min_cos: float) -> None:
    reference = run_logits(load(model_dirs, "llama"), PROMPT, DECODE)
    quantised = run_logits(quantize_model(load(model_dirs, "llama"), weight_dtype), PROMPT, DECODE)
    sims = cosine(quantised, reference)
    assert sims.min() > min_cos, sims
    if weight_dtype == "int8":  # and greedy choices mostly agree
        agree = (quantised.argmax(-1) == reference.argmax(-1)).float().mean()
        assert agree >= 0.9, agree


@pytest.mark.parametrize("weight_dtype,median_cos", [("int8", 0.99), ("fp8", 0.99), ("int4", 0.9)])
def test_quantised_moe_logits_mostly_stay_close(model_dirs, weight_dtype: str, median_cos: float) -> None:
    # Top-2 of 4 random experts: a small change in a router input can flip an expert choice
    # and move that position's logits a lot (min cosine ~0.93 for int8), so the median is checked.
    reference = run_logits(load(model_dirs, "mixtral"), PROMPT, DECODE)
    quantised = run_logits(quantize_model(load(model_dirs, "mixtral"), weight_dtype), PROMPT, DECODE)
    assert cosine(quantised, reference).median() > median_cos


def test_bf16_model_quantises_with_bf16_scales_and_biases(model_dirs) -> None:
    model = quantize_model(load(model_dirs, "qwen2", torch.bfloat16), "int8")
    attn = model.model.layers[0].self_attn.qkv_proj
    assert attn.scales.dtype == torch.bfloat16 and attn.bias.dtype == torch.bfloat16
    reference = run_logits(load(model_dirs, "qwen2", torch.bfloat16), PROMPT, DECODE)
    assert cosine(run_logits(model, PROMPT, DECODE), reference).min() > 0.99


def test_bad_weight_dtype_and_double_quantisation(model_dirs) -> None:
    model = load(model_dirs, "llama")
    with pytest.raises(ValueError, match="weight_dtype must be one of int8, int4, fp8"):
        quantize_model(model, "int3")
    quantize_model(model, "int8")
    with pytest.raises(ValueError, match="already quantised"):
        quantize_model(model, "int4")
