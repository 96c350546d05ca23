"""Simulate a deployment serving a workload: replicas, a router and the workload's playback in SimPy."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
import dataclasses
from dataclasses import dataclass

import simpy
from simpy.events import ProcessGenerator

from engine.config import ModelConfig, SpeculativeSettings
from engine.core import (
    KVCacheManager,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepLoop,
    TierStats,
    WindowGroups,
)
from engine.core.metrics import RequestMetrics
from engine.core.kv_cache_manager import PrefixCacheStats
from engine.errors import InputError, unknown_name_error
from planner.costmodel import CostModel, CostParams
from planner.costmodel.fitted import FittedModel, RunKind, prediction_interval
from planner.engines import EngineProfile, get_engine, resolve_deployment
from planner.memory import MemoryPlan, plan_memory
from planner.metrics import ClientStream, EarlyStop, PricingBasis, RunRecord, RunSummary, SLOWatch, StepSample, summarize
from planner.playback import Playback, Replay, Submission, check_lengths, private_requests
from planner.sim.collector import fewer_collections
from planner.sim.disagg import Disaggregated
from planner.sim.executor import SYNTHETIC_TOKEN_ID, CostModelExecutor
from planner.sim.events import play
from planner.sim.frontend import FrontEnd
from planner.sim.replica import Replica
from planner.sim.router import ROUTERS, RouterName
from planner.sim.speculative import SyntheticDrafts
from planner.sim.step_time import representative_steps
from planner.sim.trace import RunTrace, TraceRecorder
from planner.tiers import offload_blocks
from planner.specs import SLO, Deployment, HardwareProfile
from planner.workload import Workload


@dataclass(frozen=True)
class SimulationResult:
    summary: RunSummary
    record: RunRecord  # per request and per step, for CDFs and full-resolution time series
    memory: MemoryPlan
    trace: RunTrace | None = None  # the schedule, when asked for (trace=True): what a fit re-times


class _SLOMissed(Exception):
    """Raised from a finishing request once the run can no longer meet its SLO (simulate's stop_once_missed)."""


def context_length(model: ModelConfig, max_model_len: int | None) -> int:
    """The longest prompt + output a simulated engine accepts: `max_model_len` (0 is a value, not
    "unset") within 2..the model's context, or the model's context when None."""
    max_len = model.max_position_embeddings if max_model_len is None else max_model_len
    if not 2 <= max_len <= model.max_position_embeddings:
        raise InputError("max_model_len", max_len, f"must be in 2..{model.max_position_embeddings} (the model's context)")
    return max_len


@dataclass(frozen=True)
class ReplicaTemplate:
    """What every replica of a deployment is built from, resolved once: the engine profile, the
    deployment as that engine fills it in, its memory plan, cost model and scheduler settings."""

    engine: EngineProfile
    dep: Deployment  # resolved: the engine's defaults fill the knobs left unset
    memory: MemoryPlan
    cost_model: CostModel
    sched_config: SchedulerConfig
    max_len: int
    host_blocks: int
    disk_blocks: int
    spec: SpeculativeSettings | None
    acceptance: tuple[float, ...] | None

    @classmethod
    def resolve(cls, model: ModelConfig, hw: HardwareProfile, dep: Deployment, calibration: CostParams | None = None,
                max_model_len: int | None = None, kv_cache_blocks: int | None = None,
                fit: FittedModel | None = None) -> ReplicaTemplate:
        """`kv_cache_blocks` replaces the memory plan's count per replica (to mirror an engine run
        whose cache size was set by hand); `calibration` and `fit` price the steps as simulate() says."""
        max_len = context_length(model, max_model_len)
        engine = get_engine(dep.engine)
        asked, dep = dep, resolve_deployment(dep, hw, max_model_len=max_len)
        memory = plan_memory(model, hw, dep, context_tokens=max_len)
        if engine.scheduling.running_from_kv is not None:  # SGLang: the running cap follows the KV pool
            dep = resolve_deployment(asked, hw, max_model_len=max_len, kv_tokens=memory.kv_cache_tokens)
        # Only "no KV cache at all" is fatal here: requests are checked one by one by the drivers, so a
        # default max_model_len beyond what the cache holds does not stop a workload of short ones.
        if kv_cache_blocks is not None:
            if kv_cache_blocks < 1:
                raise InputError("kv_cache_blocks", kv_cache_blocks, "must be >= 1")
            memory = memory.model_copy(update={"kv_cache_blocks": kv_cache_blocks,
                                               "kv_cache_tokens": kv_cache_blocks * dep.knobs.choices.block_size_tokens})
        if memory.kv_cache_blocks < 1:
            raise InputError("deployment", f"{memory.model} on {dep.replicas} x {dep.gpus_per_replica} {hw.name}",
                             memory.reason)
        cost_model = CostModel(model, hw, dep, calibration, fit=fit)
        host_blocks, disk_blocks = offload_blocks(hw, dep, memory)
        spec = dep.knobs.speculative
        acceptance = None if spec is None else spec.acceptance_probabilities()
        if spec is not None and acceptance is None:
            raise InputError("speculative.acceptance_profile", None,
                             "the simulator needs acceptance_profile (per draft position) or acceptance_rate")
        sched_config = dataclasses.replace(dep.knobs.scheduler_config(max_len), output_reservation=engine.output_reservation())
        return cls(engine, dep, memory, cost_model, sched_config, max_len, host_blocks, disk_blocks, spec,
                   None if acceptance is None else tuple(acceptance))

    @property
    def kv_window(self) -> WindowGroups | None:
        """The KV cache's sliding-window groups, as the memory plan laid them out (None: every layer
        keeps every token)."""
        m = self.memory
        return WindowGroups(m.kv_window_groups, m.kv_window_tokens) if m.kv_window_tokens else None

    def decode_token(self, bulk_decodes: bool) -> int | None:
        """The token the schedulers may apply in bulk: the executor samples SYNTHETIC_TOKEN_ID for every
        decode. Offload tiers and sliding-window groups stay one by one: the bulk path's equivalence is
        proven (tests) without them."""
        one_by_one = self.host_blocks or self.memory.kv_window_groups or not self.cost_model.reader.reads_bulk_decodes
        return SYNTHETIC_TOKEN_ID if bulk_decodes and not one_by_one else None

    def pricing(self, hw: HardwareProfile) -> PricingBasis:
        """What a run's cost and MFU figures are taken against: every GPU of the deployment at the profile's price."""
        dep = self.dep
        peak, peak_dtype = hw.peak_flops(self.cost_model.gemm_dtype)
        return PricingBasis(
            gpus=dep.total_gpus,
            price_usd_per_gpu_hour=hw.price_usd_per_hour,
            peak_flops_per_gpu=peak,
            bandwidth_bytes_per_s_per_gpu=hw.memory_bandwidth_gb_s * 1e9,
            description=(
                f"{dep.total_gpus} x {hw.name} at "
                + (f"US${hw.price_usd_per_hour:.2f} per GPU-hour (profile price)" if hw.price_usd_per_hour else "no listed price")
                + f"; MFU against the {peak_dtype} peak; rates at this run's measured throughput"
            ),
        )

    def assumptions(self, router: RouterName, replay: Replay, *, engine_instances: int, seed: int) -> dict[str, object]:
        """What a run of these replicas assumed, for its summary: the cost model's figures, then the
        engine's settings as resolved, the workload and the simulator's own draws."""
        dep, sched_config, spec, disagg = self.dep, self.sched_config, self.spec, self.dep.disaggregation
        return {
            **self.cost_model.assumptions(),
            "engine": f"{self.engine.display_name} ({self.engine.name})",
            "replicas": dep.replicas,
            "disaggregation": None if disagg is None else {
                "instances": disagg.label, "prefill_instances": disagg.prefill_instances * dep.replicas,
                "decode_instances": disagg.decode_instances * dep.replicas,
                "rule": "a prefill instance runs each request for one token; its prompt's KV but the last token moves to a "
                        "decode instance, which computes that token again (vLLM's disaggregated prefill); prefix-cache "
                        "figures are the prefill instances'"},
            "kv_offload": None if not self.host_blocks else {
                "host_blocks_per_replica": self.host_blocks, "disk_blocks_per_replica": self.disk_blocks,
                "preemption_mode": sched_config.preemption_mode},
            "router": router,
            "kv_cache_blocks_per_replica": self.memory.kv_cache_blocks,
            "engine_instances": engine_instances,
            "block_size_tokens": sched_config.block_size,
            "max_model_len": self.max_len,
            "max_num_batched_tokens": sched_config.max_num_batched_tokens,
            "max_num_seqs": sched_config.max_num_seqs,
            "enable_chunked_prefill": sched_config.enable_chunked_prefill,
            "enable_prefix_caching": sched_config.enable_prefix_caching,
            "policy": sched_config.policy,
            "batching": sched_config.batching,
            "num_scheduler_steps": sched_config.num_scheduler_steps,
            "output_reservation": None if sched_config.output_reservation is None else dataclasses.asdict(
                sched_config.output_reservation),
            "gpu_memory_utilization": dep.knobs.choices.gpu_memory_utilization,
            "workload": replay.description,
            "output_lengths": "drawn by the workload and generated exactly (ignore_eos)",
            "speculative": None if spec is None else {
                "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                "acceptance_profile": list(self.acceptance or ()), "proposal_rate": spec.proposal_rate, "seed": seed},
        }

    def replica(self, env: simpy.Environment, index: int, on_finished: Callable[[Request], None],
                samples: list[StepSample] | None, recorder: TraceRecorder | None, decode_token: int | None,
                seed: int) -> tuple[Replica, CostModelExecutor]:
        """A new replica (the engine's own scheduler and step loop) serving on `env`, and its executor."""
        config = self.sched_config
        scheduler = Scheduler(config, KVCacheManager(self.memory.kv_cache_blocks, config.block_size,
                                                     config.enable_prefix_caching, self.host_blocks, self.disk_blocks,
                                                     self.kv_window),
                              decode_token)
        drafts = None if self.spec is None or self.acceptance is None else SyntheticDrafts(
            self.spec.num_speculative_tokens, self.acceptance, (seed, index), SYNTHETIC_TOKEN_ID, self.spec.proposal_rate)
        executor = CostModelExecutor(self.cost_model, drafts)
        loop = StepLoop(scheduler, executor, lambda: env.now, proposer=drafts, replica=index)
        return Replica(env, loop, executor, on_finished, samples, recorder, self.cost_model.api_hold_s), executor


@fewer_collections()
def simulate(
    model: ModelConfig,
    hw: HardwareProfile,
    dep: Deployment,
    workload: Workload | Replay,
    *,
    slo: SLO | None = None,
    router: RouterName = "round_robin",
    calibration: CostParams | None = None,
    fit: FittedModel | None = None,
    max_model_len: int | None = None,
    kv_cache_blocks: int | None = None,
    seed: int = 0,
    trace: bool = False,
    bulk_decodes: bool = True,
    stop_once_missed: bool = False,
    served_before: Sequence[Sequence[int]] = (),
    client_times_every_event: bool = False,
) -> SimulationResult:
    """Play `workload` (a spec to draw, or a trace / already drawn Replay) against `dep` until
    every request finishes. `kv_cache_blocks` replaces the memory plan's count per replica (to
    mirror an engine run whose cache size was set by hand). `seed` seeds the simulator's own draws
    (speculative acceptance); the workload carries its own seed. `fit` (what `serveplan calibrate
    --public` or `--from-bench` wrote) stands in for the public GPU fit: its figures price the steps
    (unless `calibration` gives every figure) and its bands make the prediction interval. Requests
    pass the engine's API server first (`CostModel.front_end_s` each, one at a time), as a
    benchmark client's do.
    `bulk_decodes`: the schedulers apply decodes where nothing happens in bulk (engine/core/
    bulk_decodes.py; same results); False handles every request in every step one by one, as the
    engine does. A traced run is always one by one: its trace records every request's steps.
    `stop_once_missed`: stop as soon as so many requests have missed their `slo` limits that the run
    can no longer meet it (metrics.SLOWatch); the summary then covers the requests finished by then,
    says so (`stopped_early`), and misses the SLO, as the whole run would have. A plan's capacity
    probes need no more than that verdict.
    `served_before`: what the replicas had served before the workload starts (token ids, prompt then
    output, in order, dealt round robin): their prefix caches start as those requests left them.
    `client_times_every_event`: the ITL statistics are those of a client that times every SSE event
    with a choice (`vllm bench serve`): the server's token-less events count as gaps of about
    nothing, and tokens that stream no event of their own arrive with the next (the engine profile's
    `streaming`); by default they are the gaps between the chunks that carry tokens."""
    if router not in ROUTERS:
        raise unknown_name_error("router", router, ROUTERS)
    build = ReplicaTemplate.resolve(model, hw, dep, calibration, max_model_len, kv_cache_blocks, fit)
    engine, dep, memory, cost_model = build.engine, build.dep, build.memory, build.cost_model
    stream = _client_stream(engine, dep, model) if client_times_every_event else ClientStream()
    max_len, sched_config = build.max_len, build.sched_config
    replay = workload if isinstance(workload, Replay) else Replay.of(workload, model.vocab_size, max_len)
    check_lengths(replay, max_len, memory.kv_cache_blocks, sched_config.block_size, where="a replica",
                  window=build.kv_window, max_step_tokens=sched_config.max_num_batched_tokens)

    env = simpy.Environment()
    samples: list[StepSample] = []
    finished: list[RequestMetrics] = []  # each request as it finishes; the scheduler drops it
    playback = Playback(replay)
    private = (private_requests(replay, sched_config.block_size, served_before)
               if sched_config.enable_prefix_caching else frozenset())
    recorder = (TraceRecorder(cost_model.reader, cost_model.api_hold_s, cost_model.api_release == "round", stream)
                if trace else None)
    api = FrontEnd(env, cost_model.front_end_s, cost_model.params.api_latency_s, cost_model.api_release)

    def send(sub: Submission, gate: str | None = None) -> None:
        """The client sends now; the engine sees the request once the API server has handled it."""
        wr = sub.request
        request = Request(wr.request_id, list(sub.prompt_token_ids),
                          SamplingParams(max_tokens=wr.output_tokens, ignore_eos=True), arrival_time=env.now,
                          private_blocks=wr.request_id in private)
        if recorder is not None:
            # A gated request goes think_time_s after its gate finishes, and not before it was due.
            due = (wr.arrival_s or 0.0) if gate else sub.due_s
            recorder.submitted(wr.request_id, due, gate, wr.think_time_s if gate else 0.0,
                               request.num_prompt_tokens, wr.output_tokens)
        api.forward(request, cluster.submit if cluster is not None else lambda r: replicas[route.choose(r, replicas)].submit(r))

    def send_later(sub: Submission, gate: str | None) -> ProcessGenerator:
        yield env.timeout(sub.due_s - env.now)
        send(sub, gate)

    watch = SLOWatch(slo, playback.num_requests) if stop_once_missed and slo is not None else None

    def on_finished(request: Request) -> None:
        finished.append(RequestMetrics.from_request(request))
        if watch is not None and watch.finished(finished[-1]) and len(finished) < playback.num_requests:
            raise _SLOMissed
        for sub in playback.finished(request.request_id, request.output_token_ids, env.now):
            if sub.due_s > env.now:
                env.process(send_later(sub, request.request_id))
            else:
                send(sub, request.request_id)

    decode_token = build.decode_token(bulk_decodes and not trace)

    def replica(index: int) -> Replica:
        made, executor = build.replica(env, index, on_finished, samples, recorder, decode_token, seed)
        executors.append(executor)
        return made

    executors: list[CostModelExecutor] = []
    disagg = dep.disaggregation
    if disagg is None:
        route = ROUTERS[router]()
        replicas = [replica(i) for i in range(dep.replicas)]
        prefilling = replicas  # where prompts are computed: the prefix-cache statistics
        cluster = None
    else:
        n_prefill = dep.replicas * disagg.prefill_instances
        replicas = [replica(i) for i in range(n_prefill + dep.replicas * disagg.decode_instances)]
        prefilling = replicas[:n_prefill]
        cluster = Disaggregated(env, prefilling, replicas[n_prefill:], ROUTERS[router](), ROUTERS[router](),
                                cost_model.copies, sched_config.block_size, on_finished)
    for k, tokens in enumerate(served_before):
        prefilling[k % len(prefilling)].scheduler.kv_cache_manager.served(f"served-before-{k}", tokens)
    play(env, playback.start(), lambda sub: sub.due_s, send)  # sorted by due time
    stopped = None
    try:
        env.run()  # the replicas idle on an event once everything is done, so the queue drains
    except _SLOMissed:
        assert watch is not None
        stopped = EarlyStop(at_s=env.now - min(r.arrival_time for r in finished), missed_requests=watch.missed,
                            basis=f"{watch.missed:,} of the {len(finished):,} requests finished by then missed a limit "
                                  f"of {watch.limits_ms} ms; the goodput share could no longer reach "
                                  f"{watch.required_share:g} of {watch.num_requests:,}")
    if stopped is None and len(finished) != playback.num_requests:
        raise RuntimeError(f"{playback.num_requests - len(finished)} requests never finished: simulator bug")

    stats = [r.scheduler.stats() for r in replicas]
    reasons: dict[str, int] = {}
    for s in stats[len(prefilling) if cluster is not None else 0:]:  # a prefill instance's one token is not the answer
        for reason, n in s.num_finished.items():
            if n:
                reasons[reason] = reasons.get(reason, 0) + n
    record = RunRecord(
        requests=finished[:],
        num_submitted=playback.num_requests,
        num_replicas=len(replicas),
        samples=samples[:],
        prefix_cache=sum((r.scheduler.stats().prefix_cache for r in prefilling), PrefixCacheStats()),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_steps=sum(s.num_steps for s in stats),
        kv_cache_blocks_total=memory.kv_cache_blocks * len(replicas),
        flops=sum(e.flops for e in executors) * dep.tensor_parallel,
        bytes=sum(e.bytes for e in executors) * dep.tensor_parallel,
        comm_s=sum(e.comm_s for e in executors),
        finish_reasons=reasons,
        offload=sum_tier_stats(s.offload for s in stats),
        transfers=cluster.transfers if cluster is not None else None,
        stopped=stopped,
        stream=stream,
    )
    # The replicas, the API server and the functions above refer to one another (SimPy events and
    # their callbacks), so only the cyclic collector frees them, and it runs rarely while simulations run
    # (planner/sim/collector.py): what the run made leaves them now, to go when its result goes.
    finished.clear()
    samples.clear()
    del playback
    pricing = build.pricing(hw)
    assumptions = build.assumptions(router, replay, engine_instances=len(replicas), seed=seed)
    summary = summarize(record, source="simulator", model=memory.model, hardware=hw.name, workload=replay.name,
                        slo=slo, pricing=pricing, assumptions=assumptions)
    kind = RunKind.of(engine, replay.regime, replay.lengths, model)
    summary = summary.model_copy(update={"prediction_interval": prediction_interval(summary, hw, engine, kind, fit),
                                         "step_time": representative_steps(cost_model, record)})
    return SimulationResult(summary=summary, record=record, memory=memory,
                            trace=None if recorder is None else recorder.trace())


def _client_stream(engine: EngineProfile, dep: Deployment, model: ModelConfig) -> ClientStream:
    """What a client that times every SSE event sees of the engine's server besides one event a token."""
    if not dep.api_server:
        return ClientStream()
    if engine.streaming is None:
        raise InputError("engine", engine.name, "its profile does not say which streamed events carry no token, so a "
                         "client that times every event cannot be replayed against it")
    events = engine.streaming.token_less_events(dep.api_endpoint)
    silent = engine.streaming.silent_leading_tokens.get(model.model_type, 0) if dep.api_endpoint == "chat" else 0
    # The role chunk, sent with the first token, is then that token's only event: not an extra one.
    return ClientStream(events - 1 if silent else events, silent)


def sum_tier_stats(stats: Iterable[TierStats | None]) -> TierStats | None:
    present = [s for s in stats if s is not None]
    if not present:
        return None
    return TierStats(**{f.name: sum(getattr(s, f.name) for s in present) for f in dataclasses.fields(TierStats)})
