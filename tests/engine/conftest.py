from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tiny_model: Callable[..., Path]) -> Path:
    """The tiny random-weight Llama of tests/conftest.py."""
    return tiny_model()
