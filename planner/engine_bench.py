"""Play a workload against the real engine in real time and summarise it like the simulator.

The engine's own step loop (engine.core.StepLoop: propose -> schedule -> execute -> update, so
speculative engines draft here too) runs on the wall clock while the same `Playback` as the
simulator's submits requests at their due times, so a measured run and a simulated one differ
only in the executor. Torch is imported by the caller that builds the LLM.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import platform
import time
from typing import TYPE_CHECKING

from engine.core import KVCacheManager, PrefixCacheStats, Request, SamplingParams, Scheduler, SchedulerOutput, SchedulerStats, StepLoop
from engine.core.metrics import RequestMetrics, StepSample
from planner.metrics import KVTransferRecord, PricingBasis, RunRecord, RunSummary, summarize
from planner.playback import Playback, Replay, Submission, check_lengths
from planner.specs import SLO

if TYPE_CHECKING:
    import torch

    from engine.disagg import DisaggregatedLLM
    from engine.disagg.worker import WorkerStats
    from engine.llm import LLM


class _Due:
    """Submissions the playback has released, by due time (run seconds since t0)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Submission]] = []
        self._order = itertools.count()  # ties keep release order

    def __bool__(self) -> bool:
        return bool(self._heap)

    @property
    def next_s(self) -> float:
        return self._heap[0][0]

    def add(self, subs: list[Submission]) -> None:
        for sub in subs:
            heapq.heappush(self._heap, (sub.due_s, next(self._order), sub))

    def submit_ready(self, llm: LLM | DisaggregatedLLM, t0: float) -> None:
        """Hand every submission now due to the engine. Arrival is when the client sent it, even
        if a step was running then: that wait is queueing."""
        while self._heap and self.next_s <= llm.now() - t0:
            sub = heapq.heappop(self._heap)[2]
            wr = sub.request
            llm.add_request(list(sub.prompt_token_ids), SamplingParams(max_tokens=wr.output_tokens, ignore_eos=True),
                            request_id=wr.request_id, arrival_time=t0 + sub.due_s)


def bench_engine(llm: LLM, replay: Replay, *, model_name: str, slo: SLO | None = None) -> tuple[RunSummary, RunRecord]:
    scheduler, loop = llm.scheduler, llm.loop
    cfg = scheduler.config
    check_lengths(replay, cfg.max_model_len, scheduler.kv_cache_manager.num_blocks, cfg.block_size, where="the engine")
    playback = Playback(replay)
    due = _Due()

    warm_up(llm)
    comm_stats = getattr(llm.executor, "comm_stats", None)  # a tensor-parallel engine's ranks time their collectives
    if comm_stats is not None:
        comm_stats()  # start counting at the run's start
    samples: list[StepSample] = []
    finished: list[RequestMetrics] = []  # each request as it finishes; the scheduler drops it
    t0 = llm.now()  # run time 0; requests arrive at t0 + due_s on the engine's clock

    def on_step(output: SchedulerOutput, sample: StepSample) -> None:
        samples.append(sample._replace(start_s=sample.start_s - t0, end_s=sample.end_s - t0))

    def on_finished(request: Request) -> None:
        finished.append(RequestMetrics.from_request(request))
        assert request.finish_time is not None
        due.add(playback.finished(request.request_id, request.output_token_ids, request.finish_time - t0))
        scheduler.pop_finished(request.request_id)  # memory follows live requests, not all served

    loop.on_step, loop.on_finished = on_step, on_finished
    try:
        due.add(playback.start())
        while due or scheduler.has_unfinished_requests():
            due.submit_ready(llm, t0)
            if not scheduler.has_unfinished_requests():
                time.sleep(max(0.0, due.next_s - (llm.now() - t0)))
                continue
            loop.step()
    finally:
        loop.on_step = loop.on_finished = None

    stats = scheduler.stats()
    record = RunRecord(
        requests=finished,
        num_submitted=playback.num_requests,
        num_replicas=1,
        samples=samples,
        prefix_cache=stats.prefix_cache,
        num_preemptions=stats.num_preemptions,
        num_steps=stats.num_steps,
        kv_cache_blocks_total=scheduler.kv_cache_manager.num_blocks,
        finish_reasons={k: v for k, v in stats.num_finished.items() if v},
        comm_s=sum(comm_stats()[0][0].values()) if comm_stats is not None else None,
        offload=stats.offload,
    )
    device = describe_device(llm.device)
    engine = llm.engine_config
    assumptions: dict[str, object] = {
        "device": device,
        "dtype": engine.dtype,
        "tensor_parallel": engine.tensor_parallel,
        "expert_parallel": engine.expert_parallel,
        "kv_cache_blocks": scheduler.kv_cache_manager.num_blocks,
        "block_size_tokens": cfg.block_size,
        "max_model_len": cfg.max_model_len,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs,
        "enable_chunked_prefill": cfg.enable_chunked_prefill,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "policy": cfg.policy,
        "preemption_mode": cfg.preemption_mode,
        "kv_offload": None if llm.host_blocks == 0 else {"host_blocks": llm.host_blocks, "disk_blocks": llm.disk_blocks},
        "workload": replay.description,
        "output_lengths": "drawn by the workload and generated exactly (ignore_eos)",
        "timing": "wall clock of this process; a step is timed from schedule() to the end of execute()",
    }
    pricing = PricingBasis(gpus=engine.tensor_parallel, price_usd_per_gpu_hour=None, peak_flops_per_gpu=None,
                           bandwidth_bytes_per_s_per_gpu=None, description=f"measured on {device}; no price attached")
    summary = summarize(record, source="engine", model=model_name, hardware=device, workload=replay.name, slo=slo,
                        pricing=pricing, assumptions=assumptions)
    return summary, record


