"""The engine behind the HTTP server: one thread owns the LLM; the event loop talks to it by queue.

The scheduler is not thread-safe, so exactly one thread, the engine thread, touches it: it takes
commands (add, abort, stop) from a queue between steps, runs the step loop while any request is
unfinished, and sleeps on the queue when none is. Each step's tokens go back to the event loop
in one call (not one per request), where each request's stream hands them to its HTTP handler.

Admission is decided on the engine thread, against the scheduler's own waiting queue, so the
back-pressure limit counts exactly what is waiting: a request over it is refused (HTTP 429) and
never queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
import logging
import queue
import threading
from typing import TYPE_CHECKING

from engine.core import Request, RequestUpdate, SamplingParams, SchedulerOutput, StepSample
from engine.errors import InputError

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.serve.metrics import ServerMetrics

log = logging.getLogger("serveplan.serve")


class QueueFull(Exception):
    """The engine's waiting queue is at its limit: try again later."""


class EngineStopped(Exception):
    """The engine is shutting down (or died) and takes no more requests."""


@dataclass(frozen=True)
class Delivery:
    """What one step hands one request: its new tokens, and how it ended if it did."""

    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


class RequestStream:
    """One request's deliveries, in order, read by its HTTP handler on the event loop."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.finished = False
        self._queue: asyncio.Queue[Delivery | BaseException] = asyncio.Queue()

    def put(self, item: Delivery | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[Delivery]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    stream: RequestStream
    admitted: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    pass


class AsyncEngine:
    def __init__(self, llm: LLM, max_waiting_requests: int, metrics: ServerMetrics | None = None) -> None:
        self.llm, self.max_waiting_requests, self.metrics = llm, max_waiting_requests, metrics
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False  # set by stop(): the front end refuses new requests at once
        self.dead: BaseException | None = None  # what killed the engine thread, if anything

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        loop = self.llm.loop
        loop.on_step, loop.on_finished = self._on_step, self._on_finished
        self._thread = threading.Thread(target=self._run, name="serveplan-engine", daemon=True)
        self._thread.start()

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          arrival_time: float) -> RequestStream:
        """Queue a request; returns its stream once the engine admitted it. Raises QueueFull,
        EngineStopped, or InputError (a request the scheduler refuses)."""
        if self.stopping or self.dead is not None:
            raise EngineStopped("the server is shutting down" if self.dead is None else "the engine has stopped")
        assert self._loop is not None, "start() the engine first"
        stream = RequestStream(request_id, prompt_token_ids)
        admitted: asyncio.Future[None] = self._loop.create_future()
        self._commands.put(_Add(request_id, prompt_token_ids, params, arrival_time, stream, admitted))
        await admitted
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request whose client has gone; its KV blocks are freed. Idempotent."""
        self._commands.put(_Abort(request_id))

    async def stop(self) -> None:
        """Abort what is still unfinished, stop the engine thread and wait for it."""
        self.stopping = True
        if self._thread is None or not self._thread.is_alive():
            return
        stop = _Stop()
        self._commands.put(stop)
        await asyncio.to_thread(self._thread.join)
        # Requests queued behind the stop were never seen by the engine.
        while not self._commands.empty():
            command = self._commands.get_nowait()
            if isinstance(command, _Add):
                _resolve(command.admitted, EngineStopped("the server is shutting down"))

    @property
    def num_queued_commands(self) -> int:
        return self._commands.qsize()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        scheduler = self.llm.scheduler
        try:
            while True:
                if self.metrics is not None and self._commands.empty():  # going idle: no step will report it
                    self.metrics.observe_state(scheduler.num_running, scheduler.num_waiting,
                                               scheduler.kv_cache_manager.usage)
                # Idle: sleep until a command comes. Busy: take what came during the step.
                stop = self._take(self._commands.get())
                while stop is None and not self._commands.empty():
                    stop = self._take(self._commands.get_nowait())
                if stop is not None:
                    self._abort_all()
                    self.llm.step()  # an idle step lets the runner forget the aborted requests
                    return
                # Step even when nothing is left: the runner forgets requests aborted since the last step.
                self._publish(self.llm.step())
                while scheduler.has_unfinished_requests() and self._commands.empty():
                    self._publish(self.llm.step())
        except BaseException as exc:  # noqa: BLE001 (every stream must learn the engine is gone)
            log.exception("engine thread died")
            self.dead = exc
            self._call_soon(self._fail_all, list(self._streams.values()), EngineStopped(f"the engine died: {exc!r}"))
            raise

    def _take(self, command: _Add | _Abort | _Stop) -> _Stop | None:
        if isinstance(command, _Stop):
            return command
        if isinstance(command, _Abort):
            self._abort(command.request_id)
            return None
        self._admit(command)
        return None

    def _admit(self, cmd: _Add) -> None:
        scheduler = self.llm.scheduler
        error: BaseException | None = None
        if scheduler.num_waiting >= self.max_waiting_requests:
            error = QueueFull(f"{scheduler.num_waiting} requests are waiting (limit {self.max_waiting_requests})")
            if self.metrics is not None:
                self.metrics.rejected.inc()
        else:
            try:
                self.llm.add_request(cmd.prompt_token_ids, cmd.params, request_id=cmd.request_id,
                                     arrival_time=cmd.arrival_time)
                self._streams[cmd.request_id] = cmd.stream
            except InputError as exc:
                error = exc
        self._call_soon(_resolve, cmd.admitted, error)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:  # finished, refused, or aborted already
            return
        scheduler = self.llm.scheduler
        scheduler.abort_request(request_id, self.llm.now())  # frees its KV blocks
        self._on_finished(scheduler.pop_finished(request_id))
        self._call_soon(stream.put, Delivery((), True, "abort"))

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id)

    def _publish(self, updates: Sequence[RequestUpdate]) -> None:
        batch: list[tuple[RequestStream, Delivery]] = []
        for u in updates:
            stream = self._streams.get(u.request_id)
            if stream is None:
                continue
            batch.append((stream, Delivery(u.new_token_ids, u.finished, u.finish_reason)))
            if u.finished:
                del self._streams[u.request_id]
                self.llm.scheduler.pop_finished(u.request_id)
        if batch:
            self._call_soon(_deliver, batch)

    def _on_step(self, output: SchedulerOutput, sample: StepSample) -> None:
        if self.metrics is not None:
            self.metrics.observe_step(output, sample)

    def _on_finished(self, request: Request) -> None:
        if self.metrics is not None:
            self.metrics.observe_finished(request)

    def _call_soon(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop has closed: nobody is left to tell
            pass

    @staticmethod
    def _fail_all(streams: list[RequestStream], exc: BaseException) -> None:
        for stream in streams:
            stream.put(exc)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the handler was cancelled while waiting: its abort follows in the queue
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(batch: list[tuple[RequestStream, Delivery]]) -> None:
    for stream, delivery in batch:
        stream.put(delivery)
