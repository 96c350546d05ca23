"""Re-time a simulated run's schedule under new step durations, and read published figures off it.

The public fit moves cost-model parameters many times per second; simulating hundreds of runs
for each move would take hours. A `RunTrace` keeps what the scheduler decided; here new step
durations turn it into new timestamps with the same rules the simulator follows:
- the API server handles requests one at a time, `api_s` each, in the order they were sent, and
  each then reaches the engine `api_latency_s` later (a latency requests spend side by side);
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


_PERCENTILES = (("p50", 50.0), ("p99", 99.0))


def summary_value(summary: RunSummary, metric: Metric) -> float:
    value = summary.figure(".".join(SUMMARY_FIELD[metric]))
    assert value is not None  # latencies and rates are always set
    return value


@dataclass(frozen=True)
class Timeline:
    step_end_s: np.ndarray
    send_s: np.ndarray  # per request: when the client sent it


def retime(trace: RunTrace, step_s: np.ndarray, api_s: float, api_hold_s: float = 0.0,
           api_latency_s: float = 0.0) -> Timeline:
    """Timestamps of `trace`'s schedule when its steps take `step_s` seconds."""
    gated = trace.gate >= 0
    last = trace.last_delivery
    send = trace.due_s.copy()
    end = np.zeros(trace.num_steps)
    # Each pass settles one more link of every chain of gates (a closed-loop client's requests
    # one after another): the longest chain bounds the passes.
    for _ in range(trace.gate_depth + 1):
        admitted = np.full(trace.num_steps, -np.inf)
        np.maximum.at(admitted, trace.first_step, _through_api(send, api_s) + api_latency_s)
        end = _step_ends(step_s, trace.api_holds * api_hold_s, admitted, trace.replica_steps)
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
    first_token = end[trace.delivery_step[trace.first_delivery]]
    finish = end[trace.delivery_step[trace.last_delivery]]
    out: dict[Metric, float] = {}
    duration = max(finish.max() - send.min(), 1e-12)
    stats: dict[str, dict[str, float]] = {}
    for metric in metrics:
        group, field = SUMMARY_FIELD[metric]
        if group == "throughput":
            tokens = {"requests_per_s": len(send), "output_tokens_per_s": trace.output_tokens.sum(),
                      "input_tokens_per_s": trace.prompt_tokens.sum(),
                      "total_tokens_per_s": trace.prompt_tokens.sum() + trace.output_tokens.sum()}[field]
            out[metric] = float(tokens / duration)
            continue
        if group not in stats:
            wanted = {SUMMARY_FIELD[m][1] for m in metrics if SUMMARY_FIELD[m][0] == group}
            ms, count = _latencies_ms(group, trace, end, send, first_token, finish)
            stats[group] = _stats(ms, count, wanted)
        out[metric] = stats[group][field]
    return out


def _latencies_ms(group: str, trace: RunTrace, end: np.ndarray, send: np.ndarray, first_token: np.ndarray,
                  finish: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """A latency's values in ms, and how many times each occurs (None: once each)."""
    if group == "ttft_ms":
        return (first_token - send) * 1e3, None
    if group == "e2e_ms":
        return (finish - send) * 1e3, None
    if group == "tpot_ms":
        many = trace.output_tokens > 1
        return (finish[many] - first_token[many]) / (trace.output_tokens[many] - 1) * 1e3, None
    # ITL: gaps between a request's consecutive deliveries (its tokens arrive in chunks), priced
    # once per pair of steps they lie between.
    pairs = trace.delivery_gaps
    gaps = (end[pairs.later] - end[pairs.earlier]) * 1e3
    kept = gaps != 0
    return gaps[kept], pairs.count[kept]


def _stats(values: np.ndarray, count: np.ndarray | None, fields: set[str]) -> dict[str, float]:
    """Mean and linear-interpolation percentiles (numpy's default, as the benchmark clients compute
    them) of `values`, each repeated `count` times (None: once)."""
    wanted = [(field, q) for field, q in _PERCENTILES if field in fields]
    out: dict[str, float] = {}
    if count is None:
        if wanted:
            out.update(zip([f for f, _ in wanted], map(float, np.percentile(values, [q for _, q in wanted])), strict=True))
        if "mean" in fields:
            out["mean"] = float(values.mean())
        return out
    order = np.argsort(values, kind="stable")
    ranked, weight = values[order], count[order]
    ends = np.cumsum(weight)  # the sorted repeated values: ranked[k] fills positions ends[k-1] .. ends[k] - 1
    n = int(ends[-1])
    for field, q in wanted:
        share = q / 100
        rank = (n - 1) * share  # numpy's virtual index for the linear method
        low = int(np.floor(rank))
        a, b = ranked[np.searchsorted(ends, [low, min(low + 1, n - 1)], side="right")]
        out[field] = _lerp(float(a), float(b), rank - low)
    if "mean" in fields:
        out["mean"] = float(np.dot(ranked, weight) / n)
    return out


def _lerp(a: float, b: float, t: float) -> float:
    """numpy.percentile's interpolation between neighbours a <= b, the same expression."""
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


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


def _step_ends(step_s: np.ndarray, hold_s: np.ndarray, admitted: np.ndarray,
               replica_steps: tuple[np.ndarray, ...]) -> np.ndarray:
    """end_i = max(end of the replica's previous step + the hold after it, arrival of what step i
    admits) + step_s_i."""
    end = np.empty_like(step_s)
    for idx in replica_steps:
        d = step_s[idx]
        before = np.concatenate(([0.0], hold_s[idx][:-1]))  # the hold after the previous step
        done = np.cumsum(d + before)
        # end_i = D_i + max_{k <= i} (A_k - (D_k - d_k)), D counting the holds
        end[idx] = done + np.maximum.accumulate(admitted[idx] - (done - d))
    return end
