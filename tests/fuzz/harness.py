"""Running one CLI invocation in a forked child under a memory and time cap, so that a blow-up
or a hang fails one example instead of taking the test run down with it; and what a clean
refusal looks like."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import io
import multiprocessing
import os
from pathlib import Path
import resource
import sys

SECRET = "TOP-SECRET-CONTENT-7f3a9c"
# Caps of one CLI invocation: generous for inputs that take well under a second, there only to
# turn a hang or a memory blow-up into a failed example (never a measure of speed).
MEMORY_CAP_BYTES = 3 * 2**30
TIME_CAP_S = 300


@dataclass(frozen=True)
class Outcome:
    code: int | None  # None: killed by a cap
    out: str
    err: str


def _child(argv: Sequence[str], conn: multiprocessing.connection.Connection) -> None:
    # The cap counts address space: what the parent had mapped plus the allowance.
    mapped = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith("VmSize:"))) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + MEMORY_CAP_BYTES, resource.RLIM_INFINITY))
    out, err = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = out, err
    from planner.cli import main

    try:
        code = main(list(argv))
    except BaseException as exc:  # noqa: BLE001 (a traceback is exactly what the fuzz looks for)
        import traceback

        err.write("Traceback (escaped main)\n" + "".join(traceback.format_exception(exc)))
        code = 99
    conn.send((code, out.getvalue(), err.getvalue()))
    conn.close()
    os._exit(0)


def run_cli(argv: Sequence[str]) -> Outcome:
    """`serveplan argv` in a forked child under MEMORY_CAP_BYTES and TIME_CAP_S."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(list(argv), child))
    proc.start()
    child.close()
    result = parent.recv() if parent.poll(TIME_CAP_S) else None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if result is None:
        return Outcome(None, "", f"no answer within the caps (exit {proc.exitcode})")
    return Outcome(*result)


def assert_clean_refusal(outcome: Outcome) -> None:
    """Exit 2 with exactly one line on stderr, no traceback, nothing of the secret file."""
    assert outcome.code == 2, outcome
    assert outcome.err.startswith("serveplan: error: ") and outcome.err.count("\n") == 1, outcome.err
    assert "Traceback" not in outcome.err and SECRET not in outcome.err + outcome.out
