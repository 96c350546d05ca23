"""`serveplan bench --url`: play a workload against a live OpenAI-compatible endpoint and measure
it from the stream, on the client's clock.

The same `Playback` as the simulator and `engine bench` decides when each request goes in (open
loop at its drawn time, closed loop on a reply, follow-up turns after their parent), so the three
runs differ only in what serves them. Prompts go as token ids to /v1/completions with
`max_tokens` = the drawn output length and `ignore_eos` (vLLM's extra, which SGLang and ServePlan
take too), streaming, temperature 0. `--max-concurrency` caps the requests in flight, as
`vllm bench serve` does: a request due while the cap is reached is sent when a slot frees, and its
latencies count from then.

Each chunk's tokens are counted from the token ids it carries (`return_token_ids`), else from the
usage it carries (`stream_options.continuous_usage_stats`), else as one token per non-empty
chunk; the file records which. A client cannot see the server's queue, steps, preemptions or
prefix cache: those summary fields are 0 and the assumptions say so.

The file `--json` writes (`BenchReport`) holds, per run, the RunSummary, the client's semantics
and every request's send, first-token, chunk and finish times: what `calibrate --from-bench`
fits the simulator to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
import json
import time
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from engine.core.kv_cache_manager import PrefixCacheStats
from engine.core.metrics import RequestMetrics
from engine.errors import InputError
from planner.metrics import PricingBasis, RunRecord, RunSummary, summarize
from planner.playback import Playback, Replay, Submission, check_lengths
from planner.specs import SLO

BENCH_FILE_VERSION = 1
CONNECT_TIMEOUT_S = 10.0
ERROR_CHARS = 300


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClientSemantics(_File):
    """How the client sent the run's requests."""

    arrival: str = Field(description="The workload's arrival kind (poisson, gamma, constant, time_varying, "
                                     "closed_loop) or 'trace'")
    rate_per_s: float | None = Field(description="Open loop: mean arrivals per second; None for closed loop or a trace")
    concurrency: int | None = Field(description="Closed loop: users each sending on a reply; None for open loop")
    max_concurrency: int | None = Field(description="Most requests in flight (a request due past it waits); None: no cap")
    prompt_format: Literal["token_ids"] = "token_ids"
    temperature: float
    ignore_eos: bool
    token_count_source: Literal["token_ids", "usage", "chunks"] = Field(
        description="How chunk token counts were read: token ids in each chunk, usage in each chunk, or one per "
                    "non-empty chunk (then the last chunk also takes what the final usage adds)")
    clock: str = Field("time.perf_counter() of the client, seconds since the run's start",
                       description="What every *_s time in this run is measured on")


class RequestRecord(_File):
    """One request as the client saw it; times in seconds since the run's start."""

    request_id: str
    parent_id: str | None = Field(description="The earlier turn of its conversation, if a follow-up")
    released_by: str | None = Field(description="The request whose finish let it go (closed loop or follow-up)")
    think_s: float = Field(description="Pause after released_by's finish before it was due")
    due_s: float = Field(description="When the replay rules wanted it sent")
    send_s: float = Field(description="When it was sent (later than due_s only under --max-concurrency)")
    first_token_s: float | None
    chunk_times_s: list[float] = Field(description="Arrival of every chunk that carried tokens")
    chunk_tokens: list[int] = Field(description="Tokens each of those chunks carried")
    finish_s: float | None = Field(description="When the stream ended ([DONE] or the connection closed)")
    prompt_tokens: int = Field(description="Prompt tokens sent")
    server_prompt_tokens: int | None = Field(description="Prompt tokens the server reported in its usage")
    max_tokens: int = Field(description="Output tokens asked for")
    output_tokens: int = Field(description="Output tokens received")
    finish_reason: str | None
    http_status: int
    error: str | None = Field(description="Why it failed: the server's message, or the connection's error")


class BenchRun(_File):
    url: str
    model: str
    workload: str
    client: ClientSemantics
    summary: RunSummary | None = Field(description="None when no request finished")
    requests: list[RequestRecord]


class BenchReport(_File):
    """The file of `serveplan bench --url --json`: one run, or one per point of a sweep."""

    version: int = BENCH_FILE_VERSION
    sweep: Literal["rate", "concurrency"] | None = Field(description="What the runs vary, if more than one")
    slo: SLO | None = Field(description="The --slo goodput was counted against")
    runs: list[BenchRun]
    max_goodput_requests_per_s: float = Field(description="Highest goodput of any run (throughput without an SLO)")
    max_goodput_point: float | None = Field(description="The --rate or --concurrency of that run")


class EndpointError(Exception):
    """The endpoint cannot be benchmarked as asked (unreachable, or refuses what bench sends)."""


# --------------------------------------------------------------------------- one request


