"""Servers on loopback for the serve tests, and the byte-level tokenizer of their tiny model.

Every byte is one token (no merges), so a regex pins the output token by token, and text sent as
a prompt has as many tokens as bytes. The tokenizer is the `tokenizers` library's own ByteLevel
BPE, saved as tokenizer.json beside the model's config.json, with a chat template.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
import threading
import time

from engine.llm import LLM
from engine.serve.settings import ServeSettings
from engine.serve.server import uvicorn_server

EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
START_TIMEOUT_S = 60  # a bound on waiting, never an assertion on speed


def byte_level_vocab() -> dict[str, int]:
    """GPT-2's byte-to-character table: token id = byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {chars[b]: b for b in range(256)}


def byte_llm(folder: Path, **knobs: object) -> LLM:
    settings: dict[str, object] = dict(random_weights=True, seed=5, num_kv_blocks=512, block_size_tokens=16,
                                       max_num_seqs=16, max_num_batched_tokens=1024)
    return LLM(str(folder), **{**settings, **knobs})


class RunningServer:
    def __init__(self, llm: LLM, settings: ServeSettings) -> None:
        self.server = uvicorn_server(llm, settings.model_copy(update={"port": 0}), log_level="warning")
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.app_server = self.server.config.app  # FastAPI app, for its OpenAIServer
        self.llm = llm

    @property
    def engine_thread(self) -> threading.Thread | None:
        return self.openai_server.engine._thread

    @property
    def openai_server(self):  # noqa: ANN201 (engine.serve.api.OpenAIServer)
        return self.app_server.state.openai_server

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self.base_url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(START_TIMEOUT_S)


@contextmanager
def running_server(llm: LLM, **settings: object) -> Iterator[RunningServer]:
    server = RunningServer(llm, ServeSettings(**{"served_model_name": "tiny", **settings}))
    server.start()
    try:
        yield server
    finally:
        server.stop()
