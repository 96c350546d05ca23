"""Cost model: first-principles checks of the step-time roofline."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from engine.catalog import resolve_model
from engine.config import EngineKnobs, graph_batch_size
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.errors import InputError
from planner.costmodel import (
    DEQUANT_OPS_PER_WEIGHT,
    OPERATORS,
    CostModel,
    CostParams,
    expected_distinct_experts,
    gemm_compute_dtype,
)
from planner.costmodel.model import COMM_OPERATORS, _totals, busiest_rank_factors
from planner.costmodel.shape import StepShape
from planner.engines import get_engine
from planner.hardware import get_hardware
from planner.memory import WEIGHT_BYTES_PER_PARAM
from planner.specs import Deployment

GEMMS = ("qkv_proj", "o_proj", "mlp")


def req(q: int, cached: int = 0, *, prefill: bool | None = None, samples: bool = True, drafts: int = 0, rid: str = "r"):
    return ScheduledRequest(
        request_id=rid,
        token_ids=tuple(range(q)),
        num_computed_tokens=cached,
        new_block_ids=(),
        reset_block_table=False,
        num_draft_tokens=drafts,
        samples=samples,
        sampling_params=SamplingParams(),
        prompt_len=cached + q if prefill is None or prefill else cached,
        is_prefill=q > 1 if prefill is None else prefill,
    )


def step(*reqs: ScheduledRequest) -> SchedulerOutput:
    reqs = tuple(r._replace(request_id=f"r{i}") for i, r in enumerate(reqs))
    return SchedulerOutput(
        scheduled=reqs,
        total_num_scheduled_tokens=sum(r.num_tokens for r in reqs),
        preempted_request_ids=(),
        finished_request_ids=(),
        num_waiting=0,
        num_running=len(reqs),
        kv_cache_usage=0.0,
    )


def cost(model: str = "llama-3.1-8b", hw: str = "h100-sxm", calibration: CostParams | None = None, hw_update=None, **dep):
    """The cost model at the profiles' own estimates (not the public fit's figures), so that each
    check can derive its known answer from the profile it reads."""
    profile = get_hardware(hw)
    if hw_update:
        profile = profile.model_copy(update=hw_update)
    deployment = Deployment(hardware=hw, **dep)
    params = calibration or CostParams.defaults(profile, get_engine(deployment.engine))
    return CostModel(resolve_model(model), profile, deployment, params)


def read_weight_bytes(model: str, weight_dtype: str = "bf16") -> float:
    """Bytes one step reads for a dense model: every layer weight plus the LM head (not the embedding)."""
    m = resolve_model(model)
    layers = m.total_params - m.embedding_params - m.lm_head_params - m.hidden_size
    return layers * WEIGHT_BYTES_PER_PARAM[weight_dtype] + m.vocab_size * m.hidden_size * 2.0


def test_batch1_decode_is_the_weight_read_plus_kernel_latencies_and_host_work() -> None:
    cm = cost()
    hw = get_hardware("h100-sxm")
    e = hw.efficiency
    expected = read_weight_bytes("llama-3.1-8b") / (hw.memory_bandwidth_gb_s * 1e9 * e.memory)
    # Every kernel costs graph_kernel_us on the device: 32 layers x (qkv, o, 3 attention, 3 MLP, 2 norms)
    # + final norm + embedding in the replayed graph, then the LM head and sampling's 3 kernels.
    expected += (32 * 10 + 2 + 1 + 3) * e.graph_kernel_us * 1e-6
    # One launch for the graph; sampling's 3 eager kernels each wait on a launch, far longer than they run.
    expected += e.kernel_launch_us * 1e-6 + 3 * e.kernel_launch_us * 1e-6
    expected += cm.params.step_overhead_s + cm.params.per_request_overhead_s  # the engine's host work, one request
    assert cm.step_time(step(req(1, 128))) == pytest.approx(expected, rel=0.01)
    assert cm.decode_time_per_token_s(1, 128) == pytest.approx(cm.step_time(step(req(1, 128))), rel=1e-12)


def test_doubling_bandwidth_halves_memory_bound_decode_work() -> None:
    hw = get_hardware("h100-sxm")
    base = cost()
    fast = cost(hw_update={"memory_bandwidth_gb_s": 2 * hw.memory_bandwidth_gb_s})
    out = step(*[req(1, 1000) for _ in range(4)])
    latency = hw.efficiency.graph_kernel_us * 1e-6

    def memory_work(cm: CostModel) -> float:  # host work, launches and kernel latencies do not scale with bandwidth
        b = cm.breakdown(out)
        kernels = 32 * 10 + 2 + 1 + 3
        return cm.step_time(out) - b["host"] - b["kernel_launch"] - kernels * latency

    assert memory_work(fast) == pytest.approx(memory_work(base) / 2, rel=1e-3)


def test_long_prefill_is_compute_bound() -> None:
    cm = cost()
    m, hw = resolve_model("llama-3.1-8b"), get_hardware("h100-sxm")
    tokens = 8192
    b = cm.breakdown(step(req(tokens)))
    layer_params = m.total_params - m.embedding_params - m.lm_head_params - m.hidden_size
    layer_params -= m.num_layers * m.norms_per_layer * m.hidden_size  # norm weights are not matmuls
    matmul_time = 2 * layer_params * tokens / (hw.peak_flops("bf16")[0] * hw.efficiency.compute)
    matmul_time += 5 * m.num_layers * hw.efficiency.graph_kernel_us * 1e-6  # qkv, o, gate_up, SwiGLU, down kernels
    assert sum(b[k] for k in GEMMS) == pytest.approx(matmul_time, rel=1e-3)
    weight_read = read_weight_bytes("llama-3.1-8b") / (hw.memory_bandwidth_gb_s * 1e9 * hw.efficiency.memory)
    assert matmul_time > 20 * weight_read
    total = sum(b.values())
    assert 0.7 * total < matmul_time < total  # the matmuls dominate; attention and the rest add the remainder
    assert b["attention"] > 0 and b["lm_head"] > 0


def test_a_dense_matmul_with_few_rows_computes_at_its_profiles_falloff() -> None:
    """An A100's dense matmul of M rows computes at M / (M + h) of its rate, h its profile's
    gemm_half_size_tokens (from cuBLAS measurements): a compute-bound one (512 decode rows) takes
    (M + h) / M as long as without the falloff; one bound by its weight reads (a single row) and the
    routed experts (fused grouped kernels on a GPU, priced by their own share) are unchanged."""
    profile = get_hardware("a100-80gb-sxm")
    half = profile.efficiency.gemm_half_size_tokens
    assert half > 0
    flat = {"efficiency": profile.efficiency.model_copy(update={"gemm_half_size_tokens": 0.0})}
    latency = 3 * 32 * profile.efficiency.graph_kernel_us * 1e-6  # the MLP's 3 kernels a layer

    def mlp(rows: int, **update) -> float:
        return cost(hw="a100-80gb-sxm", hw_update=update).shape_breakdown([(1, 1000, False)] * rows)["mlp"] - latency

    assert mlp(512) == pytest.approx(mlp(512, **flat) * (512 + half) / 512, rel=1e-9)
    assert mlp(1) == pytest.approx(mlp(1, **flat), rel=1e-12)
    prefill = [(8192, 0, True)] * 2
    falloff = cost(model="qwen3-30b-a3b", hw="a100-80gb-sxm").shape_breakdown(prefill)
    assert falloff["moe_experts"] == cost(model="qwen3-30b-a3b", hw="a100-80gb-sxm", hw_update=flat).shape_breakdown(prefill)["moe_experts"]


def test_fp8_weights_halve_the_decode_weight_read() -> None:
    bf16, fp8 = cost(), cost(weight_dtype="fp8")
    out = step(req(1, 100))
    b16, b8 = bf16.breakdown(out), fp8.breakdown(out)
    latency = get_hardware("h100-sxm").efficiency.graph_kernel_us * 1e-6
    for op, kernels in zip(GEMMS, (32, 32, 96), strict=True):  # the read halves, the kernels stay
        assert b8[op] - kernels * latency == pytest.approx((b16[op] - kernels * latency) / 2, rel=0.01)
    assert b8["lm_head"] == pytest.approx(b16["lm_head"])  # the LM head stays unquantised
    assert fp8.gemm_dtype == "fp8" and not fp8.dequant


def test_compute_dtype_rule() -> None:
    h100, a100 = get_hardware("h100-sxm"), get_hardware("a100-80gb-sxm")
    assert gemm_compute_dtype("fp8", h100) == ("fp8", False)  # W8A8 on Hopper
    assert gemm_compute_dtype("fp8", a100) == ("bf16", True)  # no fp8 tensor cores: weight-only
    assert gemm_compute_dtype("int8", h100) == ("bf16", True)
    assert gemm_compute_dtype("int4", h100) == ("bf16", True)
    assert gemm_compute_dtype("fp4", get_hardware("b200")) == ("fp4", False)
    assert gemm_compute_dtype("bf16", h100) == ("bf16", False)
    # Weight-only prefill pays dequantisation on top of bf16 math; W8A8 fp8 prefill is about twice as fast.
    bf16, int8, fp8 = cost(), cost(weight_dtype="int8"), cost(weight_dtype="fp8")
    assert int8.prefill_time_s(4096) > bf16.prefill_time_s(4096) > 1.5 * fp8.prefill_time_s(4096)
    b16, b8 = bf16.prefill_breakdown(4096), fp8.prefill_breakdown(4096)
    assert sum(b8[k] for k in GEMMS) == pytest.approx(sum(b16[k] for k in GEMMS) / 2, rel=0.01)
    assert b8["attention"] == b16["attention"]  # attention math stays bf16


def test_tensor_parallel_halves_matmul_time_and_adds_allreduce() -> None:
    # A shard's matmuls have half the roofline; each kernel's fixed time stays whole, so it is left out.
    engine = get_engine(Deployment(hardware="h100-sxm").engine)
    rooflines = CostParams.defaults(get_hardware("h100-sxm"), engine).with_values({"kernel_latency_s": 0.0})
    one, two = cost(calibration=rooflines), cost(calibration=rooflines, tensor_parallel=2)
    for out in (step(req(4096)), step(req(1, 500))):
        b1, b2 = one.breakdown(out), two.breakdown(out)
        assert sum(b2[k] for k in GEMMS) == pytest.approx(sum(b1[k] for k in GEMMS) / 2, rel=0.02)
        assert b1["tp_allreduce"] == b1["tp_gather"] == 0 and b2["tp_allreduce"] > 0 and b2["tp_gather"] > 0
    assert two.tp_link is not None and two.tp_link.name.startswith("NVLink")
    # By hand from the H100 profile's measured curve: 4096 tokens x 4096 x 2 B = 32 MiB, a measured
    # size (212.88 us on 8 ranks), at 2 ranks through the busbw factors 1 / 1.75; two all-reduces per
    # layer and one after the embedding.
    m = resolve_model("llama-3.1-8b")
    expected = (2 * m.num_layers + 1) * 212.88e-6 * (1.0 / 1.75)
    assert two.breakdown(step(req(4096)))["tp_allreduce"] == pytest.approx(expected, rel=1e-9)


def test_links_without_a_measured_curve_use_the_ring_on_datasheet_figures() -> None:
    two = cost(hw="l4", tensor_parallel=2)
    link, eff = two.tp_link, get_hardware("l4").efficiency.interconnect
    assert link is not None and not link.collectives
    m, tokens = resolve_model("llama-3.1-8b"), 1000
    one = 2 * link.latency_us * 1e-6 + tokens * m.hidden_size * 2 / (link.bandwidth_gb_s * 1e9 * eff)
    assert two.breakdown(step(req(tokens)))["tp_allreduce"] == pytest.approx((2 * m.num_layers + 1) * one, rel=1e-9)


def test_gpus_without_peer_access_reduce_over_pcie_whatever_links_the_board_has() -> None:
    """An H100 board whose GPUs lack peer access (vLLM: 'platform lacks GPU P2P capability') prices the
    TP all-reduce on the PCIe link as the ring on its datasheet figures, like a PCIe-only card; the
    matmuls are unchanged."""
    peers, host = cost(tensor_parallel=2), cost(tensor_parallel=2, peer_access=False)
    link, eff = host.tp_link, get_hardware("h100-sxm").efficiency.interconnect
    assert link is not None and "PCIe" in link.name and not link.collectives
    assert host.assumptions()["tp_link"]["name"] == link.name
    m, tokens = resolve_model("llama-3.1-8b"), 1000
    one = 2 * link.latency_us * 1e-6 + tokens * m.hidden_size * 2 / (link.bandwidth_gb_s * 1e9 * eff)
    b_host, b_peers = host.breakdown(step(req(tokens))), peers.breakdown(step(req(tokens)))
    assert b_host["tp_allreduce"] == pytest.approx((2 * m.num_layers + 1) * one, rel=1e-9)
    assert b_host["tp_allreduce"] > 2 * b_peers["tp_allreduce"]
    assert all(b_host[k] == b_peers[k] for k in GEMMS)


def test_links_beyond_the_scale_up_domain_and_pcie_only_cards() -> None:
    assert cost(model="llama-3.1-70b", tensor_parallel=16).tp_link.name.startswith("8x400G")
    assert "PCIe" in cost(hw="l4", tensor_parallel=2).tp_link.name
    pp = cost(pipeline_parallel=2)
    b = pp.breakdown(step(req(1000)))
    assert b["pp_transfer"] > 0
    # Sum over stages: the layers cost what they cost on one GPU, plus the hand-off.
    assert sum(b[k] for k in GEMMS) == pytest.approx(sum(cost().breakdown(step(req(1000)))[k] for k in GEMMS))


def test_expected_distinct_experts() -> None:
    assert expected_distinct_experts(8, 2, 1) == pytest.approx(2)
    assert expected_distinct_experts(128, 8, 0) == 0
    assert expected_distinct_experts(128, 8, 10_000) == pytest.approx(128)
    assert 8 < expected_distinct_experts(128, 8, 4) < 32


@pytest.mark.parametrize("experts, top_k, ranks", [(128, 8, 8), (256, 8, 8), (32, 4, 4)])
def test_the_busiest_expert_parallel_rank_against_routing_drawn_at_random(experts: int, top_k: int, ranks: int) -> None:
    """Known answer by Monte Carlo: tokens each choose top_k distinct experts at random, experts lie
    experts / ranks to a rank in order; the busiest rank's distinct experts, over the mean rank's,
    match busiest_rank_factors within 5 %, and so do its rows from 16 tokens on. (Its ranks are
    independent binomials, where the drawn ones share their totals: with a few rows in all, one rank
    always has some, and the rows factor comes out up to 7 % low; such steps are bound by the experts'
    weight reads, which the experts factor prices.) Many tokens leave no rank idle."""
    rng = np.random.default_rng(7)
    per_rank = experts // ranks
    for tokens in (1, 4, 16, 64):
        touched_max, rows_max = [], []
        for _ in range(600):
            choice = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
            rows_max.append(np.bincount((choice // per_rank).ravel(), minlength=ranks).max())
            touched_max.append(np.bincount(np.unique(choice) // per_rank, minlength=ranks).max())
        touched_factor, rows_factor = busiest_rank_factors(experts, top_k, ranks, tokens)
        assert touched_factor == pytest.approx(np.mean(touched_max) / (expected_distinct_experts(experts, top_k, tokens)
                                                                       / ranks), rel=0.05), tokens
        if tokens >= 16:
            assert rows_factor == pytest.approx(np.mean(rows_max) / (tokens * top_k / ranks), rel=0.05), tokens
    assert busiest_rank_factors(experts, top_k, 1, 3) == pytest.approx((1.0, 1.0))  # one rank is the mean
    assert busiest_rank_factors(experts, top_k, ranks, 0) == (1.0, 1.0)
    assert busiest_rank_factors(experts, top_k, ranks, 100_000) == pytest.approx((1.0, 1.0), abs=0.01)


def test_expert_parallel_experts_take_the_busiest_ranks_time() -> None:
    """A decode of one token on 4 expert-parallel GPUs reads the busiest rank's experts: the weight
    reads of the same step on 4 tensor-parallel GPUs (each holding a quarter of every expert) times
    busiest_rank_factors' experts factor; at a large batch every rank touches all its experts and the
    two meet."""
    def experts_s(batch: int, ep: int) -> float:
        cm = cost(model="qwen3-30b-a3b", tensor_parallel=4, expert_parallel=ep)
        kernels = cm.ops.experts.kernels * cm.params.kernel_latency_s
        return cm.decode_breakdown(batch, 100)["moe_experts"] - kernels

    m = resolve_model("qwen3-30b-a3b")
    touched_factor, _ = busiest_rank_factors(m.moe.num_experts, m.moe.top_k, 4, 1)
    assert touched_factor > 1.5
    assert experts_s(1, 4) == pytest.approx(touched_factor * experts_s(1, 1), rel=0.01)
    assert experts_s(1024, 4) == pytest.approx(experts_s(1024, 1), rel=0.02)
    assert "busiest rank" in " ".join(cost(model="qwen3-30b-a3b", tensor_parallel=4, expert_parallel=4)
                                      .assumptions()["notes"])


def test_moe_decode_reads_k_experts_at_batch_one_and_all_at_large_batch() -> None:
    cm = cost(model="qwen3-30b-a3b")
    m, hw = resolve_model("qwen3-30b-a3b"), get_hardware("h100-sxm")
    bw = hw.memory_bandwidth_gb_s * 1e9 * hw.efficiency.memory
    one_expert_all_layers = m.num_moe_layers * m.expert_params() * 2.0 / bw
    kernels = 4 * m.num_moe_layers * hw.efficiency.graph_kernel_us * 1e-6  # gather, two grouped GEMMs, SwiGLU
    small = cm.decode_breakdown(1, 100)["moe_experts"] - kernels
    large = cm.decode_breakdown(512, 100)["moe_experts"] - kernels
    assert small == pytest.approx(m.moe.top_k * one_expert_all_layers, rel=0.01)
    assert large == pytest.approx(m.moe.num_experts * one_expert_all_layers, rel=0.05)
    assert cm.decode_breakdown(1, 100)["mlp"] == 0 and cm.decode_breakdown(1, 100)["router"] > 0


@pytest.mark.parametrize("batch", [1, 64, 512])
def test_an_moe_efficiency_slows_the_routed_experts_alone(batch: int) -> None:
    """At the engine's kernel efficiency e, the experts' roofline takes 1/e as long, whatever bounds
    it (weights at batch 1, more FLOPs at 512). The family's grouped-GEMM efficiency g slows their
    compute alone: a step bound by the experts' weight reads (batch 1) is unchanged by it, one bound
    by their FLOPs (a 32,768-token prefill) takes 1/g as long. Their kernels' fixed latency and
    every other operator are unchanged."""
    hw = get_hardware("h100-sxm")
    base = CostParams.defaults(hw, get_engine("vllm-0.11"))
    kernels = 4 * resolve_model("qwen3-30b-a3b").num_moe_layers * base.kernel_latency_s

    def experts(requests: list[tuple[int, int, bool]], **values: float) -> dict[str, float]:
        return cost(model="qwen3-30b-a3b", calibration=replace(base, **values)).shape_breakdown(requests)

    decode = [(1, 2000, False)] * batch
    full, half = experts(decode), experts(decode, moe_kernel_efficiency=0.5)
    assert half["moe_experts"] - kernels == pytest.approx(2 * (full["moe_experts"] - kernels))
    assert {k: v for k, v in half.items() if k != "moe_experts"} == {k: v for k, v in full.items() if k != "moe_experts"}
    if batch == 1:  # four experts' weights a layer: bound by reading them
        assert experts(decode, grouped_gemm_efficiency=0.5) == full
    prefill = [(8192, 0, True)] * 4
    dense_rate, grouped = experts(prefill), experts(prefill, grouped_gemm_efficiency=0.5)
    assert grouped["moe_experts"] - kernels == pytest.approx(2 * (dense_rate["moe_experts"] - kernels))


def test_mxfp4_experts_take_the_engines_fp4_moe_share_and_others_its_moe_share() -> None:
    """Experts stored as MXFP4 (gpt-oss's checkpoint) run the engine's MXFP4 kernel: its share
    (fp4_moe_kernel_efficiency) sets their time, the bf16/fp8 fused-MoE share does not; bf16 experts
    the other way round. Halving the share that applies doubles the experts' roofline alone."""
    hw = get_hardware("h100-sxm")
    base = CostParams.defaults(hw, get_engine("vllm-0.11"))
    decode = [(1, 2000, False)] * 8

    def experts(model: str, weight_dtype: str, **values: float) -> float:
        cm = cost(model=model, weight_dtype=weight_dtype, calibration=replace(base, **values))
        kernels = 4 * resolve_model(model).num_moe_layers * base.kernel_latency_s
        return cm.shape_breakdown(decode)["moe_experts"] - kernels

    for model, dtype, own, other in (("gpt-oss-20b", "fp4", "fp4_moe_kernel_efficiency", "moe_kernel_efficiency"),
                                     ("qwen3-30b-a3b", "bf16", "moe_kernel_efficiency", "fp4_moe_kernel_efficiency")):
        full = experts(model, dtype)
        assert experts(model, dtype, **{own: 0.5}) == pytest.approx(2 * full), model
        assert experts(model, dtype, **{other: 0.5}) == full, model


def test_the_grouped_gemm_share_leaves_weight_only_experts_dequantisation_alone() -> None:
    """fp8 experts on an A100 (no fp8 tensor cores) run bf16 math on weights dequantised by the vector
    units. In a prefill that touches every expert, bound by that work, the experts take
    (math / g + dequantisation) / e: halving the family's grouped-GEMM share g adds the math once
    more, not the dequantisation, which is every expert weight x DEQUANT_OPS_PER_WEIGHT operations at
    the fp32 peak x compute_efficiency."""
    hw = get_hardware("a100-80gb-sxm")
    base = CostParams.defaults(hw, get_engine("vllm-0.11"))
    model = resolve_model("qwen3-30b-a3b")
    kernels = 4 * model.num_moe_layers * base.kernel_latency_s

    def experts(**values: float) -> float:
        cm = cost(model="qwen3-30b-a3b", hw="a100-80gb-sxm", weight_dtype="fp8", calibration=replace(base, **values))
        assert cm.dequant
        return cm.shape_breakdown([(8192, 0, True)] * 4)["moe_experts"] - kernels

    e = base.moe_kernel_efficiency
    dequant_s = (model.num_moe_layers * model.moe.num_experts * model.expert_params() * DEQUANT_OPS_PER_WEIGHT
                 / (hw.peak_flops("fp32")[0] * base.compute_efficiency))
    full, halved = experts(grouped_gemm_efficiency=1.0), experts(grouped_gemm_efficiency=0.5)
    math_s = full * e - dequant_s
    assert math_s > dequant_s > 0  # both terms matter here
    assert halved * e == pytest.approx(2 * math_s + dequant_s)


def test_scaled_matmuls_reach_their_share_of_the_formats_rates() -> None:
    """fp8 weights (W8A8 on H100) are half bf16's bytes and FLOPs at twice the rate: at shares of 0.5
    the weight matmuls of an fp8 step cost what bf16's do, bound by their weight reads in a batch-1
    decode and by their FLOPs in a 32,768-token prefill. The shares leave the unquantised LM head,
    every other operator, and bf16 weights alone. Each kernel's fixed time, which the formats share, is
    left out."""
    hw = get_hardware("h100-sxm")
    base = CostParams.defaults(hw, get_engine("vllm-0.11")).with_values({"kernel_latency_s": 0.0})
    halved = replace(base, scaled_gemm_efficiency=0.5, scaled_gemm_memory_efficiency=0.5)
    matmuls = ("qkv_proj", "o_proj", "mlp")
    for shape in ([(1, 1000, False)], [(8192, 0, True)] * 4):
        bf16 = cost(calibration=halved).shape_breakdown(shape)
        fp8, fp8_at_rates = (cost(calibration=c, weight_dtype="fp8").shape_breakdown(shape) for c in (halved, base))
        assert cost(calibration=base).shape_breakdown(shape) == bf16
        for op in matmuls:
            assert fp8[op] == pytest.approx(bf16[op], rel=0.02), op  # activations are bf16 in both
            assert fp8_at_rates[op] < 0.6 * fp8[op], op
        assert {k: v for k, v in fp8.items() if k not in matmuls} == {
            k: v for k, v in fp8_at_rates.items() if k not in matmuls}


def test_windowed_layers_cap_the_attended_context() -> None:
    cm = cost(model="mistral-7b")  # Mistral-7B-v0.1: every layer windowed to 4096 tokens
    window = resolve_model("mistral-7b").layer_windows[0]
    assert window == 4096
    assert cm.decode_breakdown(8, window + 10_000)["attention"] == pytest.approx(
        cm.decode_breakdown(8, window + 20_000)["attention"]
    )
    dense = cost()
    assert dense.decode_breakdown(8, 30_000)["attention"] > dense.decode_breakdown(8, 20_000)["attention"]


def test_mla_reads_the_latent() -> None:
    cm = cost(model="deepseek-v3", hw="h200", tensor_parallel=8, weight_dtype="fp8")
    m = resolve_model("deepseek-v3")
    assert cm.assumptions()["kv_bytes_per_token_per_layer_per_gpu"] == (512 + 64) * 2
    short, long = cm.decode_breakdown(32, 1000)["attention"], cm.decode_breakdown(32, 9000)["attention"]
    hw = get_hardware("h200")
    kv_time = 32 * 8000 * m.num_layers * (512 + 64) * 2 / (hw.memory_bandwidth_gb_s * 1e9 * hw.efficiency.attention_memory)
    assert long - short == pytest.approx(kv_time, rel=1e-6)


def test_mla_prefills_expanded_and_decodes_absorbed() -> None:
    """A query token's attention FLOPs per key, per layer: a prefill's over the expanded heads (qk
    192 + v 128 dims for DeepSeek-V3's 128 heads), a decode's over the latent (512 + 64, then 512)."""
    cm = cost(model="deepseek-v3", hw="h200", tensor_parallel=8, weight_dtype="fp8")
    layers = resolve_model("deepseek-v3").num_layers

    def attention_flops(step_rows: list[tuple[int, int, bool]], more_context: int) -> float:
        grown = [(q, c + more_context, prefill) for q, c, prefill in step_rows]
        return cm.shape_cost(grown).flops - cm.shape_cost(step_rows).flops

    per_gpu_heads = 128 / 8
    assert attention_flops([(1000, 1000, True)], 1000) == pytest.approx(
        1000 * 1000 * layers * 2 * per_gpu_heads * (128 + 64 + 128))
    assert attention_flops([(1, 1000, False)] * 32, 1000) == pytest.approx(
        32 * 1000 * layers * 2 * per_gpu_heads * (512 + 64 + 512))


def test_each_rank_reads_the_attention_weights_it_holds() -> None:
    """Per layer and GPU, the attention projections a step reads are those the GPU holds: DeepSeek-V3's
    down-projections (q_a 7168 x 1536, kv_a 7168 x (512 + 64), and their norms) whole on every
    tensor-parallel rank, as vLLM and SGLang hold them, beside an eighth of the up-projections (q_b
    1536 x 128 x 192, kv_b 512 x 128 x (128 + 128)) and of o_proj (128 x 128 x 7168) at tp 8;
    Qwen3-235B-A22B's 4 KV heads one per rank at tp 8 (64 query heads of 128 over hidden 4096)."""
    layers = resolve_model("deepseek-v3").num_layers
    ops = cost(model="deepseek-v3", hw="h200", tensor_parallel=8, weight_dtype="fp8").ops
    down = 7168 * (1536 + 512 + 64) + 1536 + 512
    up = (1536 * 128 * 192 + 512 * 128 * (128 + 128)) / 8
    assert ops.qkv_proj.weight_bytes == pytest.approx(layers * (down + up))  # fp8: a byte a weight
    assert ops.o_proj.weight_bytes == pytest.approx(layers * 128 * 128 * 7168 / 8)
    assert ops.qkv_proj.flops_per_row == pytest.approx(2 * ops.qkv_proj.weight_bytes)  # every rank projects every row

    ops = cost(model="qwen3-235b-a22b", hw="h200", tensor_parallel=8).ops
    assert ops.qkv_proj.weight_bytes == pytest.approx(94 * (4096 * 64 * 128 / 8 + 2 * 4096 * 128) * 2)


def test_a_checkpoint_that_quantises_only_its_experts_reads_attention_in_bf16() -> None:
    """gpt-oss's MXFP4 checkpoints hold the routed experts in fp4 and attention in bf16, as the memory
    model loads them: on an H100 (no fp4 math) the attention projections read two bytes a weight at the
    bf16 rates and dequantise nothing, the bytes of a bf16 deployment, while the experts read fp4's and
    are dequantised."""
    fp4 = cost(model="gpt-oss-120b", hw="h100-sxm", weight_dtype="fp4")
    bf16 = cost(model="gpt-oss-120b", hw="h100-sxm", weight_dtype="bf16")
    assert fp4.dequant
    for name in ("qkv_proj", "o_proj"):
        quantised, plain = getattr(fp4.ops, name), getattr(bf16.ops, name)
        assert quantised.weight_bytes == pytest.approx(plain.weight_bytes) == pytest.approx(quantised.flops_per_row)
        assert quantised.high_precision and quantised.dequant_ops == 0.0
    assert fp4.ops.experts is not None and fp4.ops.experts.dequant_ops_per_expert > 0
    assert fp4.ops.experts.bytes_per_expert < 0.3 * bf16.ops.experts.bytes_per_expert  # fp4's bytes, and padding


def test_an_mxfp4_kernel_streams_and_multiplies_the_experts_as_it_pads_them() -> None:
    """vLLM's Marlin MXFP4 kernel (Hopper, Ampere) holds gpt-oss-120b's experts padded, hidden 2880 -> 3072
    and intermediate 2880 -> 2944 on one GPU, as the memory model loads them: a step reads and multiplies
    3 x 3072 x 2944 values an expert (and its bf16 biases, 2 x 2944 + 3072). SGLang's kernel pads nothing."""
    m = resolve_model("gpt-oss-120b")
    assert m.moe is not None and m.moe.expert_bias
    layers, per_value = m.num_moe_layers, WEIGHT_BYTES_PER_PARAM["fp4"]
    values, biases = 3 * 3072 * 2944, 2 * 2944 + 3072
    vllm = cost(model="gpt-oss-120b", weight_dtype="fp4", engine="vllm-0.11").ops.experts
    assert vllm is not None
    assert vllm.bytes_per_expert == pytest.approx(layers * (values * per_value + 2 * biases))
    assert vllm.flops_per_row == pytest.approx(2 * layers * m.moe.top_k * (values + biases))
    sglang = cost(model="gpt-oss-120b", weight_dtype="fp4", engine="sglang-0.5").ops.experts
    assert sglang is not None
    assert sglang.bytes_per_expert == pytest.approx(layers * (3 * 2880 * 2880 * per_value + 2 * 3 * 2880))


def test_breakdown_sums_to_step_time_for_mixed_steps() -> None:
    out = step(req(1, 900), req(1, 50), req(3, 300, prefill=False, drafts=2), req(512, 1024, samples=False), req(700))
    for cm in (cost(), cost(tensor_parallel=2, pipeline_parallel=2), cost(model="qwen3-30b-a3b", tensor_parallel=2),
               cost(model="gemma-2-9b"), cost(model="deepseek-v3", hw="h200", tensor_parallel=8, weight_dtype="fp8")):
        b = cm.breakdown(out)
        assert tuple(b) == OPERATORS
        assert all(v >= 0 for v in b.values())
        assert sum(b.values()) == pytest.approx(cm.step_time(out), rel=1e-12)


_STEP_REQUESTS = st.lists(st.tuples(st.integers(1, 2048), st.integers(0, 8192), st.booleans(), st.booleans()),
                          min_size=1, max_size=12)


@pytest.mark.parametrize("cm", [
    cost(), cost(tensor_parallel=2, pipeline_parallel=2), cost(model="qwen3-30b-a3b", tensor_parallel=2, engine="sglang-0.5"),
    cost(model="gemma-2-9b", engine="trtllm-1.2"), cost(model="deepseek-v3", hw="h200", tensor_parallel=8, weight_dtype="fp8"),
    cost(engine="vllm-0.6", knobs=EngineKnobs(enforce_eager=True)), cost(tensor_parallel=2, context_parallel=2),
], ids=["dense", "tp2-pp2", "moe-overlapped-host", "windows", "mla-fp8", "eager", "context-parallel"])
@settings(max_examples=40, deadline=None)
@given(steps=st.lists(_STEP_REQUESTS, min_size=2, max_size=6), copy_s=st.sampled_from([0.0, 1.5e-4]))
def test_a_step_costs_the_same_a_float_at_a_time_as_over_arrays(cm: CostModel, steps, copy_s: float) -> None:
    """step() prices a step a float at a time, with what depends on row counts alone memoised (the
    simulator's path); times() prices any step, or many at once over arrays (bulk runs, the public
    fit). To the bit for one step: a bulk run is times() over one row count (scalar row terms) and
    must agree with the steps one by one (tests/planner/test_sim_bulk.py). Over steps of different
    row counts, numpy's power (MoE's experts touched) may differ from C's in the last bit."""
    outputs = [step(*(req(q, cached, prefill=q > 1 and prefill, samples=samples or q == 1) for q, cached, prefill, samples
                      in requests)) for requests in steps]
    shapes = StepShape.stack([cm.reader.read(o) for o in outputs])
    times, flops, nbytes = cm.times(shapes, copy_s=copy_s)
    many = [np.broadcast_to(v, len(outputs)) for v in (sum(times), flops, nbytes, sum(
        times[OPERATORS.index(op)] for op in COMM_OPERATORS + ("pp_transfer",)))]
    for i, o in enumerate(outputs):
        shape = cm.reader.read(o)
        alone = cm._step_cost(shape, copy_s)
        one_times, one_flops, one_bytes = cm.times(shape, copy_s=copy_s)
        seconds, comm_s = _totals(one_times)
        assert tuple(alone) == (seconds, one_flops, one_bytes, comm_s)
        assert tuple(alone) == pytest.approx(tuple(float(v[i]) for v in many), rel=1e-12)


def test_only_sampled_rows_reach_the_lm_head() -> None:
    cm = cost()
    assert cm.breakdown(step(req(512, samples=False)))["lm_head"] == 0
    one, five = cm.breakdown(step(req(1, 10))), cm.breakdown(step(req(5, 10, prefill=False, drafts=4)))
    kernels = 3 * get_hardware("h100-sxm").efficiency.graph_kernel_us * 1e-6
    assert five["sampling"] - kernels == pytest.approx(5 * (one["sampling"] - kernels))


def test_deterministic_and_empty_step() -> None:
    out = step(req(1, 100), req(300))
    assert cost().step_time(out) == cost().step_time(out)
    assert cost().step_time(step()) == 0.0


def test_calibration_params_override_and_validate() -> None:
    base = cost()
    params = base.params
    slow = params.with_values({"step_overhead_s": params.step_overhead_s + 1e-3})
    assert cost(calibration=slow).decode_time_per_token_s(1, 10) == pytest.approx(base.decode_time_per_token_s(1, 10) + 1e-3)
    falloff = params.with_values({"gemm_half_size_tokens": 64})
    # Few tokens: under-utilised matmuls; many tokens: nearly no change.
    assert cost(calibration=falloff).prefill_time_s(512) > 1.05 * base.prefill_time_s(512)
    assert cost(calibration=falloff).prefill_time_s(8192) == pytest.approx(base.prefill_time_s(8192), rel=0.02)
    with pytest.raises(InputError):
        params.with_values({"memory_efficiency": 1.5})
    with pytest.raises(InputError, match="cost parameter"):
        params.with_values({"warp_speed": 2.0})


def test_assumptions_list_the_figures() -> None:
    a = cost(tensor_parallel=2, weight_dtype="fp8").assumptions()
    for key in ("gemm_peak_tflops", "memory_bandwidth_gb_s", "memory_efficiency", "compute_efficiency",
                "weight_bytes_per_param", "tp_link", "step_overhead_s", "notes"):
        assert key in a
    assert a["gemm_compute_dtype"] == "fp8" and a["gemm_peak_tflops"] == 1979


@pytest.mark.parametrize("model", ["llama-3.1-8b", "gemma-2-9b"])
def test_convenience_functions_match_scheduler_outputs(model: str) -> None:
    cm = cost(model=model)
    assert cm.decode_time_per_token_s(4, 6000) == pytest.approx(cm.step_time(step(*[req(1, 6000)] * 4)), rel=1e-12)
    assert cm.prefill_time_s(5000, cached=2000) == pytest.approx(cm.step_time(step(req(5000, 2000))), rel=1e-12)


# ---------------------------------------------------------------- graphs vs eager launches


def test_a_replayed_graph_pads_the_dense_operators_to_its_captured_size() -> None:
    graph, eager = cost(), cost(knobs=EngineKnobs(enforce_eager=True))
    nine = graph.breakdown(step(*[req(1, 500) for _ in range(9)]))
    sixteen_eager = eager.breakdown(step(*[req(1, 500) for _ in range(16)]))
    nine_eager = eager.breakdown(step(*[req(1, 500) for _ in range(9)]))
    for op in (*GEMMS, "norms_elementwise"):  # 9 requests run as the 16-row graph
        assert nine[op] == pytest.approx(sixteen_eager[op], rel=1e-12)
    for op in ("attention", "lm_head", "sampling"):  # only the real requests attend and sample
        assert nine[op] == pytest.approx(nine_eager[op], rel=1e-12)


def test_eager_small_batches_wait_on_launches_that_a_graph_removes() -> None:
    hw = get_hardware("h100-sxm")
    e = hw.efficiency
    out = step(req(1, 128))
    eager = cost(knobs=EngineKnobs(enforce_eager=True)).breakdown(out)
    graph = cost().breakdown(out)
    # 66 norm kernels (2 per layer + final norm + embedding) each take a launch, far longer than the
    # norm itself: eager waits at least that long on the norms alone.
    assert eager["kernel_launch"] >= 66 * e.kernel_launch_us * 1e-6 - eager["norms_elementwise"]
    # The graph: one launch; then sampling's 3 eager kernels, each shorter than its launch.
    assert graph["kernel_launch"] == pytest.approx(4 * e.kernel_launch_us * 1e-6 - graph["sampling"], rel=1e-9)
    assert graph["kernel_launch"] < eager["kernel_launch"] / 3
    # Big batches are long enough to hide the launches: eager and graph end up within a few percent.
    big = step(*[req(1, 2000) for _ in range(256)])
    assert cost(knobs=EngineKnobs(enforce_eager=True)).step_time(big) == pytest.approx(cost().step_time(big), rel=0.03)


@pytest.mark.parametrize(
    "out",
    [
        step(req(1, 100), req(64, 0)),  # a prefill chunk in the step
        step(req(4, 100, prefill=False, drafts=3)),  # speculative verification
        step(*[req(1, 100) for _ in range(9)]),  # more requests than max_graph_batch_size below
    ],
    ids=["mixed", "speculative", "over-max"],
)
def test_steps_a_graph_cannot_hold_run_eagerly(out: SchedulerOutput) -> None:
    # SGLang captures decode batches only: its prompt chunks and drafts run eagerly.
    graph = cost(engine="sglang-0.5", knobs=EngineKnobs(max_graph_batch_size=8)).breakdown(out)
    eager = cost(engine="sglang-0.5", knobs=EngineKnobs(enforce_eager=True)).breakdown(out)
    assert graph == eager


@pytest.mark.parametrize("out", [step(req(1, 100), req(64, 0)), step(req(4, 100, prefill=False, drafts=3))],
                         ids=["mixed", "speculative"])
def test_vllm_v1_replays_piecewise_graphs_for_prompt_chunks_and_drafts(out: SchedulerOutput) -> None:
    """vLLM V1 captures the layers between attentions for any step of up to its largest captured size:
    the dense operators run at the padded size, a launch a layer, attention's kernels launched eagerly
    between; the LM head and sampling after the graph as for a decode graph."""
    launch = get_hardware("h100-sxm").efficiency.kernel_launch_us * 1e-6
    piecewise = cost(knobs=EngineKnobs(max_graph_batch_size=512)).breakdown(out)
    eager = cost(knobs=EngineKnobs(enforce_eager=True)).breakdown(out)
    layers = resolve_model("llama-3.1-8b").num_layers
    expected = (launch * (1 + layers) + max(3 * layers * launch - piecewise["attention"], 0.0)
                + max(launch - piecewise["lm_head"], 0.0) + max(3 * launch - piecewise["sampling"], 0.0))
    assert piecewise["kernel_launch"] == pytest.approx(expected, rel=1e-12)
    assert piecewise["kernel_launch"] < eager["kernel_launch"]
    tokens = out.total_num_scheduled_tokens
    padded = step(req(1, 100), req(graph_batch_size(tokens, 512) - 1, 0))  # the same rows, eagerly
    for op in (*GEMMS, "norms_elementwise"):
        assert piecewise[op] == pytest.approx(cost(knobs=EngineKnobs(enforce_eager=True)).breakdown(padded)[op], rel=1e-12)
    # vLLM 0.8-0.10 replay a decode batch piecewise too; 0.11 in one whole graph.
    decode = step(*[req(1, 500) for _ in range(9)])
    old_v1, new_v1 = cost(engine="vllm-0.9").breakdown(decode), cost().breakdown(decode)
    assert old_v1["kernel_launch"] == pytest.approx(
        new_v1["kernel_launch"] + launch * layers + max(3 * layers * launch - old_v1["attention"], 0.0), rel=1e-12)
    # Past the largest captured size a step runs eagerly.
    big = cost(knobs=EngineKnobs(max_graph_batch_size=32)).breakdown(out)
    small_cap = cost(knobs=EngineKnobs(enforce_eager=True)).breakdown(out)
    assert (big == small_cap) == (tokens > 32)


def test_devices_without_graph_capture_ignore_the_knob() -> None:
    out = step(req(1, 100))
    on_cpu = cost(hw="epyc-9654-2s").breakdown(out)
    assert on_cpu == cost(hw="epyc-9654-2s", knobs=EngineKnobs(enforce_eager=True)).breakdown(out)
    assert on_cpu["kernel_launch"] == 0.0  # CPU per-op costs live in the calibrated overheads


def test_api_server_figures_are_priced_only_when_served_over_http() -> None:
    """The serveplan profile's streaming cost: api_step_s + api_token_s per token, once per step that
    samples, and nothing for an in-process deployment."""
    from planner.engines import get_engine

    model, hw = resolve_model("llama-3.1-8b"), get_hardware("h100-sxm")
    engine = get_engine("serveplan")
    params = CostParams.defaults(hw, engine)
    assert params.api_step_s > 0 and params.api_token_s > 0 and params.api_request_s > 0
    served = CostModel(model, hw, Deployment(hardware=hw.name, engine="serveplan"), params)
    local = CostModel(model, hw, Deployment(hardware=hw.name, engine="serveplan", api_server=False), params)
    assert local.params == params.in_process()
    for batch in (1, 8):
        extra = served.decode_cost(batch, 512).seconds - local.decode_cost(batch, 512).seconds
        assert extra == pytest.approx(params.api_step_s + batch * params.api_token_s)


@pytest.mark.parametrize(("model_name", "endpoint", "api_server", "templated"), [
    ("qwen3-14b", "chat", True, True),
    ("qwen3-14b", "completions", True, False),
    ("gpt-oss-20b", "chat", True, False),  # vLLM renders gpt-oss's harmony format natively
    ("qwen3-14b", "chat", False, False),  # in process: no API server at all
])
def test_the_api_server_renders_a_chat_template_only_for_chat_requests_to_templated_models(
        model_name: str, endpoint: str, api_server: bool, templated: bool) -> None:
    from planner.engines import get_engine

    model, hw, engine = resolve_model(model_name), get_hardware("h100-sxm"), get_engine("vllm-0.11")
    params = CostParams.defaults(hw, engine).with_values({"api_request_s": 3e-3, "api_chat_template_s": 7e-3})
    dep = Deployment(hardware=hw.name, engine=engine.name, api_server=api_server, api_endpoint=endpoint)
    front_end_s = CostModel(model, hw, dep, params).front_end_s
    assert front_end_s == pytest.approx((3e-3 + (7e-3 if templated else 0.0)) if api_server else 0.0)


def test_api_latency_delays_each_request_without_loading_the_server() -> None:
    """Known answer, one replica: a request sent alone reaches its first token api_latency_s later
    than without it; a burst of requests is not spread further apart by it (requests spend it side
    by side), unlike api_request_s, which they take one after another."""
    from planner.sim import simulate
    from planner.workload import FixedLength, OfflineArrivals, Workload

    model, hw = resolve_model("llama-3.1-8b"), get_hardware("h100-sxm")
    dep = Deployment(hardware=hw.name, engine="vllm-0.11", api_endpoint="completions")
    base = CostParams.defaults(hw).with_values({"api_request_s": 1e-3, "api_latency_s": 0.0})

    def ttfts_ms(requests: int, **values: float) -> list[float]:
        w = Workload(name="burst", arrival=OfflineArrivals(), input_tokens=FixedLength(tokens=64),
                     output_tokens=FixedLength(tokens=4), num_requests=requests)
        result = simulate(model, hw, dep, w, calibration=base.with_values(values))
        return sorted(r.ttft_s * 1e3 for r in result.record.requests)

    alone, alone_late = ttfts_ms(1), ttfts_ms(1, api_latency_s=0.05)
    assert alone_late[0] == pytest.approx(alone[0] + 50.0)
    burst, burst_late = ttfts_ms(8), ttfts_ms(8, api_latency_s=0.05)
    assert burst_late == pytest.approx([t + 50.0 for t in burst])


@pytest.mark.parametrize(("model_name", "hw_name", "engine_name", "chosen", "triton"), [
    ("gpt-oss-20b", "a100-80gb-sxm", "vllm-0.11", None, True),  # sinks before Hopper: vLLM's Triton backend
    ("gpt-oss-20b", "l40s", "sglang-0.5", None, True),  # and SGLang's, on Ada too
    ("gpt-oss-20b", "h100-sxm", "vllm-0.11", None, False),  # FlashAttention 3 has sinks
    ("gpt-oss-20b", "a100-80gb-sxm", "trtllm-1.2", None, False),  # TensorRT-LLM's own kernels
    ("qwen3-14b", "a100-80gb-sxm", "vllm-0.11", None, False),  # no sinks: FlashAttention 2
    ("qwen3-14b", "h100-sxm", "sglang-0.5", "triton", True),  # --attention-backend triton
    ("gpt-oss-20b", "h100-sxm", "vllm-0.11", "flash", False),
])
def test_prefill_attention_runs_at_the_triton_share_where_the_engine_takes_triton_kernels(
        model_name: str, hw_name: str, engine_name: str, chosen: str | None, triton: bool) -> None:
    """Known answer: a long prompt's attention is FLOP-bound, so at a Triton share of 1/4 it takes 4x
    as long where the engine runs Triton attention (its choice, or the deployment's), and exactly as
    long elsewhere; decode attention, bound by its KV reads, is the same either way."""
    model, hw = resolve_model(model_name), get_hardware(hw_name)
    dep = Deployment(hardware=hw.name, engine=engine_name, attention_kernel=chosen)
    base = CostParams.defaults(hw, get_engine(engine_name)).with_values({"kernel_latency_s": 0.0})

    def attention_s(share: float) -> tuple[float, float]:
        cm = CostModel(model, hw, dep, base.with_values({"triton_attention_efficiency": share}))
        assert cm.triton_attention is triton
        return cm.prefill_breakdown(8192)["attention"], cm.decode_breakdown(32, 2048)["attention"]

    (prefill_full, decode_full), (prefill_quarter, decode_quarter) = attention_s(1.0), attention_s(0.25)
    assert prefill_quarter == pytest.approx(prefill_full * (4.0 if triton else 1.0), rel=1e-9)
    assert decode_quarter == pytest.approx(decode_full, rel=1e-9)


def test_flash_attention_is_refused_where_the_engine_has_none_for_the_model() -> None:
    """gpt-oss's attention sinks have no FlashAttention-class kernel in vLLM before Hopper: choosing one
    is one line naming the setting, not a silent Triton price."""
    model, hw = resolve_model("gpt-oss-20b"), get_hardware("a100-80gb-sxm")
    with pytest.raises(InputError, match="attention_kernel.*vllm-0.11 has no FlashAttention-class kernel for attention "
                                         "sinks on ampere GPUs"):
        CostModel(model, hw, Deployment(hardware=hw.name, engine="vllm-0.11", attention_kernel="flash"))
