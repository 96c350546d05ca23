"""One worker process of a disaggregated engine: an LLM running the step loop as a prefill or a
decode instance, talking to the router by queues.

- A prefill worker runs each request for one token, then sends the KV of its prompt (all but the
  last token, which the decode side computes again for its logits, as vLLM's disaggregated
  prefill does) to its staging slots and tells the router. The blocks of a request that just
  finished are free but untouched until the next schedule(), which is when this runs (the
  step loop's on_finished hook).
- A decode worker takes each request with `num_external_computed_tokens` set: the scheduler admits
  it when its blocks fit, and the runner copies the staged KV in before the step computes the
  last prompt token. Tokens go back to the router as each step delivers them.

Every process stamps time on one clock: time.perf_counter() less an origin the router chose
(perf_counter is CLOCK_MONOTONIC, system-wide on Linux).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
import math
from multiprocessing.queues import Queue
import queue
import traceback
from typing import Any, Literal, TypedDict

from engine.core import Request, SamplingParams, SchedulerStats, StepSample
from engine.core.metrics import RequestMetrics
from engine.disagg.transport import (
    KVReceiver, SharedMemoryReceiver, SharedMemorySender, SharedMemoryStaging, StagingLayout, TransferHandle,
)

Role = Literal["prefill", "decode"]
IDLE_POLL_S = 0.05  # how often an idle worker checks that its router is still there


@dataclass(frozen=True)
class WorkerSpec:
    role: Role
    index: int  # among workers of its role
    replica: int  # among all workers: the StepSample replica index
    model: str
    settings: dict[str, object]  # EngineConfig fields
    clock_origin: float  # time.perf_counter() value that every process measures from
    staging_gib: float = 0.0  # prefill: its staging segment's size


class _EngineLimits(TypedDict):
    max_model_len: int
    block_size: int
    num_kv_blocks: int


class WorkerReady(_EngineLimits, total=False):
    """A worker's "ready" message to the router: its engine's limits, and a prefill worker's staging."""

    staging: tuple[str, StagingLayout]  # (shared memory segment's name, layout)


@dataclass(frozen=True)
class RequestSpec:
    """What the router sends a worker to run."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    num_external_computed_tokens: int = 0
    handle: TransferHandle | None = None  # decode: where its prompt's KV is staged


@dataclass(frozen=True)
class Prefilled:
    """A prefill worker's report of one request: its KV is staged (handle) for the decode side."""

    request_id: str
    handle: TransferHandle | None  # None: a one-token prompt, nothing to send
    first_scheduled_time: float
    cached_prompt_tokens: int  # prefix-cache hit on the prefill worker
    prefill_done_time: float  # the prefill step's end
    send_s: float  # copying the blocks into staging
    sent_time: float


@dataclass(frozen=True)
class Decoded:
    """A decode worker's report of one finished request."""

    request_id: str
    output_token_ids: list[int]
    metrics: RequestMetrics
    received_time: float | None  # the worker took the request (its KV staged)
    load_s: float | None  # copying the staged KV into the cache
    loaded_time: float | None


@dataclass(frozen=True)
class WorkerStats:
    role: Role
    index: int
    scheduler: SchedulerStats
    samples: list[StepSample]
    num_kv_blocks: int


@dataclass
class ReceivedKV:
    """The decode runner's external KV source: staged transfers by request, timed."""

    receiver: KVReceiver
    clock: Callable[[], float]
    handles: dict[str, TransferHandle] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)

    def read(self, request_id: str, first_block: int, num_blocks: int) -> list:
        self.started[request_id] = self.clock()
        return self.receiver.read(self.handles[request_id], first_block, num_blocks)

    def loaded(self, request_id: str) -> None:
        self.finished[request_id] = self.clock()


def run_worker(spec: WorkerSpec, inbox: Queue[Any], outbox: Queue[Any]) -> None:
    """The worker process's main: report errors to the router instead of dying silently."""
    try:
        _Worker(spec, inbox, outbox).serve()
    except Exception:
        outbox.put(("error", spec.role, spec.index, traceback.format_exc(limit=8)))


