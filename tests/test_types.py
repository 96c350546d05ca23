"""The project type-checks: mypy, with pydantic's plugin, over the packages pyproject.toml names.

Type hints are the project's contract between the engine, the simulator and the dashboard; a hint
nobody checks drifts from the code (an Optional read without its None, a Protocol that lacks an
attribute a caller reads). mypy runs here, on the configuration in pyproject.toml's [tool.mypy],
so a change that breaks a hint fails `make test` as a broken assertion would.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parents[1]


def test_project_type_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    # mypy reads pyproject.toml and the files it names from the working directory, and keeps its
    # incremental cache in .mypy_cache there: about a minute on 2 cores the first time, seconds after.
    monkeypatch.chdir(ROOT)
    report, errors, status = api.run([])
    assert status == 0, f"mypy found type errors:\n{report}{errors}"
