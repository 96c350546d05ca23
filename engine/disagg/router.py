"""DisaggregatedLLM: prefill and decode workers in their own processes, behind one router.

The router is the proxy in front: it sends each request to the prefill worker with the fewest
prompt tokens outstanding (run for one token), then, once that worker has staged the prompt's
KV, to the decode worker with the fewest tokens outstanding, with the transfer's handle; the
decode worker streams the tokens back. Greedy outputs are those of one engine doing both (tests).

    with DisaggregatedLLM("smollm2-135m", prefill_workers=1, decode_workers=1) as llm:
        [out] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16))
        out.transfer.nbytes, out.transfer.send_s, out.metrics.ttft_s
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
import itertools
import math
import multiprocessing
from multiprocessing import shared_memory
from multiprocessing.queues import Queue
import queue
import time
from typing import Any

from pydantic import ValidationError

from engine.catalog import resolve_model
from engine.config import EngineConfig
from engine.core import RequestUpdate, SamplingParams
from engine.core.metrics import RequestMetrics
from engine.disagg.transport import StagingLayout
from engine.disagg.worker import Decoded, Prefilled, RequestSpec, Role, WorkerReady, WorkerSpec, WorkerStats, run_worker
from engine.errors import InputError, from_validation_error

START_TIMEOUT_S = 900.0  # loading a model in each worker; a CPU reads a GGUF in ~10 s
MAX_WORKERS = 64
MAX_STAGING_GIB = 1024


@dataclass(frozen=True)
class KVTransfer:
    """One request's prompt KV moved from its prefill worker to its decode worker."""

    nbytes: int
    num_blocks: int
    send_s: float  # the prefill worker copying its blocks into staging
    wire_s: float  # staged -> taken in by the decode worker (the router's hop)
    load_s: float | None  # the decode worker copying it into its cache (None: its prefix cache had it)

    @property
    def total_s(self) -> float:
        return self.send_s + self.wire_s + (self.load_s or 0.0)


@dataclass(frozen=True)
class DisaggregatedOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics  # queueing and prefix hits are the prefill worker's, the rest the decode worker's
    transfer: KVTransfer | None  # None: a one-token prompt, nothing to move
    prefill_worker: int
    decode_worker: int


@dataclass
class _Worker:
    role: Role
    index: int
    process: multiprocessing.process.BaseProcess
    inbox: Queue[Any]
    outstanding_tokens: int = 0
    ready: WorkerReady | None = None

    def report(self) -> WorkerReady:
        """Its "ready" message: the router has every worker's before it does anything else."""
        if self.ready is None:
            raise RuntimeError(f"{self.role} worker {self.index} has not reported ready")
        return self.ready


@dataclass
class _Flight:
    """A request between add_request() and its last token."""

    spec: RequestSpec
    prefill: int  # the prefill worker's index
    prefilled: Prefilled | None = None
    decode: int | None = None

    @property
    def decode_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + self.spec.params.max_tokens


