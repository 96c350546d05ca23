"""Frozen dataclasses of the core that cross processes (a tensor-parallel rank's schedule, a
worker's statistics and metrics) pickle through their fields."""

from __future__ import annotations

from dataclasses import fields
from typing import Any


class PickledByFields:
    """Pickled as its class and its fields' values, and rebuilt by calling the class with them.

    Where the core is compiled (engine/core/compiled.py), a frozen dataclass has no __dict__ for
    pickle to fill, and its frozen __setattr__ refuses the fields one by one; __init__ takes them all.
    Every field of a subclass must be an __init__ argument."""

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return type(self), tuple(getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]
