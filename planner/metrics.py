"""Serving metrics: one summary for a simulated run and for a measured engine run.

Both runs drive the same `engine.core` scheduler, which stamps the same Request fields
(with `env.now` or the wall clock), so both feed this module the same raw material — a
`RunRecord` — and get the same `RunSummary`, field for field. That is what makes
engine-vs-simulator comparisons meaningful.

Conventions: latencies in ms from seconds; percentiles interpolate linearly between order
statistics (numpy's default, as vLLM's benchmark does). Rates come twice: `throughput` is the
benchmark client's definition (completed requests and tokens over the run, first arrival to last
finish), which published figures use; `steady_state` excludes the warm-up (the batch filling)
and the drain (after the last request was admitted, when no work waits), so that a short run's
tail does not pass for a slow server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
import itertools
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engine.core.kv_cache_manager import PrefixCacheStats
from engine.core.kv_tiers import TierStats
from engine.core.metrics import RequestMetrics, StepSample
from planner.specs import SLO

TIMESERIES_POINTS = 120
# Published figures and prediction bands are grouped so: rates, time to first token, time between
# tokens (TPOT and ITL), whole-request latency.
MetricFamily = Literal["throughput", "ttft", "tpot_itl", "e2e"]
# How requests reach the server: "offline", every one at once with none held back (a benchmark
# client's request rate inf, a batch job); "online", over time, or from users who each wait for a
# reply. Predictions miss differently in the two, so their bands may differ (costmodel/fitted.py).
ArrivalRegime = Literal["online", "offline"]
# Whether the model routes each token to a few of many experts ("moe") or runs every weight on it
# ("dense"): the public data's MoE runs miss their predictions more widely, so their bands may differ.
Architecture = Literal["dense", "moe"]
# Whether a run's requests all have one prompt length and one output length ("fixed": a benchmark's
# random dataset at range ratio 0) or not ("varied": ShareGPT, uniform draws, traces, conversations):
# the public data's bursts of varied lengths miss their predictions in another direction than
# fixed-length ones, so their bands may differ.
LengthSpread = Literal["fixed", "varied"]


def length_spread(prompt_tokens: Sequence[int] | np.ndarray, output_tokens: Sequence[int] | np.ndarray) -> LengthSpread:
    """'fixed' where every request's prompt has one length and every output another, else 'varied'."""
    same = all(np.unique(np.asarray(side)).size <= 1 for side in (prompt_tokens, output_tokens))
    return "fixed" if same else "varied"


@dataclass(frozen=True)
class KVTransferRecord:
    """One request's prompt KV moved from its prefill to its decode instance (disaggregation)."""

    nbytes: float  # what each GPU of the prefill instance sends (a CPU engine: the whole)
    num_blocks: int
    send_s: float  # prefill engine time putting it on its way (0 for DMA/RDMA)
    wire_s: float  # on its way: from the end of the send to the decode side taking it in
    load_s: float  # decode engine time copying it into its cache (0 for DMA/RDMA)


@dataclass(frozen=True)
class ClientStream:
    """What a streaming client times of a response besides one event per token (the engine profile's
    `streaming`, for a client that times every SSE event, as `vllm bench serve` does):
    `token_less_events` events a request with no token, each an inter-token gap of about nothing; the
    first `silent_leading_tokens` tokens stream no event of their own (a harmony response's channel
    header under vLLM): the role chunk stands for the first, the others arrive with the next event."""

    token_less_events: int = 0
    silent_leading_tokens: int = 0


@dataclass
class RunRecord:
    """What one run (engine or simulator) produced, before any statistics."""

    requests: list[RequestMetrics]  # finished requests
    num_submitted: int
    num_replicas: int
    samples: list[StepSample]
    prefix_cache: PrefixCacheStats  # summed over replicas
    num_preemptions: int
    num_steps: int
    kv_cache_blocks_total: int  # all replicas
    flops: float | None = None  # work done by all GPUs, when known (the simulator knows)
    bytes: float | None = None
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # Seconds of the replicas' steps spent communicating, as one GPU (rank 0) sees it; None where
    # nothing measured or priced it (a one-process engine).
    comm_s: float | None = None
    offload: TierStats | None = None  # summed over replicas; None without offload tiers
    transfers: list[KVTransferRecord] | None = None  # None without disaggregation
    stopped: EarlyStop | None = None  # the run stopped once it could no longer meet its SLO
    # What the client timed of each request's stream besides its token chunks (simulate's
    # client_times_every_event); by default the gaps between token chunks alone.
    stream: ClientStream = field(default_factory=ClientStream)


