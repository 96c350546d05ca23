"""When each drawn request goes in: the replay rules every driver shares.

The simulator (SimPy time) and `serveplan engine bench` (wall clock) both replay a workload
through a `Playback`, so they submit the same requests with the same prompts at the same
moments relative to what the server does:
- open loop: each conversation's first turn arrives at its drawn time; a client capped at
  `max_concurrency` in flight holds a due request until an earlier conversation ends
  (`vllm bench serve --max-concurrency`; with every request due at once, a closed loop);
- closed loop: `concurrency` users; each starts its next conversation `think_time_s` after its
  previous one ended;
- a follow-up turn goes in `think_time_s` after its parent finishes, its prompt being the
  parent's prompt, the parent's output and the new user message.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pathlib import Path

from engine.core import WindowGroups, blocks_to_hold
from engine.errors import InputError
from planner.metrics import ArrivalRegime, LengthSpread, length_spread
from planner.workload import (ClosedLoopArrivals, Workload, WorkloadRequest, build_prompt, context_error, draw, follow_ups,
                              load_trace)


@dataclass(frozen=True)
class Replay:
    """The requests a driver plays, whether drawn from a Workload or read from a trace."""

    name: str
    requests: list[WorkloadRequest]
    concurrency: int | None  # closed-loop users; None: open loop (every first turn has an arrival time)
    description: str
    max_concurrency: int | None = None  # open loop: most conversations in flight (None: no cap)

    @classmethod
    def of(cls, workload: Workload, vocab_size: int | None = None, max_model_len: int | None = None) -> Replay:
        """`max_model_len`: refuse a request beyond it before drawing any token id."""
        arrival = workload.arrival
        return cls(
            name=workload.name,
            requests=draw(workload, vocab_size, max_model_len),
            concurrency=arrival.concurrency if isinstance(arrival, ClosedLoopArrivals) else None,
            description=f"workload {workload.name!r} ({arrival.kind}, seed {workload.seed})",
            max_concurrency=getattr(arrival, "max_concurrency", None),
        )

    @property
    def regime(self) -> ArrivalRegime:
        """'offline' where every request is offered at once and none is held back, else 'online'
        (planner.metrics.ArrivalRegime): from the requests themselves, so a drawn workload, a trace
        and a measured run's requests are told apart the same way."""
        if self.concurrency is not None or self.max_concurrency is not None:
            return "online"
        starts = {r.arrival_s for r in self.requests if r.arrival_s is not None}  # follow-up turns: None
        return "offline" if len(starts) <= 1 else "online"

    @property
    def lengths(self) -> LengthSpread:
        """'fixed' where every request has one prompt length and one output length, else 'varied'
        (planner.metrics.LengthSpread); a conversation's follow-up turns grow their prompts: varied."""
        if any(r.is_follow_up for r in self.requests):
            return "varied"
        return length_spread([len(r.prompt_token_ids) for r in self.requests], [r.output_tokens for r in self.requests])

    @classmethod
    def from_trace(cls, path: str | Path, vocab_size: int | None = None, seed: int = 0,
                   max_model_len: int | None = None) -> Replay:
        kwargs = {} if vocab_size is None else {"vocab_size_tokens": min(vocab_size, 30_000)}
        return cls(name=Path(path).stem, requests=load_trace(path, seed=seed, max_model_len=max_model_len, **kwargs),
                   concurrency=None,
                   description=f"trace {path} (recorded arrival times, synthetic token ids, seed {seed})")


@dataclass(frozen=True)
class Submission:
    due_s: float
    request: WorkloadRequest
    prompt_token_ids: tuple[int, ...]


