"""The compiled core (engine/core/compiled.py): a stale extension is refused, and the core's values
that cross processes pickle, compiled or not."""

from __future__ import annotations

import importlib.machinery
import json
from pathlib import Path
import pickle

import pytest

from engine.core import (
    KVCacheManager,
    PrefixCacheStats,
    Request,
    RequestMetrics,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    TierStats,
    compiled,
)


@pytest.fixture
def fake_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A core of one module, `mod`, in tmp_path, with check() looking there."""
    (tmp_path / "mod.py").write_text("X = 1\n")
    monkeypatch.setattr(compiled, "HERE", tmp_path)
    monkeypatch.setattr(compiled, "MANIFEST", tmp_path / "_compiled.json")
    monkeypatch.setattr(compiled, "MODULES", ("mod",))
    return tmp_path


def _extension(core: Path) -> Path:
    path = core / f"mod{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    path.write_bytes(b"")  # check() looks at names and hashes, never loads it
    return path


def test_a_pure_python_core_needs_no_manifest(fake_core: Path) -> None:
    compiled.check()
    assert not compiled.is_compiled()


def test_an_extension_built_from_this_source_is_accepted(fake_core: Path) -> None:
    _extension(fake_core)
    compiled.MANIFEST.write_text(json.dumps({"mod": compiled.source_sha256("mod")}))
    compiled.check()
    assert compiled.is_compiled()


@pytest.mark.parametrize("manifest", [None, "not json", json.dumps({"mod": "0" * 64}), json.dumps({})])
def test_an_extension_built_from_another_source_is_refused(fake_core: Path, manifest: str | None) -> None:
    _extension(fake_core)
    if manifest is not None:
        compiled.MANIFEST.write_text(manifest)
    with pytest.raises(ImportError, match=r"^engine/core/mod\.py changed since it was compiled: run `make core`"):
        compiled.check()


def test_editing_a_compiled_module_makes_it_refused(fake_core: Path) -> None:
    _extension(fake_core)
    compiled.MANIFEST.write_text(json.dumps({"mod": compiled.source_sha256("mod")}))
    (fake_core / "mod.py").write_text("X = 2\n")
    with pytest.raises(ImportError, match="mod.py changed since it was compiled"):
        compiled.check()


def test_clean_leaves_pure_python(fake_core: Path) -> None:
    ext = _extension(fake_core)
    compiled.MANIFEST.write_text("{}")
    compiled.clean()
    assert not ext.exists() and not compiled.MANIFEST.exists() and (fake_core / "mod.py").exists()


def test_what_crosses_processes_pickles() -> None:
    """A tensor-parallel rank receives each step's SchedulerOutput; workers send back statistics and
    metrics. Compiled frozen dataclasses have no __dict__ for pickle: they are rebuilt by __init__."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, block_size=4)
    scheduler = Scheduler(config, KVCacheManager(num_blocks=32, block_size=4))
    scheduler.add_request(Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), arrival_time=0.0))
    output = scheduler.schedule(0.0)
    request = scheduler.get_request("r")
    request.first_scheduled_time, request.first_token_time, request.finish_time = 0.0, 0.5, 1.0
    request.token_times = [0.5, 1.0]
    values = [config, output, scheduler.stats(), PrefixCacheStats(1, 2, 3), TierStats(),
              RequestMetrics.from_request(request)]
    for value in values:
        assert pickle.loads(pickle.dumps(value)) == value, type(value).__name__


def test_the_core_type_checks_so_that_mypyc_can_compile_it() -> None:
    """mypyc compiles only code that type-checks; where `make core` cannot, the core runs as pure
    Python, correct but slower. This keeps it compilable."""
    from mypy import api

    sources = [str(compiled.HERE / f"{m}.py") for m in compiled.MODULES]
    report, errors, status = api.run(["--ignore-missing-imports", "--no-incremental", *sources])
    assert status == 0, report + errors
