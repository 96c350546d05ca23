"""Communication, expert parallelism, data-parallel attention and context parallelism in the cost and
memory models: each checked against a figure worked out by hand or an invariant it must keep."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from pydantic import ValidationError
import pytest

from engine.catalog import resolve_model
from planner.costmodel import OPERATORS, CostModel, CostParams
from planner.costmodel.comm import MAX_MEMO_PAYLOADS, CollectiveCost, bus_factor, custom_all_reduce_stages
from planner.costmodel.model import COMM_OPERATORS
from planner.engines import get_engine
from planner.hardware import get_hardware
from planner.memory import plan_memory
from planner.sim import simulate
from planner.specs import CollectiveCurve, Deployment, Link
from planner.workload import FixedLength, PoissonArrivals, Workload

CURVE = CollectiveCurve(ranks=8, points=((1e3, 10.0), (1e5, 20.0), (1e7, 200.0)), source="test")
LINK = Link(name="test", bandwidth_gb_s=100.0, latency_us=2.0, domain_size=8, collectives={"all_reduce": CURVE})


def test_a_measured_curve_gives_its_points_and_interpolates_log_log_between() -> None:
    cost = CollectiveCost("all_reduce", 8, LINK, 0.8)
    for size, us in CURVE.points:
        assert cost.seconds(size) == pytest.approx(us * 1e-6)
    # Halfway in log size between 1e5 and 1e7 lies the geometric mean of their times.
    assert cost.seconds(1e6) == pytest.approx(np.sqrt(20.0 * 200.0) * 1e-6)
    assert cost.seconds(10.0) == cost.seconds(1e3)  # the latency floor below the smallest point
    assert cost.seconds(4e7) == pytest.approx(4 * cost.seconds(1e7))  # the largest point's bandwidth beyond it
    arrays = cost.seconds(np.array([10.0, 1e6, 4e7]))
    assert arrays == pytest.approx([cost.seconds(10.0), cost.seconds(1e6), cost.seconds(4e7)])


def test_a_curve_of_8_ranks_is_used_on_2_through_the_bus_bandwidth_factors() -> None:
    eight, two = CollectiveCost("all_reduce", 8, LINK, 0.8), CollectiveCost("all_reduce", 2, LINK, 0.8)
    assert two.seconds(1e6) == pytest.approx(eight.seconds(1e6) * bus_factor("all_reduce", 2) / bus_factor("all_reduce", 8))
    # A collective without a curve: the ring on the datasheet figures.
    a2a = CollectiveCost("all_to_all", 4, LINK, 0.5)
    assert a2a.seconds(1e6) == pytest.approx(3 * 2e-6 + 0.75 * 1e6 / (100e9 * 0.5))
    assert "measured" in eight.describe()["model"] and "ring" in a2a.describe()["model"]


def test_the_custom_all_reduce_prices_small_payloads_by_vllms_stages_and_nccl_above_its_buffer() -> None:
    """Known answers on a 100 GB/s, 2 us link (efficiency 0.8): one stage below 256 KiB on 8 ranks,
    two stages up to the 8 MiB buffer, NCCL's curve from there; the fitted time scale applies."""
    eight = CollectiveCost("all_reduce", 8, LINK, 0.8, time_scale=1.5, custom_max_bytes=8 << 20)
    bandwidth = 100e9 * 0.8
    assert eight.seconds(64 << 10) == pytest.approx(1.5 * (2 * 2e-6 + 7 * (64 << 10) / bandwidth))
    assert eight.seconds(1 << 20) == pytest.approx(1.5 * (3 * 2e-6 + 2 * 7 / 8 * (1 << 20) / bandwidth))
    nccl = CollectiveCost("all_reduce", 8, LINK, 0.8, time_scale=1.5)
    assert eight.seconds(8 << 20) == nccl.seconds(8 << 20)  # the buffer's size itself goes to NCCL
    sizes = np.array([64 << 10, 1 << 20, 8 << 20], dtype=float)
    assert eight.seconds(sizes) == pytest.approx([eight.seconds(float(b)) for b in sizes])
    # vLLM's switch: 2 ranks always one stage; 4 ranks below 512 KiB; 8 ranks below 256 KiB.
    assert [custom_all_reduce_stages(r, 300 << 10) for r in (2, 4, 8)] == [1, 1, 2]
    assert [custom_all_reduce_stages(r, 600 << 10) for r in (2, 4, 8)] == [1, 2, 2]
    assert eight.describe()["custom_all_reduce"]["below_payload_bytes"] == 8 << 20


