"""Before any simulation: what does not fit in memory, what misses the SLO even unloaded, and an
upper bound on what one replica can serve (hence a lower bound on replicas and cost)."""

from __future__ import annotations

from dataclasses import dataclass
import math

import numpy as np

from engine.config import ModelConfig
from engine.errors import InputError
from planner.costmodel import CostModel
from planner.costmodel.fitted import FittedModel
from planner.memory import GIB
from planner.playback import Replay, request_lengths
from planner.search.space import Candidate
from planner.search.ttft_bound import ProbeRequests, applies, fewest_replicas, least_prefill_s_per_token
from planner.specs import SLO
from planner.workload import Workload

# The analytic capacity is a roofline estimate, not a proof: mixed prefill/decode steps share
# weight reads that it charges twice, so a replica can beat it slightly. It is inflated by this
# factor before it is used to bound replicas and cost, so that pruning never drops a winner.
CAPACITY_SLACK = 1.5
# The most replicas a capacity search considers.
MAX_REPLICAS = 4096


@dataclass(frozen=True)
class Shape:
    """What the analytic screen needs to know about the drawn requests."""

    longest_tokens: int  # prompt + output of the longest request (its KV footprint)
    mean_prompt_tokens: float  # as submitted, follow-ups with their history
    mean_new_prompt_tokens: float  # excluding shared prefixes and history: the least prefill work
    mean_output_tokens: float
    requests_per_arrival: float  # a conversation's turns in a multi-turn workload (whose rate counts its starts), else 1
    new_prompt_tokens: np.ndarray
    prompt_tokens: np.ndarray

    @classmethod
    def of(cls, replay: Replay, workload: Workload) -> Shape:
        lengths = request_lengths(replay)
        prefix = workload.shared_prefix.prefix_tokens if workload.shared_prefix else 0
        new = np.array([
            len(r.new_prompt_token_ids) if r.parent_id else len(r.prompt_token_ids) - (prefix if r.prefix_id is not None else 0)
            for r in replay.requests
        ])
        prompts = np.array([p for p, _ in lengths.values()])
        totals = np.array([t for _, t in lengths.values()])
        return cls(
            longest_tokens=int(totals.max()),
            mean_prompt_tokens=float(prompts.mean()),
            mean_new_prompt_tokens=float(new.mean()),
            mean_output_tokens=float((totals - prompts).mean()),
            requests_per_arrival=len(replay.requests) / sum(r.parent_id is None for r in replay.requests),
            new_prompt_tokens=new,
            prompt_tokens=prompts,
        )


@dataclass(frozen=True)
class Screen:
    """What memory and the cost model found about one candidate. Exactly one of memory_problem,
    slo_problem and capacity_bound_per_s is set: it is out for memory, out for the SLO, or goes on."""

    memory_problem: str | None = None
    memory_shortfall_gib: float | None = None  # per GPU, for one longest request
    slo_problem: str | None = None
    slo_miss_ratio: float | None = None  # worst unloaded latency / its limit
    capacity_bound_per_s: float | None = None  # most requests/s one replica can serve, before CAPACITY_SLACK
    min_replicas: int = 1  # fewer cannot serve the sized rate: the inflated capacity, or the TTFT queue
    # Fewer replicas than this miss the TTFT target for certain (ttft_bound.py); None where it does not apply.
    ttft_min_replicas: int | None = None


def slo_limits_ms(slo: SLO) -> dict[str, tuple[float, float]]:
    """metric -> (tightest per-request or percentile limit, quantile of requests it binds)."""
    limits = {metric: (bound[0], max(bound[1], slo.goodput_share))
              for metric in ("ttft", "tpot") if (bound := slo.request_limit_ms(metric)) is not None}
    if slo.itl_p99_ms is not None:
        tpot = limits.get("tpot")
        limits["tpot"] = (min(slo.itl_p99_ms, tpot[0]) if tpot else slo.itl_p99_ms, 0.99)
    return limits


