"""Re-time a simulated run's schedule under new step durations, and read published figures off it.

The public fit moves cost-model parameters many times per second; simulating hundreds of runs
for each move would take hours. A `RunTrace` keeps what the scheduler decided and when; here new
step durations turn it into new timestamps:
- each replica runs its steps one after another as traced: a step starts when the previous one
  ends, plus the engine time owed after it (a server in the engine's process takes `api_hold_s`
  per request that arrived while the step ran) and the idle time the traced replica spent
  waiting for work, kept as it was;
- a request's time in the engine is measured on its replica's steps from the point it reached
  them: one that arrived a third of the way into a step is placed a third of the way into that
  step's new duration, one that arrived while the replica idled, as far into the idle time;
- the API server handles requests one at a time, `api_s` each, in the order it handled them in the
  traced run, and each then reaches the engine `api_latency_s` later (a latency requests spend
  side by side); its first token and finish come its time in the engine after that. A server that
  lets them go on in rounds (planner/sim/frontend.py) keeps the traced rounds: a round starts once
  the last one ended and its last request was sent, and all of it goes on when it ends;
- a gated request (closed loop, follow-up turn) is sent `think_s` after its gate finishes.
Fixed point of these is found in a few passes (gates only look back). Because the schedule is
kept, re-timing is exact for the durations it was traced with (a test checks it against the
simulator) and an approximation elsewhere: the fit re-simulates to refresh the schedule.

Why times in the engine are measured from where a request met the steps, not on one clock from
the start: with open-loop arrivals the steps of a busy replica run back to back for the whole
run, so 0.1 % longer steps put the 20,000th step 20 steps' worth later, and requests arriving
then would wait for all of it, where an engine admits them at its next step. Re-timed that way,
DataCrunch's Llama-3.3-70B at 1 request/s had its median TTFT raised 2.4x by steps 0.1 % slower,
so the fit saw every slower figure punished and could only make steps faster (a test's Poisson
run: 903 ms for 2 % slower steps, where a fresh simulation gives 15). Held to the steps they
met, requests wait what the new steps make them wait; a queue the trace had is served at the new
steps' pace, but one that slower steps would have lengthened is not (at the figures one round of
the public fit reached from its traced ones, Hopper's collectives 2.3x slower and engines' dense
shares up to 19 % lower, Poisson runs' E2E came out a median 10 % below a fresh simulation, the
offline and closed-loop runs' figures within 1 %): the fit simulates again to refresh the schedule.
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
    step_end_s: np.ndarray  # per step, on its replica's re-timed clock (gaps between them are ITLs)
    send_s: np.ndarray  # per request: when the client sent it
    first_token_s: np.ndarray  # per request, on the client's clock
    finish_s: np.ndarray


def retime(trace: RunTrace, step_s: np.ndarray, api_s: float, api_hold_s: float = 0.0,
           api_latency_s: float = 0.0) -> Timeline:
    """Timestamps of `trace`'s schedule when its steps take `step_s` seconds (module docstring)."""
    start, end = _step_times(trace, step_s, api_hold_s)
    first_step = trace.delivery_step[trace.first_delivery]
    last_step = trace.delivery_step[trace.last_delivery]
    # A request's first token and finish come as long after it reached the engine as the re-timed
    # steps make them: end of the step + (when it reached the engine - where it met the steps).
    met_first, met_last = _met(trace, start, end, first_step), _met(trace, start, end, last_step)
    # A gated request is sent once its gate has finished. Passes from the traced sends settle one
    # more link of every chain of gates each (a closed-loop client's requests one after another,
    # and requests after them in the API server's queue); at the traced durations the first pass
    # already finds them.
    gated, gate = trace.gate >= 0, np.maximum(trace.gate, 0)
    traced_finish = trace.step_end_s[last_step]
    send = np.where(gated, np.maximum(trace.due_s, traced_finish[gate] + trace.think_s), trace.due_s)
    through_api = _through_api_in_rounds if trace.api_rounds else _through_api
    for _ in range(2 * trace.gate_depth + 2):
        arrive = through_api(send, api_s, trace.arrived_s) + api_latency_s
        finish = end[last_step] + (arrive - met_last)
        new_send = np.where(gated, np.maximum(trace.due_s, finish[gate] + trace.think_s), trace.due_s)
        if np.array_equal(new_send, send):
            break
        send = new_send
    else:
        arrive = through_api(send, api_s, trace.arrived_s) + api_latency_s
        finish = end[last_step] + (arrive - met_last)
    return Timeline(end, send, end[first_step] + (arrive - met_first), finish)


