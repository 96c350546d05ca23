"""Step time of one replica: the named operators' rooflines, kernel latencies, launches and host work.

Model of one operator: kernels x kernel_latency + max(FLOPs / (peak x compute efficiency at its
row count), bytes / (bandwidth x memory efficiency)), summed over layers; a dense weight matmul's
roofline is divided by the engine's dense_kernel_efficiency (its kernels against the family's).
Eager steps wait for the host to issue kernels (each operator takes at least kernels x
kernel_launch); a replayed graph is one launch. Host work (scheduling, input preparation, output
handling) adds to the device time, or overlaps it in engines that schedule ahead (SGLang,
TensorRT-LLM).

Rules worth knowing (all listed by `assumptions()`):
- A dense weight matmul of M rows computes at M / (M + gemm_half_size_tokens) of the compute
  efficiency (a GPU's figure from its hardware profile's kernel measurements; 0 where none were
  found): with few rows its tiles leave the device's SMs idle. Routed experts on GPUs run in fused
  grouped kernels, priced by their own share instead.
- Compute dtype of the weight matmuls: bf16/fp16/fp32 weights compute in their own format.
  fp8 (and fp4) weights compute natively (W8A8 / W4A4: activations quantised on the fly) when
  the profile lists a peak for that format (Hopper, Ada, Blackwell, MI300...); otherwise, and
  always for int8/int4, they are weight-only: the matmul runs in bf16 and each weight read
  pays DEQUANT_OPS_PER_WEIGHT vector (fp32-peak) operations, overlapping with the read.
- Weights are read once per step per layer, whatever the token count; activations in bf16
  (fp32 for fp32 models). Embedding and LM head stay unquantised, as in planner/memory/weights.py, and
  so does attention where the checkpoint quantises the routed experts only (MXFP4: gpt-oss).
- Each GPU reads the attention projections the memory model lays out on it: heads split, KV heads past
  their count and MLA's down-projections (q_a, kv_a) whole on every tensor-parallel rank.
- Pipeline parallelism: a step is one micro-batch flowing through every stage, so its time is
  the sum over stages (= every layer once, sharded by TP) plus (pp - 1) stage hand-offs.
- MoE: T tokens with top-k routing among E experts touch E(1 - (1 - k/E)^T) distinct experts
  in expectation (uniform routing); expert weight bytes scale with that (each expert as the engine's
  kernel holds it: vLLM's MXFP4 kernels pad gpt-oss's), FLOPs with T x k, and the
  grouped GEMM's efficiency follows the rows per touched expert, times the engine's fused-MoE
  kernel share (moe_kernel_efficiency; fp4_moe_kernel_efficiency for MXFP4 experts, another kernel)
  and the GPU family's grouped-GEMM share. That share slows
  the experts' tensor-core math alone: weight-only experts (MXFP4 on Hopper/Ampere, fp8 on Ampere)
  dequantise on the vector units, and the kernels stream their weights, at the family's own rates.
- MLA (DeepSeek): decode in the absorbed formulation, prefill attention expanded (as the engines
  run them); the KV latent is read once per token and is replicated on every TP rank.
"""

from __future__ import annotations

from dataclasses import asdict
from functools import cache
from typing import Generic, NamedTuple, overload

import numpy as np
from scipy.stats import binom

from engine.config import ModelConfig
from engine.core.bulk_decodes import BulkShape
from engine.core.scheduler import SchedulerOutput
from engine.errors import InputError
from planner.costmodel.comm import CUSTOM_ALL_REDUCE_RANKS, CollectiveCost
from planner.costmodel.operators import (
    DEQUANT_OPS_PER_WEIGHT,
    NORM_TRAFFIC,
    Comm,
    Experts,
    Gemm,
    Operators,
    build_operators,
    dispatches_by_all_to_all,
)
from planner.costmodel.fitted import FittedModel
from planner.costmodel.params import CostParams
from planner.engines import EngineProfile, get_engine, resolve_deployment
from planner.costmodel.shape import GraphPolicy, N_co, Number, ShapeReader, StepShape
from planner.costmodel.transfer import KVCopyModel
from planner.memory import SAMPLER_COPIES, WEIGHT_BYTES_PER_PARAM, check_parallelism
from planner.specs import Deployment, HardwareProfile, Link

OPERATORS: tuple[str, ...] = (
    "qkv_proj",
    "o_proj",
    "attention",
    "mlp",
    "moe_experts",
    "router",
    "norms_elementwise",
    "lm_head",
    "sampling",
    "tp_allreduce",
    "tp_gather",
    "ep_alltoall",
    "cp_transfer",
    "pp_transfer",
    "host",
    "kernel_launch",
    "spec_draft",
    "kv_copy",
)
"""Keys of `CostModel.breakdown()`, always all present (0.0 where an operator does not apply)."""
_DEVICE_OPS = OPERATORS[: OPERATORS.index("host")]
COMM_OPERATORS = OPERATORS[OPERATORS.index("tp_allreduce") : OPERATORS.index("pp_transfer")]
_COMM_INDICES = tuple(OPERATORS.index(op) for op in (*COMM_OPERATORS, "pp_transfer"))
_GROUP_FIELD = {"tp_allreduce": "tensor_parallel", "tp_gather": "tensor_parallel", "ep_alltoall": "expert_parallel",
                "cp_transfer": "context_parallel"}
_AFTER_GRAPH = (OPERATORS.index("lm_head"), OPERATORS.index("sampling"))  # eager after a replayed graph
_ATTENTION = OPERATORS.index("attention")  # eager between the pieces of a piecewise graph


class StepCost(NamedTuple):
    """One step on one GPU of the replica: its time and the work behind it (for MFU and bandwidth use)."""

    seconds: float
    flops: float
    bytes: float
    comm_seconds: float = 0.0  # of `seconds`, the collectives and pipeline hand-offs


NO_COST = StepCost(0.0, 0.0, 0.0)


class StepCosts(NamedTuple):
    """StepCost's fields for many steps, as arrays."""

    seconds: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    comm_seconds: np.ndarray


# Scalar steps' row terms are memoised per (dense rows, sampled rows): decode steps repeat a few
# batch sizes all run long. Bounded, as prefill chunks can take many sizes.
_MAX_MEMO_ROWS = 8192


