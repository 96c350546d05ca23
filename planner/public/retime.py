"""Re-time a simulated run's schedule under new step durations, and read published figures off it.

The public fit moves cost-model parameters many times per second; simulating hundreds of runs
for each move would take hours. A `RunTrace` keeps what the scheduler decided; here new step
durations turn it into new timestamps with the same rules the simulator follows:
- the API server handles requests one at a time, `api_s` each, in the order they were sent;
- a server in the engine's process also takes `api_hold_s` from the step loop per request that
  arrived while it ran: the replica's next step starts that much later (the traced counts);
- a step starts when the previous step of its replica ends, and not before the requests it admits
  have reached the engine;
- a gated request (closed loop, follow-up turn) is sent `think_s` after its gate finishes.
Fixed point of these is found in a few passes (gates only look back). Because the schedule is
kept, re-timing is exact for the durations it was traced with (a test checks it against the
simulator) and an approximation elsewhere: the fit re-simulates to refresh the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.metrics import RunSummary
from planner.public.data import Metric
from planner.sim.trace import RunTrace

# Where each published figure sits in a RunSummary (median = P50: numpy's linear percentile, as
# vLLM's and SGLang's benchmark clients compute them).
SUMMARY_FIELD: dict[str, tuple[str, str]] = {
    "request_throughput": ("throughput", "requests_per_s"),
    "output_throughput": ("throughput", "output_tokens_per_s"),
    "input_throughput": ("throughput", "input_tokens_per_s"),
    "total_throughput": ("throughput", "total_tokens_per_s"),
    **{f"{m}_{stat}": (f"{m}_ms", {"mean": "mean", "median": "p50", "p99": "p99"}[stat])
       for m in ("ttft", "tpot", "itl", "e2e") for stat in ("mean", "median", "p99")},
}


def summary_value(summary: RunSummary, metric: Metric) -> float:
    value = summary.figure(".".join(SUMMARY_FIELD[metric]))
    assert value is not None  # latencies and rates are always set
    return value


@dataclass(frozen=True)
class Timeline:
    step_end_s: np.ndarray
    send_s: np.ndarray  # per request: when the client sent it


def retime(trace: RunTrace, step_s: np.ndarray, api_s: float, api_hold_s: float = 0.0) -> Timeline:
    """Timestamps of `trace`'s schedule when its steps take `step_s` seconds."""
    gated = trace.gate >= 0
    last = _last_delivery(trace)
    send = trace.due_s.copy()
    end = np.zeros(trace.num_steps)
    # Each pass settles one more link of every chain of gates (a closed-loop client's requests
    # one after another): the longest chain bounds the passes.
    for _ in range(_chain_depth(trace.gate) + 1):
        admitted = np.full(trace.num_steps, -np.inf)
        np.maximum.at(admitted, trace.first_step, _through_api(send, api_s))
        end = _step_ends(step_s, trace.api_holds * api_hold_s, admitted, trace.step_replica)
        if not gated.any():
            break
        finish = end[trace.delivery_step[last]]
        new_send = np.where(gated, np.maximum(trace.due_s, finish[np.maximum(trace.gate, 0)] + trace.think_s), trace.due_s)
        if np.array_equal(new_send, send):
            break
        send = new_send
    return Timeline(end, send)


def figures(trace: RunTrace, timeline: Timeline, metrics: list[Metric]) -> dict[Metric, float]:
    """The published figures of a re-timed run, computed as RunSummary computes them."""
    end, send = timeline.step_end_s, timeline.send_s
    first = np.searchsorted(trace.delivery_request, np.arange(len(send)))
    last = _last_delivery(trace)
    first_token = end[trace.delivery_step[first]]
    finish = end[trace.delivery_step[last]]
    out: dict[Metric, float] = {}
    duration = max(finish.max() - send.min(), 1e-12)
    values: dict[str, np.ndarray] = {}
    for metric in metrics:
        group, field = SUMMARY_FIELD[metric]
        if group == "throughput":
            tokens = {"requests_per_s": len(send), "output_tokens_per_s": trace.output_tokens.sum(),
                      "input_tokens_per_s": trace.prompt_tokens.sum(),
                      "total_tokens_per_s": trace.prompt_tokens.sum() + trace.output_tokens.sum()}[field]
            out[metric] = float(tokens / duration)
            continue
        if group not in values:
            values[group] = _latencies(group, trace, end, send, first_token, finish)
        v = values[group] * 1e3
        out[metric] = float(v.mean()) if field == "mean" else float(np.percentile(v, 50 if field == "p50" else 99))
    return out


def _latencies(group: str, trace: RunTrace, end: np.ndarray, send: np.ndarray, first_token: np.ndarray,
               finish: np.ndarray) -> np.ndarray:
    if group == "ttft_ms":
        return first_token - send
    if group == "e2e_ms":
        return finish - send
    if group == "tpot_ms":
        many = trace.output_tokens > 1
        return (finish[many] - first_token[many]) / (trace.output_tokens[many] - 1)
    # ITL: gaps between a request's consecutive deliveries (its tokens arrive in chunks).
    t = end[trace.delivery_step]
    same = trace.delivery_request[1:] == trace.delivery_request[:-1]
    gaps = (t[1:] - t[:-1])[same]
    return gaps[gaps != 0]


def _chain_depth(gate: np.ndarray) -> int:
    """Longest run of requests each gated by the one before (gates always point back)."""
    depth = [0] * len(gate)
    for i, g in enumerate(gate.tolist()):  # a gate was submitted before the request it releases
        if g >= 0:
            depth[i] = depth[g] + 1
    return max(depth, default=0)


def _last_delivery(trace: RunTrace) -> np.ndarray:
    return np.searchsorted(trace.delivery_request, np.arange(len(trace.due_s)), side="right") - 1


def _through_api(send: np.ndarray, api_s: float) -> np.ndarray:
    """When each request leaves a single FIFO server that takes api_s per request."""
    if not api_s:
        return send
    order = np.argsort(send, kind="stable")
    k = np.arange(len(send))
    out = np.empty_like(send)
    # t_k = max(send_k, t_{k-1}) + a  =>  t_k = (k + 1) a + max_{j <= k} (send_j - j a)
    out[order] = (k + 1) * api_s + np.maximum.accumulate(send[order] - k * api_s)
    return out


def _step_ends(step_s: np.ndarray, hold_s: np.ndarray, admitted: np.ndarray, replica: np.ndarray) -> np.ndarray:
    """end_i = max(end of the replica's previous step + the hold after it, arrival of what step i
    admits) + step_s_i."""
    end = np.empty_like(step_s)
    for r in np.unique(replica):
        idx = np.flatnonzero(replica == r)
        d = step_s[idx]
        before = np.concatenate(([0.0], hold_s[idx][:-1]))  # the hold after the previous step
        done = np.cumsum(d + before)
        # end_i = D_i + max_{k <= i} (A_k - (D_k - d_k)), D counting the holds
        end[idx] = done + np.maximum.accumulate(admitted[idx] - (done - d))
    return end
