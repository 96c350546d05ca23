"""The step loop, written once: propose drafts -> schedule -> execute -> update.

`LLM`, `engine bench`, calibration and the simulator's replicas all run this loop. They differ
only in the `Executor` and the clock it is given:

- the model runner (engine/runner.py) runs a step on the device; the clock is the wall clock,
  which has moved on by the time `execute` returns;
- the cost-model executor (planner/sim/executor.py) prices a step; the clock is SimPy's
  `env.now`, so it reports how long the step takes (`ExecutedStep.duration_s`) and the replica
  lets that much simulated time pass between `launch()` and `complete()`.

So a difference between engine and simulator is, by construction, a difference of executors,
which is what `serveplan validate` measures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

from engine.core.bulk_decodes import BulkShape
from engine.core.metrics import StepSample
from engine.core.request import Request
from engine.core.scheduler import RequestUpdate, Scheduler, SchedulerOutput
from engine.core.speculative import Proposer, SpecStats, draft_budget


class ExecutedStep(NamedTuple):
    # Per request that samples this step: its accepted drafts plus one sampled token.
    sampled: Mapping[str, Sequence[int]]
    # How long the step takes on a simulated clock; 0 for an executor that ran on the caller's
    # clock (the wall clock has moved on by itself).
    duration_s: float = 0.0


class Executor(Protocol):
    def execute(self, output: SchedulerOutput) -> ExecutedStep:
        """Run (or price) one step the scheduler planned: first its KV copies (`output.kv_transfers`,
        in order), then the forward pass of its scheduled requests."""
        ...

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop per-request state (block tables, sampler generators) of finished requests."""
        ...


class LaunchedStep(NamedTuple):
    """A step that has executed but whose results the scheduler has not taken yet."""

    output: SchedulerOutput
    executed: ExecutedStep
    start_s: float
    draft_rooms: Mapping[str, int]  # requests offered drafts: how many each could take
    num_proposed: Mapping[str, int]  # ... and how many the proposer gave


