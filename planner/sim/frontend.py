"""The engine's API server in front of the replicas: each request costs it `CostModel.front_end_s`
(HTTP, tokeniser, and for chat requests the chat template), one request at a time, before the
engine sees it; then `CostParams.api_latency_s`, which requests spend side by side (hand-offs
between processes, the first token's way back), so it adds to their latency but not to the
server's load.

vLLM's and SGLang's servers tokenise in one Python process, so a burst of requests queues there:
the thousandth of a thousand sent at once reaches the engine a thousand handling times late. The
client's clock (TTFT, E2E) starts when it sends, so that wait is part of what it measures."""

from __future__ import annotations

from collections.abc import Callable

import simpy

from engine.core import Request


class FrontEnd:
    def __init__(self, env: simpy.Environment, request_s: float, latency_s: float) -> None:
        self.env, self.request_s, self.latency_s = env, request_s, latency_s
        self.free_at = 0.0  # when the server finishes the requests already in it

    def forward(self, request: Request, deliver: Callable[[Request], None]) -> None:
        """Hand `request` to `deliver` once the server has handled it and its latency has passed
        (at once when both are nothing)."""
        if not self.request_s and not self.latency_s:
            deliver(request)
            return
        done = max(self.env.now, self.free_at) + self.request_s
        self.free_at = done
        self.env.process(self._at(done + self.latency_s, request, deliver))

    def _at(self, when: float, request: Request, deliver: Callable[[Request], None]):  # noqa: ANN202 (SimPy)
        yield self.env.timeout(when - self.env.now)
        deliver(request)