def warm_up(llm: LLM) -> None:
    """The largest prefill plus a few decodes through the engine's executor before the clock
    starts, as a server does at start-up: the first passes over fresh memory pay page faults and
    allocator growth (glibc raises its mmap threshold only after large frees) that steady serving
    does not. A private scheduler over the same executor keeps the warm-up out of the engine's own
    requests, statistics and prefix cache."""
    cfg = dataclasses.replace(llm.scheduler.config, enable_prefix_caching=False, num_speculative_tokens=0)
    num_blocks = llm.scheduler.kv_cache_manager.num_blocks
    scheduler = Scheduler(cfg, KVCacheManager(num_blocks, cfg.block_size, enable_prefix_caching=False))
    # The cache must hold every warm-up request at once: half of it for the prefill, the rest for
    # decodes of one block each (a request whose prompt and output fit one block).
    tokens = max(1, min(cfg.max_num_batched_tokens, cfg.max_model_len - 1, num_blocks * cfg.block_size // 2))
    decodes = max(0, min(4, cfg.max_num_seqs - 1, num_blocks - -(-tokens // cfg.block_size)))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    scheduler.add_request(Request("warm-up-prefill", [1 + i % 50 for i in range(tokens)], params, 0.0))
    for i in range(decodes):
        decode_params = SamplingParams(max_tokens=min(4, cfg.block_size, cfg.max_model_len - 1), ignore_eos=True)
        scheduler.add_request(Request(f"warm-up-decode-{i}", [1], decode_params, 0.0))
    StepLoop(scheduler, llm.executor, llm.now).run_until_idle()


def describe_device(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {torch.get_num_threads()} threads"


def bench_disaggregated(llm: DisaggregatedLLM, replay: Replay, *, model_name: str,
                        slo: SLO | None = None) -> tuple[RunSummary, RunRecord]:
    """`bench_engine` for prefill and decode workers behind their router: the same playback on the
    same clock (the workers stamp on the router's), summarised the same way, plus each request's
    KV transfer. Prefix-cache figures are the prefill workers' (where prompts are computed)."""
    max_len, num_blocks = llm.limits["decode"]
    check_lengths(replay, max_len, num_blocks, llm.block_size, where="a decode worker")
    playback = Playback(replay)
    due = _Due()

    # Warm-up through both workers (a long prefill, its transfer, a few decodes), then the
    # statistics so far, to leave out of the run's.
    warm = max(1, min(max_len - 8, llm.limits["prefill"][0] - 8, 512))
    llm.generate([[1 + i % 50 for i in range(warm)], *([[1 + i] for i in range(4)])], SamplingParams(max_tokens=4, ignore_eos=True))
    before = {(w.role, w.index): w for w in llm.stats()}
    t0 = llm.now()
    finished: list[str] = []
    reported = set(llm.outputs)  # the warm-up's
    due.add(playback.start())
    while due or llm.has_unfinished_requests():
        due.submit_ready(llm, t0)
        llm.poll(timeout_s=min(1.0, max(0.0, due.next_s - (llm.now() - t0))) if due else 1.0)
        for rid in [rid for rid in llm.outputs if rid not in reported]:
            reported.add(rid)
            finished.append(rid)
            out = llm.outputs[rid]
            m = out.metrics
            due.add(playback.finished(rid, out.token_ids, m.arrival_time + m.e2e_s - t0))
    after = llm.stats()
    prefill = [w for w in after if w.role == "prefill"]
    run = [_since(before[(w.role, w.index)], w) for w in after]
    outputs = [llm.outputs[rid] for rid in finished]
    record = RunRecord(
        requests=[o.metrics for o in outputs],
        num_submitted=playback.num_requests,
        num_replicas=len(after),
        samples=[s._replace(start_s=s.start_s - t0, end_s=s.end_s - t0) for w in after for s in w.samples if s.start_s >= t0],
        prefix_cache=sum((stats.prefix_cache for w, stats in zip(after, run, strict=True) if w.role == "prefill"),
                         PrefixCacheStats()),
        num_preemptions=sum(stats.num_preemptions for stats in run),
        num_steps=sum(stats.num_steps for stats in run),
        kv_cache_blocks_total=sum(w.num_kv_blocks for w in after),
        finish_reasons={k: v for k, v in _reasons(run[len(prefill):]).items() if v},
        transfers=[KVTransferRecord(o.transfer.nbytes, o.transfer.num_blocks, o.transfer.send_s, o.transfer.wire_s,
                                    o.transfer.load_s or 0.0) for o in outputs if o.transfer is not None],
    )
    device = describe_device_name()
    assumptions: dict[str, object] = {
        "device": device,
        "disaggregation": {"prefill_workers": len(prefill), "decode_workers": len(after) - len(prefill),
                           "transport": "shared memory on this machine (engine/disagg/transport.py)",
                           "rule": "prefill workers run each request for one token; its prompt's KV but the last token "
                                   "moves to a decode worker, which computes that token again; prefix-cache figures "
                                   "are the prefill workers'"},
        "kv_cache_blocks": [w.num_kv_blocks for w in after],
        "block_size_tokens": llm.block_size,
        "workload": replay.description,
        "output_lengths": "drawn by the workload and generated exactly (ignore_eos)",
        "timing": "wall clock, one clock for the router and every worker process",
    }
    pricing = PricingBasis(gpus=len(after), price_usd_per_gpu_hour=None, peak_flops_per_gpu=None,
                           bandwidth_bytes_per_s_per_gpu=None, description=f"measured on {device}; no price attached")
    summary = summarize(record, source="engine", model=model_name, hardware=device, workload=replay.name, slo=slo,
                        pricing=pricing, assumptions=assumptions)
    return summary, record


def _since(before: WorkerStats, after: WorkerStats) -> SchedulerStats:
    """A worker's statistics from `before` to `after` (counts only)."""
    a, b = after.scheduler, before.scheduler
    return dataclasses.replace(
        a, num_requests=a.num_requests - b.num_requests, num_preemptions=a.num_preemptions - b.num_preemptions,
        num_steps=a.num_steps - b.num_steps, num_finished={k: v - b.num_finished.get(k, 0) for k, v in a.num_finished.items()},
        prefix_cache=a.prefix_cache - b.prefix_cache)


def _reasons(stats: list[SchedulerStats]) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for s in stats:
        for reason, n in s.num_finished.items():
            reasons[reason] = reasons.get(reason, 0) + n
    return reasons


def describe_device_name() -> str:
    """The CPU a worker runs on (the router's process need not load torch's CUDA)."""
    return f"CPU {platform.processor() or platform.machine()}, one process per worker"
