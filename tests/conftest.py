"""What every test package shares: one torch thread, and tiny random-weight checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterator
import json
from pathlib import Path

import pytest

TINY_LLAMA: dict[str, object] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    # On a 2-core machine shared with other work, torch's second intra-op thread is often
    # descheduled and every parallel op waits for it (~8 ms each); one thread is 10x faster.
    # Set before every test: an engine command run through the CLI sets its own --threads.
    # Imported here, not at module level, so that TRITON_INTERPRET (tests/kernels) is set first.
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model(name, **changes): a folder holding TINY_LLAMA's config.json with `changes`
    applied (load it with random_weights=True); the same arguments give the same folder."""
    made: dict[str, Path] = {}

    def make(name: str = "tiny-llama", **changes: object) -> Path:
        key = json.dumps([name, changes], sort_keys=True)
        if key not in made:
            folder = tmp_path_factory.mktemp(name)
            (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, **changes}))
            made[key] = folder
        return made[key]

    return make
