"""The engine's API server in front of the replicas: each request costs it `CostModel.front_end_s`
(HTTP, tokeniser, and for chat requests the chat template), one request at a time, before the
engine sees it; then `CostParams.api_latency_s`, which requests spend side by side (hand-offs
between processes, the first token's way back), so it adds to their latency but not to the
server's load.

vLLM's and SGLang's servers tokenise in one Python process, so a burst of requests queues there:
the thousandth of a thousand sent at once reaches the engine a thousand handling times late. The
client's clock (TTFT, E2E) starts when it sends, so that wait is part of what it measures.

How the handled requests go on to the engine is the engine profile's (`Overheads.api_release`):
- "each": a request goes on as soon as the server has handled it (SGLang's tokenizer manager sends
  it to the scheduler right after tokenising it);
- "round": the server handles, one after another, every request waiting when it turns to them,
  and only then do they go on, together (vLLM's asyncio server runs each waiting request's
  handler up to its first await, the chat template among it, before any handler continues to the
  engine). A burst then reaches the engine at once, a burst's handling time after it was sent,
  instead of trickling in while the engine runs.
"""

from __future__ import annotations

from collections.abc import Callable

import simpy

from engine.core import Request
from planner.engines import ApiRelease
from planner.sim.events import Soon

Deliver = Callable[[Request], None]
Batch = list[tuple[Request, Deliver]]


class FrontEnd:
    """The server's rounds and hand-offs are timeouts with callbacks, not SimPy processes: a process
    costs two more events (its start and its end) per request, a fifth of a light run's events."""

    def __init__(self, env: simpy.Environment, request_s: float, latency_s: float,
                 release: ApiRelease = "each") -> None:
        self.env, self.request_s, self.latency_s, self.release = env, request_s, latency_s, release
        self.free_at = 0.0  # when the server will have handled every request it has accepted
        self._waiting: Batch = []  # "round": for the server's next round
        self._serving = False

    def forward(self, request: Request, deliver: Deliver) -> None:
        """Hand `request` to `deliver` once the server has handled it and its latency has passed
        (at once when both are nothing)."""
        if not self.request_s and not self.latency_s:
            deliver(request)
            return
        self.free_at = max(self.env.now, self.free_at) + self.request_s
        if self.release == "each":
            self._release(self.free_at + self.latency_s, [(request, deliver)])
            return
        self._waiting.append((request, deliver))
        if not self._serving:
            self._serving = True
            # The round starts once everything else happening now has run, so that it takes every
            # request sent at this instant (a burst, sent in one go).
            Soon(self.env, self._round)

    def _round(self, _event: simpy.Event | None = None) -> None:
        """A round takes every waiting request, handles them one by one, then lets them go; then
        the next round, while requests wait."""
        batch, self._waiting = self._waiting, []
        self.env.timeout(len(batch) * self.request_s).callbacks.append(lambda _event: self._round_done(batch))

    def _round_done(self, batch: Batch) -> None:
        self._release(self.env.now + self.latency_s, batch)
        if self._waiting:
            self._round()
        else:
            self._serving = False

    def _release(self, when: float, batch: Batch) -> None:
        def deliver_all(_event: simpy.Event) -> None:
            for request, deliver in batch:
                deliver(request)

        self.env.timeout(when - self.env.now).callbacks.append(deliver_all)