class Playback:
    def __init__(self, replay: Replay) -> None:
        requests, concurrency = replay.requests, replay.concurrency
        if not requests:
            raise InputError("workload", "0 requests", "needs at least one request")
        roots = [r for r in requests if r.parent_id is None]
        open_loop = concurrency is None
        if any((r.arrival_s is None) == open_loop for r in roots):
            raise InputError(
                "workload.arrival", "mixed", "either every first turn has an arrival time (open loop) or none (closed loop)"
            )
        self.num_requests = len(requests)
        self._children = follow_ups(requests)
        self._prompts: dict[str, tuple[int, ...]] = {}  # of submitted requests whose follow-up is pending
        # Conversations in flight at once: closed-loop users, or an open-loop client's cap.
        self._concurrency = concurrency if concurrency is not None else replay.max_concurrency
        # Open loop: every root has an arrival time (checked above).
        self._queue = deque(sorted(roots, key=lambda r: r.arrival_s or 0.0) if open_loop else roots)

    def start(self) -> list[Submission]:
        """The submissions known before anything runs: every open-loop arrival (the first
        max_concurrency of them under a cap), or the first turn of each closed-loop user at t=0."""
        n = len(self._queue) if self._concurrency is None else min(self._concurrency, len(self._queue))
        first = [self._queue.popleft() for _ in range(n)]
        return [self._submission(r.arrival_s or 0.0, r, r.prompt_token_ids) for r in first]

    def finished(self, request_id: str, output_token_ids: Sequence[int], now_s: float) -> list[Submission]:
        """What to submit because `request_id` finished at `now_s`."""
        child = self._children.pop(request_id, None)
        if child is not None:
            parent_prompt = self._prompts.pop(request_id)
            prompt = tuple(build_prompt(parent_prompt, output_token_ids, child.new_prompt_token_ids))
            return [self._submission(now_s + child.think_time_s, child, prompt)]
        if self._concurrency is not None and self._queue:
            nxt = self._queue.popleft()
            # A closed-loop user thinks first; a capped open-loop request goes when it is due and a slot is free.
            due = now_s + nxt.think_time_s if nxt.arrival_s is None else max(nxt.arrival_s, now_s)
            return [self._submission(due, nxt, nxt.prompt_token_ids)]
        return []

    def _submission(self, due_s: float, request: WorkloadRequest, prompt: tuple[int, ...]) -> Submission:
        if request.request_id in self._children:
            self._prompts[request.request_id] = prompt
        return Submission(due_s, request, prompt)


def private_requests(replay: Replay, block_size: int, served: Sequence[Sequence[int]] = ()) -> frozenset[str]:
    """The requests whose KV blocks no other request can share (Request.private_blocks): prompts
    of at least a block whose first block no other prompt here, nor anything `served` before, starts
    with, and that no follow-up turn extends. Block keys chain over every token before them, so a
    prompt can match another's block only where their first blocks match."""
    children = follow_ups(replay.requests)
    firsts: dict[tuple[int, ...], int] = {}
    for tokens in [*(r.prompt_token_ids for r in replay.requests if r.parent_id is None), *served]:
        if len(tokens) >= block_size:
            first = tuple(tokens[:block_size])
            firsts[first] = firsts.get(first, 0) + 1
    return frozenset(r.request_id for r in replay.requests
                     if r.parent_id is None and r.request_id not in children and len(r.prompt_token_ids) >= block_size
                     and firsts[tuple(r.prompt_token_ids[:block_size])] == 1)


def request_lengths(replay: Replay) -> dict[str, tuple[int, int]]:
    """request id -> (prompt tokens, prompt + output tokens) as the request will be submitted.

    Follow-up prompts are known only at run time, but their lengths are not: the parent's
    prompt and output plus the new message."""
    lengths: dict[str, tuple[int, int]] = {}
    for r in replay.requests:  # a parent comes before its follow-ups
        prompt = len(r.prompt_token_ids) if r.parent_id is None else (
            lengths[r.parent_id][1] + len(r.new_prompt_token_ids))
        lengths[r.request_id] = (prompt, prompt + r.output_tokens)
    return lengths


def check_lengths(replay: Replay, max_model_len: int, num_blocks: int, block_size: int, where: str,
                  window: WindowGroups | None = None, max_step_tokens: int = 1) -> None:
    """Reject, before anything runs, a request the server could never take, naming it. `window`: the
    KV cache's sliding-window groups, whose blocks a request holds beside its own, up to the window
    and a step's `max_step_tokens` tokens."""
    for request_id, (prompt, total) in request_lengths(replay).items():
        output = total - prompt
        if total > max_model_len:
            raise context_error(request_id, prompt, output, max_model_len)
        blocks = blocks_to_hold(total - 1, block_size, window, max_step_tokens)
        if blocks > num_blocks:
            raise InputError(f"request {request_id}", f"{prompt} prompt + {output} output tokens",
                             f"needs {blocks} KV blocks but {where} holds {num_blocks}")
