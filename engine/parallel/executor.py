"""The engine's side of tensor parallelism: worker processes, and the executor that drives them.

As in vLLM V1's multiprocess executor, the scheduler stays in the engine's process and every
rank runs in a process of its own (so each engine owns its torch.distributed group, and one
Python process can hold several engines). Each step the executor sends the SchedulerOutput to
every rank and returns rank 0's sampled tokens: it is an `Executor` of the one step loop
(engine/core/step_loop.py), in the model runner's place, not a second loop.
"""

from __future__ import annotations

from collections.abc import Iterable
import itertools
import multiprocessing as mp
from multiprocessing.connection import Connection, wait
from pathlib import Path
import shutil
import tempfile
from typing import Any
import weakref

import torch

from engine.config import EngineConfig, ModelConfig
from engine.core import ExecutedStep, SchedulerOutput
from engine.errors import InputError
from engine.parallel.worker import ModelInfo, RankSpec, main

# How long a rank whose pipe broke gets to finish exiting before the engine stops anyway.
_REAP_TIMEOUT_S = 10.0


class WorkerPool:
    """One process per tensor-parallel rank, each holding its shard of the model. Duck-types the
    loader's LoadedModel (config, tokenizer, source_description; no model in this process)."""

    model = None

    def __init__(self, model: str, cfg: EngineConfig, device: torch.device, threads: int) -> None:
        self.size = cfg.tensor_parallel
        self.device = device
        self._dir = tempfile.mkdtemp(prefix="serveplan-tp-")
        spec = RankSpec(model, cfg.model_dump(), self.size, Path(self._dir, "rendezvous").as_uri(),
                        "nccl" if device.type == "cuda" else "gloo", threads)
        ctx = mp.get_context("spawn")  # a forked child would inherit torch's thread pools mid-use
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        for rank in range(self.size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=main, args=(spec, rank, theirs), name=f"serveplan-tp-rank-{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        self._close = weakref.finalize(self, _shut_down, self._conns, self._procs, self._dir)
        info: ModelInfo = self._gather()[0]
        self.config: ModelConfig = info.config
        self.tokenizer = info.tokenizer
        self.source_description = f"{info.source_description}; tensor parallel over {self.size} processes"
        self._runner_ids = itertools.count()
        self._dropped: list[int] = []  # filled by executors' finalizers, which must not talk to the ranks

    def executor(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, seed: int) -> ParallelExecutor:
        """A fresh engine's executor: every rank builds a runner (its KV-cache shard, block tables)."""
        runner_id = next(self._runner_ids)
        self.call("new_runner", runner_id, num_blocks, block_size, kv_dtype, seed)
        return ParallelExecutor(self, runner_id)

    def call(self, method: str, *args: object) -> list[Any]:
        """Run `method` on every rank; their results in rank order."""
        while self._dropped:  # runners of engines that have gone: free their KV caches first
            self._send("drop_runner", (self._dropped.pop(),))
        return self._send(method, args)

    def _send(self, method: str, args: tuple[object, ...]) -> list[Any]:
        for conn in self._conns:
            try:
                conn.send((method, args))
            except OSError:  # a rank's end of the pipe is gone: say which rank, not how the pipe broke
                self._stop_for_a_dead_rank(self._conns.index(conn))
                raise
        return self._gather()

    def _stop_for_a_dead_rank(self, broken_pipe_rank: int | None = None) -> None:
        """If a rank's process has exited, stop the engine naming it: the other ranks' errors
        (a collective whose peer vanished) are consequences, not causes. A rank whose pipe broke
        is dying: its pipe closes before the kernel lets the parent reap it, so wait for that."""
        if broken_pipe_rank is not None:
            self._procs[broken_pipe_rank].join(timeout=_REAP_TIMEOUT_S)
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():  # polls the process without waiting on a live one
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) "
                                   "before answering; the engine has stopped")

    def close(self) -> None:
        self._close()

    def _gather(self) -> list[Any]:
        """Every rank's reply. A rank that reports an error or dies stops the whole engine: the
        others may be waiting in a collective for it and would never answer."""
        replies: list[Any] = [None] * self.size
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while pending:
            ready = wait([*pending, *sentinels])
            answered = [conn for conn in ready if conn in pending]
            if not answered:  # a rank exited without answering
                self._stop_for_a_dead_rank()
            for conn in answered:
                rank = pending.pop(conn)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    self._stop_for_a_dead_rank(rank)
                    raise
                if status == "error":
                    self._stop_for_a_dead_rank()
                    self.close()
                    if isinstance(payload, InputError):
                        raise payload
                    raise RuntimeError(f"tensor-parallel {payload}")
                replies[rank] = payload
        return replies


class ParallelExecutor:
    """The step loop's executor for a tensor-parallel engine: one runner on every rank."""

    def __init__(self, pool: WorkerPool, runner_id: int) -> None:
        self.pool, self.runner_id = pool, runner_id
        self.device = pool.device
        weakref.finalize(self, pool._dropped.append, runner_id)

    def execute(self, output: SchedulerOutput) -> ExecutedStep:
        return self.pool.call("execute", self.runner_id, output)[0]

    def forget(self, request_ids: Iterable[str]) -> None:
        self.pool.call("forget", self.runner_id, list(request_ids))

    def comm_stats(self) -> list[tuple[dict[str, float], dict[str, int]]]:
        """Per rank: seconds and calls per collective kind since the last call (CPU ranks only time them)."""
        return self.pool.call("take_comm_stats")


def _shut_down(conns: list[Connection], procs: list[mp.process.BaseProcess], folder: str) -> None:
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except (BrokenPipeError, OSError):
            pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    shutil.rmtree(folder, ignore_errors=True)
