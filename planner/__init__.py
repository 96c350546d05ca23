"""ServePlan's planner: memory, cost model, simulator and the search on top.

`plan` is imported lazily so that `import planner.<module>` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.search import plan

__all__ = ["plan"]


def __getattr__(name: str) -> Any:
    if name == "plan":
        from planner.search import plan

        return plan
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
