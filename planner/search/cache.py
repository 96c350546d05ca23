"""Simulation results on disk under the SHA-256 of their full input, so asking again is instant and
a code change never serves a stale answer. An entry is trusted only when it is a small regular file
(a link is never followed) whose checksum matches; anything else is reported, ignored and replaced.
Writes are renamed into place: readers (parallel workers, a run after Ctrl-C) see no entry or a whole one."""

from __future__ import annotations

from dataclasses import asdict, dataclass
import errno
from functools import cache
import hashlib
from importlib.metadata import PackageNotFoundError, version
import json
import os
from pathlib import Path
import stat
import tempfile

from pydantic import ValidationError

from engine.config import ModelConfig
from engine.errors import InputError
from planner.costmodel.fitted import PUBLIC_FIT_FILE, FittedModel
from planner.metrics import RunSummary
from planner.sim import simulate
from planner.specs import SLO, Deployment, HardwareProfile
from planner.workload import Workload

DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "serveplan"
MAX_ENTRY_BYTES = 1 << 20  # a run summary is ~10 kB; anything larger is not one of ours


@cache
def code_version() -> str:
    """Package version plus a hash of the source and data the results depend on (engine profiles, the
    public GPU fit), so edits and refits invalidate the cache."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    data = [*root.glob("planner/engines/*.yaml"), *([PUBLIC_FIT_FILE] if PUBLIC_FIT_FILE.exists() else [])]
    for path in sorted([*root.glob("planner/**/*.py"), *root.glob("engine/core/*.py"), root / "engine" / "config.py",
                        *data]):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    try:
        package = version("serveplan")
    except PackageNotFoundError:
        package = "source"
    return f"{package}+{digest.hexdigest()[:16]}"


def cache_key(model: ModelConfig, hw: HardwareProfile, dep: Deployment, workload: Workload, slo: SLO,
              fit: FittedModel | None = None, stop_once_missed: bool = False) -> str:
    """SHA-256 of the canonical JSON of everything a simulation's result depends on (the public fit
    through code_version, a fit given instead by its content; a run that may stop once it misses the
    SLO apart from a whole one)."""
    payload = {
        "model": asdict(model),
        "hardware": hw.model_dump(mode="json"),
        "deployment": dep.model_dump(mode="json"),
        "workload": workload.model_dump(mode="json"),
        "slo": slo.model_dump(mode="json"),
        "router": "round_robin",
        "code": code_version(),
        **({"fit": fit.model_dump(mode="json")} if fit is not None else {}),
        **({"stop_once_missed": True} if stop_once_missed else {}),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class RunCache:
    """One file per input: the SHA-256 of its key and content on the first line, the RunSummary JSON after."""

    root: Path

    @classmethod
    def open(cls, path: str | Path) -> RunCache:
        """The cache under `path`, created if need be; refused before any work when it cannot be written."""
        root = Path(path).expanduser()
        try:
            (root / "runs").mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=root / "runs").close()
        except OSError as exc:
            raise InputError("cache_dir", str(root), f"must be a writable folder ({exc.strerror or exc})") from None
        return cls(root)

    def path(self, key: str) -> Path:
        return self.root / "runs" / key[:2] / f"{key}.json"

    def get(self, key: str) -> tuple[RunSummary | None, str | None]:
        """The stored summary (None when absent or bad) and, for a bad entry, why it was ignored."""
        try:  # O_NOFOLLOW: the kernel refuses a link rather than resolve it; O_NONBLOCK: a FIFO cannot hang us
            fd = os.open(self.path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            return None, "a symbolic link, not followed" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_ENTRY_BYTES + 1) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        checksum, _, text = (data or b"").partition(b"\n")
        # The reasons never quote the file: it may hold anything. (A file over the limit fails the checksum.)
        if data is None or checksum.decode(errors="replace") != _checksum(key, text):
            return None, "not a regular file" if data is None else "its checksum does not match its key and content"
        try:
            return RunSummary.model_validate_json(text), None
        except ValidationError:  # a checksum is no signature: someone may have written one for other content
            return None, "not a run summary"

    def put(self, key: str, summary: RunSummary) -> str | None:
        """Store `summary` atomically (write, then rename over the entry); why not, if it could not be."""
        text = summary.model_dump_json().encode()
        path, tmp = self.path(key), None
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(_checksum(key, text).encode() + b"\n" + text)
            os.replace(tmp, path)  # replaces a link itself, never its target
        except OSError as exc:
            return exc.strerror or str(exc)
        finally:  # also on Ctrl-C: no temporary file is left behind
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        return None


def _checksum(key: str, text: bytes) -> str:
    return hashlib.sha256(key.encode() + b"\n" + text).hexdigest()


def simulate_cached(model: ModelConfig, hw: HardwareProfile, dep: Deployment, workload: Workload, slo: SLO,
                    runs: RunCache | None, fit: FittedModel | None = None, *,
                    stop_once_missed: bool = False) -> tuple[RunSummary, list[str]]:
    """simulate(...).summary, from / into `runs` (None: no cache), with a line for each bad entry met."""
    def run() -> RunSummary:
        return simulate(model, hw, dep, workload, slo=slo, router="round_robin", fit=fit,
                        stop_once_missed=stop_once_missed).summary

    if runs is None:
        return run(), []
    key = cache_key(model, hw, dep, workload, slo, fit, stop_once_missed)
    summary, bad = runs.get(key)
    if summary is not None:
        return summary, []
    summary = run()
    not_stored, where = runs.put(key, summary), runs.path(key)
    notes = [f"ignored the bad plan cache entry {where} ({bad})"] if bad else []
    if not_stored:
        notes.append(f"could not write the plan cache entry {where} ({not_stored})")
    elif bad:
        notes[0] += "; replaced by a fresh result"
    return summary, notes
