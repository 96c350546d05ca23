"""A lower bound on every request's time to first token in a capacity probe, before simulating it,
and so on the replicas a candidate needs under a TTFT target.

The analytic capacity (screen.py) is a throughput roofline; under a P99 TTFT target with Poisson
arrivals it is the prefill queue that binds, long before the roofline: a replica of Llama-3.1-70B
on two L40S is bounded at 2.7 req/s and meets a 1 s P99 TTFT at 0.46. This bound follows the
queue instead, for one replica of an engine that schedules in arrival order:

- Prompts finish in arrival order. The scheduler (engine/core/scheduler.py, policy fcfs) gives a
  step's token budget to the running requests first and admits waiting ones in order, the head
  blocking the rest; a prompt that does not fit the budget takes all of it, so no later prompt
  finishes its prefill before an earlier one (a preempted one goes back to the queue's head).
- Steps run one after another, and a step that computes p prompt tokens lasts at least p x tau,
  tau the least time per prompt token, attention and sampling aside, of any prefill step the cost
  model prices: attention, the LM head, decodes, overheads and copies only add to a step.
- Request m computes at least its prompt without a shared prefix (a prefix may be cached).

So request i's first token comes no sooner than the single-server FCFS queue of that prefill work
serves it (Lindley): C_i = max over j <= i of (a_j + tau x (n_j + ... + n_i)). Waiting for KV
blocks or request slots, preemption and the API server only delay it further. The bound applies to
the simulated probe itself: its arrival times are the seeded Poisson draw, scaled by 1 / rate, and
its prompts the seeded draw, so a probe ruled out here would miss its SLO if simulated.

Not for pipeline stages, attention data-parallel groups or disaggregated prefill (steps overlap),
priority scheduling (prompts overtake), or conversations (follow-ups arrive as the run goes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.costmodel import CostModel
from planner.playback import Replay
from planner.specs import SLO, Deployment
from planner.workload import Workload


@dataclass(frozen=True)
class ProbeRequests:
    """A capacity probe's requests as the simulator plays them, for any rate."""

    unit_arrival_s: np.ndarray  # arrival times at 1 request/s; at a rate r they are these / r
    prefill_tokens: np.ndarray  # the prompt tokens each computes at least, in arrival order

    @classmethod
    def of(cls, unit_rate: Replay, workload: Workload) -> ProbeRequests | None:
        """From the probe's replay at 1 request/s; None where arrivals depend on the run (conversations)."""
        if workload.conversation is not None or any(r.arrival_s is None for r in unit_rate.requests):
            return None
        prefix = workload.shared_prefix.prefix_tokens if workload.shared_prefix is not None else 0
        arrival = np.array([r.arrival_s for r in unit_rate.requests], dtype=float)
        tokens = np.array([len(r.prompt_token_ids) - (prefix if r.prefix_id is not None else 0)
                           for r in unit_rate.requests], dtype=float)
        order = np.argsort(arrival, kind="stable")
        return cls(arrival[order], tokens[order])


def applies(dep: Deployment) -> bool:
    """Whether the bound holds for this deployment's replicas (the module's docstring says why not)."""
    return (dep.pipeline_parallel == 1 and dep.attention_data_parallel == 1 and dep.disaggregation is None
            and dep.knobs.policy == "fcfs")


def least_prefill_s_per_token(cm: CostModel, chunk_tokens: int) -> float:
    """tau: the least time per prompt token over prefill steps of 1 .. chunk_tokens tokens, without
    their attention and sampling nothing. A step's attention depends on how its tokens split into
    prompts (a 16k-token prompt attends over far more than eight of 2k), so it is left out; a chunk
    before a prompt's last reaches no LM head; every other operator grows with the step's tokens.
    Per-token cost falls as fixed costs spread over more tokens; the minimum is taken over doublings
    and the chunk itself, not assumed to lie at the chunk."""
    sizes = sorted({chunk_tokens, *(2**e for e in range(chunk_tokens.bit_length()) if 2**e <= chunk_tokens)})

    def per_token_s(n: int) -> float:
        operators = cm.prefill_breakdown(n, samples=False)
        return (sum(operators.values()) - operators["attention"]) / n

    return min(per_token_s(n) for n in sizes)


def ttft_floor_s(probe: ProbeRequests, rate_per_s: float, prefill_s_per_token: float) -> np.ndarray:
    """Each request's least TTFT at `rate_per_s`: its first token's completion in the FCFS queue of
    prefill work, less its arrival. Vectorised Lindley: with S the prefill times and cum their
    running sum, C_i = cum_i + max over j <= i of (a_j - cum_{j-1})."""
    arrival = probe.unit_arrival_s / rate_per_s
    work = probe.prefill_tokens * prefill_s_per_token
    cum = np.cumsum(work)
    return np.maximum.accumulate(arrival - (cum - work)) + cum - arrival


def misses_for_certain(floor_s: np.ndarray, slo: SLO) -> bool:
    """Whether so many requests' least TTFT exceeds the SLO's per-request TTFT limit that the probe's
    goodput share cannot reach the SLO's: the test SLOWatch and the summary apply."""
    limit_ms = slo.request_limits_ms().get("ttft")
    if limit_ms is None:
        return False
    missed = int(np.count_nonzero(floor_s * 1e3 > limit_ms))
    return (floor_s.size - missed) / floor_s.size < slo.goodput_share


def fewest_replicas(probe: ProbeRequests, prefill_s_per_token: float, slo: SLO, sized_rate_per_s: float,
                    at_least: int, at_most: int) -> int:
    """The fewest replicas k >= at_least whose probe, at sized_rate / k per replica, this bound does
    not rule out; at_most if even that one is. Fewer replicas mean a faster rate, hence waits no
    shorter (arrival gaps shrink with the rate): the ruled-out counts are those below the answer."""

    def ruled_out(k: int) -> bool:
        return misses_for_certain(ttft_floor_s(probe, sized_rate_per_s / k, prefill_s_per_token), slo)

    low = at_least
    if not ruled_out(low):
        return low
    high = low
    while ruled_out(high):  # the least count not ruled out lies above `low`: double to pass it
        if high >= at_most:
            return at_most
        low, high = high, min(2 * high, at_most)
    while high - low > 1:  # ruled_out(low) and not ruled_out(high)
        mid = (low + high) // 2
        low, high = (mid, high) if ruled_out(mid) else (low, mid)
    return high
