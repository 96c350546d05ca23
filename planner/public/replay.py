"""A published benchmark run, replayed as it was run: the engine's profile for its release and
flags, the benchmark client's semantics and its request lengths, then the simulator.

What cannot be replayed is said, not guessed: a run whose engine feature ServePlan does not model
(EAGLE speculative decoding without a published acceptance) is set aside with its reason;
everything the replay assumes is listed in `ReplayRun.assumptions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from engine.catalog import resolve_model
from engine.config import ModelConfig
from planner.costmodel import CostParams
from planner.costmodel.operators import dispatches_by_all_to_all
from planner.engines import ENGINE_FLAG_KNOBS, EngineProfile, engine_for_release, get_engine, knobs_from_flags
from planner.hardware import get_hardware
from planner.metrics import LengthSpread, RunSummary, length_spread
from planner.playback import Replay
from planner.public.data import Figure, PublicRun
from planner.public.retime import summary_value
from planner.sim import SimulationResult, simulate
from planner.specs import AttentionKernel, Deployment, HardwareProfile
from planner.workload import (
    ClosedLoopArrivals,
    FixedLength,
    LognormalLength,
    OfflineArrivals,
    PoissonArrivals,
    UniformLength,
    Workload,
    WorkloadRequest,
    draw,
    draw_lengths,
    sharegpt_lengths,
)

# Flags that change nothing the simulator models (kernels and backends are inside the fitted
# efficiencies of the engine; the rest is bookkeeping of the run).
_NEUTRAL_ARGS = frozenset({
    "enable_torch_compile", "dtype", "quantization", "VLLM_USE_TRITON_FLASH_ATTN",
    "kv_cache_dtype", "kv_cache_dtype_skip_layers", "max_seq_len_to_capture", "max_model_len", "max_seq_len",
    "kv_transfer_config", "async_scheduling", "enable_expert_parallel", "disable_radix_cache",
    # SGLang's output parsers split a response into reasoning, content and tool calls as it streams; every
    # token still goes out in its event.
    "reasoning_parser", "tool_call_parser",
})
# Flags that shape the Deployment (read in `prepare`).
_DEPLOYMENT_ARGS = frozenset({"enable_dp_attention", "attention_backend"})
# SGLang's --attention-backend values by the kernels they run; one not listed sets the run aside.
_ATTENTION_KERNELS: dict[str, AttentionKernel] = {
    "triton": "triton", "fa3": "flash", "fa4": "flash", "flashinfer": "flash", "trtllm_mha": "flash",
}
# Flags whose feature the simulator does not reproduce: the run is set aside.
_UNSUPPORTED_ARGS: dict[str, str] = {
    "speculative_algorithm": "EAGLE speculative decoding: the draft head's acceptance is not published",
}
# SGLang's ServerArgs turns --enable-dp-attention off when its dp size is 1: attention stays tensor-parallel.
_SGLANG_DP_ATTENTION_OFF = ("--enable-dp-attention without --dp: SGLang turns DP attention off at dp size 1 "
                            "(server_args.py _handle_data_parallelism); replayed as tensor-parallel attention")


class Measured(Protocol):
    """What the fit reads of a measured run: a published run, or a run of `serveplan bench --url`."""

    @property
    def run_key(self) -> str: ...
    @property
    def source_key(self) -> str: ...  # the unit weighed alike and held out together
    @property
    def publisher(self) -> str: ...  # a wider unit held out together (the public fit's folds)
    @property
    def confidence(self) -> Literal["high", "medium", "low"]: ...
    @property
    def figures(self) -> tuple[Figure, ...]: ...


@dataclass(frozen=True)
class ReplayRun:
    run: Measured
    model: ModelConfig
    hw: HardwareProfile
    engine: EngineProfile
    dep: Deployment
    workload: Workload | Replay  # drawn again, or (a bench run) the very requests measured
    max_model_len: int
    overlap_host: bool | None  # a flag of the run that changes host overlap (vLLM --async-scheduling)
    assumptions: tuple[str, ...]
    # What the server served before the run whose prompts the run meets again: earlier runs of the
    # client (same seed and lengths), then, if the client sends one, its test request (the run's first).
    served_runs: tuple[Workload, ...] = ()
    test_request: bool = False
    set_aside: frozenset[str] = frozenset()  # metric families the run's conditions leave unknown
    set_aside_reason: str = ""
    # The client times every streamed event with a choice, the server's token-less ones too (ITL).
    times_every_event: bool = False

    @property
    def figures(self) -> tuple[Figure, ...]:
        return tuple(f for f in self.run.figures if f.family not in self.set_aside)

    @property
    def lengths(self) -> LengthSpread:
        """Whether the requests the replay plays vary in length (Replay.lengths): what picks the run's
        lengths band, as a simulated workload's requests pick its own."""
        if isinstance(self.workload, Replay):
            return self.workload.lengths
        # A published run's drawn workload is single-turn with no shared prefix (_workload): its
        # requests' lengths are the drawn ones, without drawing their token ids.
        assert self.workload.conversation is None and self.workload.shared_prefix is None
        return length_spread(*draw_lengths(self.workload))

    def params(self, base: CostParams) -> CostParams:
        """`base` (the fitted figures of this GPU family and engine) with what this run's flags change."""
        return base if self.overlap_host is None else base.with_values({"overlap_host": self.overlap_host})

    def simulate(self, params: CostParams, *, trace: bool = False) -> SimulationResult:
        workload = self.workload
        served: list[list[int]] = []
        if self.served_runs or self.test_request:
            drawn = workload
            assert isinstance(drawn, Workload)  # only a published run's (drawn) workload has either
            workload = Replay.of(drawn, self.model.vocab_size, self.max_model_len)
            for prior in self.served_runs:
                served += [_served_tokens(r, k, prior) for k, r in enumerate(draw(prior, self.model.vocab_size))]
            if self.test_request:
                served.append(_served_tokens(workload.requests[0], 0, drawn))
        return simulate(self.model, self.hw, self.dep, workload, calibration=self.params(params),
                        max_model_len=self.max_model_len, trace=trace, served_before=served,
                        client_times_every_event=self.times_every_event)