def test_a_measured_custom_all_reduce_curve_prices_the_kernel_up_to_its_last_point_then_nccl() -> None:
    """Known answers: the custom kernel's curve for the group's rank count (else the fewest ranks above
    it, else the most measured), log-log between points, the fitted time scale on it; past its last
    measured payload NCCL's curve, not the kernel's curve extrapolated."""
    two = CollectiveCurve(ranks=2, points=((1e3, 4.0), (1e6, 40.0)), source="test")
    eight = CollectiveCurve(ranks=8, points=((1e3, 8.0), (1e6, 80.0)), source="test")
    link = LINK.model_copy(update={"custom_all_reduce": (two, eight)})
    on = {r: CollectiveCost("all_reduce", r, link, 0.8, time_scale=1.5, custom_max_bytes=8 << 20) for r in (2, 4, 8)}
    assert [on[r].custom_curve.ranks for r in (2, 4, 8)] == [2, 8, 8]
    assert on[2].seconds(1e3) == pytest.approx(1.5 * 4e-6)
    assert on[8].seconds(1e6) == pytest.approx(1.5 * 80e-6)
    assert on[4].seconds(np.sqrt(1e9)) == pytest.approx(1.5 * np.sqrt(8.0 * 80.0) * 1e-6)  # geometric mean
    nccl = CollectiveCost("all_reduce", 8, LINK, 0.8, time_scale=1.5)
    assert on[8].seconds(1e6 + 1) == nccl.seconds(1e6 + 1)  # past the curve, under the 8 MiB buffer
    sixteen = CollectiveCost("all_reduce", 16, link, 0.8, custom_max_bytes=8 << 20)
    assert sixteen.custom_curve is eight  # more ranks than measured: the most measured
    sizes = np.array([1e3, 5e5, 2e6, 1e7])
    assert on[8].seconds(sizes) == pytest.approx([on[8].seconds(float(b)) for b in sizes])
    assert on[8].describe()["custom_all_reduce"]["model"] == "measured curve, log-log interpolation"
    with pytest.raises(ValidationError, match="one curve per rank count"):
        LINK.model_copy(update={"custom_all_reduce": (two, two)}).model_validate(
            {**LINK.model_dump(), "custom_all_reduce": [two.model_dump(), two.model_dump()]})


def test_a_payload_priced_again_costs_what_it_cost_the_first_time() -> None:
    """One step at a time, prices are kept by payload (CollectiveCost._memo): a second call, and
    calls past the memo's bound, give the first call's seconds, and arrays price alike."""
    cost = CollectiveCost("all_reduce", 8, LINK, 0.8, time_scale=1.5, custom_max_bytes=8 << 20)
    sizes = np.geomspace(1.0, 1e9, 300)
    first = [cost.seconds(float(b)) for b in sizes]
    assert [cost.seconds(float(b)) for b in sizes] == first
    assert first == pytest.approx(cost.seconds(sizes), rel=1e-12)
    for b in range(MAX_MEMO_PAYLOADS + 10):  # the memo is cleared when full, not grown
        cost.seconds(float(b))
    assert [cost.seconds(float(b)) for b in sizes] == first


def test_hopper_decode_all_reduces_cost_what_the_kernel_was_measured_at() -> None:
    """Llama-3.1-70B on 4 x H100 and 4 x H200 (the same NVLink 4 and switch): a decode step's
    all-reduce of 32 rows (512 KiB) costs the 4-rank measurement at 512 KiB, 26.9 us, where the
    latency + bytes / bandwidth model gave a fifth of it."""
    model = resolve_model("llama-3.1-70b")
    for name in ("h100-sxm", "h200"):
        hw = get_hardware(name)
        costs = CostModel(model, hw, dep(hardware=name, tensor_parallel=4, engine="vllm-0.11"),
                          CostParams.defaults(hw, get_engine("vllm-0.11"))).comms
        [allreduce] = [cost for c, cost in costs if c.operator == "tp_allreduce"]
        assert allreduce.seconds(32 * model.hidden_size * 2) == pytest.approx(26.9e-6)


def test_engines_custom_all_reduce_reaches_tensor_parallel_decode_on_the_switch_only() -> None:
    """vLLM's small-batch decode all-reduce on 8 x H100 (NVSwitch) takes its custom kernel, far under
    NCCL's ~40 us floor; ServePlan's own engine (gloo/NCCL only) and an A100 PCIe card without a
    switch keep NCCL's or the ring's pricing."""
    model, hw = resolve_model("llama-3.1-70b"), get_hardware("h100-sxm")
    vllm = CostModel(model, hw, dep(tensor_parallel=8, engine="vllm-0.11"), CostParams.defaults(hw, get_engine("vllm-0.11")))
    [(_, allreduce)] = [(c, cost) for c, cost in vllm.comms if c.operator == "tp_allreduce"]
    assert allreduce.custom_max_bytes == 8 << 20
    decode_payload = 8 * model.hidden_size * 2  # 8 rows of bf16 activations
    nccl = replace(allreduce, custom_max_bytes=0)  # the same collective sent through NCCL
    assert allreduce.seconds(decode_payload) < 0.5 * nccl.seconds(decode_payload)
    own = CostModel(model, hw, dep(tensor_parallel=8, engine="serveplan"), CostParams.defaults(hw, get_engine("serveplan")))
    assert all(cost.custom_max_bytes == 0 for _, cost in own.comms)
    pcie = get_hardware("a100-80gb-pcie")
    on_pcie = CostModel(model, pcie, dep(hardware=pcie.name, tensor_parallel=4, engine="vllm-0.11"),
                        CostParams.defaults(pcie, get_engine("vllm-0.11")))
    assert all(cost.custom_max_bytes == 0 for _, cost in on_pcie.comms)


