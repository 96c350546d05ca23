"""Per-request latency metrics from a finished Request's timestamps, and per-step samples.

The engine (wall clock) and the simulator (SimPy time) stamp the same Request fields through the
same scheduler, so both compute TTFT, ITL, TPOT and E2E with this one function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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
class RequestMetrics:
    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int
    queueing_s: float  # arrival to first scheduled step
    ttft_s: float  # arrival to first output token
    itl_s: tuple[float, ...]  # gaps between consecutive deliveries of output tokens
    tpot_s: float  # mean time per output token after the first (0 with one token)
    e2e_s: float  # arrival to finish
    finish_reason: str | None
    num_preemptions: int

    @classmethod
    def from_request(cls, r: Request) -> RequestMetrics:
        if r.first_token_time is None or r.finish_time is None or r.first_scheduled_time is None:
            raise ValueError(f"request {r.request_id} has not produced a token and finished yet")
        times = r.token_times
        # ITL per delivered chunk, as benchmark clients measure it from the stream: tokens that
        # arrive together (accepted drafts, a multi-step group) make one gap, not several zeros.
        itl = tuple(b - a for a, b in zip(times, times[1:]) if b != a)
        return cls(
            request_id=r.request_id,
            arrival_time=r.arrival_time,
            prompt_tokens=r.num_prompt_tokens,
            output_tokens=r.num_output_tokens,
            cached_prompt_tokens=r.num_cached_tokens,
            queueing_s=r.first_scheduled_time - r.arrival_time,
            ttft_s=r.first_token_time - r.arrival_time,
            itl_s=itl,
            tpot_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0,
            e2e_s=r.finish_time - r.arrival_time,
            finish_reason=r.finish_reason,
            num_preemptions=r.num_preemptions,
        )