def _served_tokens(request: WorkloadRequest, index: int, workload: Workload) -> list[int]:
    """A served request's prompt and output. Benchmark clients decode greedily, so prompt i's output
    is the same in every run (a shorter one a prefix of a longer): drawn from a stream seeded by i."""
    output = np.random.default_rng(index).integers(workload.first_token_id, workload.vocab_size_tokens,
                                                    size=request.output_tokens)
    return [*request.prompt_token_ids, *output.tolist()]


def predicted(run: ReplayRun, summary: RunSummary) -> dict[str, float]:
    """figure id -> the simulator's value of that figure."""
    return {f.id: summary_value(summary, f.metric) for f in run.figures}


def prepare(run: PublicRun) -> ReplayRun | str:
    """The replay of `run`, or why it cannot be replayed."""
    args = run.engine.args
    for name, reason in _UNSUPPORTED_ARGS.items():
        if name in args:
            return reason
    unknown = sorted(set(args) - set(ENGINE_FLAG_KNOBS) - _NEUTRAL_ARGS - _DEPLOYMENT_ARGS)
    if unknown:
        return f"engine flags not modelled: {', '.join(unknown)}"
    backend = args.get("attention_backend")
    if backend is not None and backend not in _ATTENTION_KERNELS:
        return f"attention backend {backend} not modelled"
    d = run.deployment
    engine_name, note = engine_for_release(run.engine.engine, run.engine.version)
    engine = get_engine(engine_name)
    assumptions = [note] if note else []
    changed = engine.earlier_execution(run.engine.version) if note is None else {}
    if changed:
        assumptions.append(f"{run.engine.engine} {run.engine.version} as it ran, not as {engine.name}'s newest release: "
                           f"execution {', '.join(f'{k}={v}' for k, v in changed.items())} (the profile's earlier_releases)")
    attention_dp = 1
    if args.get("enable_dp_attention"):
        # SGLang's --dp D with DP attention: D attention groups inside one engine over its TP GPUs.
        attention_dp = d.data_parallel
        if d.tensor_parallel % attention_dp:
            return f"DP attention over {attention_dp} groups does not divide tensor parallel {d.tensor_parallel}"
        if attention_dp == 1:
            assumptions.append(_SGLANG_DP_ATTENTION_OFF)
    elif d.data_parallel > 1:
        return "data-parallel engines behind one client are not replayed"
    model, hw = resolve_model(d.model), get_hardware(d.hardware)
    max_model_len = int(args.get("max_model_len") or args.get("max_seq_len") or model.max_position_embeddings)
    max_model_len = min(max_model_len, model.max_position_embeddings)
    knobs = knobs_from_flags(args)
    if run.engine.engine == "sglang" and args.get("disable_radix_cache"):
        knobs = knobs.model_copy(update={"enable_prefix_caching": False})
    if run.engine.kv_cache_gib_reported is not None:
        knobs = knobs.model_copy(update={"kv_cache_gib": run.engine.kv_cache_gib_reported})
    dep = Deployment(hardware=hw.name, tensor_parallel=d.tensor_parallel, pipeline_parallel=d.pipeline_parallel,
                     expert_parallel=d.expert_parallel, attention_data_parallel=attention_dp,
                     weight_dtype=d.weight_dtype, kv_dtype=d.kv_dtype, engine=engine_name,
                     api_server=run.client.endpoint != "in-process",
                     api_endpoint="completions" if run.client.endpoint == "completions" else "chat", knobs=knobs,
                     profile_sampler=run.engine.profile_sampler, peer_access=d.peer_access,
                     attention_kernel=_ATTENTION_KERNELS[str(backend)] if backend is not None else None)
    overlap = True if args.get("async_scheduling") else None
    times_every_event = run.client.tool in _TIMES_EVERY_EVENT and dep.api_server
    if times_every_event and engine.streaming is None:
        return (f"{run.client.tool} times every streamed event, and {engine.name}'s profile does not say which of its "
                "server's events carry no token")
    if d.expert_parallel > 1 and not dispatches_by_all_to_all(dep):
        assumptions.append(f"expert parallelism as {engine.name} runs it without DP attention: each rank's experts "
                           "on every token, summed by the layer's all-reduce (no all-to-all)")
    workload = _workload(run)
    served_runs = tuple(workload.model_copy(update={"num_requests": prior.num_prompts,
                                                     "output_tokens": FixedLength(tokens=prior.output_tokens)})
                        for prior in run.client.served_before or ())
    if served_runs:
        assumptions.append(f"the server served {len(served_runs)} published run(s) of these prompts before this one "
                           "(its prefix cache starts as they left it)")
    set_aside: frozenset[str] = frozenset()
    set_aside_reason = ""
    if run.client.served_unpublished:
        set_aside, set_aside_reason = frozenset({"ttft", "e2e"}), (
            "TTFT and E2E figures set aside: the server had served this run's prompts in unpublished runs, so its "
            "prefix cache at the start is unknown")
        assumptions.append(set_aside_reason)
    # vllm bench serve sends the run's first request alone before the run (benchmark_serving.py's
    # initial test run), so a server with prefix caching meets prompt 0 warm.
    test_request = run.client.tool == "vllm-bench-serve"
    return ReplayRun(run, model, hw, engine, dep, workload, max_model_len, overlap, tuple(assumptions),
                     served_runs, test_request, set_aside, set_aside_reason, times_every_event)


