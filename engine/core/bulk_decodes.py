"""Decodes applied in bulk: the simulator's fast path through the one scheduler, exact by construction.

When the executor samples a token known in advance for every decoding request (the simulator's
synthetic id), a decode step changes a running request in only three ways: one more computed
token, one more output token, one more token time. Nothing about it needs looking at until its
next *event*: the step that needs a new KV block or registers a full one in the prefix cache, the
step that samples its last token, a preemption, a step whose token budget does not reach it, or
someone reading it. The scheduler keeps such requests here: each step it counts them in one go
(the budget, the step's shape: requests, summed context, longest context) and brings a request's
own fields up to date only at its event. The requests stay in the scheduler's running list, in
their place, so every decision that depends on order (budget, allocation, preemption victims) is
taken exactly as step by step.

The clock is `steps`, the number of bulk steps so far. A member's fields are exact as of
`request.bulk_since`; it is next looked at in bulk step `request.bulk_until`. Both are -1 for a
request handled one by one.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

from engine.core.request import Request

# Token times of bulk steps are kept from the oldest step a member still lacks; past this many the
# members are brought up to date and the list restarts, so memory stays bounded on long runs.
_MAX_KEPT_TIMES = 1 << 14


class BulkShape(NamedTuple):
    """The bulk decodes of one step, as a cost model needs them: each is one token attending to its
    whole context (num_computed_tokens + 1)."""

    num_requests: int = 0
    context_tokens: int = 0  # summed over the requests
    max_context_len: int = 0


NO_BULK = BulkShape()


class BulkDecodes:
    def __init__(self, token: int) -> None:
        self.token = token
        self.steps = 0
        self.members: dict[str, Request] = {}
        self.context_tokens = 0  # sum of num_computed_tokens + 1 over members, as of `steps`
        self._times: list[float] = []  # time of bulk step _first_time_step + i
        self._first_time_step = 0
        # Contexts grow together, so num_computed_tokens + 1 - bulk_since orders members for good:
        # a max-heap of it, entries dropped lazily once their request left or moved.
        self._longest: list[tuple[int, str]] = []

    @property
    def num_requests(self) -> int:
        return len(self.members)

    def shape(self) -> BulkShape:
        if not self.members:
            return NO_BULK
        return BulkShape(len(self.members), self.context_tokens, self._max_context_len())

    def join(self, request: Request, until: int) -> None:
        """Take a decoding request whose fields are exact now, to be looked at again in bulk step `until`."""
        rid = request.request_id
        request.bulk_since, request.bulk_until = self.steps, until
        self.members[rid] = request
        self.context_tokens += request.num_computed_tokens + 1
        heapq.heappush(self._longest, (self.steps - request.num_computed_tokens - 1, rid))
        if len(self._longest) > 2 * len(self.members) + 64:
            self._rebuild_longest()

    def sync(self, request: Request) -> None:
        """Bring a member's computed tokens, output tokens and token times up to date."""
        n = self.steps - request.bulk_since
        if n:
            start = request.bulk_since - self._first_time_step
            request.num_computed_tokens += n
            request.output_token_ids += [self.token] * n
            request.token_times += self._times[start:start + n]
            request.bulk_since = self.steps

    def leave(self, request: Request) -> None:
        """Hand a member back to one-by-one handling, its fields exact."""
        self.sync(request)
        del self.members[request.request_id]
        self.context_tokens -= request.num_computed_tokens + 1
        request.bulk_since = request.bulk_until = -1
        if not self.members:
            self._times.clear()
            self._longest.clear()
            self._first_time_step = self.steps

    def advance(self, now: float) -> None:
        """Every member decoded one token in the step that ends at `now`."""
        self.steps += 1
        self._times.append(now)
        self.context_tokens += len(self.members)
        if len(self._times) > _MAX_KEPT_TIMES:
            for request in self.members.values():
                self.sync(request)
            self._times.clear()
            self._first_time_step = self.steps

    def _max_context_len(self) -> int:
        heap, members = self._longest, self.members
        while True:
            neg_key, rid = heap[0]
            request = members.get(rid)
            if request is not None and request.bulk_since - request.num_computed_tokens - 1 == neg_key:
                return self.steps - neg_key
            heapq.heappop(heap)

    def _rebuild_longest(self) -> None:
        self._longest = [(r.bulk_since - r.num_computed_tokens - 1, rid) for rid, r in self.members.items()]
        heapq.heapify(self._longest)
