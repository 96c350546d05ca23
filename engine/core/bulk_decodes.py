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

A member's block events (the step that takes its next block and, with prefix caching, the one
before it, which registers its full block; a private request, `Request.private_blocks`, registers
its blocks when it lets go of them, so only takes) are not visits either: the member *owes* the event
(`request.bulk_owed`, the bulk step it falls in), and the scheduler pays what is owed in the order
one by one would meet it (bulk step, then place in the running list: `request.running_seq`), at the
first thing after it that touches the block pool (anyone's allocation, lookup or release, and the
end of each step's schedule, which reports the pool's use). Between the two nothing touches the
pool, so the payment finds it exactly as one by one did. A block owed must also be there when paid:
a member owes one only while the free blocks outnumber those owed, and whatever else takes blocks
turns owed blocks back into visits (`cancel_owed_takes`) when that no longer holds, so a pool
running short meets each taker in its place, with its preemptions, as one by one.

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
        # Block events owed: (bulk step, running_seq, request id), a min-heap in the order one by one
        # meets them; entries dropped lazily once their request left, paid or turned it into a visit.
        self._owed: list[tuple[int, int, str]] = []
        self._owed_takes: set[str] = set()  # members whose owed event takes a block
        # (bulk_until, request id): a min-heap of the steps members are looked at, entries dropped
        # lazily once their request left or moved; a step before all of them is bulk decodes only.
        self._visits: list[tuple[int, str]] = []

    @property
    def num_requests(self) -> int:
        return len(self.members)

    def shape(self) -> BulkShape:
        if not self.members:
            return NO_BULK
        return BulkShape(len(self.members), self.context_tokens, self._max_context_len())

    @property
    def num_owed_takes(self) -> int:
        return len(self._owed_takes)

    def next_visit(self) -> int:
        """The first bulk step in which a member is looked at (-1: no member)."""
        heap, members = self._visits, self.members
        while heap:
            until, rid = heap[0]
            request = members.get(rid)
            if request is not None and request.bulk_until == until:
                return until
            heapq.heappop(heap)
        return -1

    def look_at(self, request: Request, step: int) -> None:
        """Look at a member next in bulk step `step`."""
        if request.bulk_until != step:
            request.bulk_until = step
            heapq.heappush(self._visits, (step, request.request_id))
            if len(self._visits) > 2 * len(self.members) + 64:
                self._visits = [(r.bulk_until, rid) for rid, r in self.members.items()]
                heapq.heapify(self._visits)

    def join(self, request: Request) -> None:
        """Take a decoding request whose fields are exact now; the caller sets when it is next looked at (look_at)."""
        rid = request.request_id
        request.bulk_since = self.steps
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
        request.bulk_since = request.bulk_until = request.bulk_owed = -1
        self._owed_takes.discard(request.request_id)
        if not self.members:
            self._times.clear()
            self._longest.clear()
            self._owed.clear()
            self._visits.clear()
            self._first_time_step = self.steps

    def owe(self, request: Request, step: int, takes: bool) -> None:
        """A member's next block event falls in bulk step `step`, at its place in the running list:
        owed, not a visit. `takes`: the event takes a block (else it registers a full one)."""
        request.bulk_owed = step
        heapq.heappush(self._owed, (step, request.running_seq, request.request_id))
        if takes:
            self._owed_takes.add(request.request_id)

    def next_owed(self, step: int, seq: int) -> tuple[Request, bool] | None:
        """The first member that owes an event before place `seq` of bulk step `step`, now owing
        nothing, and whether the event takes a block (else it registers one, and the member's fields
        are made exact); None when nothing is owed before that place."""
        owed = self._owed
        # (step, seq, id) > (step, seq): a place is not before itself.
        while owed and owed[0] < (step, seq):
            owed_step, owed_seq, rid = heapq.heappop(owed)
            request = self.members.get(rid)
            if request is not None and request.bulk_owed == owed_step and request.running_seq == owed_seq:
                request.bulk_owed = -1
                takes = rid in self._owed_takes
                if takes:
                    self._owed_takes.remove(rid)
                else:
                    self.sync(request)  # a full block is hashed over its tokens
                return request, takes
        return None

    def cancel_owed_takes(self) -> None:
        """Turn every owed block take back into a visit in the step it falls in."""
        for rid in self._owed_takes:
            request = self.members[rid]
            self.look_at(request, request.bulk_owed)
            request.bulk_owed = -1
        self._owed_takes.clear()

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
