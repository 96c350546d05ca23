"""`engine serve` through the official `openai` client on loopback: completions and chat,
streaming and not, the limits, back-pressure, disconnects and shutdown.

Nothing here asserts a duration: where a request must still be running when something happens,
it is made to run for a thousand steps (or to wait behind one that does) by construction.
"""

from __future__ import annotations

from collections.abc import Iterator
import asyncio
import json
import os
from pathlib import Path
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
import pytest

from engine.llm import LLM
from .helpers import START_TIMEOUT_S, RunningServer, byte_llm, running_server

LONG = 900  # output tokens of a request that must outlive what the test does meanwhile


@pytest.fixture(scope="module")
def server(byte_model: Path) -> Iterator[RunningServer]:
    with running_server(byte_llm(byte_model), max_body_bytes=64 * 1024, max_prompt_tokens=600) as s:
        yield s


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def metrics(base_url: str) -> dict[str, float]:
    """The server's samples by name, labels other than the model's in braces: 'x_total{reason="abort"}'."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(base_url.removesuffix("/v1") + "/metrics").text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def wait_for(condition, what: str) -> None:  # noqa: ANN001
    """Poll until `condition()` holds; the bound only keeps a broken server from hanging the suite."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_models_health_and_metrics(server: RunningServer, client: openai.OpenAI) -> None:
    [card] = client.models.list().data
    assert card.id == "tiny" and card.model_extra["max_model_len"] == 1024
    root = server.base_url.removesuffix("/v1")
    assert httpx.get(root + "/health").json() == {"status": "ok"}
    text = httpx.get(root + "/metrics").text
    for name in ("serveplan:time_to_first_token_seconds_bucket", "serveplan:inter_token_latency_seconds_bucket",
                 "serveplan:e2e_request_latency_seconds_bucket", "serveplan:num_requests_running",
                 "serveplan:num_requests_waiting", "serveplan:kv_cache_usage_perc", "serveplan:num_preemptions_total"):
        assert name in text


def test_completion_streamed_and_not_give_the_same_greedy_tokens(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0.0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kwargs)
    [choice] = whole.choices
    assert choice.finish_reason == "length" and len(choice.token_ids) == 12
    assert whole.usage.prompt_tokens == len("The quick brown fox") and whole.usage.completion_tokens == 12
    assert choice.prompt_token_ids == list(b"The quick brown fox")

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    *token_chunks, usage_chunk = chunks
    assert [t for c in token_chunks for t in c.choices[0].token_ids] == choice.token_ids
    assert "".join(c.choices[0].text for c in token_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 11 + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12


def test_chat_streamed_and_not(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    # The template's text: "<system>Be brief.\n<user>Hi\n<assistant>", one token per byte.
    assert whole.usage.prompt_tokens == len("<system>Be brief.\n<user>Hi\n<assistant>")
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True, temperature=0,
                                                 extra_body={"ignore_eos": True,
                                                             "stream_options": {"continuous_usage_stats": True}}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks) == whole.choices[0].message.content
    assert [c.usage.completion_tokens for c in chunks] == list(range(1, 9))  # one token per step


def test_token_id_prompts(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt=[10, 11, 12], max_tokens=3,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.usage.prompt_tokens == 3 and len(out.choices[0].token_ids) == 3
    with pytest.raises(openai.BadRequestError, match=r"token ids must lie in \[0, 260\)"):
        client.completions.create(model="tiny", prompt=[10, 999], max_tokens=3)


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"n": 2}, "n", "not supported by this server"),
    ({"logprobs": 2}, "logprobs", "not supported"),
    ({"stop": ["\n"]}, "stop", "use stop_token_ids"),
    ({"extra_body": {"best_of": 3}}, "best_of", "not supported"),
    ({"extra_body": {"mirostat": 1}}, "mirostat", "mirostat is not supported by this server"),
    ({"temperature": 3.0}, "temperature", "less than or equal to 2"),
    ({"max_tokens": 5000}, "max_tokens", "at most max_output_tokens=1023"),
    ({"max_tokens": 1023}, "max_tokens", r"plus max_tokens must fit max_model_len=1024"),
    ({"prompt": "x" * 601}, "prompt", "601 tokens; this server takes at most max_prompt_tokens=600"),
    ({"prompt": ["a", "b"]}, "prompt", "a batch of 2 prompts is not supported"),
    ({"extra_body": {"structured_outputs": {"regex": "(", "choice": ["a"]}}}, "structured_outputs",
     "exactly one of json, regex, grammar, choice"),
    ({"extra_body": {"structured_outputs": {"regex": "("}}}, "structured_outputs", "cannot be compiled"),
])
def test_bad_requests_get_a_400_naming_the_field(client: openai.OpenAI, fields: dict, param: str, message: str) -> None:
    kwargs = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    error = info.value.body
    assert error["param"] == param and re.search(message, error["message"]), error


