"""Run the API with uvicorn: SIGINT/SIGTERM stop taking connections, let in-flight requests
finish for `shutdown_timeout_s`, abort the rest, then stop the engine thread."""

from __future__ import annotations

from typing import TYPE_CHECKING

import uvicorn

from engine.serve.api import OpenAIServer, build_app
from engine.serve.settings import ServeSettings

if TYPE_CHECKING:
    from engine.llm import LLM


def uvicorn_server(llm: LLM, settings: ServeSettings, log_level: str = "info") -> uvicorn.Server:
    app = build_app(OpenAIServer(llm, settings))
    # uvicorn annotates timeout_graceful_shutdown as int but hands it to asyncio.timeout: seconds as a float work.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=settings.shutdown_timeout_s,  # type: ignore[arg-type]
                            lifespan="on")
    return uvicorn.Server(config)


def serve(llm: LLM, settings: ServeSettings) -> None:
    uvicorn_server(llm, settings).run()
