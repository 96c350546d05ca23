"""Prefill/decode disaggregation in the simulator: a prefill pool and a decode pool of ordinary
replicas (each the engine's own step loop and scheduler), and what happens between them.

A request goes to a prefill instance, which runs it for one token (the prompt's KV is computed
there, the token is dropped); its prompt's KV, all but the last token, then moves over the
prefill instance's link, one transfer after another, and the request goes to a decode instance
with `num_external_computed_tokens` set, whose scheduler admits it when its blocks fit and
computes the last prompt token again for its logits, as vLLM's disaggregated prefill does.
Prices come from the cost model's KVCopyModel (planner/costmodel/transfer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
import math

import simpy
from simpy.events import ProcessGenerator

from engine.core import Request, SamplingParams
from planner.costmodel.transfer import KVCopyModel
from planner.metrics import KVTransferRecord
from planner.sim.replica import Replica
from planner.sim.router import Router


class Disaggregated:
    """The router's two hops over a prefill and a decode pool."""

    def __init__(self, env: simpy.Environment, prefill: Sequence[Replica], decode: Sequence[Replica],
                 prefill_router: Router, decode_router: Router, copies: KVCopyModel, block_size: int,
                 on_finished: Callable[[Request], None]) -> None:
        self.env, self.prefill, self.decode = env, list(prefill), list(decode)
        self.prefill_router, self.decode_router = prefill_router, decode_router
        self.copies, self.block_size, self.on_finished = copies, block_size, on_finished
        self.transfers: list[KVTransferRecord] = []
        self._requests: dict[str, tuple[Request, Request, int]] = {}  # id -> (asked, prefill's, its instance)
        self._link_free_at = [0.0] * len(self.prefill)  # each prefill instance's outbound link
        for index, replica in enumerate(self.prefill):
            replica.on_finished = partial(self._prefilled, index=index)
        for replica in self.decode:
            replica.on_finished = self._decoded

    def submit(self, request: Request) -> None:
        """A request from the API server: to a prefill instance, for its prompt and one token."""
        prefill_request = Request(request.request_id, request.prompt_token_ids,
                                  SamplingParams(max_tokens=1, ignore_eos=True), request.arrival_time)
        index = self.prefill_router.choose(prefill_request, self.prefill)
        self._requests[request.request_id] = (request, prefill_request, index)
        self.prefill[index].submit(prefill_request)

    def _prefilled(self, prefill_request: Request, index: int) -> None:
        request = self._requests[prefill_request.request_id][0]
        blocks = math.ceil((request.num_prompt_tokens - 1) / self.block_size)
        send_s = self.copies.send_s(blocks)
        self.prefill[index].hold_s += send_s
        sent = self.env.now + send_s
        start = max(sent, self._link_free_at[index])
        arrive = start + self.copies.wire_s(blocks)
        self._link_free_at[index] = arrive
        self.transfers.append(KVTransferRecord(blocks * self.copies.block_bytes, blocks, send_s, arrive - sent,
                                             self.copies.receive_s(blocks)))
        decode_request = Request(request.request_id, request.prompt_token_ids, request.sampling_params,
                                 request.arrival_time, num_external_computed_tokens=request.num_prompt_tokens - 1)
        self.env.process(self._deliver(arrive, decode_request))

    def _deliver(self, when: float, request: Request) -> ProcessGenerator:
        yield self.env.timeout(when - self.env.now)
        self.decode[self.decode_router.choose(request, self.decode)].submit(request)

    def _decoded(self, request: Request) -> None:
        """The request as the client saw it: queued until its prefill's first step, and with that
        instance's prefix-cache hit."""
        _, prefill_request, _ = self._requests.pop(request.request_id)
        request.first_scheduled_time = prefill_request.first_scheduled_time
        request.num_cached_tokens = prefill_request.num_cached_tokens
        self.on_finished(request)
