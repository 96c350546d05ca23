"""Load test on loopback: 64 concurrent streaming clients, a bounded number of requests each.

Every request pins its output by construction: a regex that only one string matches, unique to
the client and the request, so the tokens each stream must carry are known in advance (the byte
tokenizer makes each character one token). A lost, duplicated or reordered token, or a token
delivered to the wrong stream, breaks the comparison. Every request must complete exactly or be
refused with 429; the engine must end empty, every KV block free, and the process's memory
steady (a loose bound: the first round warms allocators and caches, the rest must not grow).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
import random

import openai
import psutil

from .helpers import byte_llm, running_server

CLIENTS = 64
ROUNDS = 3  # requests per client after the warm-up round
EOS_ID = 256
RSS_GROWTH_BOUND_MB = 64


@dataclass
class Outcome:
    completed: int = 0
    rejected: int = 0
    mismatches: list[str] = field(default_factory=list)


def target(client: int, request: int) -> str:
    rng = random.Random(client * 1000 + request)
    return f"c{client}r{request}x" + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=rng.randint(5, 40)))


async def one_request(api: openai.AsyncOpenAI, client: int, request: int, outcome: Outcome) -> None:
    text = target(client, request)
    extra = {"structured_outputs": {"regex": text}, "return_token_ids": True}
    try:
        if request % 2:
            stream = await api.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": text}], max_tokens=64, stream=True,
                temperature=1.0, seed=request, extra_body=extra)
            chunks = [(c.choices[0].delta.content, c.choices[0].model_extra["token_ids"], c.choices[0].finish_reason)
                      async for c in stream]
        else:
            stream = await api.completions.create(model="tiny", prompt=text, max_tokens=64, stream=True,
                                                  extra_body=extra)
            chunks = [(c.choices[0].text, c.choices[0].model_extra["token_ids"], c.choices[0].finish_reason)
                      async for c in stream]
    except openai.RateLimitError:
        outcome.rejected += 1
        return
    got_text = "".join(piece for piece, _, _ in chunks)
    got_ids = [t for _, ids, _ in chunks for t in ids]
    reasons = [reason for _, _, reason in chunks]
    if got_ids != [*text.encode(), EOS_ID] or got_text != text or reasons != [None] * (len(chunks) - 1) + ["stop"]:
        outcome.mismatches.append(f"client {client} request {request}: {got_text!r} {reasons[-1:]}")
    outcome.completed += 1


async def clients(base_url: str, rounds: range) -> Outcome:
    outcome = Outcome()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as api:
        async def client(c: int) -> None:
            for r in rounds:
                await one_request(api, c, r, outcome)

        await asyncio.gather(*(client(c) for c in range(CLIENTS)))
    return outcome


def test_64_streaming_clients(byte_model: Path) -> None:
    llm = byte_llm(byte_model, max_num_seqs=32, num_kv_blocks=512)
    with running_server(llm, max_waiting_requests=24) as s:
        warm = asyncio.run(clients(s.base_url, range(1)))
        rss_before = psutil.Process().memory_info().rss
        outcome = asyncio.run(clients(s.base_url, range(1, 1 + ROUNDS)))
        rss_after = psutil.Process().memory_info().rss
        scheduler = llm.scheduler

    assert not warm.mismatches and not outcome.mismatches, outcome.mismatches[:5]
    assert outcome.completed + outcome.rejected == CLIENTS * ROUNDS and outcome.completed > 0
    print(f"\n{CLIENTS} clients x {ROUNDS} requests: {outcome.completed} completed, {outcome.rejected} got 429; "
          f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    assert not scheduler.has_unfinished_requests() and not scheduler.requests
    assert scheduler.kv_cache_manager.num_free_blocks == llm.num_blocks
    assert (rss_after - rss_before) / 2**20 < RSS_GROWTH_BOUND_MB