class SLOWatch:
    """Counts the finished requests that miss their per-request limits, and says when so many have
    that the run's goodput share can no longer reach the SLO's, whatever the others do: with m of N
    missed, at most (N - m) / N are good. The same test `_goodput` applies at the end, so a run
    stopped here would have missed the SLO had it gone on."""

    def __init__(self, slo: SLO, num_requests: int) -> None:
        self.limits_ms = slo.request_limits_ms()
        self.required_share = slo.goodput_share
        self.num_requests = num_requests
        self.missed = 0

    def finished(self, r: RequestMetrics) -> bool:
        """Count `r`; True once the SLO is missed for certain."""
        if not meets_limits(r, self.limits_ms):
            self.missed += 1
        return (self.num_requests - self.missed) / self.num_requests < self.required_share


def meets_limits(r: RequestMetrics, limits_ms: dict[str, float]) -> bool:
    """Whether one request is good: its TTFT, TPOT and E2E each within its limit (SLO.request_limits_ms)."""
    observed_ms = {"ttft": r.ttft_s * 1e3, "tpot": r.tpot_s * 1e3, "e2e": r.e2e_s * 1e3}
    return all(observed_ms[m] <= limit for m, limit in limits_ms.items())


@dataclass(frozen=True)
class PricingBasis:
    """What the cost and utilisation figures rest on; None where the hardware gives no figure."""

    gpus: int
    price_usd_per_gpu_hour: float | None
    peak_flops_per_gpu: float | None
    bandwidth_bytes_per_s_per_gpu: float | None
    description: str


# --------------------------------------------------------------------------- the summary


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LatencyStats(_Out):
    count: int = Field(description="Values summarised (requests, or gaps for ITL)")
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float


class Throughput(_Out):
    """The benchmark client's definition (vllm bench serve's): completed over first arrival to last finish."""

    requests_per_s: float
    input_tokens_per_s: float = Field(description="Prompt tokens of finished requests per second")
    output_tokens_per_s: float
    total_tokens_per_s: float


class SLOCheck(_Out):
    target: str = Field(description="SLO field, e.g. ttft_p99_ms")
    limit_ms: float
    observed_ms: float
    met: bool


class SteadyState(_Out):
    """Rates over the run's steady window: after the warm-up (the median service time, while the
    batch fills) and before the drain (after the last request was admitted, the batch only
    empties). A deployment that keeps up serves what arrives, so its rates are the arrivals'; one
    whose queue grows serves its capacity, so its rates are what finished in the window."""

    window_start_s: float = Field(description="Start of the window, seconds after the first arrival (= warm-up)")
    window_end_s: float = Field(description="End of the window, seconds after the first arrival (the last admission)")
    warmup_s: float = Field(description="Excluded at the start: the median service time (admission to finish)")
    drain_s: float = Field(description="Excluded at the end: the last admission to the last finish")
    kept_up: bool = Field(description="The queue did not grow over the window (waiting time rose by less than 0.1 s per "
                                      "second of arrivals): it served what arrived")
    requests_per_s: float = Field(description="Served requests per second: arrivals in the window if it kept up, else "
                                              "finishes in the window")
    input_tokens_per_s: float = Field(description="Prompt tokens per second, on the same basis")
    output_tokens_per_s: float = Field(description="Output tokens per second: of the window's arrivals if it kept up, "
                                                   "else delivered in the window")
    mean_batch_requests: float | None = Field(description="Mean requests per engine step inside the window (None: steps unseen)")
    usd_per_million_output_tokens: float | None = Field(description="Hourly cost over the steady output-token rate")
    basis: str = Field(description="How the window was found and which rates it used")


