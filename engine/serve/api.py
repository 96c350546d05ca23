"""The OpenAI-compatible HTTP API over an AsyncEngine: FastAPI routes, SSE streaming, errors.

Every error is OpenAI's JSON error body with the HTTP status that fits: 400 for a bad request
(naming the field), 404 for another model's name, 413 for an oversized body, 429 with
Retry-After when the engine's waiting queue is full, 503 while shutting down. A client that
disconnects aborts its request, streaming or not, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
import itertools
import json
import time
from typing import TYPE_CHECKING, TypeVar, cast
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from engine.core import SamplingParams, StructuredOutput
from engine.errors import InputError
from engine.serve.async_engine import AsyncEngine, Delivery, EngineStopped, QueueFull, RequestStream
from engine.serve.detokenize import IncrementalDetokenizer
from engine.serve.metrics import ServerMetrics
from engine.serve.middleware import BodyLimit
from engine.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    Usage,
    error_body,
)
from engine.serve.settings import ServeSettings

if TYPE_CHECKING:
    from engine.llm import LLM

T = TypeVar("T")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param), status_code=exc.status, headers=exc.headers)


class OpenAIServer:
    """Turns API requests into engine requests and engine deliveries into API responses."""

    def __init__(self, llm: LLM, settings: ServeSettings) -> None:
        self.llm, self.settings = llm, settings
        assert settings.served_model_name is not None, "the front end names the served model"
        self.model_name = settings.served_model_name
        room = llm.max_model_len - 1
        self.max_prompt_tokens = min(settings.max_prompt_tokens or room, room)
        self.max_output_tokens = min(settings.max_output_tokens or room, room)
        self.metrics = ServerMetrics(self.model_name)
        self.engine = AsyncEngine(llm, settings.max_waiting_requests, self.metrics)
        self.created = int(time.time())

    # ------------------------------------------------------------------ requests in

    async def completion(self, body: CompletionRequest, http: Request) -> Response:
        arrival = self.llm.now()
        self._check_model(body.model)
        prompt = _field("prompt", body.single_prompt)
        ids = await self._encode(prompt, "prompt", lambda: self.llm.encode(prompt))
        params = await self._sampling_params(body, len(ids), body.max_tokens, "max_tokens", "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self._submit(request_id, ids, params, arrival)
        if body.stream:
            return _sse(self._completion_chunks(stream, body))
        tokens, finish_reason = await _unless_disconnected(http, self._collect(stream))
        choice = CompletionChoice(text=self._decode(tokens), finish_reason=finish_reason,
                                  prompt_token_ids=ids if body.return_token_ids else None,
                                  token_ids=tokens if body.return_token_ids else None)
        return _json(CompletionResponse(id=request_id, model=self.model_name, choices=[choice],
                                        usage=_usage(len(ids), len(tokens))))

    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        arrival = self.llm.now()
        self._check_model(body.model)
        max_tokens = _field("max_completion_tokens", body.output_limit)
        limit_field = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
        ids = await self._encode(body.messages, "messages", lambda: self._render_chat(body))
        params = await self._sampling_params(body, len(ids), max_tokens, limit_field, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._submit(request_id, ids, params, arrival)
        if body.stream:
            return _sse(self._chat_chunks(stream, body))
        tokens, finish_reason = await _unless_disconnected(http, self._collect(stream))
        choice = ChatChoice(message=AssistantMessage(content=self._decode(tokens)), finish_reason=finish_reason,
                            token_ids=tokens if body.return_token_ids else None)
        return _json(ChatCompletionResponse(id=request_id, model=self.model_name, choices=[choice],
                                            usage=_usage(len(ids), len(tokens)),
                                            prompt_token_ids=ids if body.return_token_ids else None))

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"model={model[:80]!r} does not exist here: this server serves {self.model_name!r}",
                           "model")

    def _render_chat(self, body: ChatCompletionRequest) -> list[int]:
        tokenizer = self.llm.tokenizer
        if tokenizer is None or tokenizer.chat_template is None:
            raise InputError("messages", f"{len(body.messages)} messages", "this model has no chat template; "
                             "send the prompt to /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:
            raise InputError("messages", f"{len(messages)} messages", f"the chat template refuses them: {exc}") from None
        return tokenizer.encode(text, add_special_tokens=False)  # the template wrote them already

    async def _encode(self, prompt: object, field: str, encode: Callable[[], list[int]]) -> list[int]:
        # Token ids are checked on the loop; text is tokenised off it, so long prompts do not stall streams.
        ids = encode() if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else (
            await asyncio.to_thread(encode))
        if not ids:
            raise ApiError(400, f"{field} is empty: at least one token is needed", field)
        if len(ids) > self.max_prompt_tokens:
            raise ApiError(400, f"{field} has {len(ids)} tokens; this server takes at most "
                           f"max_prompt_tokens={self.max_prompt_tokens}", field)
        return ids

    async def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest, num_prompt: int,
                               max_tokens: int | None, field: str, prompt_field: str) -> SamplingParams:
        room = self.llm.max_model_len - num_prompt
        if max_tokens is None:
            max_tokens = min(self.max_output_tokens, room)
        if max_tokens > self.max_output_tokens:
            raise ApiError(400, f"{field}={max_tokens} is invalid: this server allows at most "
                           f"max_output_tokens={self.max_output_tokens}", field)
        if max_tokens > room:
            raise ApiError(400, f"{field}={max_tokens} is invalid: the {prompt_field} ({num_prompt} tokens) plus "
                           f"{field} must fit max_model_len={self.llm.max_model_len}", field)
        constraint = _field("response_format", body.structured_output)
        if constraint is not None:
            await self._check_constraint(*constraint)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                seed=body.seed, stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                structured_output=None if constraint is None else constraint[1],
            )
        except ValueError as exc:
            raise ApiError(400, str(exc), str(exc).partition("=")[0]) from None

    async def _check_constraint(self, field: str, constraint: StructuredOutput) -> None:
        try:  # compiling a large schema takes a while: off the loop
            await asyncio.to_thread(self.llm.check_structured_output, constraint)
        except InputError as exc:
            raise ApiError(400, f"{field}: {exc}", field) from None

    async def _submit(self, request_id: str, ids: list[int], params: SamplingParams, arrival: float) -> RequestStream:
        try:
            return await self.engine.add_request(request_id, ids, params, arrival)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc}; retry after {self.settings.retry_after_s} s",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        except EngineStopped as exc:
            raise ApiError(503, str(exc)) from None

    # ------------------------------------------------------------------ results out

    async def _collect(self, stream: RequestStream) -> tuple[list[int], str | None]:
        tokens: list[int] = []
        finish_reason = None
        try:
            async for delivery in stream:
                tokens.extend(delivery.token_ids)
                finish_reason = delivery.finish_reason
        finally:
            if not stream.finished:  # the client left (or the server stops): free the request's blocks
                self.engine.abort(stream.request_id)
        return tokens, finish_reason

    def _decode(self, tokens: list[int]) -> str:
        tokenizer = self.llm.tokenizer
        # One list of ids decodes to one str (transformers' return type covers a batch of lists too).
        return cast(str, tokenizer.decode(tokens, skip_special_tokens=True)) if tokenizer is not None else ""

    async def _deliveries(self, stream: RequestStream) -> AsyncIterator[tuple[Delivery, str, int]]:
        """Each delivery with its text and the output tokens so far; aborts the request if the
        client goes away (the response task is cancelled mid-stream)."""
        detokenizer = IncrementalDetokenizer(self.llm.tokenizer)
        num_tokens = 0
        try:
            async for delivery in stream:
                num_tokens += len(delivery.token_ids)
                yield delivery, detokenizer.add(delivery.token_ids, delivery.finished), num_tokens
        finally:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def _completion_chunks(self, stream: RequestStream, body: CompletionRequest) -> AsyncIterator[str]:
        options, created, num_prompt = body.stream_options, int(time.time()), len(stream.prompt_token_ids)
        continuous = options is not None and options.continuous_usage_stats
        first = True
        async for delivery, text, num_tokens in self._deliveries(stream):
            choice = CompletionChoice(
                text=text, finish_reason=delivery.finish_reason,
                prompt_token_ids=stream.prompt_token_ids if body.return_token_ids and first else None,
                token_ids=list(delivery.token_ids) if body.return_token_ids else None)
            first = False
            yield _event(CompletionResponse(id=stream.request_id, created=created, model=self.model_name,
                                            choices=[choice], usage=_usage(num_prompt, num_tokens) if continuous else None))
        if options is not None and options.include_usage:
            yield _event(CompletionResponse(id=stream.request_id, created=created, model=self.model_name, choices=[],
                                            usage=_usage(num_prompt, num_tokens)))

    async def _chat_chunks(self, stream: RequestStream, body: ChatCompletionRequest) -> AsyncIterator[str]:
        options, created, num_prompt = body.stream_options, int(time.time()), len(stream.prompt_token_ids)
        continuous = options is not None and options.continuous_usage_stats
        first = True
        async for delivery, text, num_tokens in self._deliveries(stream):
            # The role comes with the first tokens: an empty first chunk would read as the first token to a client.
            choice = ChatStreamChoice(delta=Delta(role="assistant" if first else None, content=text),
                                      finish_reason=delivery.finish_reason,
                                      token_ids=list(delivery.token_ids) if body.return_token_ids else None)
            yield _event(ChatCompletionChunk(
                id=stream.request_id, created=created, model=self.model_name, choices=[choice],
                usage=_usage(num_prompt, num_tokens) if continuous else None,
                prompt_token_ids=stream.prompt_token_ids if body.return_token_ids and first else None))
            first = False
        if options is not None and options.include_usage:
            yield _event(ChatCompletionChunk(id=stream.request_id, created=created, model=self.model_name, choices=[],
                                             usage=_usage(num_prompt, num_tokens)))

    # ------------------------------------------------------------------ other endpoints

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created, max_model_len=self.llm.max_model_len)])

    def health(self) -> Response:
        engine = self.engine
        if engine.dead is not None or engine.stopping:
            return JSONResponse(error_body(503, "the engine has stopped" if engine.dead else "shutting down"), 503)
        return JSONResponse({"status": "ok"})


def _field(name: str, get: Callable[[], T]) -> T:
    """A body's cross-field check, as a 400 naming `name`."""
    try:
        return get()
    except ValueError as exc:
        raise ApiError(400, f"{name}: {exc}", name) from None


