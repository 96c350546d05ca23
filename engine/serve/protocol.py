"""The OpenAI-compatible API's request and response bodies, for the fields this server supports.

Requests follow OpenAI's schema plus the extras vLLM's server added and benchmark clients send
(`top_k`, `ignore_eos`, `stop_token_ids`, `structured_outputs`, `return_token_ids`,
`stream_options.continuous_usage_stats`). A field this server does not implement is refused
with a 400 naming it, never ignored: an unknown field by `extra="forbid"`, a known OpenAI field
(n, logprobs, tools, ...) when it asks for anything but its default.
"""

from __future__ import annotations

from collections.abc import Callable
import json
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from engine.core import StructuredOutput

T = TypeVar("T")


def _only(allowed: Callable[[Any], bool], what: str) -> AfterValidator:
    """A validator for an OpenAI field this server does not implement beyond its default."""

    def check(value: T) -> T:
        if not allowed(value):
            raise ValueError(f"not supported by this server ({what})")
        return value

    return AfterValidator(check)


_Unset = _only(lambda v: v is None or v == [] or v == {}, "leave it unset")
_Off = _only(lambda v: not v, "leave it unset or false")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM extra: usage so far in every chunk")


class JsonSchemaFormat(_Body):
    name: str = Field(max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema must be given exactly when type is 'json_schema'")
        return self


class StructuredOutputs(_Body):
    """vLLM's extra field: exactly one of a JSON schema, a regex, an EBNF grammar or a choice."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "grammar", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, grammar, choice")
        return self


class _GenerationBody(_Body):
    """What completions and chat share."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="vLLM extra; 0 or -1 = off")
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[int] | None = Field(None, description="vLLM extra")
    ignore_eos: bool = Field(False, description="vLLM extra: generate exactly max_tokens")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extra")
    return_token_ids: bool = Field(False, description="vLLM extra: prompt and output token ids in the response")
    user: str | None = Field(None, max_length=256, description="end-user id; recorded nowhere")

    n: Annotated[int, _only(lambda v: v == 1, "one choice per request")] = 1
    stop: Annotated[str | list[str] | None, _only(lambda v: not v, "no stop strings; use stop_token_ids")] = None
    presence_penalty: Annotated[float, _only(lambda v: v == 0, "no penalties")] = 0.0
    frequency_penalty: Annotated[float, _only(lambda v: v == 0, "no penalties")] = 0.0
    logit_bias: Annotated[dict[str, float] | None, _Unset] = None

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        """The request's constraint and the field that gave it, or None."""
        fmt, extra = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and extra is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        if fmt is not None and fmt.type == "json_object":
            return "response_format", StructuredOutput("json_schema", '{"type": "object"}')
        if fmt is not None and fmt.json_schema is not None:
            return "response_format", StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))
        if extra is None:
            return None
        if extra.json_ is not None:
            spec = extra.json_ if isinstance(extra.json_, str) else json.dumps(extra.json_)
            return "structured_outputs", StructuredOutput("json_schema", spec)
        if extra.regex is not None:
            return "structured_outputs", StructuredOutput("regex", extra.regex)
        if extra.grammar is not None:
            return "structured_outputs", StructuredOutput("grammar", extra.grammar)
        assert extra.choice is not None
        # EBNF string literals escape like JSON strings.
        return "structured_outputs", StructuredOutput("grammar", "root ::= " + " | ".join(map(json.dumps, extra.choice)))


class CompletionRequest(_GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: Annotated[bool, _Off] = False
    logprobs: Annotated[int | None, _Unset] = None
    best_of: Annotated[int | None, _only(lambda v: v in (None, 1), "one candidate per request")] = None
    suffix: Annotated[str | None, _Unset] = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(f"a batch of {len(p)} prompts is not supported by this server: send one per request")
            return p[0]
        return p  # type: ignore[return-value]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=64)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Annotated[bool | None, _Off] = None
    top_logprobs: Annotated[int | None, _Unset] = None
    tools: Annotated[list[dict[str, Any]] | None, _Unset] = None
    tool_choice: Annotated[str | dict[str, Any] | None, _only(lambda v: v in (None, "none"), "no tools")] = None
    parallel_tool_calls: Annotated[bool | None, _Unset] = None

    def output_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_completion_tokens or max_tokens, not both")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def _absent_if_none() -> Any:
    # The vLLM extras appear only when asked for; OpenAI's own optional fields stay as null.
    return Field(None, exclude_if=lambda v: v is None)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None
    prompt_token_ids: list[int] | None = _absent_if_none()
    token_ids: list[int] | None = _absent_if_none()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None
    token_ids: list[int] | None = _absent_if_none()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = _absent_if_none()


class Delta(BaseModel):
    role: Literal["assistant"] | None = _absent_if_none()
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None
    logprobs: None = None
    token_ids: list[int] | None = _absent_if_none()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = _absent_if_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "serveplan"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
            503: "service_unavailable"}.get(status, "server_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()