class Goodput(_Out):
    requests_per_s: float = Field(description="Requests meeting every per-request limit, per second")
    share: float = Field(description="Their share of finished requests")
    request_limits_ms: dict[str, float] = Field(description="Per-request limits applied (metric -> ms); empty: no SLO")
    checks: list[SLOCheck] = Field(description="Each percentile target against the observed distribution")
    required_share: float | None
    slo_met: bool | None = Field(description="Every target and the goodput share met; None without an SLO")


class EarlyStop(_Out):
    """Why and when a run stopped before every request finished (a plan's capacity probe)."""

    at_s: float = Field(description="Simulated seconds after the first arrival")
    missed_requests: int = Field(description="Finished requests over a per-request limit by then")
    basis: str


class Cost(_Out):
    usd_per_hour: float | None = Field(description="GPUs x price per GPU-hour")
    usd_per_million_input_tokens: float | None = Field(
        description="Whole hourly cost over the input-token rate (an alternative view, not additive with output)"
    )
    usd_per_million_output_tokens: float | None = Field(description="Whole hourly cost over the output-token rate")
    usd_per_million_total_tokens: float | None
    usd_per_request: float | None
    basis: str = Field(description="What the figures assume")


class Utilisation(_Out):
    mfu: float | None = Field(description="FLOPs done / (duration x peak x GPUs) at the compute dtype's peak")
    bandwidth_utilisation: float | None = Field(description="Bytes moved / (duration x bandwidth x GPUs)")
    busy_share: float = Field(description="Share of replica-time spent in steps (the rest is idle)")
    communication_share: float | None = Field(
        None, description="Share of step time spent in collectives (tensor, expert, context parallelism) and pipeline "
        "hand-offs: priced by the cost model (simulator) or timed on rank 0, waiting for the other ranks included "
        "(a parallel engine on the CPU); null where there is none to report")


class TimeSeries(_Out):
    """Deployment-wide state on a regular grid (mean over each bin; last value carried through idle bins)."""

    t_s: list[float]
    kv_cache_usage: list[float] = Field(description="Mean over replicas, 0-1")
    num_running: list[float] = Field(description="Summed over replicas")
    num_waiting: list[float] = Field(description="Summed over replicas")
    batch_tokens: list[float] = Field(description="Tokens per step, summed over replicas")


class TransferStats(_Out):
    """Prompt KV moved from prefill to decode instances, per request."""

    requests: int = Field(description="Transfers (requests with more than one prompt token)")
    mb_per_request_mean: float = Field(description="Mean MB (1e6 bytes) each GPU of a prefill instance sent per request")
    total_ms: LatencyStats = Field(description="send + wire + load")
    send_ms: LatencyStats = Field(description="Prefill engine time putting the KV on its way (0 for DMA/RDMA)")
    wire_ms: LatencyStats = Field(description="From the end of the send to the decode side taking it in, link queueing included")
    load_ms: LatencyStats = Field(description="Decode engine time copying it into its cache (0 for DMA/RDMA)")


class OffloadStats(_Out):
    """The offload tiers over the run, all replicas."""

    host_hit_tokens: int = Field(description="Prompt tokens found in the host tier (copied back, not recomputed)")
    disk_hit_tokens: int = Field(description="Prompt tokens found in the disk tier")
    stored_blocks: int = Field(description="Blocks copied device -> host: evicted prefix blocks and swap-outs")
    demoted_blocks: int = Field(description="Blocks the host tier moved on to disk")
    loaded_host_blocks: int = Field(description="Blocks copied host -> device: prefix hits and swap-ins")
    loaded_disk_blocks: int
    swapped_out_requests: int = Field(description="Preemptions by swap")
    swap_out_refusals: int = Field(description="Preemptions that recomputed because the host tier had no room")


