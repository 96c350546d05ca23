"""Play a workload against the real engine in real time and summarise it like the simulator.

The engine's own step loop (schedule -> execute -> update) runs on the wall clock while the
same `Playback` as the simulator's submits requests at their due times, so a measured run and
a simulated one differ only in where step times come from. Torch is imported by the caller
that builds the LLM; this module only needs its scheduler and runner.
"""

from __future__ import annotations

import heapq
import platform
import time
from typing import TYPE_CHECKING

from engine.core import SamplingParams, SchedulerOutput
from engine.core.metrics import RequestMetrics
from planner.metrics import PricingBasis, RunRecord, RunSummary, StepSample, summarize
from planner.playback import Playback, Replay, Submission, check_lengths
from planner.specs import SLO

if TYPE_CHECKING:
    from engine.llm import LLM


def bench_engine(llm: LLM, replay: Replay, *, model_name: str, slo: SLO | None = None) -> tuple[RunSummary, RunRecord]:
    scheduler, runner = llm.scheduler, llm.runner
    cfg = scheduler.config
    check_lengths(replay, cfg.max_model_len, scheduler.kv_cache_manager.num_blocks, cfg.block_size, where="the engine")
    playback = Playback(replay)
    due: list[tuple[float, int, Submission]] = []
    order = 0

    def plan(subs: list[Submission]) -> None:
        nonlocal order
        for sub in subs:
            heapq.heappush(due, (sub.due_s, order, sub))
            order += 1

    warm_up(llm)
    samples: list[StepSample] = []
    finished: list[str] = []
    t0 = llm.now()  # run time 0; requests arrive at t0 + due_s on the engine's clock
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
        start = llm.now()
        output = scheduler.schedule(start)
        sampled = runner.execute(output)
        end = llm.now()
        updates = scheduler.update(output, sampled, end)
        samples.append(StepSample(0, start - t0, end - t0, output.kv_cache_usage, output.num_running,
                                  output.num_waiting, output.total_num_scheduled_tokens))
        for u in updates:
            if u.finished:
                finished.append(u.request_id)
                request = scheduler.get_request(u.request_id)
                plan(playback.finished(u.request_id, request.output_token_ids, end - t0))

    stats = scheduler.stats()
    record = RunRecord(
        requests=[RequestMetrics.from_request(scheduler.get_request(rid)) for rid in finished],
        num_submitted=playback.num_requests,
        num_replicas=1,
        samples=samples,
        prefix_cache=stats.prefix_cache,
        num_preemptions=stats.num_preemptions,
        num_steps=stats.num_steps,
        kv_cache_blocks_total=scheduler.kv_cache_manager.num_blocks,
        finish_reasons={k: v for k, v in stats.num_finished.items() if v},
    )
    device = describe_device(runner.device)
    engine = llm.engine_config
    assumptions: dict[str, object] = {
        "device": device,
        "dtype": engine.dtype,
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
    pricing = PricingBasis(gpus=1, price_usd_per_gpu_hour=None, peak_flops_per_gpu=None,
                           bandwidth_bytes_per_s_per_gpu=None, description=f"measured on {device}; no price attached")
    summary = summarize(record, source="engine", model=model_name, hardware=device, workload=replay.name, slo=slo,
                        pricing=pricing, assumptions=assumptions)
    return summary, record


def warm_up(llm: LLM) -> None:
    """One untimed step of the largest prefill plus a few decodes before the clock starts, as a
    server does at start-up: the first passes over fresh memory pay page faults and allocator
    growth (glibc raises its mmap threshold only after large frees) that steady serving does not."""
    from planner.calibrate import synthetic_output

    cfg = llm.scheduler.config
    tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len - 1,
                 llm.scheduler.kv_cache_manager.num_blocks * cfg.block_size // 2)
    decodes = min(4, cfg.max_num_seqs - 1)
    output = synthetic_output([(tokens, 0, True)] + [(1, 0, False)] * decodes, cfg.block_size, "warm-up")
    llm.runner.execute(output)
    llm.runner.execute(SchedulerOutput((), 0, (), tuple(s.request_id for s in output.scheduled), 0, 0, 0.0))


def describe_device(device: object) -> str:
    import torch

    if getattr(device, "type", None) == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {torch.get_num_threads()} threads"
