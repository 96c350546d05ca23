"""The fuzz suites' shared fixture: a file on 'the server' no answer may quote."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import SECRET


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file on 'the server' whose contents must never appear in any answer."""
    path = tmp_path_factory.mktemp("secret") / "secret.yaml"
    path.write_text(f"{SECRET}: [\n  {SECRET}\n")
    return path