class PricedStep(_Out):
    """One representative step of a simulated run, priced by the cost model the run used and split by
    operator: where a step's time goes (weight reads, attention, collectives, host)."""

    kind: Literal["decode", "prefill"]
    requests: int = Field(description="Requests in the step: the run's mean batch (decode) or one prompt (prefill)")
    tokens: int = Field(description="Decode: context tokens of each request; prefill: prompt tokens computed")
    total_ms: float = Field(description="The step's time: the sum of its operators")
    operators_ms: dict[str, float] = Field(description="Operator -> ms (CostModel.breakdown's keys; zeros left out)")
    basis: str = Field(description="Why this step represents the run")


class PredictionInterval(_Out):
    """Where a measurement of each figure would likely fall: the prediction times the P10 and P90 of
    measured / predicted over figures the fit that predicted them never saw (published runs whose
    source it left out, or a team's own bench runs one at a time)."""

    coverage: float = Field(description="Nominal share of measurements inside (held-out coverage in basis)")
    ranges: dict[str, tuple[float, float]] = Field(description="'ttft_ms.p99' -> (low, high), in the figure's unit")
    basis: str = Field(description="The fit and the held-out figures the band comes from, and its caveats")


class RunSummary(_Out):
    """The stable result schema of `serveplan simulate --json`, `serveplan engine bench --json` and
    `serveplan bench --url` (source 'endpoint': measured by a client from the stream)."""

    source: Literal["simulator", "engine", "endpoint"]
    model: str
    hardware: str
    workload: str
    num_requests: int = Field(description="Requests submitted")
    num_finished: int
    finish_reasons: dict[str, int]
    duration_s: float = Field(description="First arrival to last finish")
    ttft_ms: LatencyStats
    itl_ms: LatencyStats
    tpot_ms: LatencyStats
    e2e_ms: LatencyStats
    queueing_ms: LatencyStats = Field(description="Arrival to first scheduled step")
    throughput: Throughput = Field(description="Benchmark-client definition: completed over first arrival to last finish")
    steady_state: SteadyState | None = Field(
        None, description="Rates without warm-up and drain; None when the run is too short to have a steady window")
    mean_batch_requests: float | None = Field(
        None, description="Mean requests per engine step over all steps of all replicas (None: steps unseen, a client's view)")
    goodput: Goodput
    prefix_cache_hit_rate: float = Field(description="Prompt tokens served from the prefix cache (device memory and "
                                         "any offload tier) / prompt tokens looked up")
    prefix_cache_hit_tokens: int
    preemptions: int
    num_steps: int
    kv_cache_blocks_total: int = Field(description="KV blocks of all replicas")
    utilisation: Utilisation
    cost: Cost
    timeseries: TimeSeries
    assumptions: dict[str, object] = Field(description="Every figure the run's timing model used")
    offload: OffloadStats | None = Field(None, description="Offload tiers (host, disk, swap); None without them")
    kv_transfer: TransferStats | None = Field(None, description="Prefill-to-decode KV transfers; None without disaggregation")
    prediction_interval: PredictionInterval | None = Field(
        None, description="Simulated GPU runs with a public fit: the likely range of each figure if measured")
    step_time: list[PricedStep] | None = Field(
        None, description="Simulated runs: a decode step at the run's mean batch and a prefill chunk of its mean "
                          "prompt, split by operator; None for measured runs")
    stopped_early: EarlyStop | None = Field(
        None, description="The run stopped once it had missed its SLO for certain (a plan's capacity probe): every "
                          "figure covers only the requests finished by then, the slow ones still running left out")

    def band_caution(self) -> str | None:
        """When this run meets its SLO as predicted but its band of held-out errors (prediction_interval)
        reaches past a target: which targets and how far, the one wording every front end shows. None
        without an SLO met, without a band, or with the whole band within every target."""
        band = self.prediction_interval
        if band is None or not self.goodput.slo_met:
            return None
        past = []
        for c in self.goodput.checks:
            metric, quantile, _ = c.target.split("_")  # "ttft_p99_ms" -> the figure "ttft_ms.p99"
            high = band.ranges.get(f"{metric}_ms.{quantile}", (0.0, 0.0))[1]
            if high > c.limit_ms:
                past.append(f"{c.target} up to {high:,.1f} ms > {c.limit_ms:,.0f}")
        if not past:
            return None
        return (f"it meets the SLO as predicted, but the {band.coverage:.0%} band of held-out errors reaches past "
                f"{len(past)} target{'s' if len(past) > 1 else ''} ({'; '.join(past)}): measured, it could miss it")

    def figure(self, path: str) -> float | None:
        """The figure at a dotted path, e.g. 'ttft_ms.p99', 'throughput.output_tokens_per_s',
        'preemptions': the one way reports, comparisons and validations read a summary; None where
        the run lacks the figure or its section."""
        value: object = self
        for part in path.split("."):
            value = getattr(value, part)
            if value is None:  # a section the run does not have (kv_transfer without disaggregation)
                return None
        if not isinstance(value, (int, float)):
            raise TypeError(f"{path!r} is a section of the summary, not a figure")
        return float(value)