def screen_candidate(c: Candidate, model: ModelConfig, shape: Shape, slo: SLO, sized_rate_per_s: float,
                     fit: FittedModel | None = None, probe: ProbeRequests | None = None) -> Screen:
    """Drop what cannot hold one longest request or misses the SLO even unloaded; bound the rest,
    with the TTFT queue of `probe` (the candidate's capacity probe) where it applies."""
    m = c.memory
    if not m.fits:
        # What one longest request lacks per GPU: the weights' overflow plus that request's KV.
        need = shape.longest_tokens * m.kv_bytes_per_token_per_gpu / GIB
        return Screen(memory_problem=m.reason,
                      memory_shortfall_gib=max(0.0, need - max(m.kv_cache_gib, 0.0)) + max(0.0, -m.kv_cache_gib))
    try:
        cm = CostModel(model, c.hw, c.dep, fit=fit)
    except InputError as exc:  # e.g. pipeline stages beyond any interconnect of the profile
        return Screen(memory_problem=f"fits only as tp={c.dep.tensor_parallel} x pp={c.dep.pipeline_parallel}, but {exc}",
                      memory_shortfall_gib=0.0)
    choices = c.dep.knobs.choices  # a candidate's deployment is resolved (space.py)
    chunk, max_num_seqs = choices.max_num_batched_tokens, choices.max_num_seqs
    limits = slo_limits_ms(slo)

    # Unloaded latency is a floor: queueing and batching only add to it. Quantiles use the lower
    # order statistic and prompts without any cacheable prefix, so the floor stays a floor.
    ratios, misses = [], []
    disagg = c.dep.disaggregation
    if "ttft" in limits:
        limit, q = limits["ttft"]
        tokens = int(np.quantile(shape.new_prompt_tokens, q, method="lower"))
        ttft_ms = 1e3 * sum(cm.prefill_time_s(min(chunk, tokens - done), done) for done in range(0, tokens, chunk))
        if disagg is not None:  # then the transfer, and the decode instance's step that computes the last token
            ttft_ms += 1e3 * (_transfer_s(cm, tokens) + cm.decode_time_per_token_s(1, max(1, tokens - 1)))
        ratios.append(ttft_ms / limit)
        if ttft_ms > limit:
            misses.append(f"TTFT of the {q:.0%} request {ttft_ms:,.0f} ms > {limit:g}")
    if "tpot" in limits:
        limit, q = limits["tpot"]
        context = int(np.quantile(shape.prompt_tokens, q, method="lower"))
        tpot_ms = 1e3 * cm.decode_time_per_token_s(1, max(1, context))
        ratios.append(tpot_ms / limit)
        if tpot_ms > limit:
            misses.append(f"TPOT at batch 1 {tpot_ms:,.1f} ms > {limit:g}")
    if misses:
        return Screen(slo_problem="misses even unloaded (cost model): " + "; ".join(misses), slo_miss_ratio=max(ratios))

    # Capacity: each request costs its prefill at full-chunk efficiency plus its share of decode
    # steps at the largest batch that the KV cache, max_num_seqs and the TPOT limit allow.
    prefill_s_per_token = cm.prefill_time_s(chunk) / chunk
    context = max(1, int(shape.mean_prompt_tokens + shape.mean_output_tokens / 2))
    batch = max(1, min(max_num_seqs,
                       m.kv_cache_tokens // max(1, int(shape.mean_prompt_tokens + shape.mean_output_tokens))))
    if "tpot" in limits:
        limit_s = limits["tpot"][0] / 1e3
        lo, hi = 1, batch  # largest batch whose decode step fits the TPOT limit (monotone in batch)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cm.decode_time_per_token_s(mid, context) <= limit_s else (lo, mid - 1)
        batch = lo
    decode_s_per_token = cm.decode_time_per_token_s(batch, context) / batch
    prefill_s = shape.mean_new_prompt_tokens * prefill_s_per_token
    decode_s = shape.mean_output_tokens * decode_s_per_token
    if disagg is None:
        capacity = 1.0 / (prefill_s + decode_s)
    else:  # the slower pool bounds a replica; each request's prompt and decode run on instances of their own
        capacity = min(disagg.prefill_instances / prefill_s, disagg.decode_instances / decode_s)
    min_replicas = max(1, math.ceil(sized_rate_per_s / (capacity * CAPACITY_SLACK)))
    queue = None
    if probe is not None and applies(c.dep):
        queue = fewest_replicas(probe, least_prefill_s_per_token(cm, chunk), slo, sized_rate_per_s, 1, MAX_REPLICAS)
    return Screen(capacity_bound_per_s=capacity, min_replicas=max(min_replicas, queue or 1), ttft_min_replicas=queue)


def _transfer_s(cm: CostModel, prompt_tokens: int) -> float:
    """A prompt's KV from its prefill to its decode instance: engine copies and the link."""
    blocks = -(-(prompt_tokens - 1) // cm.copies.block_size_tokens)
    return cm.copies.send_s(blocks) + cm.copies.wire_s(blocks) + cm.copies.receive_s(blocks)