class _Stream:
    """What one streamed response delivered."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage_prompt: int | None = None
        self.usage_completion: int | None = None
        self.source: Literal["token_ids", "usage", "chunks"] = "chunks"

    def chunk(self, data: dict, now: float) -> None:
        usage = data.get("usage")
        choices = data.get("choices") or []
        if choices:
            choice = choices[0]
            ids = choice.get("token_ids")
            if ids is not None:
                count, self.source = len(ids), "token_ids"
                self.token_ids.extend(ids)
            elif usage is not None and usage.get("completion_tokens") is not None:
                count, self.source = usage["completion_tokens"] - sum(self.tokens), "usage"
            else:
                count = 1 if choice.get("text") else 0
            if count > 0:
                self.times.append(now)
                self.tokens.append(count)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if usage is not None:
            self.usage_prompt = usage.get("prompt_tokens", self.usage_prompt)
            self.usage_completion = usage.get("completion_tokens", self.usage_completion)

    def settle(self) -> None:
        """One-per-chunk counts undercount chunks of several tokens: the final usage says how many came."""
        if self.source == "chunks" and self.usage_completion is not None and self.tokens:
            self.tokens[-1] += max(0, self.usage_completion - sum(self.tokens))


def request_body(model: str, prompt: Sequence[int], max_tokens: int, temperature: float) -> dict:
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def stream_completion(http: httpx.AsyncClient, body: dict, clock: _Clock) -> tuple[_Stream, int, str | None]:
    """Send one streaming completion; returns what came, the HTTP status and the error, if any."""
    got = _Stream()
    try:
        async with http.stream("POST", "/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return got, response.status_code, _server_message(text)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    return got, response.status_code, _server_message(payload)
                got.chunk(data, clock())
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return got, 0, f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
    got.settle()
    return got, 200, None


def _server_message(text: str) -> str:
    try:
        error = json.loads(text).get("error", text)
        message = error.get("message", error) if isinstance(error, dict) else error
    except (json.JSONDecodeError, AttributeError):
        message = text
    return " ".join(str(message).split())[:ERROR_CHARS]


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


# --------------------------------------------------------------------------- one run


async def _probe(http: httpx.AsyncClient, model: str, token_id: int) -> tuple[int | None, str]:
    """One tiny request before the clock starts: the endpoint takes what bench sends, and says
    how it counts tokens. Returns the server's max_model_len (if /models tells) and the count source."""
    try:
        models = await http.get("/models")
    except httpx.HTTPError as exc:
        raise EndpointError(f"cannot reach {http.base_url}: {type(exc).__name__}: {exc}") from None
    max_model_len = None
    if models.status_code == 200:
        cards = {card.get("id"): card for card in models.json().get("data", [])}
        if cards and model not in cards:
            raise EndpointError(f"the endpoint serves {sorted(cards)}, not --model {model!r}")
        max_model_len = cards.get(model, {}).get("max_model_len")
    got, status, error = await stream_completion(http, request_body(model, [token_id], 2, 0.0), _Clock())
    if error is not None:
        raise EndpointError(f"the endpoint refused bench's first request (HTTP {status}): {error}. bench sends the "
                            "workload's token ids (below --vocab-size) as prompts to /v1/completions with ignore_eos, "
                            "stream_options and return_token_ids, as vLLM, SGLang and `serveplan engine serve` accept")
    return max_model_len, got.source


async def _run(url: str, model: str, replay: Replay, *, max_concurrency: int | None, temperature: float,
               timeout_s: float) -> tuple[list[RequestRecord], int, str]:
    limits = httpx.Limits(max_connections=max_concurrency or 10_000, max_keepalive_connections=max_concurrency or 1000)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
                                 limits=limits) as http:
        max_model_len, source = await _probe(http, model, replay.requests[0].prompt_token_ids[0]
                                             if replay.requests[0].prompt_token_ids else 1)
        if max_model_len is not None:  # its KV cache is not known: one block per token, unbounded
            check_lengths(replay, max_model_len, num_blocks=2**62, block_size=1, where="the endpoint")
        playback = Playback(replay)
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        records: list[RequestRecord] = []
        pending: set[asyncio.Task[None]] = set()
        clock = _Clock()

        def launch(subs: list[Submission], released_by: str | None) -> None:
            for sub in subs:
                task = asyncio.create_task(one(sub, released_by))
                pending.add(task)
                task.add_done_callback(pending.discard)

        async def one(sub: Submission, released_by: str | None) -> None:
            await asyncio.sleep(max(0.0, sub.due_s - clock()))
            wr = sub.request
            if slots is not None:
                await slots.acquire()
            try:
                send = clock()
                got, status, error = await stream_completion(
                    http, request_body(model, sub.prompt_token_ids, wr.output_tokens, temperature), clock)
                finish = clock()
            finally:
                if slots is not None:
                    slots.release()
            records.append(RequestRecord(
                request_id=wr.request_id, parent_id=wr.parent_id, released_by=released_by, think_s=wr.think_time_s,
                due_s=sub.due_s, send_s=send, first_token_s=got.times[0] if got.times else None,
                chunk_times_s=got.times, chunk_tokens=got.tokens, finish_s=finish,
                prompt_tokens=len(sub.prompt_token_ids), server_prompt_tokens=got.usage_prompt,
                max_tokens=wr.output_tokens, output_tokens=sum(got.tokens), finish_reason=got.finish_reason,
                http_status=status, error=error))
            # Follow-ups carry the parent's real output when the server sent its ids; else ids
            # of the right count (the prefix cache then misses on them).
            output = got.token_ids or [sub.prompt_token_ids[-1]] * sum(got.tokens)
            launch(playback.finished(wr.request_id, output, finish), wr.request_id)

        launch(playback.start(), None)
        while pending:
            await asyncio.gather(*list(pending))
    records.sort(key=lambda r: r.send_s)
    return records, playback.num_requests, source