class _Worker:
    def __init__(self, spec: WorkerSpec, inbox: Queue[Any], outbox: Queue[Any]) -> None:
        from engine.llm import LLM  # torch, in the worker process only

        self.spec, self.inbox, self.outbox = spec, inbox, outbox
        self.llm = llm = LLM(spec.model, **spec.settings)
        if llm.runner is None:  # DisaggregatedLLM refuses tensor_parallel > 1, whose KV lives in its ranks' processes
            raise RuntimeError("a disaggregated worker needs its engine in its own process (tensor_parallel=1)")
        self.runner = llm.runner
        llm.share_clock(spec.clock_origin)
        self.samples: list[StepSample] = []
        self.pending: list[tuple] = []  # messages put aside while a send waited for staging room
        self.received: dict[str, float] = {}
        llm.loop.replica = spec.replica
        llm.loop.on_step = lambda output, sample: self.samples.append(sample)
        llm.loop.on_finished = self._on_finished
        self.sender: SharedMemorySender | None = None
        self.external: ReceivedKV | None = None
        self.stagings: list[SharedMemoryStaging] = []
        ready: WorkerReady = {"max_model_len": llm.max_model_len, "block_size": llm.scheduler.config.block_size,
                              "num_kv_blocks": llm.num_blocks}
        if spec.role == "prefill":
            layout = StagingLayout.of(self.runner.kv_caches, spec.staging_gib)
            shm = SharedMemoryStaging.create(layout)
            self.staging_shm = shm  # this process unlinks it at the end; the router does too if it died
            staging = SharedMemoryStaging(shm.name, layout)
            self.stagings.append(staging)
            self.sender = SharedMemorySender(spec.index, staging)
            ready["staging"] = (shm.name, layout)
        outbox.put(("ready", spec.role, spec.index, ready))

    def serve(self) -> None:
        scheduler = self.llm.scheduler
        try:
            while True:
                busy = scheduler.has_unfinished_requests()
                for message in self._messages(block=not busy):
                    if message[0] == "stop":
                        return
                    self._handle(message)
                if scheduler.has_unfinished_requests():
                    updates = self.llm.step()
                    if self.spec.role == "decode" and updates:
                        self.outbox.put(("tokens", updates))
                    self._release_admitted()
        finally:
            for staging in self.stagings:
                staging.close()
            if self.spec.role == "prefill":
                self.staging_shm.close()
                self.staging_shm.unlink()

    def _messages(self, block: bool) -> list[tuple]:
        out, self.pending = self.pending, []
        try:
            out.append(self.inbox.get(timeout=IDLE_POLL_S) if block and not out else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return out

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            self._add(message[1])
        elif kind == "release":
            assert self.sender is not None
            self.sender.release(message[1])
        elif kind == "attach":
            self.stagings = [SharedMemoryStaging(name, layout) for name, layout in message[1]]
            self.external = ReceivedKV(SharedMemoryReceiver(self.stagings), self.llm.clock)
            self.runner.external = self.external
        elif kind == "stats":
            stats = self.llm.scheduler.stats()
            self.outbox.put(("stats", self.spec.role, self.spec.index,
                             WorkerStats(self.spec.role, self.spec.index, stats, list(self.samples), self.llm.num_blocks)))
        else:
            raise RuntimeError(f"unknown message {kind!r}")

    def _add(self, r: RequestSpec) -> None:
        request = Request(r.request_id, list(r.prompt_token_ids), r.params, r.arrival_time,
                          eos_token_id=self.llm.eos_token_id, num_external_computed_tokens=r.num_external_computed_tokens)
        if r.handle is not None:
            assert self.external is not None, "a decode worker gets its stagings before any request"
            self.external.handles[r.request_id] = r.handle
            self.received[r.request_id] = self.llm.now()
        self.llm.scheduler.add_request(request)

    def _release_admitted(self) -> None:
        """Give back the staging of requests the scheduler has admitted: their KV is in the cache
        now (or was a prefix hit and needed no copy)."""
        if self.external is None:
            return
        for request_id in [rid for rid in self.external.handles
                           if self.llm.scheduler.get_request(rid).first_scheduled_time is not None]:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        assert self.external is not None
        handle = self.external.handles.pop(request_id, None)
        if handle is not None:
            self.outbox.put(("release", handle))

    def _on_finished(self, request: Request) -> None:
        if self.spec.role == "prefill":
            self._send(request)
            return
        rid = request.request_id
        ext = self.external
        if ext is not None:
            self._release(rid)  # admitted and finished in one step
        started = ext.started.pop(rid, None) if ext is not None else None
        loaded = ext.finished.pop(rid, None) if ext is not None else None
        self.outbox.put(("decoded", Decoded(rid, list(request.output_token_ids), RequestMetrics.from_request(request),
                                            self.received.pop(rid, None),
                                            None if started is None or loaded is None else loaded - started, loaded)))
        self.llm.scheduler.pop_finished(rid)

    def _send(self, request: Request) -> None:
        """Stage the prompt's KV (all but the last token) for the decode side."""
        llm, rid = self.llm, request.request_id
        bs = llm.scheduler.config.block_size
        num_blocks = math.ceil((request.num_prompt_tokens - 1) / bs)
        table = self.runner.block_tables[rid][:num_blocks]
        start = llm.now()
        handle = None
        if num_blocks:
            blocks = [cache[:, table] for cache in self.runner.kv_caches]
            handle = self._send_when_room(blocks)
        sent = llm.now()
        assert request.first_scheduled_time is not None and request.finish_time is not None
        self.outbox.put(("prefilled", Prefilled(rid, handle, request.first_scheduled_time, request.num_cached_tokens,
                                                request.finish_time, sent - start, sent)))
        llm.scheduler.pop_finished(rid)

    def _send_when_room(self, blocks: Sequence) -> TransferHandle:
        """Send, waiting for the decode side to release staging when it is full (back-pressure)."""
        assert self.sender is not None
        while (handle := self.sender.send(blocks)) is None:
            message = self.inbox.get()
            if message[0] == "release":
                self.sender.release(message[1])
            else:
                self.pending.append(message)
        return handle
