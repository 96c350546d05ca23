"""Where capacity searches run: in process, on a local process pool, or on Ray; and the progress bar."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
import multiprocessing
import multiprocessing.pool
import os
import signal
from typing import Any, Generic, Literal, TypeVar, get_args

from engine.errors import InputError

Executor = Literal["process", "serial", "ray"]
EXECUTORS: tuple[str, ...] = get_args(Executor)
MAX_WORKERS = 256
T = TypeVar("T")
R = TypeVar("R")
U = TypeVar("U")
V = TypeVar("V")


def _ignore_sigint() -> None:
    # Ctrl-C reaches the whole process group: only the parent handles it (and ends the pool).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _indexed(fn: Callable[[T], R], item: tuple[int, T]) -> tuple[int, R]:
    """fn(task) with the task's index, so that results can come back in any order."""
    return item[0], fn(item[1])


class Runner(Generic[T, R]):
    """Maps `fn` over batches of tasks. Construct it before any work (it checks the executor);
    use it as a context manager: on any exception, Ctrl-C included, pending work is dropped and
    pool workers end without a traceback of their own."""

    def __init__(self, fn: Callable[[T], R], executor: Executor, workers: int | None) -> None:
        if executor not in EXECUTORS:
            raise InputError("executor", executor, f"allowed: {', '.join(EXECUTORS)}")
        if workers is not None and not 1 <= workers <= MAX_WORKERS:
            raise InputError("workers", workers, f"must be between 1 and {MAX_WORKERS}")
        self.fn, self.executor, self.workers = fn, executor, workers
        self._pool: multiprocessing.pool.Pool | None = None
        self._refs: list[Any] = []
        if executor == "ray":
            try:
                import ray  # optional extra: only this path needs it
            except ImportError:
                raise InputError("executor", "ray", "Ray is not installed; pip install 'serveplan[cluster]'") from None
            self._ray = ray

    def __enter__(self) -> Runner[T, R]:
        if self.executor == "process":
            self._pool = multiprocessing.Pool(self.workers or os.cpu_count() or 1, initializer=_ignore_sigint)
        elif self.executor == "ray":
            if not self._ray.is_initialized():
                self._ray.init(ignore_reinit_error=True, log_to_driver=False)  # RAY_ADDRESS selects a cluster
            self._remote = self._ray.remote(self.fn)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._pool is not None:
            if exc_type is None:
                self._pool.close()
            else:
                self._pool.terminate()  # cache writes are atomic: a killed worker leaves no partial entry
            self._pool.join()
        if exc_type is not None:
            for ref in self._refs:
                self._ray.cancel(ref)

    def later(self, fn: Callable[[U], V], task: U) -> Callable[[], V]:
        """Start fn(task) where this runner works (a pool worker, a Ray task; in process, when its
        result is asked for) and return what waits for that result: the caller works meanwhile."""
        if self._pool is not None:
            return self._pool.apply_async(fn, (task,)).get
        if self.executor == "ray":
            ref = self._ray.remote(fn).remote(task)
            self._refs.append(ref)
            return lambda: self._ray.get(ref)
        return partial(fn, task)

    def run(self, tasks: Sequence[T], done: Callable[[], None]) -> list[R]:
        """Results in task order; `done` is called as each finishes."""
        results: dict[int, R] = {}
        if self._pool is not None:
            for i, result in self._pool.imap_unordered(partial(_indexed, self.fn), enumerate(tasks)):
                results[i] = result
                done()
        elif self.executor == "ray":
            self._refs = remaining = [self._remote.remote(t) for t in tasks]
            while remaining:
                _, remaining = self._ray.wait(remaining, num_returns=1)
                done()
            results = dict(enumerate(self._ray.get(self._refs)))
            self._refs = []
        else:
            for i, t in enumerate(tasks):
                results[i] = self.fn(t)
                done()
        return [results[i] for i in range(len(tasks))]


@contextmanager
def progress_bar(enabled: bool, total: int, callback: Callable[[int, int], None] | None = None) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr (or nothing), plus an optional callback; yields the function that advances both."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("planning"), BarColumn(), MofNCompleteColumn(), TextColumn("candidates"),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True, disable=not enabled)
    task, done = bar.add_task("plan", total=total), 0

    def advance() -> None:
        nonlocal done
        done += 1
        bar.advance(task)
        if callback is not None:
            callback(done, total)

    with bar:
        yield advance
