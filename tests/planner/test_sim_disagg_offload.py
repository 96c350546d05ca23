"""Disaggregation and offload tiers in the simulator: the same scheduler, first-principles transfer
and copy times, when splitting prefill from decode helps, and what a host tier buys."""

from __future__ import annotations

import math

from pydantic import ValidationError
import pytest

from engine.catalog import resolve_model
from engine.core import BlockCopy, ExternalLoad, KVTransfers
from engine.errors import InputError
from planner.costmodel import CostModel, CostParams
from planner.hardware import get_hardware
from planner.memory import plan_memory
from planner.sim import simulate
from planner.specs import Deployment, Disaggregation, EngineKnobs, Link, MemoryTier
from planner.workload import FixedLength, LognormalLength, PoissonArrivals, SharedPrefix, Workload

LLAMA_8B = resolve_model("llama-3.1-8b")
H100 = get_hardware("h100-sxm")
PARAMS = CostParams.defaults(H100)


def workload(n: int = 40, inp: int = 512, out: int = 32, rate: float = 4.0, **extra: object) -> Workload:
    return Workload(name="t", arrival=PoissonArrivals(rate_per_s=rate), input_tokens=FixedLength(tokens=inp),
                    output_tokens=FixedLength(tokens=out), num_requests=n, **extra)


def block_bytes(dep: Deployment) -> int:
    return plan_memory(LLAMA_8B, H100, dep, 4096).kv_bytes_per_block_per_gpu


# --------------------------------------------------------------------------- disaggregation


def test_a_transfer_takes_its_bytes_over_the_link_and_nothing_is_lost() -> None:
    dep = Deployment(hardware="h100-sxm", disaggregation=Disaggregation())
    s = simulate(LLAMA_8B, H100, dep, workload(n=1, inp=1025), calibration=PARAMS).summary
    blocks = math.ceil(1024 / 16)  # all but the last prompt token, 16-token blocks
    link = H100.scale_up  # 1P1D of one GPU each fits the NVLink domain
    wire_s = blocks * block_bytes(dep) / (link.bandwidth_gb_s * 1e9 * PARAMS.interconnect_efficiency) + link.latency_us * 1e-6
    assert s.kv_transfer.requests == 1
    assert s.kv_transfer.wire_ms.mean == pytest.approx(wire_s * 1e3, rel=1e-9)
    assert s.kv_transfer.send_ms.max == s.kv_transfer.load_ms.max == 0.0  # GPUs: DMA, no engine time
    assert s.num_finished == 1 and s.finish_reasons == {"length": 1}


def test_instances_beyond_the_nvlink_domain_transfer_over_the_network() -> None:
    near = Deployment(hardware="h100-sxm", tensor_parallel=4, disaggregation=Disaggregation())  # 8 GPUs: NVLink
    far = Deployment(hardware="h100-sxm", tensor_parallel=8, disaggregation=Disaggregation())  # 16 GPUs: InfiniBand
    w = workload(n=1, inp=4097)
    t_near = simulate(LLAMA_8B, H100, near, w, calibration=PARAMS).summary.kv_transfer.wire_ms.mean
    t_far = simulate(LLAMA_8B, H100, far, w, calibration=PARAMS).summary.kv_transfer.wire_ms.mean
    # Each GPU sends its shard: tp=8 halves the bytes per GPU, InfiniBand is 9x slower than NVLink.
    assert t_far / t_near == pytest.approx(H100.scale_up.bandwidth_gb_s / H100.scale_out.bandwidth_gb_s / 2, rel=0.02)
    assert simulate(LLAMA_8B, H100, far.model_copy(update={"disaggregation": Disaggregation(kv_link="scale_up")}), w,
                    calibration=PARAMS).summary.kv_transfer.wire_ms.mean < t_far


def test_disaggregation_keeps_long_prompts_off_the_decode_steps() -> None:
    # Same GPUs: two colocated replicas vs one prefill and one decode instance. Long prompts land in
    # the colocated replicas' decode steps and stretch them; the decode instance never sees one.
    w = workload(n=200, inp=6000, out=256, rate=3.0)
    colocated = simulate(LLAMA_8B, H100, Deployment(hardware="h100-sxm", replicas=2), w).summary
    split = simulate(LLAMA_8B, H100, Deployment(hardware="h100-sxm", disaggregation=Disaggregation()), w).summary
    assert split.cost.usd_per_hour == colocated.cost.usd_per_hour
    assert split.itl_ms.p99 < 0.25 * colocated.itl_ms.p99  # no 6k-token chunk in a decode step
    assert split.tpot_ms.p99 < colocated.tpot_ms.p99
    assert split.ttft_ms.p50 > colocated.ttft_ms.p50  # the price: one prefill instance, and the transfer


def test_a_cpu_engine_copies_the_kv_itself() -> None:
    cpu = get_hardware("cpu-amd-epyc-1t").model_copy(update={
        "scale_up": Link(name="shared memory", bandwidth_gb_s=2.0, latency_us=50, domain_size=1)})
    dep = Deployment(hardware=cpu.name, weight_dtype="fp32", kv_dtype="fp32", disaggregation=Disaggregation(),
                     knobs=EngineKnobs(block_size_tokens=16, max_num_batched_tokens=512, max_num_seqs=16))
    model = resolve_model("smollm2-135m")
    s = simulate(model, cpu, dep, workload(n=1, inp=161, out=4), kv_cache_blocks=256).summary
    seconds = 10 * model.kv_bytes_per_token("fp32") * 16 / (2e9 * cpu.efficiency.interconnect)
    assert s.kv_transfer.send_ms.mean == pytest.approx(seconds * 1e3, rel=1e-6)
    assert s.kv_transfer.load_ms.mean == pytest.approx(seconds * 1e3, rel=1e-6)
    assert s.kv_transfer.wire_ms.mean == pytest.approx(0.05, rel=1e-6)  # the latency alone


