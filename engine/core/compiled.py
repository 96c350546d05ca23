"""The engine core compiled to C with mypyc, and the check that what runs was compiled from what is here.

The scheduler and KV-cache manager run every step of every simulated replica, so the planner's
speed is theirs: mypyc compiles these modules, type hints and all, to C extensions that run the
same code 1.5-2x faster (docs/benchmarks.md, "Simulator speed"). Python imports an extension
before the source beside it, so an extension built from an older source would silently run old
code: `check()` refuses that at import, naming the module and what to do. Without a C compiler
the core stays pure Python and runs the same, only slower.

    python tools/compile_core.py          # compile (what `make core` runs)
    python tools/compile_core.py --clean  # back to pure Python
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Left interpreted: the package's __init__ (which runs check() first), this module, and
# sampling_params (the user's settings: its checks name the field, where a compiled dataclass would
# refuse a wrong type with mypyc's own message first). Every other module of the core is compiled.
INTERPRETED = frozenset({"__init__", "compiled", "sampling_params"})
MODULES: tuple[str, ...] = tuple(sorted(p.stem for p in HERE.glob("*.py") if p.stem not in INTERPRETED))
MANIFEST = HERE / "_compiled.json"  # what each extension was compiled from
GROUP = "engine.core._core"  # mypyc's shared library: engine/core/_core__mypyc.*.so


def source_sha256(module: str) -> str:
    return hashlib.sha256((HERE / f"{module}.py").read_bytes()).hexdigest()


def _extensions(module: str) -> list[Path]:
    return [HERE / f"{module}{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES
            if (HERE / f"{module}{suffix}").exists()]


def is_compiled() -> bool:
    """Whether the core that runs is the compiled one (check() has refused a stale one)."""
    return all(_extensions(m) for m in MODULES)


def check() -> None:
    """Raise ImportError if a compiled module was built from a source other than the one beside it."""
    built = [m for m in MODULES if _extensions(m)]
    if not built:
        return
    try:
        manifest = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        manifest = {}
    for module in built:
        if manifest.get(module) != source_sha256(module):
            raise ImportError(f"engine/core/{module}.py changed since it was compiled: run `make core` to compile it "
                              f"again, or `python tools/compile_core.py --clean` to run the core as pure Python")


def clean() -> None:
    for path in [*(p for m in MODULES for p in _extensions(m)), *HERE.glob("_core__mypyc*"), MANIFEST]:
        path.unlink(missing_ok=True)