def _workload(run: PublicRun) -> Workload:
    client, lengths = run.client, run.lengths
    inputs: LognormalLength | FixedLength | UniformLength
    outputs: LognormalLength | FixedLength | UniformLength
    if lengths.dataset == "sharegpt":
        rules = lengths.sharegpt_rules or ("sglang" if client.tool == "sglang-bench-serving" else "vllm")
        inputs, outputs, max_total = sharegpt_lengths(lengths.mean_input_tokens, lengths.mean_output_tokens, rules)
    else:
        assert lengths.input_tokens is not None and lengths.output_tokens is not None  # the schema requires them
        inputs = _random_length(lengths.input_tokens, lengths.random_range_ratio, client.tool)
        outputs = _random_length(lengths.output_tokens, lengths.random_range_ratio, client.tool)
        if client.tool in _STOPS_AT_EOS and lengths.mean_output_tokens is not None:
            outputs = stopping_at_eos(outputs, lengths.mean_output_tokens)
        max_total = None
    if client.arrival == "closed_loop":
        assert client.max_concurrency is not None
        arrival: object = ClosedLoopArrivals(concurrency=client.max_concurrency)
    elif client.arrival == "poisson":
        assert client.request_rate_per_s is not None
        arrival = PoissonArrivals(rate_per_s=client.request_rate_per_s, max_concurrency=client.max_concurrency)
    else:
        arrival = OfflineArrivals(max_concurrency=client.max_concurrency)
    workload = Workload(name="published-run", description=run.run_key[:1000], arrival=arrival, input_tokens=inputs,
                        output_tokens=outputs, max_total_tokens=max_total, num_requests=client.num_prompts, seed=0)
    if lengths.dataset == "sharegpt":
        return _drawn_with_means(workload, lengths.mean_input_tokens, lengths.mean_output_tokens)
    return workload