class StepLoop:
    """One engine's loop over its scheduler and executor.

    Hooks, set by whoever drives the loop: `on_step(output, sample)` after every step (run
    records, calibration), `on_finished(request)` for every request that finishes in a step.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        clock: Callable[[], float],
        *,
        proposer: Proposer | None = None,
        replica: int = 0,
    ) -> None:
        self.scheduler, self.executor, self.clock = scheduler, executor, clock
        self.proposer = proposer
        self.replica = replica
        k = scheduler.config.num_speculative_tokens
        if (proposer is None) != (k == 0):
            raise ValueError(
                f"num_speculative_tokens={k} needs a proposer, and a proposer needs num_speculative_tokens >= 1"
            )
        # Acceptance per draft position, accepted length, draft and verify time; None without speculation.
        self.spec_stats = SpecStats(k) if proposer is not None else None
        self.on_step: Callable[[SchedulerOutput, StepSample], None] | None = None
        self.on_finished: Callable[[Request], None] | None = None

    def step(self) -> list[RequestUpdate]:
        """One whole step on the caller's clock (the engine). An idle step still lets the executor
        forget requests that finished or were aborted since the last one."""
        launched = self.launch()
        return [] if launched is None else self.complete(launched)

    def run_until_idle(self) -> None:
        """Step until every request has finished, then drop their state from the executor."""
        while self.scheduler.has_unfinished_requests():
            self.step()
        self.step()

    def launch(self) -> LaunchedStep | None:
        """Propose drafts, schedule and execute; None when there is nothing to run."""
        propose_start = self.clock()
        rooms, proposed = self._propose() if self.proposer is not None else ({}, {})
        start = self.clock()
        output = self.scheduler.schedule(start)
        self._forget_finished(output)
        if self.spec_stats is not None:
            self.spec_stats.draft_s += start - propose_start
        if not output.has_work:
            return None
        return LaunchedStep(output, self.executor.execute(output), start, rooms, proposed)

    def complete(self, launched: LaunchedStep) -> list[RequestUpdate]:
        """Hand the step's sampled tokens to the scheduler at the clock's current time."""
        now = self.clock()
        output = launched.output
        updates = self.scheduler.update(output, launched.executed.sampled, now)
        if self.spec_stats is not None:
            self._record_speculation(launched, now)
        if self.on_step is not None:
            self.on_step(output, self._sample(output, launched.start_s, now))
        if self.on_finished is not None:
            for update in updates:
                if update.finished:
                    self.on_finished(self.scheduler.get_request(update.request_id))
        return updates

    def run_bulk(self, first: BulkShape, durations_s: Sequence[float], start_s: float,
                 before_s: float) -> tuple[int, float]:
        """Steps of bulk decodes only (Scheduler.bulk_run), back to back from `start_s`: the i-th has the
        shape `first` grown by i tokens a request and lasts durations_s[i], as the executor priced it
        ahead. Each is scheduled and updated as launch() and complete() do, on a clock that the caller
        keeps (the simulator's). Stops at a step that is not certain to be one, or that would not end
        before `before_s`; returns how many ran and when the last ended."""
        scheduler, now, ran = self.scheduler, start_s, 0
        n = first.num_requests
        for duration in durations_s:
            end = now + duration
            if not end < before_s or not scheduler.bulk_steps_ahead():
                break
            output = scheduler.schedule(now)
            expected = BulkShape(n, first.context_tokens + ran * n, first.max_context_len + ran)
            if output.scheduled or output.kv_transfers is not None or output.bulk_decodes != expected:
                raise RuntimeError(f"step {ran} of a bulk run is not {expected}: Scheduler.bulk_run promised "
                                   "the same bulk decodes only, each a token longer a step")
            self._forget_finished(output)
            scheduler.update(output, {}, end)
            if self.on_step is not None:
                self.on_step(output, self._sample(output, now, end))
            now, ran = end, ran + 1
        return ran, now

    def _forget_finished(self, output: SchedulerOutput) -> None:
        """The executor (and proposer) drop the state of requests that finished since the last step."""
        if output.finished_request_ids:
            self.executor.forget(output.finished_request_ids)
            if self.proposer is not None:
                self.proposer.forget(output.finished_request_ids)

    def _sample(self, output: SchedulerOutput, start_s: float, end_s: float) -> StepSample:
        return StepSample(self.replica, start_s, end_s, output.kv_cache_usage, output.num_running, output.num_waiting,
                          output.total_num_scheduled_tokens)

    def _propose(self) -> tuple[dict[str, int], dict[str, int]]:
        assert self.proposer is not None
        k = self.scheduler.config.num_speculative_tokens
        rooms: dict[str, int] = {}
        drafting: list[Request] = []
        for request in self.scheduler.running:
            if room := draft_budget(request, k):
                rooms[request.request_id] = room
                drafting.append(request)
        if not drafting:
            return rooms, {}
        proposals = self.proposer.propose(drafting, list(rooms.values()))
        for request in drafting:
            request.spec_token_ids = proposals.get(request.request_id, [])
        return rooms, {rid: len(tokens) for rid, tokens in proposals.items()}

    def _record_speculation(self, launched: LaunchedStep, now: float) -> None:
        stats = self.spec_stats
        assert stats is not None
        scheduled = launched.output.scheduled
        if any(s.num_draft_tokens for s in scheduled):
            stats.verify_s += now - launched.start_s
            stats.num_steps += 1
        sampled = launched.executed.sampled
        for s in scheduled:
            room = launched.draft_rooms.get(s.request_id)
            if room is None or not s.samples:
                continue
            # The scheduler may cut drafts to fit its token budget: then only those had room.
            if s.num_draft_tokens < launched.num_proposed.get(s.request_id, 0):
                room = s.num_draft_tokens
            if room:
                stats.record(room, s.num_draft_tokens, len(sampled[s.request_id]) - 1)
