"""ModelConfig against first principles and published figures."""

import json

import pytest

from engine.catalog import catalog, resolve_model
from engine.config import ModelConfig
from engine.errors import InputError


@pytest.mark.parametrize("name", sorted(catalog()))
def test_parameter_counts_match_published_totals(name: str) -> None:
    entry = catalog()[name]
    model = resolve_model(name)
    assert model.total_params / 1e9 == pytest.approx(entry.published_total_params_b, rel=0.01)
    if entry.published_active_params_b is not None:
        active = model.active_params
        if entry.family == "gpt_oss":  # OpenAI counts active parameters without the input embedding
            active -= model.embedding_params
        if entry.family == "glm4_moe":  # Zhipu's without the embedding and the LM head
            active -= model.embedding_params + model.lm_head_params
        assert active / 1e9 == pytest.approx(entry.published_active_params_b, rel=0.02)


def test_catalog_has_at_least_twenty_models() -> None:
    assert len(catalog()) >= 20


def test_kv_bytes_per_token_from_first_principles() -> None:
    # Llama-3.1-8B: 32 layers x (K and V) x 8 KV heads x 128 dims x 2 bytes.
    assert resolve_model("llama-3.1-8b").kv_bytes_per_token("bf16") == 32 * 2 * 8 * 128 * 2 == 131_072
    # DeepSeek-V3 MLA: 61 layers x (512 latent + 64 rope) x 2 bytes.
    assert resolve_model("deepseek-v3").kv_bytes_per_token("bf16") == 61 * 576 * 2 == 70_272
    # fp8: a byte per element plus the engine's fp32 scale per token and KV head.
    assert resolve_model("llama-3.1-8b").kv_bytes_per_token("fp8") == 32 * 2 * 8 * (128 + 4) == 67_584


def test_windowed_layers_hold_only_their_window() -> None:
    gemma = resolve_model("gemma-2-9b")  # 42 layers alternating local (4096) and global
    per_layer = 2 * 8 * 256 * 2
    assert gemma.kv_bytes_for_sequence(8192) == (21 * 4096 + 21 * 8192) * per_layer
    assert gemma.kv_bytes_for_sequence(1000) == 42 * 1000 * per_layer
    oss = resolve_model("gpt-oss-120b")  # half the layers see a 128-token window
    assert sum(1 for w in oss.layer_windows if w == 128) == 18


def test_moe_structure() -> None:
    ds = resolve_model("deepseek-v3")
    assert ds.num_moe_layers == 58 and ds.moe.num_experts == 256 and ds.moe.top_k == 8
    qwen = resolve_model("qwen3-30b-a3b")
    assert qwen.num_moe_layers == 48 and qwen.intermediate_size == 0


def test_flops_per_token_is_twice_the_matmul_parameters_plus_attention() -> None:
    m = resolve_model("llama-3.1-8b")
    matmul = 2 * (m.total_params - m.embedding_params)  # untied head: its matmul counts, the lookup does not
    assert m.flops_per_token(0) == matmul
    assert m.flops_per_token(1000) - m.flops_per_token(0) == 32 * 4 * 32 * 128 * 1000


def test_unknown_model_suggests_close_names() -> None:
    with pytest.raises(InputError, match="did you mean llama-3.1-8b"):
        resolve_model("llama-3.1-8")


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"model_type": "bert"}, "model_type"),
        ({"num_attention_heads": None}, "num_attention_heads"),
    ],
)
def test_bad_configs_name_the_field(tmp_path, patch: dict, field: str) -> None:
    cfg = {**resolve_model("llama-3.2-1b").hf_config, **patch}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=field.split("_")[0]):
        ModelConfig.from_json_file(tmp_path)


def test_malformed_json_is_an_input_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        resolve_model(str(tmp_path))


# --------------------------------------------------------------------------- issue 14, defects 8 and 11
# A config.json written by hand or exported by another tool: every value ServePlan reads is a
# finite, positive, consistent figure, or the config is refused naming the field. Each case
# below was accepted with an absurd answer, or raised a traceback, before.


def _config(base: str, **patch: object) -> dict:
    return {**resolve_model(base).hf_config, **patch}


@pytest.mark.parametrize(
    ("base", "patch", "field", "allowed"),
    [
        ("llama-3.2-1b", {"num_attention_heads": 0}, "num_attention_heads", "greater than or equal to 1"),
        ("llama-3.2-1b", {"num_key_value_heads": 0}, "num_key_value_heads", "greater than or equal to 1"),
        ("llama-3.2-1b", {"intermediate_size": -8192}, "intermediate_size", "greater than or equal to 0"),
        ("llama-3.2-1b", {"intermediate_size": 0}, "intermediate_size", "dense MLP layers need a width >= 1"),
        ("mixtral-8x7b", {"num_local_experts": 0}, "num_local_experts", "routes to experts: needs >= 1"),
        ("mixtral-8x7b", {"num_experts_per_tok": 9}, "num_experts_per_tok", "must be in 1..num_experts=8"),
        ("llama-3.2-1b", {"hidden_size": "2048"}, "hidden_size", "valid integer"),
        ("llama-3.2-1b", {"hidden_size": 2048.5}, "hidden_size", "valid integer"),
        ("llama-3.2-1b", {"num_hidden_layers": True}, "num_hidden_layers", "valid integer"),
        ("llama-3.2-1b", {"vocab_size": 10**12}, "vocab_size", "less than or equal to"),
        ("llama-3.2-1b", {"rms_norm_eps": float("nan")}, "rms_norm_eps", "finite number"),
        ("llama-3.2-1b", {"rope_scaling": "yes"}, "rope_scaling", "valid dictionary"),
        ("llama-3.2-1b", {"head_dim": None, "hidden_size": 2050}, "head_dim", "not a multiple"),
        ("deepseek-v3", {"kv_lora_rank": None}, "kv_lora_rank", "missing"),
        ("gemma-2-9b", {"text_config": [1, 2]}, "text_config", "must be a JSON object"),
    ],
)
def test_absurd_or_mistyped_configs_are_refused(base: str, patch: dict, field: str, allowed: str) -> None:
    with pytest.raises(InputError) as info:
        ModelConfig.from_hf_config(_config(base, **patch))
    assert info.value.field == field and allowed in info.value.allowed, info.value


def test_an_absent_kv_head_count_still_means_one_per_query_head() -> None:
    cfg = _config("llama-3.2-1b")
    del cfg["num_key_value_heads"]
    assert ModelConfig.from_hf_config(cfg).num_kv_heads == cfg["num_attention_heads"]


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary", b"[" * 200_000, b"{}" + b" " * (1 << 20)])
def test_unreadable_config_files_are_one_input_error(tmp_path, content: bytes) -> None:
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(InputError) as info:
        resolve_model(str(tmp_path))
    assert info.value.field in ("config.json", "model") and len(str(info.value)) < 300


def test_a_config_that_is_not_a_regular_file_is_refused_before_reading(tmp_path) -> None:
    import os

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # reading it would block forever
    with pytest.raises(InputError, match="not a regular file"):
        resolve_model(str(tmp_path))
