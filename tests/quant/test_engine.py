"""weight_dtype / kv_cache_dtype through LLM, the CLI flags, and clear errors for bad names."""

import pytest

from engine.core import SamplingParams
from engine.errors import InputError
from engine.llm import LLM
from engine.quant.linear import Int4Linear, Int8Linear

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 41, 200, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


def make_llm(model_dirs, **knobs) -> LLM:
    return LLM(str(model_dirs["llama"]), random_weights=True, seed=7, block_size_tokens=4, **knobs)


def test_weight_dtype_quantises_and_generates(model_dirs) -> None:
    base = [o.token_ids for o in make_llm(model_dirs, kv_cache_gib=0.01).generate(PROMPTS, GREEDY)]
    llm = make_llm(model_dirs, weight_dtype="int8", kv_cache_gib=0.01)
    assert isinstance(llm.model.model.layers[0].self_attn.qkv_proj, Int8Linear)
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    agree = sum(a == b for x, y in zip(got, base) for a, b in zip(x, y)) / sum(map(len, base))
    assert agree >= 0.75, (got, base)
    int4 = make_llm(model_dirs, weight_dtype="int4", kv_cache_gib=0.01)
    assert isinstance(int4.model.model.layers[1].mlp.down_proj, Int4Linear)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in int4.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_kv_cache_dtype_gives_more_blocks_and_generates(model_dirs, kv_cache_dtype: str) -> None:
    fp32 = make_llm(model_dirs, kv_cache_gib=0.01)
    quant = make_llm(model_dirs, kv_cache_dtype=kv_cache_dtype, kv_cache_gib=0.01)
    # tiny llama: 2 layers, 2 KV heads, head_dim 16, 4-token blocks.
    assert fp32.kv_bytes_per_block(fp32.runner.kv_caches[0].dtype) == 2 * 2 * 2 * 16 * 4 * 4
    assert quant.kv_bytes_per_block(quant.runner.kv_caches[0].dtype) == 2 * 2 * 2 * (16 + 4) * 1 * 4
    assert quant.num_blocks == int(0.01 * 2**30 // (2 * 2 * 2 * 20 * 4))
    assert quant.num_blocks > 3 * fp32.num_blocks
    # The allocated cache is exactly as big as the accounting says.
    allocated = sum(c.numel() * c.element_size() for c in quant.runner.kv_caches)
    assert allocated == quant.num_blocks * quant.kv_bytes_per_block(quant.runner.kv_caches[0].dtype)
    # Closeness of the logits is checked in test_kv; greedy tokens of a random model can
    # flip on a near tie, so here only that the engine runs the quantised cache end to end.
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in quant.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("field,value,allowed", [
    ("weight_dtype", "int3", "'auto', 'int8', 'int4' or 'fp8'"),
    ("kv_cache_dtype", "int4", "'auto', 'int8' or 'fp8'"),
])
def test_bad_dtype_names_are_refused_clearly(model_dirs, field: str, value: str, allowed: str) -> None:
    with pytest.raises(InputError) as info:
        make_llm(model_dirs, **{field: value})
    assert info.value.field == field and allowed in str(info.value)


def test_cli_flags() -> None:
    import argparse

    from engine.cli import add_engine_commands
    from engine.knobs import read_flags

    parser = argparse.ArgumentParser()
    add_engine_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["engine", "generate", "hi", "--weight-dtype", "int4", "--kv-cache-dtype", "fp8"])
    read_flags(args)
    assert (args.weight_dtype, args.kv_cache_dtype) == ("int4", "fp8")
    assert parser.parse_args(["engine", "generate", "hi"]).weight_dtype == "auto"
    with pytest.raises(InputError, match="weight_dtype='int3' is invalid: must be one of auto, int8, int4, fp8"):
        read_flags(parser.parse_args(["engine", "generate", "hi", "--weight-dtype", "int3"]))


def test_dynamic_int8_kernel_runs_the_engine_and_is_refused_where_it_does_not_apply(model_dirs) -> None:
    llm = LLM(str(model_dirs["llama"]), random_weights=True, seed=7, weight_dtype="int8", int8_kernel="dynamic",
              num_kv_blocks=64)
    assert {m.kernel for m in llm.model.modules() if isinstance(m, Int8Linear)} == {"dynamic"}
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6
    with pytest.raises(InputError, match="int8_kernel='dynamic' is invalid: .*needs weight_dtype='int8'"):
        LLM(str(model_dirs["llama"]), random_weights=True, int8_kernel="dynamic")


def test_int8_lm_head_is_close_to_the_float_head_and_keeps_the_tied_embedding(model_dirs) -> None:
    import torch

    from engine.model.layers import Linear
    from engine.model.quantize import quantize_lm_head

    for arch in ("llama", "qwen2"):  # qwen2's tiny config ties the embedding
        base = LLM(str(model_dirs[arch]), random_weights=True, seed=7, block_size_tokens=4, kv_cache_gib=0.01)
        llm = LLM(str(model_dirs[arch]), random_weights=True, seed=7, block_size_tokens=4, kv_cache_gib=0.01,
                  lm_head_dtype="int8")
        head = llm.model.lm_head
        assert isinstance(head, Int8Linear) and head.kernel == "dynamic"
        assert isinstance(llm.model.model.embed_tokens.weight, torch.nn.Parameter)
        assert llm.model.model.embed_tokens.weight.dtype == torch.float32  # lookups stay exact
        hidden = torch.randn(5, llm.config.hidden_size, generator=torch.Generator().manual_seed(0))
        exact, quantised = base.model.compute_logits(hidden), llm.model.compute_logits(hidden)
        assert torch.nn.functional.cosine_similarity(exact, quantised, dim=-1).min() > 0.999
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in llm.generate(PROMPTS, GREEDY))
        with pytest.raises(ValueError, match="the LM head is already a Int8Linear"):
            quantize_lm_head(llm.model)
        assert type(base.model.lm_head) is Linear
    with pytest.raises(InputError, match="lm_head_dtype"):
        llm.with_settings(lm_head_dtype="auto")