class DisaggregatedLLM:
    def __init__(self, model: str, *, prefill_workers: int = 1, decode_workers: int = 1, kv_transfer_gib: float = 0.25,
                 prefill: dict[str, object] | None = None, decode: dict[str, object] | None = None,
                 **engine_settings: object) -> None:
        """`engine_settings` (EngineConfig fields) apply to every worker; `prefill` and `decode`
        override them per role. `kv_transfer_gib`: each prefill worker's staging memory."""
        for name, value in (("prefill_workers", prefill_workers), ("decode_workers", decode_workers)):
            if not 1 <= value <= MAX_WORKERS:
                raise InputError(name, value, f"must be in 1..{MAX_WORKERS}")
        if not 0 < kv_transfer_gib <= MAX_STAGING_GIB:
            raise InputError("kv_transfer_gib", kv_transfer_gib, f"must be in (0, {MAX_STAGING_GIB}] GiB")
        settings = {role: {**engine_settings, **(overrides or {})} for role, overrides in
                    (("prefill", prefill), ("decode", decode))}
        for values in settings.values():
            try:
                config = EngineConfig.model_validate(values)  # every bad setting is refused before a process starts
            except ValidationError as exc:
                raise from_validation_error(exc) from None
            if config.tensor_parallel > 1:  # the worker sends and receives KV from its runner's own caches
                raise InputError("tensor_parallel", config.tensor_parallel,
                                 "must be 1 with disaggregated prefill and decode: each worker runs in one process")
        self.model_config = resolve_model(model)
        self._t0 = time.perf_counter()
        self._ids = itertools.count()
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch state
        self._outbox = context.Queue()
        self.workers: list[_Worker] = []
        self._flights: dict[str, _Flight] = {}
        self.outputs: dict[str, DisaggregatedOutput] = {}  # finished requests
        self._staging_names: list[str] = []
        self._closed = False
        try:
            for role, count in (("prefill", prefill_workers), ("decode", decode_workers)):
                for index in range(count):
                    spec = WorkerSpec(role, index, len(self.workers), model, settings[role], self._t0,  # type: ignore[arg-type]
                                      kv_transfer_gib if role == "prefill" else 0.0)
                    inbox = context.Queue()
                    process = context.Process(target=run_worker, args=(spec, inbox, self._outbox),
                                              name=f"serveplan-{role}-{index}", daemon=True)
                    process.start()
                    self.workers.append(_Worker(role, index, process, inbox))  # type: ignore[arg-type]
            self._await_ready()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> DisaggregatedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ set-up and shut-down

    def _role(self, role: Role) -> list[_Worker]:
        return [w for w in self.workers if w.role == role]

    def _await_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while any(w.ready is None for w in self.workers):
            message = self._next(max(0.01, deadline - time.monotonic()))
            if message is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers did not start within {START_TIMEOUT_S:g} s")
                continue
            if message[0] != "ready":
                raise RuntimeError(f"unexpected message {message[0]!r} while starting")
            _, role, index, info = message
            self._role(role)[index].ready = info
            if role == "prefill":
                self._staging_names.append(info["staging"][0])
        stagings: list[tuple[str, StagingLayout]] = [w.report()["staging"] for w in self._role("prefill")]
        for w in self._role("decode"):
            w.inbox.put(("attach", stagings))
        self._staging_slots = min(layout.num_slots for _, layout in stagings)
        # role -> (max_model_len, KV blocks) its smallest worker allows
        self.limits = {role: (min(w.report()["max_model_len"] for w in self._role(role)),
                               min(w.report()["num_kv_blocks"] for w in self._role(role)))
                        for role in ("prefill", "decode")}
        sizes = {w.report()["block_size"] for w in self.workers}
        if len(sizes) != 1:
            raise InputError("block_size_tokens", sorted(sizes), "must be the same on prefill and decode workers")
        self.block_size = sizes.pop()

    def close(self) -> None:
        """Stop the workers and remove the staging segments (also those of a worker that died)."""
        if self._closed:
            return
        self._closed = True
        for w in self.workers:
            if w.process.is_alive():
                w.inbox.put(("stop",))
        for w in self.workers:
            w.process.join(timeout=30)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
        for name in self._staging_names:
            try:
                shared_memory.SharedMemory(name=name).unlink()
            except FileNotFoundError:  # its worker removed it on the way out
                pass

    # ------------------------------------------------------------------ requests

    def now(self) -> float:
        """Seconds on the clock every worker stamps with."""
        return time.perf_counter() - self._t0

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        prompt = [int(t) for t in prompt_token_ids]
        self._check(rid, prompt, params)
        spec = RequestSpec(rid, prompt, params, self.now() if arrival_time is None else arrival_time)
        worker = min(self._role("prefill"), key=lambda w: (w.outstanding_tokens, w.index))
        worker.outstanding_tokens += len(prompt)
        self._flights[rid] = _Flight(spec, worker.index)
        # The prefill worker computes the prompt and one token, which the decode worker computes again.
        worker.inbox.put(("add", replace(spec, params=replace(params, max_tokens=1))))
        return rid

    def _check(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        """Refuse here what a worker would refuse, naming the request: a worker that raised would
        take the whole engine down."""
        if rid in self._flights or rid in self.outputs:
            raise InputError("request_id", rid, "is already in use")
        if not prompt:
            raise InputError("prompt", "[]", "needs at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InputError("prompt", prompt[:8], f"token ids must lie in [0, {vocab})")
        bs = self.block_size
        for role, (max_len, blocks) in self.limits.items():
            total = len(prompt) + (1 if role == "prefill" else params.max_tokens)
            if total > max_len:
                raise InputError("prompt", f"{len(prompt)} tokens", f"with max_tokens, {total} tokens exceed the "
                                 f"{role} workers' max_model_len={max_len}")
            if math.ceil((total - 1) / bs) > blocks:
                raise InputError("prompt", f"{len(prompt)} tokens", f"needs more KV blocks than the {role} workers' {blocks}")
        if math.ceil((len(prompt) - 1) / bs) > self._staging_slots:
            raise InputError("prompt", f"{len(prompt)} tokens", f"its KV needs more than the {self._staging_slots} "
                             "staging blocks of a prefill worker; raise kv_transfer_gib")

    def has_unfinished_requests(self) -> bool:
        return bool(self._flights)

    def poll(self, timeout_s: float = 0.0) -> list[RequestUpdate]:
        """Route what the workers reported, waiting up to timeout_s for the first report; returns
        the decode workers' token updates, in order (finished requests are then in `outputs`)."""
        updates: list[RequestUpdate] = []
        message = self._next(timeout_s)
        while message is not None:
            updates += self._route(message)
            message = self._next(0.0)
        return updates

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[DisaggregatedOutput]:
        ids = [self.add_request(p, params) for p in prompts]
        while any(rid not in self.outputs for rid in ids):
            self.poll(timeout_s=1.0)
        return [self.outputs[rid] for rid in ids]

    def stats(self) -> list[WorkerStats]:
        """Each worker's scheduler statistics and step samples, prefill workers first."""
        for w in self.workers:
            w.inbox.put(("stats",))
        got: dict[tuple[str, int], WorkerStats] = {}
        while len(got) < len(self.workers):
            message = self._next(1.0)
            if message is None:
                continue
            if message[0] == "stats":
                got[(message[1], message[2])] = message[3]
            else:
                self._route(message)
        return [got[(w.role, w.index)] for w in self.workers]

    def _route(self, message: tuple) -> list[RequestUpdate]:
        kind = message[0]
        if kind == "prefilled":
            self._to_decode(message[1])
        elif kind == "release":
            self._role("prefill")[message[1].sender].inbox.put(("release", message[1]))
        elif kind == "tokens":
            return message[1]
        elif kind == "decoded":
            self._finish(message[1])
        else:
            raise RuntimeError(f"unexpected message {kind!r} from a worker")
        return []

    def _to_decode(self, report: Prefilled) -> None:
        flight = self._flights[report.request_id]
        self._role("prefill")[flight.prefill].outstanding_tokens -= len(flight.spec.prompt_token_ids)
        worker = min(self._role("decode"), key=lambda w: (w.outstanding_tokens, w.index))
        worker.outstanding_tokens += flight.decode_tokens
        flight.prefilled, flight.decode = report, worker.index
        spec = replace(flight.spec, num_external_computed_tokens=len(flight.spec.prompt_token_ids) - 1, handle=report.handle)
        worker.inbox.put(("add", spec))

    def _finish(self, done: Decoded) -> None:
        flight = self._flights.pop(done.request_id)
        report = flight.prefilled
        assert report is not None and flight.decode is not None
        self._role("decode")[flight.decode].outstanding_tokens -= flight.decode_tokens
        h = report.handle
        transfer = None if h is None or done.received_time is None else KVTransfer(
            h.nbytes, h.num_blocks, report.send_s, done.received_time - report.sent_time, done.load_s)
        metrics = replace(done.metrics, queueing_s=report.first_scheduled_time - done.metrics.arrival_time,
                          cached_prompt_tokens=report.cached_prompt_tokens)
        self.outputs[done.request_id] = DisaggregatedOutput(
            done.request_id, flight.spec.prompt_token_ids, done.output_token_ids, metrics.finish_reason, metrics,
            transfer, flight.prefill, flight.decode)

    def _next(self, timeout_s: float) -> tuple | None:
        """The next worker report; a worker that failed or died raises here."""
        try:
            message = self._outbox.get(timeout=timeout_s) if timeout_s > 0 else self._outbox.get_nowait()
        except queue.Empty:
            dead = [w for w in self.workers if not w.process.is_alive()]
            if dead and not self._closed:
                raise RuntimeError(f"{dead[0].role} worker {dead[0].index} died (exit code {dead[0].process.exitcode})") from None
            return None
        if message[0] == "error":
            raise RuntimeError(f"{message[1]} worker {message[2]} failed:\n{message[3]}")
        return message