def test_chat_refusals(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens or max_tokens, not both"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       max_completion_tokens=2)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}])


def test_other_model_is_404_and_oversized_body_is_413(server: RunningServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="this server serves 'tiny'"):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    response = httpx.post(server.base_url + "/completions", json={"model": "tiny", "prompt": "x" * 70_000})
    assert response.status_code == 413 and "max_body_bytes=65536" in response.json()["error"]["message"]


def test_a_streaming_client_that_disconnects_aborts_its_request_and_frees_its_blocks(
        server: RunningServer, client: openai.OpenAI) -> None:
    before = metrics(server.base_url)
    stream = client.completions.create(model="tiny", prompt="abc", max_tokens=LONG, stream=True,
                                       extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()  # the client goes away with ~900 tokens still to come

    def aborted() -> bool:
        m = metrics(server.base_url)
        return m.get('serveplan:request_success_total{finished_reason="abort"}', 0) == \
            before.get('serveplan:request_success_total{finished_reason="abort"}', 0) + 1
    wait_for(aborted, "the abort")
    m = metrics(server.base_url)
    assert m["serveplan:num_requests_running"] == 0 and m["serveplan:kv_cache_usage_perc"] == 0.0
    assert server.llm.scheduler.kv_cache_manager.num_free_blocks == server.llm.num_blocks
    assert not server.llm.scheduler.requests  # the server keeps no finished request


def test_a_non_streaming_client_that_disconnects_aborts_its_request(server: RunningServer) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=None) as http:
            call = asyncio.create_task(http.post("/completions", json={
                "model": "tiny", "prompt": "abc", "max_tokens": LONG, "ignore_eos": True}))
            await asyncio.to_thread(wait_for, lambda: metrics(server.base_url)["serveplan:num_requests_running"] == 1,
                                    "the request to run")
            call.cancel()  # closes the connection

    before = metrics(server.base_url).get('serveplan:request_success_total{finished_reason="abort"}', 0)
    asyncio.run(go())
    wait_for(lambda: metrics(server.base_url).get('serveplan:request_success_total{finished_reason="abort"}', 0)
             == before + 1, "the abort")
    wait_for(lambda: server.llm.scheduler.kv_cache_manager.num_free_blocks == server.llm.num_blocks, "free blocks")


def test_a_full_waiting_queue_answers_429_with_retry_after(byte_model: Path) -> None:
    # One running slot, one waiting place: A runs for 900 steps, B waits behind it, C is one too many.
    with running_server(byte_llm(byte_model, max_num_seqs=1), max_waiting_requests=1, retry_after_s=7) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        a = client.completions.create(model="tiny", prompt="a", max_tokens=LONG, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(a))  # A is running
        with httpx.Client(base_url=s.base_url, timeout=None) as http:
            with http.stream("POST", "/completions", json={"model": "tiny", "prompt": "b", "max_tokens": 2,
                                                           "stream": True}) as b:
                wait_for(lambda: metrics(s.base_url)["serveplan:num_requests_waiting"] == 1, "B to wait")
                with pytest.raises(openai.RateLimitError) as info:
                    client.completions.create(model="tiny", prompt="c", max_tokens=2)
                assert info.value.response.headers["retry-after"] == "7"
                assert "1 requests are waiting (limit 1)" in info.value.body["message"]
                a.close()  # A's client leaves: B runs
                events = [line for line in b.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] is not None
        assert metrics(s.base_url)["serveplan:request_rejected_total"] == 1


def test_graceful_shutdown_lets_in_flight_requests_finish(byte_model: Path, no_error_logs: None) -> None:
    s = RunningServer(byte_llm(byte_model), _settings(shutdown_timeout_s=60))
    s.start()
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    stream = client.completions.create(model="tiny", prompt="a", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = [next(iter(stream))]
    s.server.should_exit = True  # as SIGTERM does
    chunks += list(stream)
    assert sum(len(c.choices[0].token_ids) for c in chunks) == 200 and chunks[-1].choices[0].finish_reason == "length"
    s.thread.join(START_TIMEOUT_S)
    assert not s.thread.is_alive() and not s.engine_thread.is_alive()


def test_shutdown_past_its_timeout_aborts_in_flight_requests(byte_model: Path, no_error_logs: None) -> None:
    llm = byte_llm(byte_model)
    s = RunningServer(llm, _settings(shutdown_timeout_s=0))
    s.start()
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    stream = client.completions.create(model="tiny", prompt="a", max_tokens=LONG, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    s.server.should_exit = True
    with pytest.raises((httpx.RemoteProtocolError, openai.APIError)):
        list(stream)  # cut off: the server aborted it
    s.thread.join(START_TIMEOUT_S)
    assert not s.thread.is_alive() and not s.engine_thread.is_alive()
    assert llm.scheduler.kv_cache_manager.num_free_blocks == llm.num_blocks and not llm.scheduler.has_unfinished_requests()


def test_the_cli_server_exits_cleanly_on_sigterm(byte_model: Path) -> None:
    """`serveplan engine serve` as deployed: SIGTERM mid-stream lets the stream finish, then the
    process shuts down without a traceback and ends by the signal (uvicorn re-raises it after its
    shutdown, so a supervisor sees a SIGTERM exit)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "planner.cli", "engine", "serve", "--model", str(byte_model), "--random-weights",
         "--served-model-name", "tiny", "--port", str(port), "--num-kv-blocks", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        wait_for(lambda: server.poll() is not None or _healthy(port), "the server to start")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="a", max_tokens=100, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream))
        server.send_signal(signal.SIGTERM)
        chunks = [first, *stream]
        _, stderr = server.communicate(timeout=START_TIMEOUT_S)
    finally:
        if server.poll() is None:
            server.kill()
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) == 100
    assert server.returncode == -signal.SIGTERM and "Traceback" not in stderr, stderr[-2000:]
    assert "Application shutdown complete" in stderr


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_engine_without_tokenizer_serves_token_ids_only(model_dir_no_tokenizer: LLM) -> None:
    with running_server(model_dir_no_tokenizer) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4 and out.choices[0].text == ""
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            client.completions.create(model="tiny", prompt="text", max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError, match="needs the model's tokenizer"):
            client.completions.create(model="tiny", prompt=[1], extra_body={"response_format": {"type": "json_object"}})


@pytest.fixture
def model_dir_no_tokenizer(tiny_model) -> LLM:  # noqa: ANN001
    return LLM(str(tiny_model()), random_weights=True, num_kv_blocks=64, block_size_tokens=4)


def _settings(**changes: object):  # noqa: ANN202
    from engine.serve.settings import ServeSettings

    return ServeSettings(served_model_name="tiny", **changes)
