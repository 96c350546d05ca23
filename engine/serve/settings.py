"""The server's own settings (the engine's are EngineConfig's), declared once: the CLI's flags
are generated from these fields (engine/knobs.py). Torch- and FastAPI-free, so that `serveplan`
builds its parser fast."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from engine.knobs import Knob


class ServeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    served_model_name: Annotated[str | None, Knob("--served-model-name", "Served model name")] = Field(
        None, min_length=1, max_length=256, description="The model name clients send and /v1/models lists "
        "(default: the --model value)")
    host: Annotated[str, Knob("--host", "Listen address")] = Field(
        "127.0.0.1", min_length=1, description="Address to listen on; there is no authentication (docs/serving.md)")
    port: Annotated[int, Knob("--port", "Port")] = Field(8000, ge=0, le=65535, description="TCP port; 0: any free one")
    max_prompt_tokens: Annotated[int | None, Knob("--max-prompt-tokens", "Longest prompt", "tokens")] = Field(
        None, ge=1, description="Longest prompt accepted (default: the max model length - 1)")
    max_output_tokens: Annotated[int | None, Knob("--max-output-tokens", "Largest max_tokens", "tokens")] = Field(
        None, ge=1, description="Largest max_tokens accepted (default: the max model length - 1)")
    max_waiting_requests: Annotated[int, Knob("--max-waiting-requests", "Waiting requests", "requests")] = Field(
        256, ge=0, le=1_000_000, description="Requests waiting for the engine before new ones get 429")
    retry_after_s: Annotated[int, Knob("--retry-after", "Retry-After", "s")] = Field(
        1, ge=1, le=3600, description="Retry-After of a 429")
    max_body_bytes: Annotated[int, Knob("--max-body-bytes", "Largest request body", "bytes")] = Field(
        4 * 2**20, ge=1024, le=2**30, description="Largest request body")
    shutdown_timeout_s: Annotated[float, Knob("--shutdown-timeout", "Shutdown grace", "s")] = Field(
        30.0, ge=0, le=3600, description="On SIGINT/SIGTERM, how long in-flight requests may finish before they "
        "are aborted")