def test_curves_must_ascend_in_size() -> None:
    with pytest.raises(ValidationError, match="points.*strictly ascending"):
        CollectiveCurve(ranks=2, points=((1e3, 1.0), (1e3, 2.0)), source="x")


def dep(**changes: object) -> Deployment:
    return Deployment(**{"hardware": "h100-sxm", **changes})  # type: ignore[arg-type]


def test_collective_time_scale_scales_every_communication_term_and_no_other_device_time() -> None:
    """The public fit's one communication figure: it must reach collectives priced from a measured
    curve (the H100 all-reduce), from the datasheet ring (the logits' all-gather, all-to-all) and
    the pipeline hand-off, or a family's communication could not be fitted."""
    model, hw = resolve_model("qwen3-30b-a3b"), get_hardware("h100-sxm")
    d = dep(tensor_parallel=4, pipeline_parallel=2, expert_parallel=4, engine="serveplan")
    base = CostParams.defaults(hw, get_engine("serveplan"))
    one = CostModel(model, hw, d, base).prefill_breakdown(2048)
    scaled = CostModel(model, hw, d, base.with_values({"collective_time_scale": 2.5})).prefill_breakdown(2048)
    comm = (*COMM_OPERATORS, "pp_transfer")
    assert all(one[op] > 0 for op in ("tp_allreduce", "tp_gather", "ep_alltoall", "pp_transfer"))
    device = OPERATORS[:OPERATORS.index("host")]  # the launch wait after them depends on their sum
    for op in device:
        assert scaled[op] == pytest.approx(one[op] * (2.5 if op in comm else 1.0), rel=1e-12), op


def test_shared_host_slowdown_scales_each_ranks_kernels_and_no_communication() -> None:
    """Ranks sharing a host's cores and memory (`calibrate --tp` fits how much they slow each other):
    every computing operator's roofline takes that multiple, the collectives keep their curve's
    time, and a model on one process is untouched."""
    model, hw = resolve_model("qwen3-30b-a3b"), get_hardware("h100-sxm")  # the arithmetic is the same on any device
    base = CostParams.defaults(hw, get_engine("serveplan")).with_values({"kernel_latency_s": 0.0})
    slowed = base.with_values({"shared_host_slowdown": 1.5})
    device = OPERATORS[:OPERATORS.index("host")]
    comm = (*COMM_OPERATORS, "pp_transfer")
    for tp in (1, 2):
        d = dep(hardware=hw.name, tensor_parallel=tp, expert_parallel=tp, engine="serveplan")
        one = CostModel(model, hw, d, base).prefill_breakdown(512, 256)
        scaled = CostModel(model, hw, d, slowed).prefill_breakdown(512, 256)
        assert tp == 1 or one["tp_allreduce"] > 0
        for op in device:
            factor = 1.5 if tp > 1 and op not in comm else 1.0
            assert scaled[op] == pytest.approx(one[op] * factor, rel=1e-12), (tp, op)


def test_expert_parallel_all_to_all_where_the_engine_dispatches_so() -> None:
    """ServePlan's engine sends tokens to their experts' ranks; vLLM's FusedMoE runs each rank's experts
    on the replicated tokens and all-reduces: the MoE layers' all-reduces become all-to-alls."""
    model = resolve_model("qwen3-30b-a3b")
    hw = get_hardware("h100-sxm")
    vllm = CostModel(model, hw, dep(tensor_parallel=4, expert_parallel=4, engine="vllm-0.11"))
    ours = CostModel(model, hw, dep(tensor_parallel=4, expert_parallel=4, engine="serveplan"))
    width = CostModel(model, hw, dep(tensor_parallel=4, engine="vllm-0.11"))
    calls = {name: {c.operator: sum(x.calls for x in cm.ops.comms if x.operator == c.operator) for c in cm.ops.comms}
             for name, cm in (("vllm", vllm), ("ours", ours), ("width", width))}
    layers, moe = model.num_layers, model.num_moe_layers
    assert calls["vllm"] == calls["width"] == {"tp_allreduce": 2 * layers + 1, "tp_gather": 1}
    # Two all-to-alls and a count exchange per MoE layer, then the all-gather back to every rank.
    assert calls["ours"] == {"tp_allreduce": 2 * layers + 1 - moe, "tp_gather": 1, "ep_alltoall": 4 * moe}
    b = ours.prefill_breakdown(1024)
    assert b["ep_alltoall"] > 0 and vllm.prefill_breakdown(1024)["ep_alltoall"] == 0
    assert "all-to-all" in " ".join(ours.assumptions()["notes"])  # type: ignore[arg-type]