def _drawn_with_means(workload: Workload, mean_input_tokens: float | None, mean_output_tokens: float | None,
                      rounds: int = 60, tolerance: float = 1e-3) -> Workload:
    """`workload` with its log-normal medians moved until the requests it draws have the published
    means: a client's mean is that of the prompts it sampled (100 of them in GPUStack's latency runs,
    whose replies average 221 tokens where ShareGPT's average 202), not the dataset's."""
    targets = {"input_tokens": mean_input_tokens, "output_tokens": mean_output_tokens}
    for _ in range(rounds):
        drawn = dict(zip(("input_tokens", "output_tokens"), draw_lengths(workload)))
        off = {side: target / float(drawn[side].mean()) for side, target in targets.items() if target is not None}
        if all(abs(ratio - 1) <= tolerance for ratio in off.values()):
            break
        workload = workload.model_copy(update={
            side: getattr(workload, side).model_copy(update={"median_tokens": getattr(workload, side).median_tokens * ratio})
            for side, ratio in off.items()})
    return workload


# Clients that time every SSE event with a choice: TTFT at the first, an ITL at each next one, the
# server's role and finish_reason chunks included (vllm bench serve: `if choices := data.get("choices")`,
# https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/benchmarks/lib/endpoint_request_func.py).
# SGLang's bench_serving times only events that carry text.
_TIMES_EVERY_EVENT = frozenset({"vllm-bench-serve"})

# Clients that leave EOS on for the random dataset: `vllm bench serve` sends max_tokens = the
# drawn length and ignore_eos only under --ignore-eos, so a request may stop early (GPUStack's
# gpt-oss-20b runs asked for 200 tokens and got 105 on average). SGLang's bench_serving and vLLM's
# offline throughput benchmark ignore EOS by default: their lengths are the drawn ones.
_STOPS_AT_EOS = frozenset({"vllm-bench-serve"})


def stopping_at_eos(asked: FixedLength | UniformLength, mean_tokens: float) -> FixedLength | UniformLength:
    """Output lengths of requests that ask for `asked` tokens but may stop at EOS, where the run
    generated `mean_tokens` per request: each request generates the same share of what it asked
    for. The sources publish only the mean; their TPOT P99 sits within a few per cent of the
    median, which a spread of lengths (a memoryless EOS puts some requests at 2-3 tokens, their
    one step mixed with a long prefill) would not give. A mean at or above the asked one leaves
    `asked`."""
    low, high = (asked.tokens, asked.tokens) if isinstance(asked, FixedLength) else (asked.min_tokens, asked.max_tokens)
    share = mean_tokens / ((low + high) / 2)
    if share >= 1:
        return asked
    low, high = max(1, round(low * share)), max(1, round(high * share))
    return FixedLength(tokens=low) if low == high else UniformLength(min_tokens=low, max_tokens=high)


def _random_length(nominal: int, ratio: float | None, tool: str) -> FixedLength | UniformLength:
    """The random dataset's lengths as each client draws them (the data's Lengths.random_range_ratio)."""
    if tool == "sglang-bench-serving":
        r = 0.0 if ratio is None else ratio  # SGLang draws uniformly in [rL, L], at least 1
        low = max(1, int(nominal * r))
        return UniformLength(min_tokens=low, max_tokens=nominal) if low < nominal else FixedLength(tokens=nominal)
    r = ratio or 0.0  # vLLM draws uniformly in [L(1-r), L(1+r)]; its default r = 0 is the nominal length
    low, high = max(1, int(nominal * (1 - r))), int(nominal * (1 + r))
    return UniformLength(min_tokens=low, max_tokens=high) if high > low else FixedLength(tokens=nominal)
