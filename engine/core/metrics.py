"""Per-request latency metrics from a finished Request's timestamps, and per-step samples.

The engine (wall clock) and the simulator (SimPy time) stamp the same Request fields through the
same scheduler, so both compute TTFT, ITL, TPOT and E2E with this one function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import operator
from typing import NamedTuple

from engine.core.by_fields import PickledByFields
from engine.core.request import Request


class StepSample(NamedTuple):
    """One step of one replica, as scheduled: its batch and the cache right after allocation."""

    replica: int
    start_s: float
    end_s: float
    kv_cache_usage: float
    num_running: int  # requests in the batch
    num_waiting: int  # left in the queue
    num_batched_tokens: int


@dataclass(frozen=True)
class RequestMetrics(PickledByFields):
    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int
    queueing_s: float | None  # arrival to first scheduled step; None where unseen (a client's view)
    ttft_s: float  # arrival to first output token
    token_times: tuple[float, ...]  # when each output token was delivered (tokens delivered together share it)
    tpot_s: float  # mean time per output token after the first (0 with one token)
    e2e_s: float  # arrival to finish
    finish_reason: str | None
    num_preemptions: int

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Gaps between consecutive deliveries of output tokens, as benchmark clients measure ITL
        from the stream: tokens that arrive together (accepted drafts, a multi-step group) make one
        gap, not several zeros. (Distinct floats never differ by 0.0, so dropping zero gaps is
        dropping equal times.) A run's summary takes them from every request at once (planner/metrics.py)."""
        times = self.token_times
        return tuple(filter(None, map(operator.sub, times[1:], times)))

    @classmethod
    def from_request(cls, r: Request) -> RequestMetrics:
        if r.first_token_time is None or r.finish_time is None or r.first_scheduled_time is None:
            raise ValueError(f"request {r.request_id} has not produced a token and finished yet")
        return cls.from_token_times(
            r.request_id, r.arrival_time, r.num_prompt_tokens, r.token_times, r.finish_time,
            first_token_time=r.first_token_time, first_scheduled_time=r.first_scheduled_time,
            cached_prompt_tokens=r.num_cached_tokens, finish_reason=r.finish_reason, num_preemptions=r.num_preemptions,
        )

    @classmethod
    def from_token_times(
        cls,
        request_id: str,
        arrival_time: float,
        prompt_tokens: int,
        token_times: Sequence[float],
        finish_time: float,
        *,
        first_token_time: float | None = None,
        first_scheduled_time: float | None = None,
        cached_prompt_tokens: int = 0,
        finish_reason: str | None = None,
        num_preemptions: int = 0,
    ) -> RequestMetrics:
        """From one time per output token (tokens delivered together share it): the engine's
        stamps, or what a client saw arrive on a stream."""
        if not token_times:
            raise ValueError(f"request {request_id} has no output token: its latencies are undefined")
        times = tuple(token_times)
        return cls(
            request_id=request_id,
            arrival_time=arrival_time,
            prompt_tokens=prompt_tokens,
            output_tokens=len(times),
            cached_prompt_tokens=cached_prompt_tokens,
            queueing_s=None if first_scheduled_time is None else first_scheduled_time - arrival_time,
            ttft_s=(times[0] if first_token_time is None else first_token_time) - arrival_time,
            token_times=times,
            tpot_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0,
            e2e_s=finish_time - arrival_time,
            finish_reason=finish_reason,
            num_preemptions=num_preemptions,
        )