def figures(trace: RunTrace, timeline: Timeline, metrics: list[Metric]) -> dict[Metric, float]:
    """The published figures of a re-timed run, computed as RunSummary computes them."""
    end, send = timeline.step_end_s, timeline.send_s
    first_token, finish = timeline.first_token_s, timeline.finish_s
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
    # once per pair of steps they lie between. The server's token-less events that the client timed
    # are gaps of about nothing, so many per request.
    pairs = trace.delivery_gaps
    gaps = (end[pairs.later] - end[pairs.earlier]) * 1e3
    kept = gaps != 0
    events = trace.stream.token_less_events
    if not events:
        return gaps[kept], pairs.count[kept]
    return np.append(gaps[kept], 0.0), np.append(pairs.count[kept], events * len(send))


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


def _through_api(send: np.ndarray, api_s: float, traced_arrival: np.ndarray) -> np.ndarray:
    """When each request leaves a single server that takes api_s per request, one at a time in the
    order they went through it in the traced run (part of the schedule kept: requests the finishes
    of one step released together keep their order)."""
    if not api_s:
        return send
    order = np.argsort(traced_arrival, kind="stable")
    k = np.arange(len(send))
    out = np.empty_like(send)
    # t_k = max(send_k, t_{k-1}) + a  =>  t_k = (k + 1) a + max_{j <= k} (send_j - j a)
    out[order] = (k + 1) * api_s + np.maximum.accumulate(send[order] - k * api_s)
    return out


def _through_api_in_rounds(send: np.ndarray, api_s: float, traced_arrival: np.ndarray) -> np.ndarray:
    """When each request leaves a server that handles its requests in the traced run's rounds (those
    that reached the engine at one instant), api_s each, one round after another: a round starts
    once the one before ended and its last request was sent, and all of it leaves when it ends."""
    if not api_s:
        return send
    order = np.argsort(traced_arrival, kind="stable")
    arrived = traced_arrival[order]
    starts = np.flatnonzero(np.concatenate(([True], arrived[1:] != arrived[:-1])))
    size = np.diff(np.append(starts, len(send)))
    last_sent = np.maximum.reduceat(send[order], starts)
    # end_r = max(end_{r-1}, last_sent_r) + size_r a  =>  end_r = C_r + max_{j <= r} (last_sent_j - C_{j-1}),
    # with C_r the handling time of rounds 0..r
    handled = np.cumsum(size) * api_s
    ends = handled + np.maximum.accumulate(last_sent - (handled - size * api_s))
    out = np.empty_like(send)
    out[order] = np.repeat(ends, size)
    return out


def _step_times(trace: RunTrace, step_s: np.ndarray, api_hold_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of every step on its replica's re-timed clock: back to back as traced, each
    followed by the engine time owed after it (its API holds re-priced at `api_hold_s`) and by the
    idle time the traced replica then spent waiting for work."""
    owed = trace.hold_s + trace.api_holds * (api_hold_s - trace.api_hold_s)
    start, end = np.empty_like(step_s), np.empty_like(step_s)
    for idx in trace.replica_steps:
        traced_start = trace.step_start_s[idx]
        idle = traced_start - np.concatenate(([0.0], (trace.step_end_s + trace.hold_s)[idx][:-1]))
        before = np.maximum(idle, 0.0) + np.concatenate(([0.0], owed[idx][:-1]))
        end[idx] = np.cumsum(before + step_s[idx])
        start[idx] = end[idx] - step_s[idx]
    return start, end


def _met(trace: RunTrace, start: np.ndarray, end: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Per request: where it reached the engine on the re-timed clock of the replica that ran
    `steps` (one step per request): as far into the step it arrived during as it was traced, by
    share of the step; as far past a step's end (into the hold or idle time after it) in seconds."""
    arrived = trace.arrived_s
    met = np.empty_like(arrived)
    replica = trace.step_replica[steps]
    for idx in trace.replica_steps:
        mine = np.flatnonzero(replica == trace.step_replica[idx[0]])
        if not len(mine):
            continue
        t_start, t_end = trace.step_start_s[idx], trace.step_end_s[idx]
        a = arrived[mine]
        j = np.searchsorted(t_start, a, side="right") - 1  # the last step that started by then
        at = np.maximum(j, 0)
        k = idx[at]
        traced = t_end[at] - t_start[at]
        share = np.divide(a - t_start[at], traced, out=np.zeros_like(a), where=traced > 0)
        during = start[k] + share * (end[k] - start[k])
        after = end[k] + (a - t_end[at])
        before = start[idx[0]] - (t_start[0] - a)  # before the replica's first step: as far before it
        met[mine] = np.where(j < 0, before, np.where(a < t_end[at], during, after))
    return met