def latency_stats_ms(values_s: Sequence[float] | np.ndarray) -> LatencyStats:
    v = np.asarray(values_s, dtype=float) * 1e3
    if v.size == 0:
        return LatencyStats(count=0, mean=0.0, p50=0.0, p90=0.0, p95=0.0, p99=0.0, max=0.0)
    p50, p90, p95, p99 = np.percentile(v, [50, 90, 95, 99]).tolist()
    return LatencyStats(count=int(v.size), mean=float(v.mean()), p50=p50, p90=p90, p95=p95, p99=p99, max=float(v.max()))


def streamed_deliveries(first: np.ndarray, tokens: np.ndarray, silent_leading_tokens: int) -> np.ndarray:
    """Which deliveries send an event of their own: `tokens` each, grouped by request in order,
    `first` marking each request's first. Not one carrying only tokens 2..`silent_leading_tokens` of
    its request, unless it is the request's last (ClientStream)."""
    after = np.cumsum(tokens)
    before = after - tokens - np.maximum.accumulate(np.where(first, after - tokens, 0))
    last = np.r_[first[1:], True]
    return ~((before >= 1) & (before + tokens <= silent_leading_tokens) & ~last)


def inter_token_gaps(reqs: Sequence[RequestMetrics], silent_leading_tokens: int = 0) -> np.ndarray:
    """Every request's ITLs (RequestMetrics.itl_s), in request order, as one array: the gaps of all
    their token times at once, less those between one request's last token and the next one's first.
    Tokens 2..`silent_leading_tokens` of a request, but its last, stream no event (ClientStream)."""
    counts = np.fromiter((len(r.token_times) for r in reqs), dtype=np.int64, count=len(reqs))
    times = np.fromiter(itertools.chain.from_iterable(r.token_times for r in reqs), dtype=float,
                        count=int(counts.sum()))  # sized once: millions of tokens in a long run
    if silent_leading_tokens > 1:
        starts = np.cumsum(counts) - counts
        first = np.zeros(times.size, dtype=bool)
        first[starts] = True
        streams = streamed_deliveries(first, np.ones(times.size, dtype=np.int64), silent_leading_tokens)
        times, counts = times[streams], np.add.reduceat(streams, starts)
    gaps = np.diff(times)
    within = np.ones(gaps.size, dtype=bool)
    within[np.cumsum(counts)[:-1] - 1] = False
    gaps = gaps[within]
    return gaps[gaps != 0.0]


