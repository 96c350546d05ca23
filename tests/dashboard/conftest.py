"""What the dashboard tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def plan_cache(tmp_path, monkeypatch):
    """Keep the planner's on-disk cache out of the user's home."""
    monkeypatch.setattr("planner.search.DEFAULT_CACHE_DIR", tmp_path / "serveplan-cache")
