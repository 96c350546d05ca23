from collections.abc import Callable
from pathlib import Path

import pytest

# Changes to tests/conftest.py's tiny Llama. A larger initializer_range than HF's 0.02 keeps
# attention and logits far from uniform, so quantisation error shows.
SPREAD = {"initializer_range": 0.1}
CONFIGS: dict[str, dict[str, object]] = {
    "llama": SPREAD,
    "qwen2": {**SPREAD, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
    "mixtral": {
        **SPREAD, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "num_local_experts": 4, "num_experts_per_tok": 2,
    },
}


@pytest.fixture(scope="session")
def model_dirs(tiny_model: Callable[..., Path]) -> dict[str, Path]:
    return {name: tiny_model(f"tiny-{name}", **changes) for name, changes in CONFIGS.items()}
