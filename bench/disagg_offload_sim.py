"""Simulated figures of docs/disaggregation.md and docs/offload.md: colocated vs 1P1D on the same two
H100s for long prompts, and device-only vs a host KV tier for agent prefixes that outgrow the
device cache. Simulator only (seeded, no wall clock), so the figures are the same on any machine.

    .venv/bin/python bench/disagg_offload_sim.py
"""

from __future__ import annotations

from engine.catalog import resolve_model
from planner.hardware import get_hardware
from planner.sim import simulate
from planner.specs import Deployment, Disaggregation, EngineKnobs
from planner.workload import FixedLength, LengthDist, LognormalLength, PoissonArrivals, SharedPrefix, Workload

MODEL, H100 = resolve_model("llama-3.1-8b"), get_hardware("h100-sxm")


def workload(n: int, prompt: LengthDist, output_tokens: int, rate_per_s: float, **extra: object) -> Workload:
    return Workload(name="bench", arrival=PoissonArrivals(rate_per_s=rate_per_s), input_tokens=prompt,
                    output_tokens=FixedLength(tokens=output_tokens), num_requests=n, **extra)


def long_prompts() -> None:
    print("== 200 prompts of 6,000 tokens, 256 output tokens, 3 req/s; two H100s either way")
    w = workload(200, FixedLength(tokens=6000), 256, 3.0)
    for name, dep in [("2 colocated replicas", Deployment(hardware="h100-sxm", replicas=2)),
                      ("1P1D", Deployment(hardware="h100-sxm", disaggregation=Disaggregation()))]:
        s = simulate(MODEL, H100, dep, w).summary
        t = s.kv_transfer
        print(f"{name}: TTFT p50 {s.ttft_ms.p50:.0f} p99 {s.ttft_ms.p99:.0f} ms; TPOT p99 {s.tpot_ms.p99:.1f} ms; "
              f"ITL p99 {s.itl_ms.p99:.1f} ms; US$/h {s.cost.usd_per_hour:.2f}"
              + (f"; transfer {t.mb_per_request_mean:.0f} MB/request, {t.total_ms.mean:.2f} ms mean" if t else ""))


def agent_prefixes() -> None:
    print("== 600 agent requests, 64 prefixes of 2,048 tokens, 8 req/s; one H100 with a 2,048-block KV cache")
    w = workload(600, LognormalLength(median_tokens=100, sigma=0.4, min_tokens=16, max_tokens=400), 64, 8.0,
                 shared_prefix=SharedPrefix(num_prefixes=64, prefix_tokens=2048, share=1.0))
    for name, knobs in [("device only", EngineKnobs()), ("host tier 64 GiB", EngineKnobs(kv_offload_host_gib=64))]:
        s = simulate(MODEL, H100, Deployment(hardware="h100-sxm", knobs=knobs), w, kv_cache_blocks=2048).summary
        o = s.offload
        print(f"{name}: prefix hit rate {s.prefix_cache_hit_rate:.3f}; TTFT p50 {s.ttft_ms.p50:.0f} p99 {s.ttft_ms.p99:.0f} ms"
              + (f"; host hit tokens {o.host_hit_tokens}, stored {o.stored_blocks}, loaded {o.loaded_host_blocks} blocks"
                 if o else ""))


if __name__ == "__main__":
    long_prompts()
    agent_prefixes()
