"""The hostile-input battery of issue 14: every kind of bad input the issue's audit tried, plus
valid ones, each run in its own process under a time and memory cap, each outcome classified.

    nice .venv/bin/python bench/hostile_inputs.py                  # everything, 2 at a time
    nice .venv/bin/python bench/hostile_inputs.py --only cli.simulate dashboard --jobs 1 --json out.json

Inputs: `serveplan` argument vectors (every numeric flag against a pool of non-numbers,
infinities, huge, tiny and negative numbers and each side of its bound; catalog names; SLO
texts), every flag that takes a path against hostile files (a file holding a secret, a folder, a
binary file, a FIFO, a link to /dev/zero, an alias bomb, JSON nested 100k deep, a sparse file
past the size limit), workload/trace/profile/config.json/calibration/plan-cache files with absurd
or malformed contents, `engine bench` on a tiny model, Ctrl-C during `plan`, the dashboard's URL
parameters through streamlit's AppTest and its upload readers.

Each input runs in a child forked from this process (so nothing is imported twice), in its own
process group, with RLIMIT_AS at what this process had mapped plus --memory-cap-gib, and output
files capped at 16 MiB (RLIMIT_FSIZE); the group is killed at --time-cap-s. Outcomes:

- refused: exit 2 and exactly one line `serveplan: error: ...` of at most 1,000 characters (the
  dashboard: an error element of one such line and no exception; the Python API: an InputError);
- interrupted: Ctrl-C answered with `serveplan: interrupted` and exit 130;
- answered: a result (exit 0, or 1 where that is the answer: memory's "does not fit");
- and the failures: traceback, hang (the time cap), blow-up (the memory or output cap, or an
  out-of-memory error), echoed (the secret planted in the hostile files appears in the output),
  unclear refusal (exit 2, but not one short line), absurd accepted (a bad input answered),
  valid refused (a valid input refused).

The caps only turn a hang or a blow-up into an outcome; no figure here depends on the machine's
speed, except that a valid input answered after the time cap would be misread as a hang (valid
inputs are kept to seconds of work; raise --time-cap-s on a slow machine).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
import json
import math
import os
from pathlib import Path
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tree this file is in, not an installed copy

SECRET = "TOP-SECRET-CONTENT-91c4e2"
# A value the user wrote where it does not belong may be named in the error, as an excerpt of at
# most 80 characters, its head and tail (engine/core/errors.py excerpt): this one has the secret
# in its middle, beyond what an excerpt shows.
OFFENDING = "v" * 100 + SECRET + "v" * 100
PUBLIC_FIT = REPO / "hwprofiles/calibrations/public-gpu.json"
MAX_LINE_CHARS = 1000  # a line may list the allowed names (~40 hardware profiles)
OUTPUT_CAP_BYTES = 16 * 2**20

Expect = Literal["bad", "valid", "interrupt"]
FAILURES = ("traceback", "hang", "blow-up", "echoed", "unclear refusal", "absurd accepted", "valid refused")


@dataclass(frozen=True)
class Case:
    kind: str  # e.g. cli.simulate, file.trace, dashboard.simulate
    name: str
    expect: Expect
    run: Callable[[], dict]  # in the child: what happened, as plain data
    interrupt_after_s: float | None = None  # send SIGINT to the child's group after this long


# --------------------------------------------------------------------------- what runs in a child


def cli(argv: list[str]) -> Callable[[], dict]:
    def run() -> dict:
        from planner.cli import main

        try:
            code = main(argv)
        except BaseException as exc:  # noqa: BLE001 (an escaped exception is what this looks for)
            import traceback

            sys.stderr.write("Traceback (escaped main)\n" + "".join(traceback.format_exception(exc)))
            code = 99
        return {"code": code}

    return run


def page(name: str, params: dict[str, str], results: str) -> Callable[[], dict]:
    """A dashboard page opened with URL query parameters; `results`: text that shows it computed."""

    def run() -> dict:
        from streamlit.testing.v1 import AppTest

        at = AppTest.from_file(str(REPO / "app.py"), default_timeout=600)
        if name != "plan":
            at.run()
            at.switch_page(f"dashboard/pages/{name}.py")
        for key, value in params.items():
            at.query_params[key] = value
        at.run()
        shown = [str(e.value) for kind in (at.error, at.warning, at.info, at.success, at.markdown, at.caption,
                                           at.subheader) for e in kind]
        return {"exception": [str(e.value) for e in at.exception], "errors": [str(e.value) for e in at.error],
                "shown": "\n".join(shown), "computed": any(results in s for s in shown)}

    return run


def call(fn: Callable[[], object]) -> Callable[[], dict]:
    """A Python API call: an InputError is its refusal (the dashboard shows it as one line)."""

    def run() -> dict:
        from pydantic import ValidationError

        from engine.errors import InputError, from_validation_error

        try:
            fn()
        except (InputError, ValidationError) as exc:
            error = from_validation_error(exc) if isinstance(exc, ValidationError) else exc
            return {"refused": str(error)}
        except Exception as exc:  # noqa: BLE001
            import traceback

            sys.stderr.write("".join(traceback.format_exception(exc)))
            return {"exception": type(exc).__name__}
        return {"answered": True}

    return run


def _child(case: Case, out: Path, err: Path, result: Path, memory_cap: int) -> None:
    os.setpgid(0, 0)  # Ctrl-C and the time cap reach the whole group (plan's pool workers too)
    mapped = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith("VmSize:"))) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_cap, resource.RLIM_INFINITY))
    resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_CAP_BYTES, resource.RLIM_INFINITY))
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        data = case.run()
    except MemoryError:
        data = {"memory_error": True}
    sys.stdout.flush()
    sys.stderr.flush()
    result.write_text(json.dumps(data))
    os._exit(0)


# --------------------------------------------------------------------------- classification


def classify(case: Case, data: dict | None, out: str, err: str, killed: str | None) -> str:
    text = out + err + json.dumps(data)
    if SECRET in text:
        return "echoed"
    if killed == "time":
        return "hang"
    if killed == "output" or data is None and killed is None or (data or {}).get("memory_error") \
            or "out of memory" in err or "MemoryError" in err:
        return "blow-up"
    if data is None:
        return "traceback"
    if "Traceback" in err or data.get("exception"):
        return "traceback"
    if "code" in data:
        code, lines = data["code"], err.splitlines()
        if code == 130:
            outcome = "interrupted" if err == "serveplan: interrupted\n" else "unclear refusal"
        elif code == 2:
            one = len(lines) == 1 and lines[0].startswith("serveplan: error: ") and len(lines[0]) <= MAX_LINE_CHARS
            outcome = "refused" if one else "unclear refusal"
        elif code in (0, 1) and out.strip():
            outcome = "answered"
        else:
            outcome = "traceback"
    elif "computed" in data:  # a dashboard page
        errors = data["errors"]
        if errors:
            one = all("\n" not in e and len(e) <= MAX_LINE_CHARS for e in errors)
            outcome = "refused" if one else "unclear refusal"
        else:
            outcome = "answered" if data["computed"] else "valid refused"
    else:
        refusal = data.get("refused")
        outcome = "answered" if refusal is None else "refused" if len(refusal) <= MAX_LINE_CHARS else "unclear refusal"
    if case.expect == "interrupt":
        return outcome if outcome == "interrupted" else "traceback" if outcome == "answered" else outcome
    if case.expect == "bad" and outcome == "answered":
        return "absurd accepted"
    if case.expect == "valid" and outcome == "refused":
        return "valid refused"
    return outcome


@dataclass
class Running:
    case: Case
    pid: int
    started: float
    folder: Path
    interrupted: bool = False


@dataclass
class Record:
    case: Case
    outcome: str
    wall_s: float
    maxrss_mib: float
    excerpt: str = field(default="")


def run_all(cases: list[Case], jobs: int, time_cap_s: float, memory_cap: int, work: Path,
            on_done: Callable[[Record], None]) -> list[Record]:
    pending = list(reversed(cases))
    running: list[Running] = []
    records: list[Record] = []
    sys.stdout.flush()
    sys.stderr.flush()
    while pending or running:
        while pending and len(running) < jobs:
            case = pending.pop()
            folder = Path(tempfile.mkdtemp(dir=work))
            pid = os.fork()
            if pid == 0:
                try:
                    _child(case, folder / "out", folder / "err", folder / "result.json", memory_cap)
                finally:
                    os._exit(98)
            running.append(Running(case, pid, time.monotonic(), folder))
        time.sleep(0.05)
        for r in list(running):
            elapsed = time.monotonic() - r.started
            if r.case.interrupt_after_s is not None and not r.interrupted and elapsed > r.case.interrupt_after_s:
                _signal_group(r.pid, signal.SIGINT)
                r.interrupted = True
            killed = None
            if elapsed > time_cap_s:
                _signal_group(r.pid, signal.SIGKILL)
                killed = "time"
            pid, status, usage = os.wait4(r.pid, 0 if killed else os.WNOHANG)
            if pid == 0:
                continue
            _signal_group(r.pid, signal.SIGKILL)  # leftover workers of the group, if any
            running.remove(r)
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXFSZ:
                killed = "output"
            result = r.folder / "result.json"
            data = json.loads(result.read_text()) if result.exists() and result.stat().st_size else None
            out, err = (_read(r.folder / name) for name in ("out", "err"))
            record = Record(r.case, classify(r.case, data, out, err, killed), round(elapsed, 2),
                            round(usage.ru_maxrss / 1024, 1), excerpt=(err.strip().splitlines() or [""])[-1][:200])
            shutil.rmtree(r.folder, ignore_errors=True)
            records.append(record)
            on_done(record)
    return records


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path) -> str:
    with path.open("rb") as f:
        return f.read(OUTPUT_CAP_BYTES).decode("utf-8", "replace")


# --------------------------------------------------------------------------- the inputs


NON_NUMBERS = ["0", "-1", "1e-30", "1e300", "inf", "-inf", "nan", "abc", "", "9" * 40, "1.5", "0x10", "1e3"]


@dataclass(frozen=True)
class Numeric:
    flag: str
    kind: type  # int or float
    low: float
    high: float
    low_open: bool = False
    valid: str = "1"

    def allows(self, text: str) -> bool:
        if self.kind is int:
            if not re.fullmatch(r"[+-]?\d+", text.strip()):
                return False
            value: float = int(text)
        else:
            try:
                value = float(text)
            except ValueError:
                return False
            if not math.isfinite(value):
                return False
        return (value > self.low if self.low_open else value >= self.low) and value <= self.high

    def values(self) -> Iterator[str]:
        """The pool, each side of the bounds, and one known-good value."""
        outside = [str(self.kind(self.high * 10 if self.kind is float else self.high + 1))]
        if self.low > 0 or self.low_open:
            outside.append(str(self.low / 10 if self.kind is float else self.low - 1))
        yield from dict.fromkeys([*NON_NUMBERS, *outside, self.valid])


MEMORY = ["memory", "--model", "llama-3.1-8b", "--hw", "h100-sxm", "--json"]
SIMULATE = ["simulate", "--model", "llama-3.2-1b", "--hw", "l4", "--requests", "8", "--json"]
PLAN = ["plan", "--model", "llama-3.2-1b", "--rate", "2", "--slo", "ttft_p99_ms<=2000", "--hw", "l4", "--max-gpus", "1",
        "--weight-dtypes", "bf16", "--kv-dtypes", "bf16", "--requests-per-probe", "20", "--executor", "serial",
        "--no-cache", "--json"]
DEPLOYMENT_FLAGS = [
    Numeric("--tp", int, 1, 1024, valid="2"), Numeric("--pp", int, 1, 1024), Numeric("--ep", int, 1, 1024),
    Numeric("--replicas", int, 1, 100_000, valid="3"), Numeric("--block-size", int, 1, 1024, valid="32"),
    Numeric("--max-num-batched-tokens", int, 1, 1_048_576, valid="4096"),
    Numeric("--max-num-seqs", int, 1, 65_536, valid="64"), Numeric("--num-scheduler-steps", int, 1, 64, valid="4"),
    Numeric("--gpu-memory-utilization", float, 0, 1, low_open=True, valid="0.8"),
    Numeric("--max-graph-batch-size", int, 1, 4096, valid="64"),
]


def cli_cases(bench_model: Path) -> Iterator[Case]:
    for spec in [*DEPLOYMENT_FLAGS, Numeric("--context", int, 1, 131_072, valid="8192")]:
        for value in spec.values():
            yield Case("cli.memory", f"{spec.flag}={value!r}", "valid" if spec.allows(value) else "bad",
                       cli([*MEMORY, spec.flag, value]))
    simulate_flags = [Numeric("--rate", float, 0.001, 1e6, valid="4"), Numeric("--concurrency", int, 1, 1_000_000),
                      Numeric("--requests", int, 1, 1_000_000, valid="5"),
                      Numeric("--input-tokens", int, 1, 131_072 - 256, valid="100"),
                      Numeric("--output-tokens", int, 1, 131_072 - 128, valid="20"),
                      Numeric("--seed", int, 0, 2**32 - 1, valid="7"), Numeric("--max-model-len", int, 2, 131_072,
                                                                                valid="4096")]
    for spec in simulate_flags:
        for value in spec.values():
            # A large valid length beyond --max-model-len's default would be refused rightly: keep those small.
            yield Case("cli.simulate", f"{spec.flag}={value!r}", "valid" if spec.allows(value) else "bad",
                       cli([*SIMULATE, spec.flag, value]))
    for spec in DEPLOYMENT_FLAGS[3:6]:
        for value in ("0", "inf", "abc", "9" * 40):
            yield Case("cli.simulate", f"{spec.flag}={value!r}", "bad", cli([*SIMULATE, spec.flag, value]))
    plan_flags = [Numeric("--rate", float, 0.001, 1e6, valid="2"), Numeric("--max-gpus", int, 1, 1024),
                  Numeric("--budget-usd-per-hour", float, 0, 1e9, low_open=True, valid="100"),
                  Numeric("--headroom", float, 0, 100, valid="0.2"),
                  Numeric("--confidence", float, 0.5, 0.95, valid="0.8"),
                  Numeric("--requests-per-probe", int, 20, 20_000, valid="20"), Numeric("--seed", int, 0, 2**32 - 1)]
    for spec in plan_flags:
        for value in spec.values():
            # --confidence reads the public fit's bands: without the fit, every value is refused.
            usable = spec.flag != "--confidence" or PUBLIC_FIT.exists()
            expect: Expect = "valid" if spec.allows(value) and usable else "bad"
            if expect == "valid" and (value != spec.valid or spec.flag not in ("--rate", "--headroom")):
                continue  # each valid plan is a search of a minute on a busy machine: two are enough here
            yield Case("cli.plan", f"{spec.flag}={value!r}", expect, cli([*PLAN, spec.flag, value]))
    for value in ("0", "-1", "inf", "abc", "9" * 40, "257"):
        yield Case("cli.plan", f"--workers={value!r}", "bad", cli([*PLAN[:-5], "--executor", "process", "--workers", value,
                                                                  "--no-cache", "--json"]))

    names = {
        "--model": ["nonesuch", "", "llama-3.1-8b\x00", "x" * 5000],
        "--hw": ["h100", "", "../../etc/passwd", "h100-sxm,l4"],
        "--weight-dtype": ["fp64", "", "FP8 "], "--kv-dtype": ["int4", "nan"], "--policy": ["lifo"],
        "--engine": ["nonesuch", "vllm"], "--router": ["random"], "--workload": ["chatt", ""],
        "--slo": [",,,", "ttft_p99_ms<=500,ttft_p99_ms<=900", "ttft_p99_ms<=inf", "ttft_p99_ms<=nan", "x<=1",
                  "goodput_share>=2", "ttft_p99_ms<=-5", "ttft_p99_ms<500", "ttft_p99_ms", "goodput_share>=0",
                  "=" * 1000],
    }
    for flag, values in names.items():
        for value in values:
            yield Case("cli.names", f"simulate {flag}={value[:40]!r}", "bad", cli([*SIMULATE, flag, value]))
    # Names are matched without regard to case or surrounding spaces: the same catalog entry, no substitute.
    for flag, value in (("--model", "LLAMA-3.2-1B "), ("--hw", "L4"), ("--workload", "CHAT")):
        yield Case("cli.names", f"simulate {flag}={value!r}", "valid", cli([*SIMULATE, flag, value]))
    for argv in (["simulate", "--no-such-flag"], ["nonesuch"], [], ["simulate", "--rate"], ["memory", "--tp"],
                 ["simulate", "--rate", "2", "--concurrency", "4"], ["hw", "show"], ["models", "show", ""],
                 ["plan", "--slo", "ttft_p99_ms<=500"], ["plan", "--rate", "1"],
                 ["plan", *PLAN[1:], "--workload", "chat.jsonl"], ["validate"], ["validate", "--public", "--memory"],
                 ["calibrate", "--public", "--dtype", "float16"], ["calibrate", "--device", "tpu"],
                 ["calibrate", "--dtype", "float64"], ["engine", "generate", "--temperature", "-1", "hi"],
                 ["engine", "generate", "--device", "cuda", "--random-weights", "hi"],
                 ["engine", "generate", "--device", "cuda:9", "--random-weights", "hi"],
                 ["engine", "generate", "--threads", "100000", "hi"], ["simulate", "--max-model-len", "1"],
                 ["simulate", "--input-tokens", "1000000", "--requests", "1"],
                 ["simulate", "--input-tokens", "10000000", "--requests", "2"],
                 ["simulate", "--requests", "10000000"], ["simulate", "--rate", "1e-30"],
                 ["memory", "--tp", "3"], ["memory", "--pp", "200"], ["memory", "--ep", "2"],
                 ["memory", "--model", "llama-3.1-405b", "--hw", "l4", "--tp", "1024"]):
        yield Case("cli.argv", " ".join(argv)[:80] or "(empty)", "bad", cli(argv))
    valid = [
        MEMORY, [*MEMORY[:-1], "--tp", "4", "--weight-dtype", "fp8", "--kv-dtype", "fp8", "--context", "8192"],
        ["memory", "--model", "llama-3.1-405b", "--hw", "l4"],  # does not fit: exit 1 with the answer
        ["simulate", "--model", "llama-3.2-1b", "--rate", "2", "--requests", "8", "--slo", "ttft_p99_ms<=500", "--json"],
        [*SIMULATE, "--replicas", "1000", "--hw", "mi355x", "--requests", "40", "--rate", "50"],
        [*SIMULATE, "--block-size", "1", "--hw", "epyc-9654-2s", "--requests", "5"],
        [*SIMULATE, "--workload", "rag"], [*SIMULATE, "--concurrency", "4"], [*SIMULATE, "--router", "prefix_affinity"],
        ["hw", "list", "--json"], ["models", "list", "--json"], ["hw", "show", "h100-sxm"],
        ["models", "show", "deepseek-v3"], ["models", "show", "gpt-oss-20b", "--json"], PLAN,
        ["engine", "bench", "--model", str(bench_model), "--random-weights", "--requests", "3", "--input-tokens", "8",
         "--output-tokens", "4", "--json"],
    ]
    for argv in valid:
        yield Case("cli.valid", " ".join(argv)[:80], "valid", cli(argv))
    # Ctrl-C once the search is under way: one line, exit 130.
    yield Case("cli.interrupt", "plan, Ctrl-C after 4 s", "interrupt",
               cli(["plan", "--model", "llama-3.1-8b", "--rate", "20", "--slo", "ttft_p99_ms<=500", "--no-cache",
                    "--executor", "process", "--workers", "2"]), interrupt_after_s=4.0)
    yield Case("cli.interrupt", "simulate, Ctrl-C after 3 s", "interrupt",
               cli(["simulate", "--requests", "20000", "--rate", "50"]), interrupt_after_s=3.0)


def engine_cases(model: Path, files: dict[str, Path]) -> Iterator[Case]:
    base = ["engine", "bench", "--model", str(model), "--random-weights", "--json"]
    small = ["--requests", "3", "--input-tokens", "4", "--output-tokens", "2"]
    for blocks in (1, 2, 7):  # defect 5: the warm-up indexed past a cache of 7 blocks or fewer
        yield Case("engine.bench", f"--num-kv-blocks {blocks}", "valid",
                   cli([*base, "--requests", "3", "--input-tokens", "2", "--output-tokens", "2", "--num-kv-blocks",
                        str(blocks), "--block-size", "4", "--max-model-len", str(4 * blocks)]))
    yield Case("engine.bench", "a JSONL trace", "valid", cli([*base, "--workload", str(files["small.jsonl"])]))
    yield Case("engine.bench", "a workload file's num_requests", "valid",
               cli([*base, "--workload", str(files["small-workload.yaml"])]))
    for spec in (Numeric("--num-kv-blocks", int, 1, 16_777_216), Numeric("--kv-cache-gib", float, 0, 16384, True),
                 Numeric("--max-model-len", int, 2, 256), Numeric("--threads", int, 1, os.cpu_count() or 1),
                 Numeric("--block-size", int, 1, 1024)):
        for value in ("0", "-1", "inf", "nan", "abc", "9" * 40, "1e300"):
            yield Case("engine.bench", f"{spec.flag}={value!r}", "bad", cli([*base, *small, spec.flag, value]))
    yield Case("engine.bench", "a prompt beyond the context", "bad",
               cli([*base, "--requests", "1", "--input-tokens", "1000000", "--output-tokens", "2"]))
    yield Case("engine.bench", "--requests with a trace", "bad",
               cli([*base, "--workload", str(files["small.jsonl"]), "--requests", "4"]))


# Hostile files: (name, content) or a builder. SECRET sits inside each, never in a path or a flag.
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


def make_files(root: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}

    def put(name: str, content: str | bytes) -> None:
        path = root / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        files[name] = path

    passwd = "root:x:0:0:root:/root:/bin/bash\n" * 5 + f"{SECRET}:x:1000:1000::/home/me:/bin/sh\n" + "daemon:x:1:1\n" * 5
    for suffix in ("yaml", "json", "jsonl", "csv"):
        put(f"passwd.{suffix}", passwd)
        put(f"binary.{suffix}", bytes(range(256)) * 8)
        put(f"empty.{suffix}", "")
        (root / f"folder.{suffix}").mkdir()
        files[f"folder.{suffix}"] = root / f"folder.{suffix}"
        os.symlink("/dev/zero", root / f"zero.{suffix}")
        files[f"zero.{suffix}"] = root / f"zero.{suffix}"
        os.mkfifo(root / f"fifo.{suffix}")
        files[f"fifo.{suffix}"] = root / f"fifo.{suffix}"
        files[f"missing.{suffix}"] = root / f"missing.{suffix}"
        with (root / f"sparse.{suffix}").open("wb") as f:  # past every size limit, no disk used
            f.truncate(300 * 2**20)
        files[f"sparse.{suffix}"] = root / f"sparse.{suffix}"
    put("malformed.yaml", f"{SECRET}: [\n  {SECRET}\n")
    put("secret-scalar.yaml", f"{SECRET} and more {SECRET}\n")
    put("secret-key.yaml", f"name: x\n{SECRET}: 1\n")
    put("bomb.yaml", BOMB)
    put("deep.yaml", "[" * 100_000)
    put("deep.json", "[" * 100_000)
    put("long-int.yaml", "num_requests: " + "9" * 5000 + "\n")
    put("secret.json", json.dumps({SECRET: SECRET, "model": SECRET}))
    put("small.jsonl", "\n".join(json.dumps({"arrival_s": i * 0.1, "input_tokens": 6, "output_tokens": 2}) for i in range(3)))
    put("small-workload.yaml", "name: small\narrival: {kind: poisson, rate_per_s: 50}\ninput_tokens: 6\n"
                               "output_tokens: 2\nnum_requests: 3\n")
    return files


WORKLOAD = {"name": "w", "arrival": {"kind": "poisson", "rate_per_s": 4}, "input_tokens": 100, "output_tokens": 20,
            "num_requests": 8}


def workload_cases(root: Path, files: dict[str, Path]) -> Iterator[Case]:
    import yaml

    def spec(label: str, expect: Expect, changes: dict[str, object] | None = None) -> Case:
        path = root / f"w-{label}.yaml"
        data = {**WORKLOAD, **(changes or {})}
        path.write_text(yaml.safe_dump({k: v for k, v in data.items() if v is not None}))
        return Case("file.workload", label, expect, cli([*SIMULATE[:-3], "--workload", str(path), "--json"]))

    yield spec("valid", "valid")
    yield spec("valid-time-varying", "valid", {"arrival": {"kind": "time_varying", "segments": [
        {"duration_s": 1, "rate_per_s": 0}, {"duration_s": 10, "rate_per_s": 5}]}})
    yield spec("valid-empirical", "valid", {"input_tokens": {"kind": "empirical", "tokens": [10, 100], "weights": [1, 3]}})
    bad: dict[str, dict[str, object]] = {
        "input_tokens-1e7": {"input_tokens": 10_000_000}, "num_requests-1e7": {"num_requests": 10_000_000},
        "input_tokens-1e6": {"input_tokens": 1_000_000}, "output_tokens-1e6": {"output_tokens": 1_000_000},
        "tokens-over-total": {"input_tokens": 100_000, "num_requests": 1000},
        "input_tokens-0": {"input_tokens": 0}, "input_tokens-neg": {"input_tokens": -5},
        "input_tokens-float": {"input_tokens": 10.5}, "input_tokens-str": {"input_tokens": "lots"},
        "input_tokens-inf": {"input_tokens": math.inf}, "input_tokens-nan": {"input_tokens": math.nan},
        "num_requests-0": {"num_requests": 0}, "num_requests-null": {"num_requests": None},
        "rate-0": {"arrival": {"kind": "poisson", "rate_per_s": 0}},
        "rate-1e-30": {"arrival": {"kind": "poisson", "rate_per_s": 1e-30}},
        "rate-inf": {"arrival": {"kind": "poisson", "rate_per_s": math.inf}},
        "rate-str": {"arrival": {"kind": "poisson", "rate_per_s": "fast"}},
        "arrival-kind": {"arrival": {"kind": "bursty"}}, "arrival-list": {"arrival": [1, 2]},
        "time-varying-idle": {"arrival": {"kind": "time_varying", "segments": [
            {"duration_s": 1e7, "rate_per_s": 0}, {"duration_s": 1, "rate_per_s": 1e-6}]}},
        "time-varying-empty": {"arrival": {"kind": "time_varying", "segments": []}},
        "time-varying-long": {"arrival": {"kind": "time_varying", "segments": [
            {"duration_s": 1e7, "rate_per_s": 1e-5}]}, "num_requests": 1000},
        "gamma-cv-1e9": {"arrival": {"kind": "gamma", "rate_per_s": 1, "cv": 1e9}},
        "closed-loop-0": {"arrival": {"kind": "closed_loop", "concurrency": 0}},
        "think-inf": {"arrival": {"kind": "closed_loop", "concurrency": 2, "think_time_s": math.inf}},
        "empirical-inf": {"input_tokens": {"kind": "empirical", "tokens": [10, 20], "weights": [1, math.inf]}},
        "empirical-zero": {"input_tokens": {"kind": "empirical", "tokens": [10, 20], "weights": [0, 0]}},
        "empirical-mismatch": {"input_tokens": {"kind": "empirical", "tokens": [10, 20], "weights": [1]}},
        "empirical-neg": {"input_tokens": {"kind": "empirical", "tokens": [10, 20], "weights": [-1, 2]}},
        "uniform-inverted": {"input_tokens": {"kind": "uniform", "min_tokens": 100, "max_tokens": 10}},
        "normal-neg": {"input_tokens": {"kind": "normal", "mean_tokens": -5, "std_tokens": 1, "max_tokens": 10}},
        "lognormal-sigma": {"input_tokens": {"kind": "lognormal", "median_tokens": 100, "sigma": 1000,
                                             "max_tokens": 1000}},
        "prefix-1e7": {"shared_prefix": {"num_prefixes": 1, "prefix_tokens": 10_000_000, "share": 1}},
        "prefixes-1e9": {"shared_prefix": {"num_prefixes": 10**9, "prefix_tokens": 10, "share": 1}},
        "share-2": {"shared_prefix": {"num_prefixes": 1, "prefix_tokens": 10, "share": 2}},
        "turns-1e6": {"conversation": {"min_turns": 1, "max_turns": 1_000_000}},
        "turns-inverted": {"conversation": {"min_turns": 5, "max_turns": 2}},
        "name-long": {"name": "n" * 10_000}, "name-control": {"name": "a\x1b[31mred\nline"},
        "unknown-key": {"colour": "red"}, "secret-key": {OFFENDING: 1},
        "description-long": {"description": "d" * 100_000},
        "max-total-tokens-0": {"max_total_tokens": 0},
    }
    for name, changes in bad.items():
        yield spec(name, "bad", changes)
    for name in ("passwd.yaml", "binary.yaml", "empty.yaml", "folder.yaml", "zero.yaml", "fifo.yaml", "missing.yaml",
                 "sparse.yaml", "malformed.yaml", "secret-scalar.yaml", "secret-key.yaml", "bomb.yaml", "deep.yaml",
                 "long-int.yaml", "passwd.json", "binary.json", "deep.json", "secret.json", "zero.json", "fifo.json"):
        yield Case("file.workload", name, "bad", cli([*SIMULATE, "--workload", str(files[name])]))
        yield Case("file.plan-workload", name, "bad", cli([*PLAN, "--workload", str(files[name])]))


def trace_cases(root: Path, files: dict[str, Path]) -> Iterator[Case]:
    def trace(name: str, text: str | bytes, expect: Expect, suffix: str = "jsonl") -> Case:
        path = root / f"t-{name}.{suffix}"
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return Case("file.trace", f"{name}.{suffix}", expect, cli([*SIMULATE[:-3], "--workload", str(path), "--json"]))

    def rows(*items: dict) -> str:
        return "\n".join(json.dumps(r) for r in items) + "\n"

    ok = {"arrival_s": 0.5, "input_tokens": 100, "output_tokens": 20}
    yield trace("valid", rows(ok, {**ok, "arrival_s": 1.0}), "valid")
    yield trace("valid", "arrival_s,input_tokens,output_tokens\n0.5,100,20\n1.0,50,10\n", "valid", "csv")
    yield trace("valid-bom", "\ufeffarrival_s,input_tokens,output_tokens\n0.5,100,20\n", "valid", "csv")
    yield trace("valid-crlf", "arrival_s,input_tokens,output_tokens\r\n0.5,100,20\r\n", "valid", "csv")
    yield trace("valid-prefix", rows({**ok, "prefix_id": "p"}, {**ok, "prefix_id": "p", "arrival_s": 2}), "valid")
    bad_rows: dict[str, dict[str, object]] = {
        "input-1e9": {"input_tokens": 1e9}, "input-1e9-int": {"input_tokens": 10**9}, "input-0": {"input_tokens": 0},
        "input-neg": {"input_tokens": -1}, "input-float": {"input_tokens": 10.5}, "input-str": {"input_tokens": "x"},
        "input-null": {"input_tokens": None}, "input-inf": {"input_tokens": "Infinity"},
        "input-beyond-context": {"input_tokens": 1_000_000}, "output-1e7": {"output_tokens": 10_000_000},
        "arrival-1e300": {"arrival_s": 1e300}, "arrival-neg": {"arrival_s": -1}, "arrival-nan": {"arrival_s": "NaN"},
        "arrival-str": {"arrival_s": "soon"}, "prefix-list": {"prefix_id": [1, 2]}, "secret-key": {OFFENDING: 1},
        "prefix-tokens-1e9": {"prefix_id": "p", "prefix_tokens": 10**9},
    }
    for name, change in bad_rows.items():
        yield trace(name, rows({**ok, **change}), "bad")
    yield trace("not-json", f"{SECRET}\n", "bad")
    yield trace("list-row", "[1, 2, 3]\n", "bad")
    yield trace("missing-field", rows({"arrival_s": 1}), "bad")
    yield trace("long-line", '{"arrival_s": 1, "x": "' + "y" * 100_000 + '"}\n', "bad")
    yield trace("deep", "[" * 100_000 + "\n", "bad")
    yield trace("big-int", '{"arrival_s": 1, "input_tokens": ' + "9" * 5000 + ', "output_tokens": 1}\n', "bad")
    yield trace("tokens-over-total", rows(*[{**ok, "input_tokens": 100_000, "arrival_s": i} for i in range(300)]), "bad")
    yield trace("empty", "", "bad")
    csv_bad: dict[str, str | bytes] = {
        "extra-values": "arrival_s,input_tokens,output_tokens\n0.5,100,20,7\n",
        "missing-values": "arrival_s,input_tokens,output_tokens\n0.5,100\n",
        "duplicate-column": "arrival_s,input_tokens,input_tokens,output_tokens\n0.5,100,200,20\n",
        "secret-header": f"{SECRET},b,c\n1,2,3\n",
        "secret-value": f"arrival_s,input_tokens,output_tokens\n0.5,{OFFENDING},20\n",
        "arrival-1e300": "arrival_s,input_tokens,output_tokens\n1e300,100,20\n",
        "input-1e9": "arrival_s,input_tokens,output_tokens\n0.5,1000000000,20\n",
        "nan": "arrival_s,input_tokens,output_tokens\nnan,100,20\n",
        "header-only": "arrival_s,input_tokens,output_tokens\n",
        "binary": b"arrival_s,input_tokens,output_tokens\n\xff\xfe,1,2\n",
    }
    for name, text in csv_bad.items():
        yield trace(name, text, "bad", "csv")
    for name in ("passwd.jsonl", "passwd.csv", "binary.jsonl", "binary.csv", "empty.jsonl", "folder.jsonl",
                 "folder.csv", "zero.jsonl", "zero.csv", "fifo.jsonl", "fifo.csv", "missing.csv", "sparse.jsonl",
                 "sparse.csv"):
        yield Case("file.trace", name, "bad", cli([*SIMULATE[:-3], "--workload", str(files[name])]))


def profile_cases(root: Path, files: dict[str, Path]) -> Iterator[Case]:
    import yaml

    from planner.hardware import get_hardware

    base = get_hardware("h100-sxm").model_dump(mode="json", exclude_none=True)
    base["name"] = "my-gpu"

    def profile(name: str, expect: Expect, path: tuple[str, ...], value: object) -> Case:
        data = json.loads(json.dumps(base))
        node = data
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        file = root / f"hw-{name}.yaml"
        file.write_text(yaml.safe_dump(data))
        return Case("file.profile", name, expect, cli([*MEMORY[:3], "--hw", str(file), "--json"]))

    yield profile("valid", "valid", ("name",), "my-gpu")
    bad = {
        "memory-inf": (("memory_gib",), math.inf), "memory-0": (("memory_gib",), 0), "memory-neg": (("memory_gib",), -80),
        "memory-str": (("memory_gib",), "lots"), "bandwidth-1e-300": (("memory_bandwidth_gb_s",), 1e-300),
        "bandwidth-inf": (("memory_bandwidth_gb_s",), math.inf), "bandwidth-nan": (("memory_bandwidth_gb_s",), math.nan),
        "bf16-1e300": (("peak_tflops", "bf16"), 1e300), "bf16-1e-300": (("peak_tflops", "bf16"), 1e-300),
        "peaks-empty": (("peak_tflops",), {}), "price-1e9": (("price_usd_per_hour",), 1e9),
        "price-neg": (("price_usd_per_hour",), -1), "latency-nan": (("scale_up", "latency_us"), math.nan),
        "domain-0": (("scale_up", "domain_size"), 0), "overhead-1e12": (("efficiency", "step_overhead_us"), 1e12),
        "share-2": (("efficiency", "memory_bandwidth"), 2), "name-upper": (("name",), "My GPU"),
        "name-long": (("name",), "g" * 1000), "name-secret": (("name",), OFFENDING),
        "unknown-key": (("colour",), "red"), "power-0": (("power_w",), 0),
    }
    for name, (path, value) in bad.items():
        yield profile(name, "bad", path, value)
    for name in ("passwd.yaml", "binary.yaml", "empty.yaml", "folder.yaml", "zero.yaml", "fifo.yaml", "missing.yaml",
                 "sparse.yaml", "malformed.yaml", "secret-scalar.yaml", "secret-key.yaml", "bomb.yaml", "deep.yaml"):
        yield Case("file.profile", name, "bad", cli([*MEMORY[:3], "--hw", str(files[name])]))
        yield Case("file.hw-show", name, "bad", cli(["hw", "show", str(files[name])]))


def config_cases(root: Path, files: dict[str, Path]) -> Iterator[Case]:
    from engine.catalog import resolve_model

    def config(name: str, expect: Expect, base: str, **patch: object) -> Case:
        folder = root / f"cfg-{name}"
        folder.mkdir()
        data = {**resolve_model(base).hf_config, **patch}
        (folder / "config.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
        return Case("file.config", name, expect, cli(["memory", "--model", str(folder), "--hw", "h100-sxm", "--json"]))

    yield config("valid-llama", "valid", "llama-3.2-1b")
    yield config("valid-mixtral", "valid", "mixtral-8x7b")
    bad: dict[str, tuple[str, dict[str, object]]] = {
        "heads-0": ("llama-3.2-1b", {"num_attention_heads": 0}), "kv-heads-0": ("llama-3.2-1b", {"num_key_value_heads": 0}),
        "kv-heads-3": ("llama-3.2-1b", {"num_key_value_heads": 3}), "layers-0": ("llama-3.2-1b", {"num_hidden_layers": 0}),
        "layers-1e9": ("llama-3.2-1b", {"num_hidden_layers": 10**9}),
        "intermediate-neg": ("llama-3.2-1b", {"intermediate_size": -8192}),
        "hidden-str": ("llama-3.2-1b", {"hidden_size": "2048"}), "hidden-float": ("llama-3.2-1b", {"hidden_size": 2048.5}),
        "hidden-bool": ("llama-3.2-1b", {"hidden_size": True}), "vocab-1e12": ("llama-3.2-1b", {"vocab_size": 10**12}),
        "context-1e12": ("llama-3.2-1b", {"max_position_embeddings": 10**12}),
        "eps-nan": ("llama-3.2-1b", {"rms_norm_eps": math.nan}), "rope-str": ("llama-3.2-1b", {"rope_scaling": "yes"}),
        "head-dim-odd": ("llama-3.2-1b", {"head_dim": None, "hidden_size": 2050}),
        "experts-0": ("mixtral-8x7b", {"num_local_experts": 0}), "top-k-9": ("mixtral-8x7b", {"num_experts_per_tok": 9}),
        "top-k-0": ("mixtral-8x7b", {"num_experts_per_tok": 0}), "lora-missing": ("deepseek-v3", {"kv_lora_rank": None}),
        "text-config-list": ("gemma-2-9b", {"text_config": [1, 2]}),
        "model-type-secret": ("llama-3.2-1b", {"model_type": OFFENDING}),
    }
    for name, (base, patch) in bad.items():
        yield config(name, "bad", base, **patch)
    for name in ("binary.json", "deep.json", "secret.json", "passwd.json", "empty.json", "sparse.json"):
        folder = root / f"cfgfile-{name}"
        folder.mkdir()
        os.symlink(files[name], folder / "config.json")
        yield Case("file.config", f"config.json = {name}", "bad", cli(["models", "show", str(folder)]))
    for name in ("zero.json", "fifo.json", "folder.json", "missing.json", "binary.json", "passwd.json", "deep.json"):
        yield Case("file.config", f"--model {name}", "bad", cli([*SIMULATE, "--model", str(files[name])]))


def calibration_cases(root: Path, files: dict[str, Path]) -> Iterator[Case]:
    source = REPO / "hwprofiles/calibrations/cpu-amd-epyc-1t__smollm2-135m__fp32.json"
    data = json.loads(source.read_text())
    argv = ["validate", "--model", "smollm2-135m", "--random-weights", "--quick", "--workloads", "chat-low"]
    unknown = root / "cal-unknown-param.json"
    unknown.write_text(json.dumps({**data, "params": {**data["params"], "bogus_knob": 1.0}}))
    yield Case("file.calibration", "unknown fitted parameter", "bad", cli([*argv, "--calibration", str(unknown)]))
    infinite = root / "cal-inf.json"
    infinite.write_text(json.dumps({**data, "params": {**data["params"], "compute_efficiency": "Infinity"}}))
    yield Case("file.calibration", "non-finite parameter", "bad", cli([*argv, "--calibration", str(infinite)]))
    yield Case("file.calibration", "--report in a missing folder", "bad",
               cli([*argv, "--calibration", str(source), "--report", str(root / "missing/dir/r.md")]))
    yield Case("file.calibration", "--report at a folder", "bad",
               cli([*argv, "--calibration", str(source), "--report", str(files["folder.json"])]))
    for name in ("passwd.json", "binary.json", "deep.json", "secret.json", "empty.json", "zero.json", "fifo.json",
                 "folder.json", "missing.json", "sparse.json"):
        yield Case("file.calibration", name, "bad", cli([*argv, "--calibration", str(files[name])]))
    yield Case("file.calibration", "calibrate --out in a missing folder (before measuring)", "bad",
               cli(["calibrate", "--model", "smollm2-135m", "--random-weights", "--quick", "--out",
                    str(root / "missing/dir/c.json")]))
    yield Case("file.calibration", "calibrate --out at a folder", "bad",
               cli(["calibrate", "--model", "smollm2-135m", "--random-weights", "--quick", "--out",
                    str(files["folder.json"])]))
    yield Case("file.calibration", "calibrate an unknown model (nothing measured first)", "bad",
               cli(["calibrate", "--model", "nonesuch-7b", "--random-weights", "--quick", "--out", str(root / "c.json")]))


def output_cases(root: Path, files: dict[str, Path]) -> Iterator[Case]:
    existing = root / "notes.txt"
    existing.write_text("keep")
    for name, target in (("an existing file", existing), ("/dev/zero", Path("/dev/zero")),
                         ("under a file", existing / "sub"), ("/proc", Path("/proc/serveplan-schemas"))):
        yield Case("file.output", f"schema --out {name}", "bad", cli(["schema", "--out", str(target)]))
    for name in ("passwd.json", "zero.json", "fifo.json"):
        yield Case("file.output", f"plan --cache-dir {name}", "bad", cli([*PLAN[:-2], "--cache-dir", str(files[name])]))
    yield Case("file.output", "schema --out a fresh folder", "valid", cli(["schema", "--out", str(root / "schemas")]))


def compare_cases(root: Path, files: dict[str, Path]) -> Iterator[Case]:
    good = root / "dep-a.yaml"
    good.write_text("hardware: l4\nmodel: llama-3.2-1b\n")
    bad = {"tp-abc": "hardware: l4\ntensor_parallel: abc\n", "tp-null": "hardware: l4\ntensor_parallel: null\n",
           "budget-lots": "hardware: l4\nknobs: {max_num_batched_tokens: lots}\n",
           "hw-path": f"hardware: {files['passwd.yaml']}\n", "hw-secret-yaml": f"hardware: {files['malformed.yaml']}\n",
           "unknown-key": "hardware: l4\ncolour: red\n", "replicas-1e6": "hardware: l4\nreplicas: 1000000\n",
           "list": "- 1\n- 2\n", "model-path": f"hardware: l4\nmodel: {files['secret.json']}\n"}
    yield Case("file.compare", "valid", "valid", cli(["compare", str(good), str(good), "--requests", "8", "--json"]))
    for name, text in bad.items():
        path = root / f"dep-{name}.yaml"
        path.write_text(text)
        yield Case("file.compare", name, "bad", cli(["compare", str(good), str(path), "--requests", "8"]))
    for name in ("passwd.yaml", "binary.yaml", "folder.yaml", "zero.yaml", "fifo.yaml", "bomb.yaml", "deep.yaml",
                 "malformed.yaml", "secret-scalar.yaml", "sparse.yaml"):
        yield Case("file.compare", name, "bad", cli(["compare", str(good), str(files[name]), "--requests", "8"]))


def cache_cases(root: Path) -> Iterator[Case]:
    """Plan cache entries damaged three ways: each is reported by path, ignored and replaced."""
    for damage in ("edited", "truncated", "linked"):
        yield Case("file.cache", damage, "valid", cli([*PLAN[:-2], "--cache-dir", str(root / f"cache-{damage}"),
                                                      "--json"]))


def prepare_caches(root: Path, files: dict[str, Path]) -> None:
    """One cached plan, copied three times and damaged (run before the battery, in a child)."""
    from planner.cli import main

    seed = root / "cache-seed"
    assert main([*PLAN[:-2], "--cache-dir", str(seed), "--json"]) == 0
    entries = sorted(p for p in seed.rglob("*") if p.is_file())
    for damage in ("edited", "truncated", "linked"):
        copy = root / f"cache-{damage}"
        shutil.copytree(seed, copy)
        for entry in (copy / p.relative_to(seed) for p in entries):
            text = entry.read_text()
            if damage == "edited":
                entry.write_text(re.sub(r'"num_finished": ?\d+', '"num_finished": 999999', text))
            elif damage == "truncated":
                entry.write_text(text[: len(text) // 2])
            else:
                entry.unlink()
                os.symlink(files["passwd.json"], entry)


def dashboard_cases(files: dict[str, Path]) -> Iterator[Case]:
    small = {"requests": "20", "rate": "4"}
    # Four kinds of value no parameter takes: infinity, a word, a huge number, a path to a file with a secret.
    hostile = ["inf", "abc", "9" * 200, str(files["passwd.yaml"])]
    pages = {
        "simulate": ({"model": "llama-3.2-1b", "hw": "l4", "tp": "1", "replicas": "2", "rate": "2", "requests": "20",
                      "input_tokens": "100", "output_tokens": "20", "seed": "3", "workload": "chat",
                      "block_size": "32", "max_num_seqs": "64", "gpu_memory_utilization": "0.8", "prefix_caching": "true"},
                     "Latency percentiles"),
        "memory": ({"model": "llama-3.1-8b", "hw": "h100-sxm", "context": "8192", "tp": "2", "weight_dtype": "fp8"},
                   "Per-GPU memory"),
        "hardware": ({"model": "llama-3.2-1b", "chips": "h100-sxm,l4", "batch": "4", "context": "2048",
                      "prefill": "512"}, "Roofline"),
    }
    for name, (valid, results) in pages.items():
        yield Case(f"dashboard.{name}", "valid", "valid", page(name, {**small, **valid}, results))
        for param in valid:
            for value in hostile:
                yield Case(f"dashboard.{name}", f"{param}={value[:30]!r}", "bad",
                           page(name, {**small, param: value}, results))
    named = [("simulate", {"hw": "H100-SXM"}), ("simulate", {"model": "llama-9000"}), ("simulate", {"requests": "1e8"}),
             ("simulate", {"input_tokens": "1000000", "requests": "1"}), ("simulate", {"input_tokens": "200000"}),
             ("simulate", {"requests": "1000000", "input_tokens": "100000"}), ("simulate", {"replicas": "100001"}),
             ("simulate", {"gpu_mem": "0"}), ("memory", {"context": "10000000"}), ("hardware", {"batch": "4097"}),
             ("plan", {"hw": "h100-sxm", "price.h100-sxm": "1e9", "run": "true"}),
             ("plan", {"hw": "h100-sxm,/etc/passwd", "run": "true"}), ("plan", {"rate": "1e-30", "run": "true"}),
             ("plan", {"slo": ",,,", "run": "true"}), ("plan", {"max_num_seqs": "64,99999", "run": "true"}),
             ("plan", {"headroom": "inf", "run": "true"}), ("plan", {"budget_usd_per_hour": "nan", "run": "true"})]
    for name, params in named:
        yield Case(f"dashboard.{name}", " ".join(f"{k}={v}" for k, v in params.items())[:60], "bad",
                   page(name, {**small, **params}, "recommended"))
    for report in (str(files["passwd.json"]), "/etc/passwd", "../README.md", "..", "schemas", "", "x" * 500):
        yield Case("dashboard.validate", f"report={report[:40]!r}", "bad", page("validate", {"report": report}, "engine"))
    yield Case("dashboard.validate", "report=validation.json", "valid",
               page("validate", {"report": "validation.json"}, "Headline errors"))

    def variants(**b: object) -> str:
        a = {"name": "A", "hardware": "l4", "tp": 1, "weight_dtype": "bf16", "kv_dtype": "bf16",
             "prefix_caching": True, "token_budget": 8192, "speculative_tokens": 0}
        return json.dumps([a, {**a, "name": "B", **b}])

    compare = {"hardware-path": variants(hardware=str(files["passwd.yaml"])),
               "hardware-bomb": variants(hardware=str(files["bomb.yaml"])), "tp-abc": variants(tp="abc"),
               "tp-null": variants(tp=None), "budget-lots": variants(token_budget="lots"),
               "dtype": variants(weight_dtype="fp64"), "unknown": variants(colour="red"), "not-json": "not json",
               "deep": "[" * 100_000, "object": json.dumps({"a": 1}), "rows-9": json.dumps([{"name": "A"}] * 9),
               "name-long": variants(name="n" * 10_000), "name-newline": variants(name="B\nforged")}
    for name, value in compare.items():
        yield Case("dashboard.compare", name, "bad", page("compare", {"variants": value, "requests": "20"}, "Δ"))


def upload_cases(files: dict[str, Path]) -> Iterator[Case]:
    """What the dashboard does with an uploaded profile, trace or report (uploads cannot travel in a URL)."""
    from dashboard import compute
    from hwprofiles import PROFILE_DIR

    profile = (PROFILE_DIR / "h100-sxm.yaml").read_bytes().replace(b"name: h100-sxm", b"name: my-gpu")
    uploads: dict[str, bytes] = {name: files[name].read_bytes() for name in (
        "passwd.yaml", "binary.yaml", "empty.yaml", "malformed.yaml", "secret-scalar.yaml", "secret-key.yaml",
        "bomb.yaml", "deep.yaml")}
    uploads["memory-inf"] = profile.replace(b"memory_gib: ", b"memory_gib: .inf #")
    uploads["bandwidth-tiny"] = profile.replace(b"memory_bandwidth_gb_s: ", b"memory_bandwidth_gb_s: 1e-300 #")
    yield Case("upload.profile", "valid", "valid", call(lambda: compute.uploaded_profile("my-gpu.yaml", profile)))
    for name, data in uploads.items():
        yield Case("upload.profile", name, "bad", call(partial(compute.uploaded_profile, "x.yaml", data)))
    ok = b'{"arrival_s": 0.5, "input_tokens": 100, "output_tokens": 20}\n'
    traces = {"secret.jsonl": f"{SECRET}\n".encode(), "binary.jsonl": files["binary.jsonl"].read_bytes(),
              "huge.jsonl": b'{"arrival_s": 0.5, "input_tokens": 1000000000, "output_tokens": 20}\n',
              "beyond-context.jsonl": b'{"arrival_s": 0.5, "input_tokens": 1000000, "output_tokens": 20}\n',
              "late.jsonl": b'{"arrival_s": 1e300, "input_tokens": 10, "output_tokens": 20}\n',
              "secret.csv": f"{SECRET},b\n1,2\n".encode(), "../../escape.jsonl": ok}
    yield Case("upload.trace", "valid", "valid", call(lambda: compute._replay(None, "t.jsonl", ok, 128_256, 131_072)))
    for name, data in traces.items():
        expect: Expect = "valid" if name.startswith("../") else "bad"  # the name is reduced to its last part
        yield Case("upload.trace", name, expect,
                   call(partial(compute._replay, None, name, data, 128_256, 131_072)))
    reports = {"secret.json": files["secret.json"].read_bytes(), "binary": files["binary.json"].read_bytes(),
               "deep": b"[" * 100_000, "passwd": files["passwd.json"].read_bytes()}
    yield Case("upload.report", "validation.json", "valid",
               call(lambda: compute.validation_report((REPO / "docs/validation.json").read_bytes())))
    for name, data in reports.items():
        yield Case("upload.report", name, "bad", call(partial(compute.validation_report, data)))


# --------------------------------------------------------------------------- main


def tiny_model(root: Path) -> Path:
    folder = root / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    return folder


def all_cases(root: Path) -> list[Case]:
    model = tiny_model(root)
    files = make_files(root)
    return [*cli_cases(model), *engine_cases(model, files), *workload_cases(root, files), *trace_cases(root, files),
            *profile_cases(root, files), *config_cases(root, files), *calibration_cases(root, files),
            *output_cases(root, files), *compare_cases(root, files), *cache_cases(root), *dashboard_cases(files),
            *upload_cases(files)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="run only cases whose kind starts with one of these (e.g. cli dashboard)")
    ap.add_argument("--jobs", type=int, default=2, help="inputs run at once (default: 2)")
    ap.add_argument("--time-cap-s", type=float, default=300.0,
                    help="an input still running after this is a hang (a valid plan search takes a minute on a busy "
                         "2-core machine)")
    ap.add_argument("--memory-cap-gib", type=float, default=2.0, help="address space an input may add")
    ap.add_argument("--json", help="write every input's outcome to this file")
    ap.add_argument("--list", action="store_true", help="list the inputs and exit")
    args = ap.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    os.environ["XDG_CACHE_HOME"] = str(work / "xdg-cache")  # the plan cache of every input stays in here
    cases = [c for c in all_cases(work) if not args.only or c.kind.startswith(tuple(args.only))]
    if args.list:
        for c in cases:
            print(f"{c.kind:22} {c.expect:9} {c.name}")
        print(f"{len(cases)} inputs")
        return
    # What every child imports, imported once here.
    import planner.cli  # noqa: F401
    import planner.search  # noqa: F401

    if any(c.kind.startswith(("engine", "file.calibration")) for c in cases):
        import torch  # noqa: F401

        import engine.llm  # noqa: F401
    if any(c.kind.startswith(("dashboard", "upload")) for c in cases):
        import streamlit.testing.v1  # noqa: F401
    if any(c.kind == "file.cache" for c in cases):
        setup = Case("setup", "plan cache", "valid", call(lambda: prepare_caches(work, make_files_index(work))))
        run_all([setup], 1, args.time_cap_s * 3, int(args.memory_cap_gib * 2**30), work, lambda r: None)

    started = time.monotonic()

    def progress(r: Record) -> None:
        flag = "" if r.outcome in ("refused", "answered", "interrupted") else "  <-- " + r.excerpt
        print(f"{r.outcome:16} {r.wall_s:6.1f}s {r.maxrss_mib:7.0f}MiB  {r.case.kind:20} {r.case.name[:70]}{flag}",
              flush=True)

    records = run_all(cases, args.jobs, args.time_cap_s, int(args.memory_cap_gib * 2**30), work, progress)
    counts = Counter(r.outcome for r in records)
    bad = [r for r in records if r.case.expect != "valid"]
    valid = [r for r in records if r.case.expect == "valid"]
    print(f"\n{len(records)} inputs ({len(bad)} bad, {len(valid)} valid) in {time.monotonic() - started:,.0f} s, "
          f"{args.jobs} at a time, caps {args.time_cap_s:g} s and {args.memory_cap_gib:g} GiB:")
    for outcome in ("refused", "interrupted", "answered", *FAILURES):
        print(f"  {outcome:16} {counts.get(outcome, 0)}")
    by_kind = Counter((r.case.kind.split(".")[0], r.outcome) for r in records)
    print("by kind: " + "; ".join(f"{k}/{o} {n}" for (k, o), n in sorted(by_kind.items())))
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"kind": r.case.kind, "name": r.case.name, "expect": r.case.expect, "outcome": r.outcome,
              "wall_s": r.wall_s, "maxrss_mib": r.maxrss_mib, "last_line": r.excerpt} for r in records], indent=1))
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if any(counts.get(f) for f in FAILURES) else 0)


def make_files_index(root: Path) -> dict[str, Path]:
    return {p.name: p for p in root.iterdir()}


if __name__ == "__main__":
    main()