class _StepTerms(NamedTuple):
    """What one scalar step's cost takes from its row counts alone (everything but attention), laid
    out for `CostModel._step_cost` to add in times()'s order."""

    head: float  # qkv + o: the device operators before attention
    tail: tuple[float, ...]  # the device operators after it, in OPERATORS order
    comm_s: float  # the collectives and pipeline hand-offs, summed as _totals sums them
    wait_head: float  # their eager launch waits (_launch_wait), likewise split around attention's
    wait_tail: tuple[float, ...]
    rows: _RowTerms[float]


class _RowTerms(NamedTuple, Generic[N_co]):
    """A step's operators that depend on its row counts only (not on attention), and their work:
    floats for one step's row counts, arrays where either count is an array."""

    qkv: N_co
    o: N_co
    mlp: N_co
    moe: N_co
    router: N_co
    norms: N_co
    lm_head: N_co
    sampling: N_co
    pp: N_co
    flops: N_co  # of the draft and the matmuls before attention, in the order times() adds them
    bytes: N_co
    lm_head_flops: N_co
    lm_head_bytes: N_co
    norm_sample_bytes: N_co
    graph_launch_s: N_co  # the launch wait of a replayed graph: one launch, then LM head and sampling


def expected_distinct_experts(num_experts: int, top_k: int, tokens: Number) -> Number:
    """Expected number of distinct experts that `tokens` tokens touch with uniform top-k routing."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@cache
def busiest_rank_factors(num_experts: int, top_k: int, ranks: int, tokens: int) -> tuple[float, float]:
    """How far the busiest of `ranks` expert-parallel ranks exceeds the mean rank when `tokens` tokens
    route top-k uniformly among `num_experts` experts, num_experts / ranks whole experts on each:
    (distinct experts it touches, expert rows it computes), each E[max over ranks] / mean. A layer's
    experts end when its busiest rank does (the all-reduce or all-to-all after them waits), so at a
    few tokens one rank may read several experts' weights where the mean rank reads one (one token,
    8 of 128 experts on 8 ranks: 2.5 against 1). Ranks are taken as independent, each expert touched
    with probability 1 - (1 - k/E)^T and each of the T x k rows on a rank with probability 1/ranks
    (a seeded Monte Carlo of top-k routing agrees within 5 %, the rows from 16 tokens on: below, the
    ranks' shared total makes the busiest one busier, by up to 7 %, where weight reads bound the step);
    routing skew (popular experts) would add to it and is not modelled."""
    if tokens < 1:
        return 1.0, 1.0
    per_rank = num_experts // ranks
    touched = 1.0 - (1.0 - top_k / num_experts) ** tokens
    return (_expected_max_binomial(per_rank, touched, ranks) / (per_rank * touched),
            _expected_max_binomial(tokens * top_k, 1.0 / ranks, ranks) * ranks / (tokens * top_k))


def _expected_max_binomial(n: int, p: float, draws: int) -> float:
    """E[max of `draws` independent Binomial(n, p)] = sum over m of P(max > m) = 1 - F(m)^draws, over
    the window where that is neither 1 nor 0 (ten standard deviations each side)."""
    sd = (n * p * (1.0 - p)) ** 0.5
    low, high = max(0, int(n * p - 10 * sd)), min(n, int(n * p + 10 * sd) + 2)
    m = np.arange(low, high)
    return low + float(np.sum(1.0 - binom.cdf(m, n, p) ** draws))


def _busiest(e: Experts, rows: Number) -> tuple[Number, Number]:
    """busiest_rank_factors of experts `e` on their expert-parallel ranks at `rows` tokens, a step's or
    each step's of an array (computed once per distinct count)."""
    if not isinstance(rows, np.ndarray):
        return busiest_rank_factors(e.num_experts, e.top_k, e.ranks, round(float(rows)))
    counts, where = np.unique(np.rint(rows).astype(np.int64), return_inverse=True)
    factors = np.array([busiest_rank_factors(e.num_experts, e.top_k, e.ranks, int(c)) for c in counts])
    return factors[where, 0].reshape(rows.shape), factors[where, 1].reshape(rows.shape)


def gemm_compute_dtype(weight_dtype: str, hw: HardwareProfile) -> tuple[str, bool]:
    """(format the weight matmuls run in, whether weights are dequantised on the fly)."""
    if weight_dtype in ("bf16", "fp16", "fp32"):
        return hw.peak_flops(weight_dtype)[1], False
    if weight_dtype in ("fp8", "fp4") and hw.peak_flops(weight_dtype)[1] == weight_dtype:
        return weight_dtype, False  # W8A8 / W4A4 on tensor cores that have the format
    return hw.peak_flops("bf16")[1], True  # weight-only: bf16 math, dequantise each weight read


@overload
def _totals(times: tuple[float, ...]) -> tuple[float, float]: ...
@overload
def _totals(times: tuple[Number, ...]) -> tuple[Number, Number]: ...
def _totals(times: tuple[Number, ...]) -> tuple[Number, Number]:
    """A step's seconds (every operator of `times`, in OPERATORS order) and those of its collectives."""
    return sum(times), sum(times[i] for i in _COMM_INDICES)


@overload
def _max(a: float, b: float) -> float: ...
@overload
def _max(a: Number, b: Number) -> Number: ...
def _max(a: Number, b: Number) -> Number:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return a if a > b else b


def _present(rows: Number) -> Number:
    """1 where an operator runs (it has rows), else 0."""
    return (rows > 0).astype(float) if isinstance(rows, np.ndarray) else float(rows > 0)


class CostModel:
    """Seconds per engine step of one replica of `dep` serving `model` on `hw`."""

    def __init__(self, model: ModelConfig, hw: HardwareProfile, dep: Deployment, params: CostParams | None = None,
                 graphs: GraphPolicy | None = None, fit: FittedModel | None = None) -> None:
        """`params` default to the profiles' estimates with what `fit` (else the public GPU fit)
        learnt of hw's family and the engine. `graphs`: which decode steps replay a captured graph
        (default: the engine's policy up to the knobs' max_graph_batch_size, capped by max_num_seqs;
        none when the device or the knobs run eagerly)."""
        check_parallelism(model, dep)
        dep = resolve_deployment(dep, hw, max_model_len=model.max_position_embeddings)
        engine = get_engine(dep.engine)
        self.model, self.hw, self.dep = model, hw, dep
        p = params if params is not None else CostParams.fitted(hw, engine, fit)
        self.params = p = p if dep.api_server else p.in_process()
        # The API server's time per request, one request at a time (the simulator's front end): a chat
        # request also has its messages rendered by the model's Jinja template, unless the engine
        # renders this model's chat format natively.
        templated = dep.api_endpoint == "chat" and model.model_type not in engine.overheads.native_chat_model_types
        self.front_end_s = p.api_request_s + (p.api_chat_template_s if templated else 0.0)
        self.api_release = engine.overheads.api_release
        # What each request arriving while the engine runs takes from its step loop (a server in the
        # engine's process, sharing its GIL).
        self.api_hold_s = self.front_end_s * p.api_hold_share
        self.ops: Operators = build_operators(model, dep, hw)
        # The experts' rows fall off as dense matmuls' do where each expert is one (ServePlan's engine on a CPU);
        # a GPU's fused grouped kernels are priced by the grouped-GEMM share instead (CostParams).
        self._experts_half = p.gemm_half_size_tokens if hw.kind == "cpu" else 0.0
        ops = self.ops
        # Kernels per step of each device operator, in OPERATORS order: launches an eager step waits for.
        calls = {op: sum(c.calls for c in ops.comms if c.operator == op) for op in COMM_OPERATORS}
        self._kernels = (ops.qkv_proj.kernels, ops.o_proj.kernels, ops.attention.kernels, ops.mlp.kernels,
                         (ops.experts.kernels if ops.experts else 0.0) + ops.shared_experts.kernels, ops.router.kernels,
                         ops.norm_kernels, ops.lm_head.kernels, ops.sample_kernels, *calls.values(), 2 * ops.pp_handoffs)
        self.graphs = graphs if graphs is not None else _graph_policy(hw, dep, engine)
        self.graph_max = self.graphs.max_batch
        self.reader = ShapeReader(model, p.attention_pairs == "dense", self.graphs)

        self.gemm_dtype, self.dequant = gemm_compute_dtype(dep.weight_dtype, hw)
        self._act = 4.0 if dep.weight_dtype == "fp32" else 2.0
        gemm_peak = hw.peak_flops(self.gemm_dtype)[0]
        high_dtype = "fp32" if dep.weight_dtype == "fp32" else "bf16"
        high_peak, self._high_dtype = hw.peak_flops(high_dtype)
        self._vector_peak = hw.peak_flops("fp32")[0]
        bw = hw.memory_bandwidth_gb_s * 1e9
        # Effective rates: seconds per FLOP or byte at full efficiency, slower where ranks share a host.
        slow = p.shared_host_slowdown if dep.gpus_per_replica > 1 else 1.0
        self._s_per_flop = slow / (gemm_peak * p.compute_efficiency)
        self._s_per_high_flop = slow / (high_peak * p.compute_efficiency)
        self._s_per_byte = slow / (bw * p.memory_efficiency)
        self._s_per_kv_byte = slow / (bw * p.attention_memory_efficiency)
        # The engine runs this model's attention in its portable Triton kernels (chosen, or the only ones it
        # has for attention sinks on this family): their math at triton_attention_efficiency of the
        # FlashAttention kernels' rate. The KV reads of decode stay at the memory share: bandwidth-bound
        # kernels differ less, and the published decode of such runs is met without it.
        kernel = engine.attention_kernel(hw.family, model.attention_sinks, dep.attention_kernel)
        self.triton_attention = kernel == "triton"
        attention_share = p.attention_compute_efficiency * (p.triton_attention_efficiency if self.triton_attention else 1.0)
        self._s_per_attn_flop = slow / (high_peak * attention_share)
        self._s_per_dequant_op = slow / (self._vector_peak * p.compute_efficiency) if self.dequant else 0.0
        # The weight matmuls (not the unquantised LM head and router): scaled low-precision formats reach
        # their shares of the format's rates.
        scaled = self.gemm_dtype in ("fp8", "fp4") and not self.dequant
        self._s_per_gemm_flop = self._s_per_flop / (p.scaled_gemm_efficiency if scaled else 1.0)
        self._s_per_gemm_byte = self._s_per_byte / (p.scaled_gemm_memory_efficiency if scaled else 1.0)
        peers = dep.peer_access
        self.tp_link = _pick_link(hw, dep.tensor_parallel, "tensor_parallel", peers) if dep.tensor_parallel > 1 else None
        self.pp_link = _pick_link(hw, dep.gpus_per_replica, "pipeline_parallel", peers) if dep.pipeline_parallel > 1 else None
        # Each collective on the link its group reaches (a context-parallel group spans its TP groups).
        self.comms: tuple[tuple[Comm, CollectiveCost], ...] = tuple(
            (c, _collective_cost(hw, c, _pick_link(hw, c.ranks * (dep.tensor_parallel if c.operator == "cp_transfer"
                                                                       else 1), _GROUP_FIELD[c.operator], peers), p))
            for c in self.ops.comms)
        self._draft = self._draft_model(model, hw, dep)
        self._row_memo: dict[tuple[float, float], _RowTerms[float]] = {}
        self._step_memo: dict[tuple[float, ...], _StepTerms] = {}
        # One KV block on one GPU: its KV heads, its pipeline stage's layers (the largest stage).
        stage_layers = -(-model.num_layers // dep.pipeline_parallel)
        self.copies = KVCopyModel(hw, dep, self.ops.attention.kv_bytes_per_token * stage_layers * dep.knobs.choices.block_size_tokens,
                                  p.interconnect_efficiency)

    # ------------------------------------------------------------------ public API

    def step_time(self, output: SchedulerOutput) -> float:
        """Seconds for one engine step of one replica (0.0 for an empty step)."""
        return self.step(output).seconds

    def step(self, output: SchedulerOutput) -> StepCost:
        """Seconds, FLOPs and bytes of one engine step, per GPU of the replica."""
        copy_s = self.copies.step_s(output.kv_transfers)
        if output.is_empty:
            return StepCost(copy_s, 0.0, 0.0) if copy_s else NO_COST
        if self._draft is None:
            return self._step_cost(self.reader.read(output), copy_s)
        times, flops, nbytes = self.times(self.reader.read(output), self._draft_cost(output), copy_s)
        seconds, comm_s = _totals(times)
        return StepCost(seconds, flops, nbytes, comm_s)

    def bulk_run(self, first: BulkShape, count: int) -> StepCosts:
        """Each step of a run of bulk decodes only from `first` (ShapeReader.bulk_run: up to `count`
        steps), priced at once: what step() gives each of them."""
        times, flops, nbytes = self.times(self.reader.bulk_run(first, count))
        seconds, comm_s = _totals(times)
        steps = np.size(seconds)
        return StepCosts(*(np.broadcast_to(v, steps) for v in (seconds, flops, nbytes, comm_s)))

    def breakdown(self, output: SchedulerOutput) -> dict[str, float]:
        """Seconds per operator (keys: OPERATORS); the values sum to step_time(output)."""
        copy_s = self.copies.step_s(output.kv_transfers)
        if output.is_empty:
            return {**dict.fromkeys(OPERATORS, 0.0), "kv_copy": copy_s}
        return dict(zip(OPERATORS, self.times(self.reader.read(output), self._draft_cost(output), copy_s)[0], strict=True))

    def shape_cost(self, requests: list[tuple[int, int, bool]]) -> StepCost:
        """A step of (query tokens, cached tokens, is_prefill) requests that all sample."""
        if not requests or any(q < 1 or c < 0 for q, c, _ in requests):
            raise InputError("tokens", requests[:1], "need at least one request with >= 1 token and >= 0 cached")
        times, flops, nbytes = self.times(self.reader.of_requests(requests))
        seconds, comm_s = _totals(times)
        return StepCost(seconds, flops, nbytes, comm_s)

    def shape_breakdown(self, requests: list[tuple[int, int, bool]]) -> dict[str, float]:
        return dict(zip(OPERATORS, self.times(self.reader.of_requests(requests))[0], strict=True))

    def decode_cost(self, batch: int, context: int) -> StepCost:
        """One decode step of `batch` requests, each with `context` tokens already cached."""
        return self.shape_cost([(1, context, False)] * batch)

    def prefill_cost(self, tokens: int, cached: int = 0) -> StepCost:
        """One step prefilling `tokens` prompt tokens of one request (after `cached` cached ones) and sampling."""
        return self.shape_cost([(tokens, cached, True)])

    def decode_time_per_token_s(self, batch: int, context: int) -> float:
        return self.decode_cost(batch, context).seconds

    def prefill_time_s(self, tokens: int, cached: int = 0) -> float:
        return self.prefill_cost(tokens, cached).seconds

    def decode_breakdown(self, batch: int, context: int) -> dict[str, float]:
        return self.shape_breakdown([(1, context, False)] * batch)

    def prefill_breakdown(self, tokens: int, cached: int = 0, *, samples: bool = True) -> dict[str, float]:
        """Seconds per operator of one step prefilling one request's `tokens`; with samples=False, a
        chunk before the prompt's last (no row reaches the LM head)."""
        return dict(zip(OPERATORS, self.times(self.reader.of([(tokens, cached, True, int(samples))]))[0], strict=True))

    # Floats for one step's shape; arrays (some terms may stay floats) for a shape of arrays.
    @overload
    def times(self, s: StepShape[float], draft: StepCost = ...,
              copy_s: float = ...) -> tuple[tuple[float, ...], float, float]: ...
    @overload
    def times(self, s: StepShape[Number], draft: StepCost = ...,
              copy_s: Number = ...) -> tuple[tuple[Number, ...], Number, Number]: ...
    def times(self, s: StepShape[Number], draft: StepCost = NO_COST,
              copy_s: Number = 0.0) -> tuple[tuple[Number, ...], Number, Number]:
        """(seconds per operator in OPERATORS order, FLOPs, bytes moved), per GPU, for one step or, with
        array fields, for many; `draft` is the step's draft-model cost and `copy_s` its KV copies
        (offload tiers, received prompt KV), each reported as its own operator."""
        p, ops = self.params, self.ops
        # A replayed graph runs its padded batch through the dense operators; context parallelism gives
        # each GPU 1/cp of the prefill tokens.
        rows = s.dense_rows - (1.0 - ops.prefill_row_share) * s.prefill_tokens
        r = self._rows(rows, s.sampled_rows, draft)
        work = [r.flops, r.bytes]
        a = ops.attention
        attention = self._attention(s.decode_tokens, s.decode_pairs * a.flops_per_pair, s.decode_kv, work) + self._attention(
            s.prefill_tokens * ops.prefill_row_share, s.prefill_pairs * a.prefill_flops_per_pair,
            s.prefill_kv * a.prefill_kv_reads, work)
        device = (r.qkv, r.o, attention, r.mlp, r.moe, r.router, r.norms, r.lm_head, r.sampling,
                  *self._communication(s, rows), r.pp)
        if isinstance(s.graph, np.ndarray) or not s.graph:
            launch = self._launch_wait(device, s.graph, r.graph_launch_s, s.piecewise)
        else:  # a replayed graph: the same value the blend gives (1 x graph + 0 x eager), without the eager sum
            launch = r.graph_launch_s + self._pieces_wait(attention) if s.piecewise else r.graph_launch_s
        busy = sum(device) + launch + draft.seconds + copy_s
        host = p.step_overhead_s + p.per_request_overhead_s * s.requests + p.layer_overhead_s * ops.layers
        # Streaming the step's tokens (one per sampled row) through an API server in the engine's process.
        host = host + (p.api_step_s + p.api_token_s * s.sampled_rows) * _present(s.sampled_rows)
        if p.overlap_host:  # the host prepared this step while the previous one ran: only its excess shows
            host = _max(host - busy, 0.0)
        return (*device, host, launch, draft.seconds, copy_s), work[0] + r.lm_head_flops, work[1] + r.lm_head_bytes + r.norm_sample_bytes

    def _step_cost(self, s: StepShape[float], copy_s: float) -> StepCost:
        """step() of one step without a draft model, a float at a time: the simulator's hot path.
        The same sums as times() and _totals(), term by term in their order, so that a step priced
        here and the same step priced in a bulk run (times() over arrays) agree to the bit; all but
        attention comes memoised per row counts (_step_terms)."""
        ops, p, a = self.ops, self.params, self.ops.attention
        rows = s.dense_rows - (1.0 - ops.prefill_row_share) * s.prefill_tokens
        key = (rows, s.sampled_rows, s.decode_tokens, s.prefill_tokens, s.graph)
        t = self._step_memo.get(key)
        if t is None:
            if len(self._step_memo) >= _MAX_MEMO_ROWS:
                self._step_memo.clear()
            t = self._step_memo[key] = self._step_terms(s, rows)
        r = t.rows
        # _attention for the decode and the prefill group, as times() calls it.
        kernel_s = a.kernels * p.kernel_latency_s
        d_tokens, d_flops = s.decode_tokens, s.decode_pairs * a.flops_per_pair
        d_bytes = s.decode_kv * a.kv_bytes_per_token + d_tokens * a.act_bytes_per_row
        compute, memory = d_flops * self._s_per_attn_flop, d_bytes * self._s_per_kv_byte
        decode = (kernel_s + (compute if compute > memory else memory)) * float(d_tokens > 0)
        p_tokens, p_flops = s.prefill_tokens * ops.prefill_row_share, s.prefill_pairs * a.prefill_flops_per_pair
        p_bytes = s.prefill_kv * a.prefill_kv_reads * a.kv_bytes_per_token + p_tokens * a.act_bytes_per_row
        compute, memory = p_flops * self._s_per_attn_flop, p_bytes * self._s_per_kv_byte
        prefill = (kernel_s + (compute if compute > memory else memory)) * float(p_tokens > 0)
        attention = decode + prefill
        device = t.head + attention
        for term in t.tail:
            device += term
        launch_s = p.kernel_launch_s
        if s.graph:  # a whole graph (most decode steps) prices no pieces
            launch = r.graph_launch_s + self._pieces_wait(attention) if s.piecewise else r.graph_launch_s
        elif launch_s:
            wait = self._kernels[_ATTENTION] * launch_s - attention
            launch = t.wait_head + (wait if wait > 0.0 else 0.0)
            for term in t.wait_tail:
                launch += term
        else:
            launch = 0.0
        busy = device + launch + 0.0 + copy_s  # 0.0: the draft's seconds, in times()'s place for them
        host = p.step_overhead_s + p.per_request_overhead_s * s.requests + p.layer_overhead_s * ops.layers
        host = host + (p.api_step_s + p.api_token_s * s.sampled_rows) * float(s.sampled_rows > 0)
        if p.overlap_host:
            host = host - busy if host - busy > 0.0 else 0.0
        seconds = device + host + launch + 0.0 + copy_s
        flops = r.flops + d_flops + p_flops + r.lm_head_flops
        nbytes = r.bytes + d_bytes + p_bytes + r.lm_head_bytes + r.norm_sample_bytes
        return StepCost(seconds, flops, nbytes, t.comm_s)

    def _step_terms(self, s: StepShape[float], rows: float) -> _StepTerms:
        r = self._rows(rows, s.sampled_rows, NO_COST)
        comms = self._communication(s, rows)
        tail = (r.mlp, r.moe, r.router, r.norms, r.lm_head, r.sampling, *comms, r.pp)
        comm_s = 0.0
        for term in (*comms, r.pp):
            comm_s += term
        launch_s = self.params.kernel_launch_s
        waits = [_max(k * launch_s - v, 0.0) for k, v in zip(self._kernels, (r.qkv, r.o, 0.0, *tail), strict=True)]
        return _StepTerms(0.0 + r.qkv + r.o, tail, comm_s, 0.0 + waits[0] + waits[1], tuple(waits[3:]), r)

    @overload
    def _rows(self, rows: float, sampled_rows: float, draft: StepCost) -> _RowTerms[float]: ...
    @overload
    def _rows(self, rows: Number, sampled_rows: Number, draft: StepCost) -> _RowTerms[Number]: ...
    def _rows(self, rows: Number, sampled_rows: Number, draft: StepCost) -> _RowTerms[Number]:
        """The row terms of a step, memoised for one step without a draft model."""
        if isinstance(rows, np.ndarray) or isinstance(sampled_rows, np.ndarray) or draft is not NO_COST:
            return self._row_terms(rows, sampled_rows, draft)
        key = (rows, sampled_rows)
        terms = self._row_memo.get(key)
        if terms is None:
            if len(self._row_memo) >= _MAX_MEMO_ROWS:
                self._row_memo.clear()
            terms = self._row_memo[key] = self._row_terms(rows, sampled_rows, draft)
        return terms

    @overload
    def _row_terms(self, rows: float, sampled_rows: float, draft: StepCost) -> _RowTerms[float]: ...
    @overload
    def _row_terms(self, rows: Number, sampled_rows: Number, draft: StepCost) -> _RowTerms[Number]: ...
    def _row_terms(self, rows: Number, sampled_rows: Number, draft: StepCost) -> _RowTerms[Number]:
        p, ops = self.params, self.ops
        work: list[Number] = [draft.flops, draft.bytes]
        # `rows`: the dense operators' rows, as times() works them out.
        qkv = self._gemm(ops.qkv_proj, rows, work)
        o = self._gemm(ops.o_proj, rows, work)
        mlp = self._gemm(ops.mlp, rows, work)
        moe = self._experts(rows, work) + self._gemm(ops.shared_experts, rows, work)
        router = self._gemm(ops.router, rows, work)
        lm_work: list[Number] = [0.0, 0.0]
        lm_head = self._gemm(ops.lm_head, sampled_rows, lm_work)
        norm_bytes, sample_bytes = rows * ops.norm_bytes_per_row, sampled_rows * ops.sample_bytes_per_row
        norms = norm_bytes * self._s_per_byte + ops.norm_kernels * p.kernel_latency_s
        sampling = (sample_bytes * self._s_per_byte + ops.sample_kernels * p.kernel_latency_s) * _present(sampled_rows)
        graph_launch = self._after_graph_wait(lm_head, sampling)
        return _RowTerms(qkv, o, mlp, moe, router, norms, lm_head, sampling, self._pp_transfer(rows),
                         work[0], work[1], lm_work[0], lm_work[1], norm_bytes + sample_bytes, graph_launch)

    def assumptions(self) -> dict[str, object]:
        """Every figure the model uses, for reports."""
        dep, hw, model = self.dep, self.hw, self.model

        def link(lk: Link | None) -> dict[str, object] | None:
            return None if lk is None else {"name": lk.name, "bandwidth_gb_s": lk.bandwidth_gb_s, "latency_us": lk.latency_us}

        notes = [
            "per operator: kernels x kernel_latency_s + max(FLOPs / (peak x efficiency at its rows), bytes / "
            "(bandwidth x memory efficiency)), summed over layers; dense weight matmuls' rooflines / "
            "dense_kernel_efficiency (the engine's kernels against the family's)"
            + (f"; a dense weight matmul of M rows computes at {self.params.gemm_efficiency_floor:g} + "
               f"{1 - self.params.gemm_efficiency_floor:g} x M / (M + {self.params.gemm_half_size_tokens:g}) of the "
               "compute efficiency (gemm_efficiency_floor, gemm_half_size_tokens: few rows under-use the device)"
               if self.params.gemm_half_size_tokens else ""),
            "weights read once per step per layer; activations in "
            + ("fp32" if self._act == 4.0 else "bf16") + "; embedding and LM head unquantised"
            + ("; attention unquantised (the checkpoint quantises the routed experts only)"
               if self.ops.qkv_proj.high_precision else ""),
            "fp8/fp4 weights compute natively when the hardware lists a peak for the format (W8A8/W4A4); otherwise, "
            f"and for int8/int4, weight-only: bf16 math plus {DEQUANT_OPS_PER_WEIGHT:g} vector ops per weight read; "
            "native ones reach scaled_gemm_efficiency of the format's FLOP rate and scaled_gemm_memory_efficiency "
            "of its weight-read rate",
            "routed experts: max(math / grouped_gemm_efficiency + dequantisation, weight reads) / moe_kernel_efficiency "
            "(fp4_moe_kernel_efficiency for MXFP4 experts); "
            "the grouped-GEMM share slows the tensor-core math, not the vector dequantisation or the weight reads",
            "attention: causal pairs q x (cached + (q+1)/2) per request and layer, capped by sliding windows; "
            "K/V of the context read once per request and layer at attention_memory efficiency, FLOPs at "
            "attention_compute efficiency; decode and prefill requests are separate rooflines"
            + (" (the engine's Triton attention kernels here: FLOPs at attention_compute x triton_attention efficiency)"
               if self.triton_attention else ""),
            "LM head and sampling only for rows that sample (1 + draft tokens per sampling request); "
            f"sampler reads fp32 logits {SAMPLER_COPIES} times",
            "TP: an all-reduce of tokens x hidden after attention and after the MLP in every layer and one after "
            "the vocabulary-parallel embedding; the LM head all-gathers the sampled rows' logits; each collective "
            "priced by message size (see communication)",
            "PP: a step is one micro-batch through every stage in turn (sum over stages) plus (pp-1) hand-offs; "
            "overlap of micro-batches in flight is not modelled",
            f"norms: residual add fused, {NORM_TRAFFIC} x hidden x activation bytes per norm per token",
            "host work per step: step_overhead_s + per_request_overhead_s x requests"
            + (" + api_step_s + api_token_s x sampled rows when the step streams tokens (API server in the engine's "
               "process)" if self.params.api_step_s or self.params.api_token_s else "")
            + (", overlapped with the previous step's device work" if self.params.overlap_host else ", after the device work"),
            "an empty step costs 0 s",
            "KV copies (kv_copy): tier copies in the step before its forward pass at the tier's rate plus its latency "
            "once per direction; each GPU copies its own shard; between a prefill and a decode instance, KV moves device "
            "to device over the link (DMA/RDMA, no engine time), or, for a CPU engine, through shared memory copied by "
            "the engines themselves (planner/costmodel/transfer.py)",
            self._graph_note() if self.graph_max else
            ("every step runs eagerly (" + ("enforce_eager" if hw.graph_capture else f"{hw.name} has no graph capture")
             + "): each operator takes at least its kernels x kernel_launch_s"),
        ]
        if model.is_moe:
            notes.append(
                "MoE: distinct experts touched by T tokens = E(1-(1-k/E)^T) (uniform routing) sets expert weight "
                "bytes; FLOPs scale with T x k; router replicated and unquantised"
                + (f"; with whole experts on {dep.expert_parallel} expert-parallel ranks a layer's experts take the "
                   "busiest rank's time: E[max over ranks] of the experts it touches and the rows it computes "
                   "(independent binomials, uniform routing; skew not modelled)" if dep.expert_parallel > 1 else "")
            )
        if dep.expert_parallel > 1:
            notes.append(
                f"EP over {dep.expert_parallel} GPUs: " + (
                    "each rank sends its 1/ep of the tokens (k copies) to their experts' ranks and gets the outputs "
                    "back (two all-to-alls per MoE layer after a count exchange)"
                    + ("; an all-gather then puts every token on every rank again" if dep.attention_data_parallel == 1
                       else "") if dispatches_by_all_to_all(dep) else
                    "each rank runs its own experts on the replicated tokens; the layer's all-reduce sums them"))
        if dep.attention_data_parallel > 1:
            notes.append(
                f"data-parallel attention: {dep.attention_data_parallel} groups of "
                f"{dep.tensor_parallel // dep.attention_data_parallel} GPUs, each with 1/{dep.attention_data_parallel} "
                "of the step's requests (balanced) and its own KV cache; attention projections read whole weights "
                "per group; tokens gathered for the MLP by an all-reduce over all GPUs (SGLang) and scattered back")
        if dep.context_parallel > 1:
            notes.append(
                f"context parallelism over {dep.context_parallel} GPUs: each runs 1/{dep.context_parallel} of the "
                "prefill tokens through every operator and of every (query, key) pair, reads the whole gathered K/V "
                "of a prefill chunk, stores and scans 1/cp of each sequence's cache; per layer an all-gather of the "
                "chunk's K/V and one of the decode tokens' partial attention outputs")
        if model.mla is not None:
            notes.append("MLA: absorbed decode, expanded prefill attention; the KV latent and the down-projections "
                         "(q_a, kv_a) are replicated on every TP rank, the up- and output projections split over it")
        spec = dep.knobs.speculative
        if spec is not None:
            notes.append(
                f"speculative ({spec.method}, k={spec.num_speculative_tokens}): drafts are verified as extra decode tokens "
                "and LM-head rows of the step; proposing them costs "
                + ("nothing (n-gram lookup)" if self._draft is None else
                   f"one forward pass of {self._draft.model.name} per draft position (operator spec_draft)")
            )
        return {
            "model": model.name or model.model_type,
            "hardware": hw.name,
            "tensor_parallel": dep.tensor_parallel,
            "pipeline_parallel": dep.pipeline_parallel,
            "expert_parallel": dep.expert_parallel,
            "weight_dtype": dep.weight_dtype,
            "weight_bytes_per_param": WEIGHT_BYTES_PER_PARAM[dep.weight_dtype],
            "kv_dtype": dep.kv_dtype,
            "kv_bytes_per_token_per_layer_per_gpu": self.ops.attention.kv_bytes_per_token,
            "activation_bytes": self._act,
            "gemm_compute_dtype": self.gemm_dtype,
            "gemm_peak_tflops": hw.peak_flops(self.gemm_dtype)[0] / 1e12,
            "weight_only_dequant": self.dequant,
            "graph_capture": bool(self.graph_max),
            "max_graph_batch_size": self.graph_max,
            "dequant_ops_per_weight": DEQUANT_OPS_PER_WEIGHT if self.dequant else 0.0,
            "vector_peak_tflops": self._vector_peak / 1e12,
            "attention_and_lm_head_dtype": self._high_dtype,
            "attention_peak_tflops": hw.peak_flops(self._high_dtype)[0] / 1e12,
            "memory_bandwidth_gb_s": hw.memory_bandwidth_gb_s,
            **asdict(self.params),
            "tp_link": link(self.tp_link),
            "pp_link": link(self.pp_link),
            "attention_data_parallel": dep.attention_data_parallel,
            "context_parallel": dep.context_parallel,
            "communication": [
                {"operator": c.operator, "calls_per_step": c.calls, "payload_bytes_per_row": c.bytes_per_row,
                 "rows": c.rows, "payload_fixed_bytes": c.fixed_bytes, **cost.describe()} for c, cost in self.comms],
            **self.copies.assumptions(),
            "notes": notes,
        }

    # ------------------------------------------------------------------ operators

    def _compute_rows(self, rows: Number, half: float) -> Number:
        """Rows a matmul of `rows` rows costs at full efficiency: few rows under-use the hardware
        (`half`: the rows at which it reaches half its rate, 0 for none)."""
        floor = self.params.gemm_efficiency_floor
        if not half:
            return rows
        denominator = floor * (rows + half) + (1.0 - floor) * rows
        if isinstance(rows, np.ndarray):
            return np.divide(rows * (rows + half), denominator, out=np.zeros_like(rows), where=denominator > 0)
        return rows * (rows + half) / denominator if denominator > 0 else 0.0

    def _gemm(self, g: Gemm, rows: Number, work: list[Number]) -> Number:
        """Roofline of one weight matmul operator over `rows` rows; adds its FLOPs and bytes to `work`."""
        if not g.present:
            return 0.0
        rows = rows * g.row_share
        flops, nbytes = g.flops_per_row * rows, g.weight_bytes + g.act_bytes_per_row * rows
        work[0] += flops
        work[1] += nbytes
        s_per_flop = self._s_per_high_flop if g.high_precision else self._s_per_gemm_flop
        s_per_byte = self._s_per_byte if g.high_precision else self._s_per_gemm_byte
        dequant = 0.0 if g.high_precision else g.dequant_ops * self._s_per_dequant_op
        p = self.params
        compute = g.flops_per_row * self._compute_rows(rows, p.gemm_half_size_tokens) * s_per_flop + dequant
        device = g.kernels * p.kernel_latency_s + _max(compute, nbytes * s_per_byte) / p.dense_kernel_efficiency
        return device * _present(rows)

    def _experts(self, rows: Number, work: list[Number]) -> Number:
        e = self.ops.experts
        if e is None:
            return 0.0
        touched = expected_distinct_experts(e.num_experts, e.top_k, rows)
        weight_bytes, act_bytes = touched * e.bytes_per_expert, e.act_bytes_per_row * rows
        flops = e.flops_per_row * rows
        work[0] += flops
        work[1] += weight_bytes + act_bytes
        # A grouped GEMM is as efficient as its per-expert matmuls: rows x k / touched rows each.
        per_expert = rows * e.top_k / _max(touched, 1e-9)
        math = flops * self._s_per_flop * self._compute_rows(per_expert, self._experts_half) / _max(per_expert, 1e-9)
        dequant = touched * e.dequant_ops_per_expert * self._s_per_dequant_op
        if e.ranks > 1:  # the busiest expert-parallel rank: more experts touched, more rows than the mean
            touched_factor, rows_factor = _busiest(e, rows)
            weight_bytes, dequant = weight_bytes * touched_factor, dequant * touched_factor
            act_bytes, math = act_bytes * rows_factor, math * rows_factor
        p = self.params
        # The family's grouped-GEMM share is a tensor-core matter (wgmma, TMA pipelines): it slows the
        # experts' math, not the vector work of dequantising their weights nor the streaming of them,
        # which a decode step is bound by.
        share = p.fp4_moe_kernel_efficiency if e.fp4 else p.moe_kernel_efficiency
        roofline = _max(math / p.grouped_gemm_efficiency + dequant, (weight_bytes + act_bytes) * self._s_per_byte) / share
        return (e.kernels * p.kernel_latency_s + roofline) * _present(rows)

    def _attention(self, tokens: Number, flops: Number, kv_tokens: Number, work: list[Number]) -> Number:
        a = self.ops.attention
        nbytes = kv_tokens * a.kv_bytes_per_token + tokens * a.act_bytes_per_row
        work[0] += flops
        work[1] += nbytes
        device = a.kernels * self.params.kernel_latency_s + _max(flops * self._s_per_attn_flop, nbytes * self._s_per_kv_byte)
        return device * _present(tokens)

    @overload
    def _communication(self, s: StepShape[float], dense_rows: float) -> tuple[float, ...]: ...
    @overload
    def _communication(self, s: StepShape[Number], dense_rows: Number) -> tuple[Number, ...]: ...
    def _communication(self, s: StepShape[Number], dense_rows: Number) -> tuple[Number, ...]:
        """Seconds per communication operator (COMM_OPERATORS order): each collective's calls x its
        time at this step's payload, on the link its group reaches."""
        rows = {"dense": dense_rows, "sampled": s.sampled_rows, "prefill": s.prefill_tokens, "decode": s.decode_tokens}
        out: dict[str, Number] = dict.fromkeys(COMM_OPERATORS, 0.0)
        for comm, cost in self.comms:
            r = rows[comm.rows]
            out[comm.operator] = out[comm.operator] + comm.calls * cost.seconds(r * comm.bytes_per_row + comm.fixed_bytes) * _present(r)
        return tuple(out.values())

    def _pp_transfer(self, rows: Number) -> Number:
        if self.pp_link is None:
            return 0.0
        link = self.pp_link
        size = rows * self.ops.pp_bytes_per_row
        p = self.params
        return self.ops.pp_handoffs * p.collective_time_scale * (
            size / (link.bandwidth_gb_s * 1e9 * p.interconnect_efficiency) + link.latency_us * 1e-6)

    def _graph_note(self) -> str:
        """What the assumptions say of the steps that replay captured graphs."""
        g = self.graphs
        pieces = "piecewise graphs (a launch a layer, attention eager between the pieces)"
        note = (f"decode-only steps of <= {self.graph_max} requests replay "
                + (pieces if g.piecewise_decode else "a captured graph (one launch)")
                + ": batch padded to the captured size (1, 2, 4, multiples of 8) for the dense operators, the LM head "
                "and sampling eager after it")
        if g.mixed_max_tokens:
            note += f"; steps with prompt chunks or drafts of <= {g.mixed_max_tokens} tokens replay {pieces}, padded alike"
        return note + "; every other step runs eagerly, each operator taking at least its kernels x kernel_launch_s"

    def _launch_wait(self, device: tuple[Number, ...], graph: Number, after_graph: Number, piecewise: Number) -> Number:
        """Seconds the device waits on the host issuing kernels: eagerly, each operator takes at least
        its kernels x kernel_launch_s; a replayed graph waits `after_graph` (_after_graph_wait), and
        a piecewise one its pieces' launches and attention's too (_pieces_wait)."""
        launch_s = self.params.kernel_launch_s
        if not launch_s:  # CPUs: nothing to add, keep the simulator's hot path lean
            return 0.0
        waits = [_max(k * launch_s - t, 0.0) for k, t in zip(self._kernels, device, strict=True)]
        return graph * (after_graph + piecewise * self._pieces_wait(device[_ATTENTION])) + (1.0 - graph) * sum(waits)

    @overload
    def _pieces_wait(self, attention: float) -> float: ...
    @overload
    def _pieces_wait(self, attention: Number) -> Number: ...
    def _pieces_wait(self, attention: Number) -> Number:
        """What a piecewise graph waits beyond a whole one's: a launch per further piece (one a layer,
        each attention splitting the forward pass) and the eager attention kernels' launches."""
        launch_s = self.params.kernel_launch_s
        return self.ops.layers * launch_s + _max(self._kernels[_ATTENTION] * launch_s - attention, 0.0)

    def _after_graph_wait(self, lm_head: Number, sampling: Number) -> Number:
        """A replayed graph is one launch, then the LM head and sampling run eagerly."""
        launch_s = self.params.kernel_launch_s
        if not launch_s:
            return 0.0
        kernels = self._kernels
        return (0 + _max(kernels[_AFTER_GRAPH[0]] * launch_s - lm_head, 0.0)
                + _max(kernels[_AFTER_GRAPH[1]] * launch_s - sampling, 0.0)) + launch_s

    # ------------------------------------------------------------------ speculative drafts

    def _draft_model(self, model: ModelConfig, hw: HardwareProfile, dep: Deployment) -> CostModel | None:
        """Speculative decoding: the drafts' verification is already in the token counts (drafts are
        tokens of the step); what remains is proposing them. n-gram lookup costs ~nothing; a draft
        model (or the target's first draft_layers layers, self-speculative) runs one forward pass per
        draft position, costed by a CostModel of the draft itself."""
        spec = dep.knobs.speculative
        if spec is None or spec.method == "ngram":
            return None
        if spec.method == "self":
            assert spec.draft_layers is not None  # SpeculativeSettings requires it
            draft_config = model.first_layers(spec.draft_layers)
        else:
            from engine.catalog import resolve_model  # torch-free; only needed for draft models

            assert spec.draft_model is not None
            draft_config = resolve_model(spec.draft_model)
        plain = dep.model_copy(update={"knobs": dep.knobs.model_copy(update={"speculative": None})})
        return CostModel(draft_config, hw, plain, self.params, self.graphs)

    def _draft_cost(self, output: SchedulerOutput) -> StepCost:
        """Proposing this step's drafts with a draft model: draft pass j feeds one token of each
        request that has more than j drafts, over its context so far (engine/spec/draft.py)."""
        draft = self._draft
        if draft is None:
            return NO_COST
        with_drafts = [(s.num_draft_tokens, s.num_computed_tokens) for s in output.scheduled if s.num_draft_tokens]
        seconds = flops = nbytes = 0.0
        for j in range(max((d for d, _ in with_drafts), default=0)):
            times, f, b = draft.times(draft.reader.of_requests([(1, c + j, False) for d, c in with_drafts if d > j]))
            seconds, flops, nbytes = seconds + sum(times), flops + f, nbytes + b
        return StepCost(seconds, flops, nbytes)


def _graph_policy(hw: HardwareProfile, dep: Deployment, engine: EngineProfile) -> GraphPolicy:
    execution = engine.execution
    if not (hw.graph_capture and execution.cuda_graphs) or dep.knobs.enforce_eager:
        return GraphPolicy()
    knobs = dep.knobs.choices
    return GraphPolicy(min(knobs.max_graph_batch_size, knobs.max_num_seqs), execution.graph_batch_sizes,
                       execution.graph_padding, execution.graph_max_context_len,
                       knobs.max_graph_batch_size if execution.graphs_cover_mixed_steps else 0,
                       execution.piecewise_decode_graphs)


def _collective_cost(hw: HardwareProfile, c: Comm, link: Link, p: CostParams) -> CollectiveCost:
    """How one collective is priced on its link. The engine's custom all-reduce applies to an
    all-reduce of 2, 4, 6 or 8 ranks over the scale-up link, whose switch connects every pair
    (vLLM's `fully_connected`); elsewhere NCCL's curve does."""
    custom = c.collective == "all_reduce" and c.ranks in CUSTOM_ALL_REDUCE_RANKS and link is hw.scale_up
    return CollectiveCost(c.collective, c.ranks, link, p.interconnect_efficiency, p.collective_time_scale,
                          p.custom_all_reduce_max_bytes if custom else 0)


def _pick_link(hw: HardwareProfile, devices: int, field: str, peer_access: bool) -> Link:
    """Scale-up link when the group fits its domain, else scale-out; PCIe-only cards use PCIe, and so
    does every board whose GPUs lack peer access (NCCL stages the data through host memory)."""
    if peer_access and hw.scale_up is not None and devices <= hw.scale_up.domain_size:
        return hw.scale_up
    if (hw.scale_up is None or not peer_access) and hw.pcie is not None and devices <= hw.pcie.domain_size:
        return hw.pcie
    if hw.scale_out is not None:
        return hw.scale_out
    raise InputError(field, devices, f"{hw.name} has no interconnect that reaches {devices} devices")
