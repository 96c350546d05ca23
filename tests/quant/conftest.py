from collections.abc import Iterator
import json
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread() -> Iterator[None]:
    # A shared 2-core machine: one intra-op thread is faster and steadier (see tests/model).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.1,  # larger than HF's 0.02, so attention and logits are far from uniform
}
CONFIGS = {
    "llama": {**TINY, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False},
    "qwen2": {**TINY, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
    "mixtral": {
        **TINY, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "tie_word_embeddings": False,
        "num_local_experts": 4, "num_experts_per_tok": 2,
    },
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, config in CONFIGS.items():
        folder = tmp_path_factory.mktemp(f"tiny-{name}")
        (folder / "config.json").write_text(json.dumps(config))
        dirs[name] = folder
    return dirs