def _usage(num_prompt: int, num_output: int) -> Usage:
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_output, total_tokens=num_prompt + num_output)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    async def with_done() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except EngineStopped as exc:
            yield f"data: {json.dumps(error_body(503, str(exc)))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(with_done(), media_type="text/event-stream")


async def _unless_disconnected(http: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it (its cleanup aborts the
    request) and answer nobody. Streaming responses get this from Starlette itself."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(http))
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watch.cancel()
        try:
            return task.result()
        except EngineStopped as exc:
            raise ApiError(503, str(exc)) from None
    task.cancel()
    raise ApiError(499, "the client disconnected")  # nginx's code; nobody reads it


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


_TYPE_NAMES = {"str", "int", "float", "bool", "none"}
_TYPE_PREFIXES = ("list[", "dict[", "function-", "union[", "literal[", "nullable[")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(part) for part in err["loc"] if part != "body"]
    # A union (prompt: str | list[int] ...) reports each member; the field is what the user wrote.
    loc = list(itertools.takewhile(lambda part: part not in _TYPE_NAMES and not part.startswith(_TYPE_PREFIXES), loc))
    field = ".".join(loc) or "body"
    if err["type"] == "extra_forbidden":
        return f"{field} is not supported by this server", field
    value = repr(err.get("input"))[:80]
    message = err["msg"].removeprefix("Value error, ")
    return (f"{field}={value} is invalid: {message}" if loc else f"the body is invalid: {message}"), field


def build_app(server: OpenAIServer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        await server.engine.stop()  # after uvicorn let in-flight requests finish (or cancelled them)

    app = FastAPI(title="ServePlan engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.openai_server = server

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(InputError)
    async def input_error(_: Request, exc: InputError) -> JSONResponse:
        return _error_response(ApiError(400, str(exc), exc.field))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(exc)
        return _error_response(ApiError(400, message, field))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        return await server.completion(body, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        return await server.chat(body, http)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        return server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimit, max_bytes=server.settings.max_body_bytes)
    return app