def summarize(
    record: RunRecord,
    *,
    source: Literal["simulator", "engine", "endpoint"],
    model: str,
    hardware: str,
    workload: str,
    slo: SLO | None,
    pricing: PricingBasis,
    assumptions: dict[str, object],
) -> RunSummary:
    reqs = record.requests
    if not reqs:
        raise ValueError("no request finished: nothing to summarise")
    start = min(r.arrival_time for r in reqs)
    end = max(r.arrival_time + r.e2e_s for r in reqs)
    duration = max(end - start, 1e-12)

    ttft = np.array([r.ttft_s for r in reqs])
    tpot = np.array([r.tpot_s for r in reqs if r.output_tokens > 1])
    e2e = np.array([r.e2e_s for r in reqs])
    itl = inter_token_gaps(reqs, record.stream.silent_leading_tokens)
    if record.stream.token_less_events:
        itl = np.concatenate([itl, np.zeros(record.stream.token_less_events * len(reqs))])
    stats = {
        "ttft_ms": latency_stats_ms(ttft),
        "itl_ms": latency_stats_ms(itl),
        "tpot_ms": latency_stats_ms(tpot),
        "e2e_ms": latency_stats_ms(e2e),
        # A client cannot see when the server first scheduled a request: no values, count 0.
        "queueing_ms": latency_stats_ms([r.queueing_s for r in reqs if r.queueing_s is not None]),
    }
    input_tokens = sum(r.prompt_tokens for r in reqs)
    output_tokens = sum(r.output_tokens for r in reqs)
    throughput = Throughput(
        requests_per_s=len(reqs) / duration,
        input_tokens_per_s=input_tokens / duration,
        output_tokens_per_s=output_tokens / duration,
        total_tokens_per_s=(input_tokens + output_tokens) / duration,
    )
    return RunSummary(
        source=source,
        model=model,
        hardware=hardware,
        workload=workload,
        num_requests=record.num_submitted,
        num_finished=len(reqs),
        finish_reasons=dict(sorted(record.finish_reasons.items())),
        duration_s=duration,
        **stats,
        throughput=throughput,
        steady_state=steady_state(reqs, record.samples, pricing),
        mean_batch_requests=float(np.mean([s.num_running for s in record.samples])) if record.samples else None,
        goodput=_goodput(reqs, stats, slo, duration, stopped=record.stopped is not None),
        prefix_cache_hit_rate=record.prefix_cache.hit_rate,
        prefix_cache_hit_tokens=record.prefix_cache.all_hit_tokens,
        preemptions=record.num_preemptions,
        num_steps=record.num_steps,
        kv_cache_blocks_total=record.kv_cache_blocks_total,
        utilisation=_utilisation(record, pricing, duration),
        cost=_cost(pricing, throughput),
        timeseries=_timeseries(record.samples, record.num_replicas, start, end),
        assumptions=assumptions,
        offload=_offload(record.offload, record.prefix_cache),
        kv_transfer=_transfers(record.transfers),
        stopped_early=record.stopped,
    )


def _offload(tiers: TierStats | None, prefix: PrefixCacheStats) -> OffloadStats | None:
    if tiers is None:
        return None
    return OffloadStats(host_hit_tokens=prefix.host_hit_tokens, disk_hit_tokens=prefix.disk_hit_tokens, **asdict(tiers))


def _transfers(records: list[KVTransferRecord] | None) -> TransferStats | None:
    if records is None:
        return None
    return TransferStats(
        requests=len(records),
        mb_per_request_mean=float(np.mean([r.nbytes for r in records]) / 1e6) if records else 0.0,
        total_ms=latency_stats_ms([r.send_s + r.wire_s + r.load_s for r in records]),
        send_ms=latency_stats_ms([r.send_s for r in records]),
        wire_ms=latency_stats_ms([r.wire_s for r in records]),
        load_ms=latency_stats_ms([r.load_s for r in records]),
    )


# A window with fewer finished requests than this says little; the summary then has no steady state.
MIN_STEADY_REQUESTS = 10
# Seconds of waiting added per second of arrivals beyond which the queue is growing: the
# deployment serves less than 90 % of what arrives.
MAX_BACKLOG_SLOPE = 0.1