def bench_endpoint(url: str, model: str, replay: Replay, *, slo: SLO | None = None, rate_per_s: float | None = None,
                   max_concurrency: int | None = None, arrival: str = "trace", temperature: float = 0.0,
                   timeout_s: float = 600.0) -> BenchRun:
    """One run of `replay` against the endpoint at `url` (e.g. http://127.0.0.1:8000/v1)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise InputError("--max-concurrency", max_concurrency, "must be >= 1")
    records, num_submitted, source = asyncio.run(
        _run(url.rstrip("/"), model, replay, max_concurrency=max_concurrency, temperature=temperature,
             timeout_s=timeout_s))
    client = ClientSemantics(arrival=arrival, rate_per_s=rate_per_s, concurrency=replay.concurrency,
                             max_concurrency=max_concurrency, temperature=temperature, ignore_eos=True,
                             token_count_source=source)
    summary = _summary(records, num_submitted, url, model, replay, client, slo)
    return BenchRun(url=url, model=model, workload=replay.name, client=client, summary=summary, requests=records)


def request_metrics(r: RequestRecord) -> RequestMetrics | None:
    """The request's latencies as the client saw them (None if it failed or brought no token)."""
    if r.error is not None or not r.chunk_tokens or r.finish_s is None:
        return None
    times = [t for t, n in zip(r.chunk_times_s, r.chunk_tokens) for _ in range(n)]
    return RequestMetrics.from_token_times(r.request_id, r.send_s, r.server_prompt_tokens or r.prompt_tokens, times,
                                           r.finish_s, finish_reason=r.finish_reason)


def _summary(records: list[RequestRecord], num_submitted: int, url: str, model: str, replay: Replay,
             client: ClientSemantics, slo: SLO | None) -> RunSummary | None:
    finished = [m for r in records if (m := request_metrics(r)) is not None]
    if not finished:
        return None
    reasons: dict[str, int] = {}
    for r in records:
        key = (r.finish_reason or "none") if r.error is None else ("http_429" if r.http_status == 429 else "error")
        reasons[key] = reasons.get(key, 0) + 1
    record = RunRecord(requests=finished, num_submitted=num_submitted, num_replicas=1, samples=[],
                       prefix_cache=PrefixCacheStats(), num_preemptions=0, num_steps=0, kv_cache_blocks_total=0,
                       finish_reasons=reasons)
    pricing = PricingBasis(gpus=1, price_usd_per_gpu_hour=None, peak_flops_per_gpu=None,
                           bandwidth_bytes_per_s_per_gpu=None, description=f"measured at {url}; no price attached")
    assumptions: dict[str, object] = {
        "endpoint": url,
        "workload": replay.description,
        "client": client.model_dump(),
        "timing": "the client's clock: TTFT from sending to the first chunk with tokens, ITL between chunks, "
                  "E2E to the stream's end; HTTP and network time included",
        "output_lengths": "asked as max_tokens with ignore_eos; counted from the stream",
        "not_observable": "queueing, steps, preemptions, prefix-cache hits, KV blocks and busy time are the "
                          "server's: reported as 0 (queueing as no values)",
    }
    return summarize(record, source="endpoint", model=model, hardware=f"endpoint {url}", workload=replay.name,
                     slo=slo, pricing=pricing, assumptions=assumptions)


def report(runs: list[BenchRun], sweep: Literal["rate", "concurrency"] | None, points: Sequence[float | None],
           slo: SLO | None) -> BenchReport:
    goodputs = [run.summary.goodput.requests_per_s if run.summary is not None else 0.0 for run in runs]
    best = max(range(len(runs)), key=goodputs.__getitem__)
    return BenchReport(sweep=sweep, slo=slo, runs=runs,
                       max_goodput_requests_per_s=goodputs[best], max_goodput_point=points[best])
