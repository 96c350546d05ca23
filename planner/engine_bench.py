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

from engine.core import KVCacheManager, Request, SamplingParams, Scheduler, SchedulerOutput, StepLoop
from engine.core.metrics import RequestMetrics, StepSample
from planner.metrics import PricingBasis, RunRecord, RunSummary, summarize
from planner.playback import Playback, Replay, Submission, check_lengths
from planner.specs import SLO

if TYPE_CHECKING:
    from engine.llm import LLM


def bench_engine(llm: LLM, replay: Replay, *, model_name: str, slo: SLO | None = None) -> tuple[RunSummary, RunRecord]:
    scheduler, loop = llm.scheduler, llm.loop
    cfg = scheduler.config
    check_lengths(replay, cfg.max_model_len, scheduler.kv_cache_manager.num_blocks, cfg.block_size, where="the engine")
    playback = Playback(replay)
    due: list[tuple[float, int, Submission]] = []
    order = itertools.count()

    def plan(subs: list[Submission]) -> None:
        for sub in subs:
            heapq.heappush(due, (sub.due_s, next(order), sub))

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
        plan(playback.finished(request.request_id, request.output_token_ids, request.finish_time - t0))
        scheduler.pop_finished(request.request_id)  # memory follows live requests, not all served

    loop.on_step, loop.on_finished = on_step, on_finished
    try:
        plan(playback.start())
        while due or scheduler.has_unfinished_requests():
            while due and due[0][0] <= llm.now() - t0:
                sub = heapq.heappop(due)[2]
                wr = sub.request
                # Arrival is when the client sent it, even if a step was running then: that wait is queueing.
                llm.add_request(list(sub.prompt_token_ids), SamplingParams(max_tokens=wr.output_tokens, ignore_eos=True),
                                request_id=wr.request_id, arrival_time=t0 + sub.due_s)
            if not scheduler.has_unfinished_requests():
                time.sleep(max(0.0, due[0][0] - (llm.now() - t0)))
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


def describe_device(device: object) -> str:
    import torch

    if getattr(device, "type", None) == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {torch.get_num_threads()} threads"
