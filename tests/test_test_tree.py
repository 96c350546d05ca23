"""Every test folder is a package under `tests`, so none can shadow an installed distribution.

pytest imports a test module from a folder without `__init__.py` by putting that folder on
sys.path; a package inside it (tests/kernels) then answers to its bare name, `kernels`, before
the PyPI distribution of that name, which transformers imports where it is installed. CI broke
that way once, on a fresh install that pulled `kernels` in.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_folder_is_a_package() -> None:
    folders = {path.parent for path in TESTS.rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(
        str(folder.relative_to(TESTS.parent)) for folder in folders if not (folder / "__init__.py").exists()
    )
    assert not missing, f"test folders without __init__.py, whose packages could shadow installed ones: {missing}"
