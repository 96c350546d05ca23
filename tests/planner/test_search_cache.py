"""The plan cache is trusted only when whole: an edited, truncated or linked entry is reported with
its path, ignored and replaced; a cache folder that cannot be used is one error before any work;
Ctrl-C ends the worker pool without tracebacks and leaves every entry whole. One candidate (L40S,
TP1, bf16) keeps each plan to a few short simulations."""

from __future__ import annotations

import logging
import os
from pathlib import Path
import subprocess
import sys

import pytest

from engine.config import EngineKnobs
from engine.errors import InputError
from planner.cli import main
from planner.costmodel.fitted import FittedModel
from planner.search import PlanResult, plan

ROOT = Path(__file__).resolve().parents[2]
ONE = dict(hardware=["l40s"], max_gpus_per_replica=1, weight_dtypes=["bf16"], kv_dtypes=["bf16"],
           knobs_grid=[EngineKnobs(max_num_batched_tokens=2048, max_num_seqs=32)], headroom=0.0,
           requests_per_probe=100, executor="serial", progress=False)
ASK = ("llama-3.1-8b", "chat", 6.0, "ttft_p99_ms<=1500,tpot_p99_ms<=100")


def entries(cache_dir: Path) -> list[Path]:
    found = sorted((cache_dir / "runs").glob("*/*"))
    assert found, "the plan wrote no cache entry"
    return found


@pytest.fixture
def cached(tmp_path: Path) -> tuple[Path, PlanResult]:
    """A plan whose every simulation is in a fresh cache folder."""
    return tmp_path, plan(*ASK, cache_dir=tmp_path, **ONE)


def replan_warns_each(cache_dir: Path, bad: list[Path], caplog: pytest.LogCaptureFixture) -> PlanResult:
    """Plan again: each bad entry is named in one warning line and replaced by a whole one."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = plan(*ASK, cache_dir=cache_dir, **ONE)
    lines = [r.getMessage() for r in caplog.records]
    for path in bad:
        assert sum(str(path) in line for line in lines) == 1, lines
        assert "\n" not in next(line for line in lines if str(path) in line)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert plan(*ASK, cache_dir=cache_dir, **ONE) == again  # replaced: no warning the next time
    assert not caplog.records
    return again


def test_a_fit_given_keys_its_own_entries(cached) -> None:
    """A plan with a fit (`--calibration`) never reads what a plan without it, or with another fit,
    cached: its answer is the one it gets with no cache at all. Two fits that differ only in the
    L40S's memory efficiency keep the screen, hence the probes, the same."""
    cache_dir, _ = cached
    slower, faster = (FittedModel(families={"ada": {"memory_efficiency": e}}, engines={}, source=f"test {e}")
                      for e in (0.7, 0.9))
    fitted = plan(*ASK, cache_dir=cache_dir, fit=slower, **ONE)
    assert fitted == plan(*ASK, cache_dir=None, fit=slower, **ONE)
    assert fitted.verification.tpot_ms.p50 > plan(*ASK, cache_dir=cache_dir, fit=faster, **ONE).verification.tpot_ms.p50


def test_edited_entries_are_ignored_and_replaced(cached, caplog: pytest.LogCaptureFixture) -> None:
    cache_dir, first = cached
    bad = entries(cache_dir)
    flipped = 0
    for path in bad:  # still well-formed JSON, but every probe's verdict reversed
        text = path.read_text()
        edited = text.replace('"slo_met":true', '"slo_met":SWAP').replace('"slo_met":false', '"slo_met":true')
        path.write_text(edited.replace('"slo_met":SWAP', '"slo_met":false'))
        flipped += text != path.read_text()
    assert flipped == len(bad)
    assert replan_warns_each(cache_dir, bad, caplog) == first


def test_truncated_entries_are_ignored_and_replaced(cached, caplog: pytest.LogCaptureFixture) -> None:
    cache_dir, first = cached
    bad = entries(cache_dir)
    for path in bad:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert replan_warns_each(cache_dir, bad, caplog) == first


def test_a_linked_entry_is_never_followed(cached, caplog: pytest.LogCaptureFixture,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    cache_dir, first = cached
    secret = cache_dir.parent / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT\n")
    bad = entries(cache_dir)
    for path in bad:
        path.unlink()
        path.symlink_to(secret)
    assert replan_warns_each(cache_dir, bad, caplog) == first
    out = capsys.readouterr()
    assert "TOP-SECRET" not in out.out + out.err + caplog.text
    assert all(not p.is_symlink() for p in bad)  # the link was replaced, its target left alone
    assert secret.read_text() == "TOP-SECRET-CONTENT\n"


def test_a_cache_dir_that_is_a_file_is_one_error_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the cache folder was checked")

    monkeypatch.setattr("planner.playback.Replay.of", no_work)
    a_file = tmp_path / "cache"
    a_file.write_text("not a folder\n")
    for where in (a_file, a_file / "below"):
        with pytest.raises(InputError) as exc:
            plan(*ASK, cache_dir=where, **ONE)
        assert exc.value.field == "cache_dir" and exc.value.value == str(where)
        assert "writable folder" in exc.value.allowed
    argv = ["plan", "--model", "llama-3.1-8b", "--rate", "1", "--slo", "ttft_p99_ms<=500", "--hw", "l4",
            "--cache-dir", str(a_file)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"serveplan: error: --cache-dir={str(a_file)!r} is invalid: must be a writable folder (Not a directory)\n"


INTERRUPTED = """
import os, signal, sys
from engine.config import EngineKnobs
from planner.search import plan

# As in a terminal: Ctrl-C raises KeyboardInterrupt. A process started in the background by a
# shell without job control inherits SIGINT ignored (and Python then keeps it ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)


def ctrl_c(done, total):  # what a terminal does on Ctrl-C: SIGINT to the whole process group
    os.killpg(os.getpgid(0), signal.SIGINT)

try:
    plan("llama-3.1-8b", "chat", 15.0, "ttft_p99_ms<=1500,tpot_p99_ms<=100", hardware=["l4", "l40s"],
         max_gpus_per_replica=2, weight_dtypes=["bf16", "fp8"], kv_dtypes=["bf16"],
         knobs_grid=[EngineKnobs(max_num_batched_tokens=2048, max_num_seqs=32)], requests_per_probe=100,
         executor="process", workers=6, cache_dir=sys.argv[1], progress=False, on_progress=ctrl_c)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
print("finished although interrupted", file=sys.stderr)
"""


def test_ctrl_c_ends_the_pool_without_worker_tracebacks_and_leaves_the_cache_whole(tmp_path: Path) -> None:
    """Ctrl-C as the first candidate finishes: six workers for a batch of four candidates, so that
    some are busy simulating and some wait for work when it comes."""
    run = subprocess.run([sys.executable, "-c", INTERRUPTED, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (run.returncode, run.stderr) == (130, "interrupted\n")
    from planner.search.cache import RunCache

    cache = RunCache(tmp_path)
    for path in entries(tmp_path):
        if path.suffix == ".json":  # a worker killed mid-write may leave its temporary file, never an entry
            summary, bad = cache.get(path.stem)
            assert summary is not None and bad is None