def test_data_parallel_attention_holds_each_groups_latents_only() -> None:
    """DeepSeek's MLA latent is replicated by tensor parallelism; with attention data-parallel over 8
    groups each GPU keeps only its own requests' latents: 8x the tokens per byte, at the price of
    attention weights replicated over the groups."""
    model, hw = resolve_model("deepseek-v3"), get_hardware("h200")
    base = {"hardware": "h200", "tensor_parallel": 8, "expert_parallel": 8, "weight_dtype": "fp8", "kv_dtype": "fp8",
            "engine": "sglang-0.5"}
    tp, dpa = Deployment(**base), Deployment(**base, attention_data_parallel=8)  # type: ignore[arg-type]
    plan_tp, plan_dpa = plan_memory(model, hw, tp, 8192), plan_memory(model, hw, dpa, 8192)
    assert plan_dpa.kv_bytes_per_token_per_gpu * 8 == pytest.approx(plan_tp.kv_bytes_per_token_per_gpu, rel=0.01)
    assert plan_dpa.weights.transformer_layers_gib > plan_tp.weights.transformer_layers_gib
    assert plan_dpa.kv_cache_tokens > 5 * plan_tp.kv_cache_tokens
    decode_tp, decode_dpa = CostModel(model, hw, tp).decode_breakdown(64, 4000), CostModel(model, hw, dpa).decode_breakdown(64, 4000)
    assert decode_dpa["attention"] < decode_tp["attention"] / 2  # each GPU reads its own requests' latents
    assert decode_dpa["ep_alltoall"] > 0 and decode_tp["ep_alltoall"] == 0  # DeepEP-style dispatch between groups
    with pytest.raises(ValidationError, match="attention_data_parallel=3 is invalid: must divide tensor_parallel"):
        Deployment(**base, attention_data_parallel=3)  # type: ignore[arg-type]


def test_context_parallelism_splits_long_prompts_and_their_cache() -> None:
    model, hw = resolve_model("llama-3.1-8b"), get_hardware("h100-sxm")
    one, four = CostModel(model, hw, dep()), CostModel(model, hw, dep(context_parallel=4))
    assert dep(context_parallel=4).gpus_per_replica == 4
    b1, b4 = one.prefill_breakdown(32_000), four.prefill_breakdown(32_000)
    for op in ("attention", "mlp", "qkv_proj"):
        assert b4[op] < b1[op] / 3  # a quarter of the tokens and pairs each, plus weight reads
    assert b4["cp_transfer"] > 0 and b1["cp_transfer"] == 0
    assert four.prefill_time_s(32_000) < one.prefill_time_s(32_000) / 3
    plan1, plan4 = plan_memory(model, hw, dep(), 100_000), plan_memory(model, hw, dep(context_parallel=4), 100_000)
    assert plan4.kv_cache_tokens == pytest.approx(4 * plan1.kv_cache_tokens, rel=0.01)


def test_simulate_reports_the_communication_terms_and_their_share() -> None:
    model, hw = resolve_model("llama-3.1-8b"), get_hardware("h100-sxm")
    wl = Workload(name="t", arrival=PoissonArrivals(rate_per_s=4.0), input_tokens=FixedLength(tokens=512),
                  output_tokens=FixedLength(tokens=32), num_requests=20, seed=1)
    single = simulate(model, hw, dep(), wl).summary
    tp4 = simulate(model, hw, dep(tensor_parallel=4), wl).summary
    assert single.utilisation.communication_share == 0.0
    assert 0.0 < tp4.utilisation.communication_share < 1.0  # type: ignore[operator]
    comms = tp4.assumptions["communication"]
    assert {c["operator"] for c in comms} == {"tp_allreduce", "tp_gather"}  # type: ignore[union-attr]
    reduce = next(c for c in comms if c["collective"] == "all_reduce")  # type: ignore[union-attr]
    assert reduce["ranks"] == 4 and reduce["model"].startswith("measured") and "nccl" in reduce["source"].lower()
    dumped = tp4.model_dump(mode="json")
    assert dumped["utilisation"]["communication_share"] == tp4.utilisation.communication_share