def steady_state(reqs: Sequence[RequestMetrics], samples: Sequence[StepSample], pricing: PricingBasis) -> SteadyState | None:
    """Rates over [first arrival + warm-up, last admission], or None when that window holds fewer
    than MIN_STEADY_REQUESTS requests. Admission is the first scheduled step (a client, which cannot
    see it, uses the arrival); the warm-up is the median time from admission to finish."""
    arrival = np.array([r.arrival_time for r in reqs])
    admitted = arrival + np.array([r.queueing_s or 0.0 for r in reqs])
    finish = arrival + np.array([r.e2e_s for r in reqs])
    first = arrival + np.array([r.ttft_s for r in reqs])
    prompt = np.array([r.prompt_tokens for r in reqs])
    output = np.array([r.output_tokens for r in reqs])
    t0 = float(arrival.min())
    warmup = float(np.median(finish - admitted))
    start, end = t0 + warmup, float(admitted.max())
    arrived = (arrival >= start) & (arrival <= end)
    done = (finish >= start) & (finish <= end)
    if end <= start or min(int(arrived.sum()), int(done.sum())) < MIN_STEADY_REQUESTS:
        return None
    window = end - start
    # Kept up: the queue did not grow over the window. Waiting (for admission; a client sees only
    # TTFT) that rises with arrival time at MAX_BACKLOG_SLOPE seconds per second or more means at
    # least that share of the arrivals was left waiting.
    waited = np.array([r.ttft_s if r.queueing_s is None else r.queueing_s for r in reqs])
    kept_up = float(np.polyfit(arrival[arrived], waited[arrived], 1)[0]) < MAX_BACKLOG_SLOPE
    if kept_up:
        requests, input_tokens, output_tokens = int(arrived.sum()), int(prompt[arrived].sum()), float(output[arrived].sum())
        rule = "it kept up, so these are the rates of the requests that arrived in it"
    else:
        # Output tokens by delivery: the first at its TTFT, the rest at each later delivery, shared
        # evenly among the deliveries (tokens delivered together, e.g. accepted drafts, count at once).
        output_tokens = 0.0
        for r, t_first in zip(reqs, first, strict=True):
            times = t_first + np.concatenate(([0.0], np.cumsum(r.itl_s)))
            output_tokens += r.output_tokens / times.size * int(((times >= start) & (times <= end)).sum())
        prefilled = (first >= start) & (first <= end)
        requests, input_tokens = int(done.sum()), int(prompt[prefilled].sum())
        rule = "its queue grew, so these are what it finished and delivered in it: its capacity"
    in_window = [s.num_running for s in samples if start <= s.start_s <= end]
    output_per_s = output_tokens / window
    per_hour = pricing.gpus * pricing.price_usd_per_gpu_hour if pricing.price_usd_per_gpu_hour is not None else None
    return SteadyState(
        window_start_s=warmup, window_end_s=end - t0, warmup_s=warmup, drain_s=float(finish.max()) - end, kept_up=kept_up,
        requests_per_s=requests / window, input_tokens_per_s=input_tokens / window, output_tokens_per_s=output_per_s,
        mean_batch_requests=float(np.mean(in_window)) if in_window else None,
        usd_per_million_output_tokens=per_hour / (output_per_s * 3600) * 1e6 if per_hour is not None and output_per_s > 0
        else None,
        basis=f"window {warmup:,.1f}-{end - t0:,.1f} s after the first arrival: the warm-up (median service time, "
              f"admission to finish) and the drain (after the last admission) left out; {rule}",
    )


def _goodput(reqs: list[RequestMetrics], stats: dict[str, LatencyStats], slo: SLO | None, duration: float, *,
             stopped: bool = False) -> Goodput:
    """Goodput of the finished requests; a run stopped by its SLOWatch missed the SLO whatever they show."""
    if slo is None:
        return Goodput(requests_per_s=len(reqs) / duration, share=1.0, request_limits_ms={}, checks=[],
                       required_share=None, slo_met=None)
    limits = slo.request_limits_ms()
    good = sum(meets_limits(r, limits) for r in reqs)
    checks = []
    for target, limit in slo.targets.items():
        metric, quantile, _ = target.split("_")
        observed = getattr(stats[f"{metric}_ms"], quantile)
        checks.append(SLOCheck(target=target, limit_ms=limit, observed_ms=observed, met=observed <= limit))
    share = good / len(reqs)
    return Goodput(
        requests_per_s=good / duration,
        share=share,
        request_limits_ms=limits,
        checks=checks,
        required_share=slo.goodput_share,
        slo_met=not stopped and share >= slo.goodput_share and all(c.met for c in checks),
    )


