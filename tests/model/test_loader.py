"""load_model's sources and its errors: every bad input is an InputError naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
import torch

from engine.errors import InputError
from engine.model.loader import load_model

from .reference import PagedDriver, hf_logits, tiny_hf_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama").save_pretrained(folder)
    return folder


def copy_checkpoint(source: Path, destination: Path) -> Path:
    destination.mkdir()
    for file in source.iterdir():
        (destination / file.name).write_bytes(file.read_bytes())
    return destination


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_missing_folder() -> None:
    with pytest.raises(InputError, match="no such file or folder"):
        load_model("/nonexistent/checkpoint")


def test_folder_without_weights_points_to_random_weights(checkpoint: Path, tmp_path: Path) -> None:
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(InputError, match=r"no \*\.safetensors.*random_weights=True"):
        load_model(str(folder))
    assert load_model(str(folder), random_weights=True).model.config.num_layers == 2


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_names_the_file(checkpoint: Path, tmp_path: Path, damage: str) -> None:
    folder = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"not a safetensors file" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(InputError, match=r"model\.safetensors.*cannot be read as safetensors"):
        load_model(str(folder))


def test_config_that_does_not_match_the_tensors(checkpoint: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    edit_config(folder, intermediate_size=80)
    # The first MLP tensor in file order is reported: down_proj [64, 96] where [64, 80] was expected.
    message = r"model\.safetensors.*mlp\.down_proj\.weight has shape \[64, 96\] but the config implies \[64, 80\]"
    with pytest.raises(InputError, match=message):
        load_model(str(folder))


def test_checkpoint_with_more_layers_than_the_config(checkpoint: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    edit_config(folder, num_hidden_layers=1)
    with pytest.raises(InputError, match=r"model\.layers\.1\.\S+ has no place in a llama model"):
        load_model(str(folder))


def test_missing_tensor_is_named(checkpoint: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(InputError, match=r"1 tensor\(s\) missing: model\.layers\.1\.self_attn\.v_proj\.weight"):
        load_model(str(folder))


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(tmp_path: Path) -> None:
    hf = tiny_hf_model("qwen3")
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="40KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()

    loaded = load_model(str(folder))
    assert f"{len(shards)} files" in loaded.source_description
    prompt = list(range(3, 12))
    ours = PagedDriver(loaded.model).step({"s": prompt})["s"]
    assert (ours - hf_logits(hf, prompt)).abs().max().item() < 1e-4

    shards[-1].unlink()
    with pytest.raises(InputError, match=rf"{shards[-1].name}.*listed in model\.safetensors\.index\.json but missing"):
        load_model(str(folder))
    for broken in ('["not", "an", "object"]', '{"metadata": {}}', '{"weight_map": {"lm_head.weight": ["a list"]}}'):
        (folder / "model.safetensors.index.json").write_text(broken)
        with pytest.raises(InputError, match="not a valid safetensors index"):
            load_model(str(folder))


def test_fused_experts_of_transformers_5_load_too(tmp_path: Path) -> None:
    # On disk transformers writes one tensor per expert; in memory it stacks them
    # (mlp.experts.gate_up_proj). A checkpoint saved from the in-memory layout must load as well.
    hf = tiny_hf_model("mixtral")
    folder = tmp_path / "fused"
    hf.save_pretrained(folder)
    in_memory = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory
    (folder / "model.safetensors").unlink()
    save_file(in_memory, folder / "model.safetensors")
    prompt = list(range(20, 31))
    ours = PagedDriver(load_model(str(folder)).model).step({"s": prompt})["s"]
    assert (ours - hf_logits(hf, prompt)).abs().max().item() < 1e-4


def test_catalog_name_without_weights_needs_random_weights() -> None:
    with pytest.raises(InputError, match="random_weights=True"):
        load_model("llama-3.1-8b")


def test_unknown_name_and_unsupported_architecture() -> None:
    with pytest.raises(InputError, match="did you mean"):
        load_model("llama-3.1-8bb", random_weights=True)
    with pytest.raises(InputError, match="model_type='gemma2'"):
        load_model("gemma-2-9b", random_weights=True)


def test_random_weights_are_seeded(checkpoint: Path) -> None:
    config_path = str(checkpoint / "config.json")
    a = load_model(config_path, random_weights=True, seed=7)
    b = load_model(config_path, random_weights=True, seed=7)
    c = load_model(config_path, random_weights=True, seed=8)
    assert "seed 7" in a.source_description and a.tokenizer is None
    weight = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(a.model.state_dict()[weight], b.model.state_dict()[weight])
    assert not torch.equal(a.model.state_dict()[weight], c.model.state_dict()[weight])
    assert a.model.state_dict()[weight].std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.all(a.model.state_dict()["model.norm.weight"] == 1)
    logits = PagedDriver(a.model).step({"s": [1, 2, 3]})["s"]
    assert logits.shape == (3, 128) and logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_catalog_model_with_random_weights_in_bf16() -> None:
    loaded = load_model("smollm2-135m", random_weights=True, dtype=torch.bfloat16, seed=0)
    assert loaded.config.name == "smollm2-135m" and "random weights" in loaded.source_description
    params = sum(p.numel() for p in loaded.model.parameters())
    assert params == loaded.config.total_params
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    logits = PagedDriver(loaded.model).step({"s": [1, 2, 3, 4, 5]})["s"]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
