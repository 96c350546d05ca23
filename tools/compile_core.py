"""Compile the engine core with mypyc (engine/core/compiled.py says what and why), or remove it.

    python tools/compile_core.py          # what `make core` runs: ~30 s on 2 cores
    python tools/compile_core.py --clean  # back to pure Python

The package itself is not imported: its __init__ refuses extensions built from other sources, the
very ones this replaces. engine/core/compiled.py (standard library only) is loaded by its path.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
import sys

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_serveplan_core_compiled", ROOT / "engine" / "core" / "compiled.py")
assert _spec is not None and _spec.loader is not None
compiled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled)


def build() -> None:
    """Compile the modules in place as one shared library, then record their sources' hashes."""
    from mypyc.build import mypycify  # build-time dependencies: the `dev` extra
    from setuptools import setup

    compiled.clean()
    os.chdir(ROOT)  # mypyc and build_ext --inplace place each module by its path from the root
    sources = [f"engine/core/{m}.py" for m in compiled.MODULES]
    setup(name="serveplan-core", packages=[], script_args=["build_ext", "--inplace", "--build-temp", "build/core"],
          ext_modules=mypycify(["--ignore-missing-imports", *sources], opt_level="3", group_name=compiled.GROUP))
    compiled.MANIFEST.write_text(json.dumps({m: compiled.source_sha256(m) for m in compiled.MODULES}, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--clean"]:
        compiled.clean()
    else:
        build()
