from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def target_dir(tiny_model: Callable[..., Path]) -> Path:
    """A tiny random-weight 4-layer Llama (config only: load with random_weights=True)."""
    return tiny_model("target", num_hidden_layers=4)


@pytest.fixture(scope="session")
def draft_dir(tiny_model: Callable[..., Path]) -> Path:
    """A smaller draft sharing the target's vocabulary."""
    return tiny_model("draft", hidden_size=32, intermediate_size=64, num_hidden_layers=1)


@pytest.fixture(scope="session")
def other_vocab_dir(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("other-vocab", num_hidden_layers=1, vocab_size=300)