def _utilisation(record: RunRecord, pricing: PricingBasis, duration: float) -> Utilisation:
    capacity_s = duration * pricing.gpus
    mfu = bw = None
    if record.flops is not None and pricing.peak_flops_per_gpu:
        mfu = record.flops / (capacity_s * pricing.peak_flops_per_gpu)
    if record.bytes is not None and pricing.bandwidth_bytes_per_s_per_gpu:
        bw = record.bytes / (capacity_s * pricing.bandwidth_bytes_per_s_per_gpu)
    busy = sum(sample.end_s - sample.start_s for sample in record.samples)
    comm = None if record.comm_s is None or not busy else record.comm_s / busy
    return Utilisation(mfu=mfu, bandwidth_utilisation=bw, busy_share=min(1.0, busy / (duration * record.num_replicas)),
                       communication_share=comm)


def _cost(pricing: PricingBasis, tp: Throughput) -> Cost:
    if pricing.price_usd_per_gpu_hour is None:
        return Cost(usd_per_hour=None, usd_per_million_input_tokens=None, usd_per_million_output_tokens=None,
                    usd_per_million_total_tokens=None, usd_per_request=None, basis=pricing.description)
    per_hour = pricing.gpus * pricing.price_usd_per_gpu_hour

    def per_million(rate_per_s: float) -> float | None:
        return per_hour / (rate_per_s * 3600) * 1e6 if rate_per_s > 0 else None

    return Cost(
        usd_per_hour=per_hour,
        usd_per_million_input_tokens=per_million(tp.input_tokens_per_s),
        usd_per_million_output_tokens=per_million(tp.output_tokens_per_s),
        usd_per_million_total_tokens=per_million(tp.total_tokens_per_s),
        usd_per_request=per_hour / (tp.requests_per_s * 3600) if tp.requests_per_s > 0 else None,
        basis=pricing.description,
    )


def _timeseries(samples: list[StepSample], num_replicas: int, start: float, end: float) -> TimeSeries:
    if not samples:
        return TimeSeries(t_s=[], kv_cache_usage=[], num_running=[], num_waiting=[], batch_tokens=[])
    edges = np.linspace(start, end, TIMESERIES_POINTS + 1)
    width = len(StepSample._fields)
    table = np.fromiter(itertools.chain.from_iterable(samples), dtype=float, count=width * len(samples)).reshape(-1, width)
    data, replica = table[:, 2:], table[:, 0]  # end_s, kv, running, waiting, tokens; replica
    totals = np.zeros((TIMESERIES_POINTS, 4))
    for k in range(num_replicas):
        rows = data[replica == k]
        if not rows.size:
            continue
        bins = np.clip(np.searchsorted(edges, rows[:, 0], side="right") - 1, 0, TIMESERIES_POINTS - 1)
        counts = np.bincount(bins, minlength=TIMESERIES_POINTS)
        # Floats: bincount with weights (numpy's stubs type every bincount as integers).
        means: np.ndarray = np.stack([np.bincount(bins, rows[:, j], minlength=TIMESERIES_POINTS) for j in range(1, 5)],
                                     axis=1)
        filled = counts > 0
        means[filled] /= counts[filled, None]
        # An idle replica keeps its last state (but runs no tokens) until its next step.
        last = np.maximum.accumulate(np.where(filled, np.arange(TIMESERIES_POINTS), -1))
        carried = np.where(last[:, None] >= 0, means[np.maximum(last, 0)], 0.0)
        carried[~filled, 3] = 0.0
        totals += carried
    totals[:, 0] /= num_replicas
    mid = ((edges[:-1] + edges[1:]) / 2 - start).tolist()
    return TimeSeries(
        t_s=[round(t, 6) for t in mid],
        kv_cache_usage=[round(v, 6) for v in totals[:, 0]],
        num_running=[round(v, 3) for v in totals[:, 1]],
        num_waiting=[round(v, 3) for v in totals[:, 2]],
        batch_tokens=[round(v, 3) for v in totals[:, 3]],
    )