def test_disaggregated_runs_are_deterministic() -> None:
    dep = Deployment(hardware="h100-sxm", replicas=2, disaggregation=Disaggregation(prefill_instances=1, decode_instances=2))
    w = workload(n=100, rate=20.0)
    a = simulate(LLAMA_8B, H100, dep, w, router="least_outstanding_tokens").summary
    b = simulate(LLAMA_8B, H100, dep, w, router="least_outstanding_tokens").summary
    assert a.model_dump_json() == b.model_dump_json()
    assert a.cost.usd_per_hour == 6 * H100.price_usd_per_hour and a.num_finished == 100


# --------------------------------------------------------------------------- offload tiers


def agent(n: int = 300) -> Workload:
    return Workload(name="agent", arrival=PoissonArrivals(rate_per_s=20), num_requests=n,
                    shared_prefix=SharedPrefix(num_prefixes=40, prefix_tokens=4096, share=1.0),
                    input_tokens=LognormalLength(median_tokens=64, sigma=0.5, min_tokens=8, max_tokens=256),
                    output_tokens=FixedLength(tokens=32))


def test_a_host_tier_raises_the_hit_rate_of_prefixes_the_device_cannot_hold() -> None:
    # 40 prefixes of 4k tokens (~20 GB of KV for Llama 8B) against a ~5 GB device cache.
    knobs = EngineKnobs(gpu_memory_utilization=0.3)
    device_only = simulate(LLAMA_8B, H100, Deployment(hardware="h100-sxm", knobs=knobs), agent()).summary
    tiered = simulate(LLAMA_8B, H100, Deployment(hardware="h100-sxm", knobs=knobs.model_copy(
        update={"kv_offload_host_gib": 64})), agent()).summary
    assert tiered.prefix_cache_hit_rate > device_only.prefix_cache_hit_rate + 0.2
    assert tiered.offload.host_hit_tokens > 0 and tiered.offload.stored_blocks > 0
    assert tiered.ttft_ms.mean < device_only.ttft_ms.mean  # a copy over PCIe beats a 4k-token prefill


def test_copies_are_priced_at_the_tier_rates() -> None:
    dep = Deployment(hardware="h100-sxm", knobs=EngineKnobs(kv_offload_host_gib=16, kv_offload_disk_gib=64))
    cm = CostModel(LLAMA_8B, H100, dep, PARAMS)
    bb = block_bytes(dep)
    copies = KVTransfers((BlockCopy("device", 1, "host", 0), BlockCopy("host", 2, "disk", 0),
                          BlockCopy("host", 3, "device", 4), BlockCopy("disk", 5, "device", 6)), ())
    host, disk = H100.host_memory, H100.local_disk
    expected = (bb / (host.write_gb_s * 1e9) + bb / (host.read_gb_s * 1e9) + 2 * host.latency_us * 1e-6
                + bb / (disk.write_gb_s * 1e9) + bb / (disk.read_gb_s * 1e9) + 2 * disk.latency_us * 1e-6)
    assert cm.copies.step_s(copies) == pytest.approx(expected, rel=1e-9)
    # A GPU's received prompt KV was written by RDMA: no engine time.
    split = CostModel(LLAMA_8B, H100, dep.model_copy(update={"disaggregation": Disaggregation()}), PARAMS)
    assert split.copies.step_s(KVTransfers((), (ExternalLoad("r", 0, (1, 2)),))) == 0.0


def test_swap_preemption_resumes_instead_of_recomputing() -> None:
    # A KV cache of 1,024 blocks (16k tokens) holds ~16 of these 1,024-token requests: everyone at once preempts.
    w = workload(n=300, inp=512, out=512, rate=200.0)
    dep = Deployment(hardware="h100-sxm")
    recompute = simulate(LLAMA_8B, H100, dep, w, kv_cache_blocks=1024).summary
    swap = simulate(LLAMA_8B, H100, dep.model_copy(update={"knobs": EngineKnobs(
        kv_offload_host_gib=128, preemption_mode="swap")}), w, kv_cache_blocks=1024).summary
    assert recompute.preemptions > 0 and swap.preemptions > 0
    assert swap.offload.swapped_out_requests == swap.preemptions
    assert swap.num_finished == recompute.num_finished == 300


def test_offload_settings_beyond_the_profile_are_refused() -> None:
    with pytest.raises(InputError, match="lists no host_memory"):
        simulate(LLAMA_8B, get_hardware("l40s"), Deployment(hardware="l40s", knobs=EngineKnobs(kv_offload_host_gib=8)),
                 workload(n=2))
    with pytest.raises(InputError, match="exceeds the 256 GiB"):
        simulate(LLAMA_8B, H100, Deployment(hardware="h100-sxm", knobs=EngineKnobs(kv_offload_host_gib=300)), workload(n=2))
    tiny = H100.model_copy(update={"host_memory": MemoryTier(name="x", capacity_gib=1, write_gb_s=1, read_gb_s=1, latency_us=0)})
    with pytest.raises(InputError, match="holds no KV block"):
        simulate(LLAMA_8B, tiny, Deployment(hardware="h100-sxm", knobs=EngineKnobs(kv_offload_host_gib=1e-9)), workload(n=2))
    with pytest.raises(ValidationError, match="needs kv_offload_host_gib"):
        EngineKnobs(preemption_mode="swap")
