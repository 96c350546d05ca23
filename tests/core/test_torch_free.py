"""engine/core is shared with the simulator, which must run on a laptop without torch:
only the standard library and engine.core itself may be imported."""

import ast
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "engine" / "core"
FORBIDDEN = {"torch", "triton", "numpy"}


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module)
    return roots


FILES = sorted(CORE.glob("*.py"))


def test_core_files_found():
    assert {"request.py", "block_pool.py", "kv_cache_manager.py", "scheduler.py"} <= {f.name for f in FILES}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_imports_only_stdlib_and_core(path: Path):
    for module in _imported_roots(path):
        root = module.split(".")[0]
        assert root not in FORBIDDEN, f"{path.name} imports {module}"
        assert root in sys.stdlib_module_names or module.startswith("engine.core"), (
            f"{path.name} imports {module}: engine/core may use the standard library only"
        )
