"""Engine profiles: what differs between serving engines and their versions (vLLM, SGLang,
TensorRT-LLM, ServePlan's own), one YAML file each under planner/engines/, validated at load.

A profile says how the engine schedules (default budgets, chunked prefill, mixed or prefill-first
batching, admission and preemption), how it executes (CUDA-graph sizes, whether host work overlaps
the GPU), what its server adds (API server and tokeniser time), how it sizes its KV cache at
start-up (memory rules), and its per-step host costs. Every default carries its source; the costs
are estimates until the public fit (planner/public) replaces them. docs/engine-profiles.md explains
each engine's behaviour; its tables are generated from these files (planner/engines/docs.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Literal

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
import yaml

from engine.config import EngineChoices
from engine.core.scheduler import Batching, OutputReservation
from engine.errors import InputError, unknown_name_error
from engine.files import profile_folder
from planner.specs import AttentionKernel, DEFAULT_ENGINE, Deployment, EngineKnobs, HardwareProfile, ProfileSampler

PROFILE_DIR = Path(__file__).parent
EngineName = Literal["vllm", "sglang", "trtllm", "serveplan"]
ApiRelease = Literal["each", "round"]  # Overheads.api_release
MIB_PER_GIB = 1024


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Sourced(_Spec):
    """A section whose defaults each have a source: `sources` lists them all, `field_sources`
    says which one backs which field (docs/engine-profiles.md prints one per field)."""

    sources: tuple[str, ...] = Field(min_length=1)
    field_sources: dict[str, str] = Field(
        default_factory=dict, description="Field name -> the URL (code at a tag or commit, or docs) it comes from"
    )

    @model_validator(mode="after")
    def _field_sources_name_fields(self) -> _Sourced:
        unknown = set(self.field_sources) - set(type(self).model_fields) - {"sources", "field_sources"}
        if unknown:
            raise ValueError(f"field_sources names unknown fields {sorted(unknown)}")
        unlisted = set(self.field_sources.values()) - set(self.sources)
        if unlisted:
            raise ValueError(f"field_sources cites URLs missing from sources: {sorted(unlisted)}")
        return self


class DeviceDefaults(_Spec):
    """Defaults an engine picks by device (vLLM V1: larger budgets on >= 70 GiB GPUs but A100;
    SGLang: chunked-prefill size and largest CUDA graph by GPU memory and TP size)."""

    min_memory_gib: float | None = Field(None, ge=0, description="Applies to devices with at least this memory")
    max_memory_gib: float | None = Field(None, ge=0, description="... and at most this memory")
    families: tuple[str, ...] | None = Field(None, description="Only these hardware families (profile `family`)")
    not_families: tuple[str, ...] = Field((), description="Never these families")
    min_tp: int | None = Field(None, ge=1, description="Only with at least this tensor-parallel size")
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    offline_max_num_batched_tokens: int | None = Field(
        None, ge=1, description="The offline (LLM class) budget on these devices, where it differs"
    )
    max_graph_batch_size: int | None = Field(None, ge=1, description="Largest decode batch captured on these devices")
    source: str

    def matches(self, family: str, memory_gib: float, tp: int) -> bool:
        return not (
            (self.min_memory_gib is not None and memory_gib < self.min_memory_gib)
            or (self.max_memory_gib is not None and memory_gib > self.max_memory_gib)
            or (self.families is not None and family not in self.families)
            or family in self.not_families
            or (self.min_tp is not None and tp < self.min_tp)
        )


class LongContextChunking(_Spec):
    """vLLM V0: with --enable-chunked-prefill unset, chunked prefill switches itself on for models
    whose max_model_len exceeds a threshold (to keep the profiling pass from running out of memory).
    Whenever chunked prefill is on, switched on so or by the flag, the scheduler takes its own small
    token budget and mixes decodes and chunks; with the flag off it stays off at any max_model_len."""

    above_max_model_len: int = Field(ge=1, description="Chunked prefill turns on when max_model_len exceeds this")
    max_num_batched_tokens: int = Field(ge=1, description="Default budget whenever it is on")
    batching: Batching = Field(description="How a step is built once it is on")
    source: str


class RunningFromKV(_Spec):
    """SGLang: with --max-running-requests unset, the cap follows the KV pool:
    min(kv_tokens // kv_tokens_per_request, request slots), where the request-slot pool holds
    clamp(int(kv_tokens / context_len * slots_per_context_len), min_slots, max_slots) - reserved_slots."""

    kv_tokens_per_request: int = Field(ge=1)
    slots_per_context_len: int = Field(ge=1)
    min_slots: int = Field(ge=1)
    max_slots: int = Field(ge=1)
    reserved_slots: int = Field(0, ge=0, description="Slots the cap leaves unused (SGLang 0.3.0: one)")
    source: str

    def cap(self, kv_tokens: int, context_len: int) -> int:
        slots = min(max(int(kv_tokens / context_len * self.slots_per_context_len), self.min_slots), self.max_slots)
        return min(kv_tokens // self.kv_tokens_per_request, slots - self.reserved_slots)


class Scheduling(_Sourced):
    max_num_seqs: int = Field(ge=1, description="Default most requests running at once (with running_from_kv: its ceiling)")
    max_num_batched_tokens: int = Field(ge=1, description="Default token budget per step (chunked-prefill chunk)")
    offline_max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Default budget of the offline LLM class where it differs from the API server's "
        "(vLLM V1 picks by usage context)"
    )
    device_defaults: tuple[DeviceDefaults, ...] = Field((), description="First matching rule wins over the defaults")
    enable_chunked_prefill: bool = Field(description="Default; without it a prompt is prefilled whole in one step")
    long_context_chunking: LongContextChunking | None = Field(
        None, description="Chunked prefill that switches itself on for long max_model_len (vLLM V0)"
    )
    budget_covers_max_model_len: bool = Field(
        False, description="Without chunked prefill the default budget is max(max_model_len, max_num_batched_tokens), "
        "so any prompt fits one step (vLLM V0)"
    )
    running_from_kv: RunningFromKV | None = Field(None, description="The running-request cap follows the KV pool (SGLang)")
    enable_prefix_caching: bool
    batching: Batching = Field(
        description="mixed: a step runs decodes and prefill chunks together (vLLM V1, TensorRT-LLM in-flight batching); "
        "prefill_first: while prompts wait and fit, a step prefills only and decodes stall (vLLM V0, SGLang)"
    )
    admission: Literal["optimistic", "reserve_output", "reserve_ratio"] = Field(
        description="optimistic: admit while the prompt's blocks fit, preempt when decodes run out (vLLM); "
        "reserve_output: admit only if prompt + max_tokens fit (TensorRT-LLM GUARANTEED_NO_EVICT); "
        "reserve_ratio: reserve admission_ratio x max_tokens of future output per running request (SGLang)"
    )
    admission_ratio: float | None = Field(None, gt=0, le=1, description="reserve_ratio: share of max_tokens reserved")
    admission_ratio_min: float | None = Field(
        None, gt=0, le=1, description="reserve_ratio: the share decays to this floor while decoding goes well"
    )
    admission_ratio_decay: float | None = Field(
        None, ge=0, description="reserve_ratio: subtracted from the share after every decode step; the share "
        "returns to admission_ratio when the engine idles and is raised after a retraction"
    )
    admission_clip_tokens: int | None = Field(
        None, ge=1, description="reserve_ratio: max_tokens counts at most this many tokens in the reservation, and an "
        "admitted request reserves min(max_tokens, this) in full"
    )
    retraction_headroom_steps: int | None = Field(
        None, ge=1, description="reserve_ratio: a decode step short of a free slot per running request retracts, the "
        "fewest output tokens first (ties: longest prompt), until the free slots hold this many decodes of every "
        "request left, and the share becomes (their outputs + this x their number) / their max_tokens (SGLang's "
        "retract_decode); none: the step preempts as `preemption` says and the share returns to admission_ratio"
    )
    preemption: Literal["recompute", "swap", "none"] = Field(
        "recompute", description="What a request short of KV loses: recompute (frees its blocks, prefills again), "
        "swap (to host memory), none (admission guarantees it never runs short)"
    )
    num_scheduler_steps: int = Field(1, ge=1, description="Decode steps per scheduling decision (vLLM 0.6 multi-step)")
    decode_steps_without_streams: int = Field(
        1, ge=1, description="Decode steps run back to back before waiting prompts are looked at again when no running "
        "request streams its output (SGLang 0.3.0-0.3.3: 10)"
    )
    block_size_tokens: int = Field(ge=1, description="KV-cache page size")

    @model_validator(mode="after")
    def _ratio_fields_only_with_reserve_ratio(self) -> Scheduling:
        ratio_fields = ("admission_ratio_min", "admission_ratio_decay", "admission_clip_tokens", "retraction_headroom_steps")
        if self.admission != "reserve_ratio" and any(getattr(self, f) is not None for f in ratio_fields):
            raise ValueError(f"{', '.join(ratio_fields)} apply only when admission is 'reserve_ratio'")
        if self.admission_ratio_min is not None and self.admission_ratio is not None \
                and self.admission_ratio_min > self.admission_ratio:
            raise ValueError("admission_ratio_min must not exceed admission_ratio")
        if self.running_from_kv is not None and self.running_from_kv.max_slots - self.running_from_kv.reserved_slots \
                != self.max_num_seqs:
            raise ValueError("with running_from_kv, max_num_seqs is its ceiling: max_slots - reserved_slots")
        if self.long_context_chunking is not None and self.enable_chunked_prefill:
            raise ValueError("long_context_chunking describes a default that is off below the threshold")
        return self


class Execution(_Sourced):
    cuda_graphs: bool = Field(description="Decode steps replay captured graphs by default")
    max_graph_batch_size: int = Field(ge=1, description="Largest decode batch captured")
    graph_batch_sizes: tuple[int, ...] | None = Field(
        None, description="The capture pattern, where it is not 1, 2, 4 and multiples of 8: the sizes up to the "
        "device's largest captured batch are captured"
    )
    graph_padding: bool = Field(
        True, description="A decode batch is padded up to the next captured size; otherwise only a batch of exactly a "
        "captured size replays a graph (TensorRT-LLM's default enable_padding=False)"
    )
    graph_max_context_len: int | None = Field(
        None, ge=1, description="Decode steps whose longest sequence exceeds this run eagerly (vLLM V0 "
        "max_seq_len_to_capture)"
    )
    graphs_cover_mixed_steps: bool = Field(
        False, description="Steps with prefill tokens replay piecewise graphs too, up to max_graph_batch_size tokens, "
        "with attention run eagerly between the pieces (vLLM V1)"
    )
    piecewise_decode_graphs: bool = Field(
        False, description="Decode-only steps replay the piecewise graphs too, attention eager between the pieces, "
        "instead of one whole captured graph (vLLM V1 before 0.11 made FULL_AND_PIECEWISE its default)"
    )
    overlap_host: bool = Field(
        description="Host work of step n+1 (scheduling, input preparation) overlaps the GPU work of step n "
        "(SGLang's overlap scheduler, TensorRT-LLM); otherwise it adds to every step"
    )
    kv_scale_format: Literal["per_tensor", "per_token_head"] = Field(
        description="FP8 KV-cache scales: one per tensor (no extra bytes) or one per (token, head) (ServePlan's engine)"
    )
    custom_all_reduce_max_bytes: int = Field(
        0, ge=0, le=1 << 30, description="Tensor-parallel all-reduces smaller than this, on a fully connected scale-up "
        "link (NVLink/NVSwitch) and 2, 4, 6 or 8 ranks, run the engine's own one- or two-stage kernel instead of NCCL "
        "(vLLM's custom all-reduce, 8 MiB); 0: always NCCL"
    )
    triton_sink_attention_families: tuple[str, ...] = Field(
        (), description="GPU families on which the engine runs the attention of models with attention sinks (gpt-oss) "
        "in its portable Triton kernels, its FlashAttention-class kernels having no sinks there (vLLM and SGLang before "
        "Hopper); priced at the family's triton_attention_efficiency"
    )
    expert_dispatch: Literal["all_reduce", "all_to_all"] = Field(
        "all_reduce", description="Expert parallelism beside tensor-parallel attention: every rank runs its own experts on "
        "the replicated tokens and the layer's all-reduce sums them (vLLM's FusedMoE, SGLang's EP MoE), or each rank "
        "sends its share of the tokens to their experts' ranks by all-to-all and gathers the outputs back (ServePlan's "
        "engine). With data-parallel attention every engine dispatches by all-to-all"
    )

    @model_validator(mode="after")
    def _graph_sizes_ascend(self) -> Execution:
        sizes = self.graph_batch_sizes
        if sizes is not None and (list(sizes) != sorted(set(sizes)) or self.max_graph_batch_size not in sizes):
            raise ValueError("graph_batch_sizes must ascend without repeats and contain max_graph_batch_size")
        return self


class Overheads(_Spec):
    """Host-side costs; estimates until fitted (planner/public replaces them with fitted values)."""

    step_us: float = Field(ge=0, description="Host time per engine step: scheduling, input preparation, output handling")
    per_request_us: float = Field(ge=0, description="Host time per scheduled request per step")
    api_request_ms: float = Field(
        ge=0, description="API server time per request before it reaches the engine (HTTP, tokeniser); "
        "requests pass the server one at a time, so a burst queues here"
    )
    api_chat_template_ms: float = Field(
        0.0, ge=0, description="API server time per chat request beyond api_request_ms: rendering the messages with the "
        "model's Jinja chat template (Hugging Face apply_chat_template) before tokenising; not paid by completions "
        "requests, nor by models in native_chat_model_types")
    api_latency_ms: float = Field(
        0.0, ge=0, description="Time each request spends between the client and the engine without occupying the API "
        "server (hand-offs to the engine process, the first token's way back through the detokeniser and the stream): "
        "requests overlap in it, so it adds to TTFT and E2E but does not limit throughput")
    api_release: ApiRelease = Field(
        "each", description="How requests the API server has handled go on to the engine: 'each' as soon as it is "
        "handled; 'round': the server handles every request waiting when it turns to them before any of them goes on "
        "(an asyncio server that runs each handler up to its first await, chat template included, before any handler "
        "continues), so a burst reaches the engine at once (planner/sim/frontend.py)")
    native_chat_model_types: list[str] = Field(
        default_factory=list, description="Model types (config.json model_type) whose chat prompts this engine's server "
        "renders natively instead of with a Jinja template (gpt-oss's harmony format)")
    api_step_us: float = Field(
        0.0, ge=0, description="Host time the API server takes from the step loop per step that streams tokens "
        "(handing the step's outputs to the server); 0 where the server runs beside the engine, not in its process")
    api_token_us: float = Field(
        0.0, ge=0, description="Host time the API server takes from the step loop per streamed token (its SSE event); "
        "0 where the server runs beside the engine, not in its process")
    api_hold_share: float = Field(
        0.0, ge=0, le=1, description="Share of api_request_ms that a request arriving while the engine runs takes from "
        "the step loop (a server in the engine's process, sharing its GIL; the rest, such as a tokeniser that releases "
        "the GIL, overlaps); 0 where the server is a process of its own")
    provenance: str


class Streaming(_Sourced):
    """What the engine's OpenAI server streams besides tokens. A benchmark client that times every SSE
    event with a choice (`vllm bench serve`) counts each token-less one as an inter-token latency of
    about nothing; one that times only events with text (SGLang's bench_serving, ServePlan's
    `endpoint bench`) does not."""

    chat_token_less_events: int = Field(
        ge=0, description="Events of a streamed chat completion that carry a choice but no token, per request: the "
        "role chunk some servers send before the first token's, a finish_reason chunk of its own after the last")
    completions_token_less_events: int = Field(
        ge=0, description="The same for a streamed text completion")
    silent_leading_tokens: dict[str, int] = Field(
        default_factory=dict, description="Model type (config.json model_type) -> the leading tokens of a streamed chat "
        "response that send no event of their own (vLLM's harmony parser while a gpt-oss response's channel header is "
        "read): the role chunk stands for the first, the rest arrive with the next event")

    @model_validator(mode="after")
    def _role_chunk_for_silent_tokens(self) -> Streaming:
        if self.silent_leading_tokens and self.chat_token_less_events < 1:
            raise ValueError("silent_leading_tokens needs the role chunk that stands for the first token "
                             "(chat_token_less_events >= 1)")
        if any(n < 1 for n in self.silent_leading_tokens.values()):
            raise ValueError("silent_leading_tokens counts at least one token per model type")
        return self

    def token_less_events(self, endpoint: Literal["chat", "completions"]) -> int:
        return self.chat_token_less_events if endpoint == "chat" else self.completions_token_less_events


class UtilizationByTP(_Spec):
    """SGLang <= 0.4: mem_fraction_static by tensor-parallel size."""

    min_tp: int = Field(ge=1)
    utilization: float = Field(gt=0, le=1)


class ReservedMemory(_Spec):
    """SGLang >= 0.5.3 with mem_fraction_static unset: round((device MiB - reserved MiB) / device MiB, 3), with
    reserved = base + per_budget_token x max(chunked_prefill_size, min_budget_tokens)
    + per_graph_batch x cuda_graph_max_bs + per_gpu x tp x pp, at least floor_mib on devices above floor_above_mib."""

    base_mib: float = Field(ge=0)
    per_budget_token_mib: float = Field(ge=0)
    min_budget_tokens: int = Field(ge=0)
    per_graph_batch_mib: float = Field(ge=0)
    per_gpu_mib: float = Field(ge=0)
    floor_mib: float = Field(ge=0)
    floor_above_mib: float = Field(ge=0)
    source: str

    def utilization(self, device_mib: float, budget_tokens: int, graph_batch: int, gpus: int) -> float:
        reserved = (self.base_mib + self.per_budget_token_mib * max(budget_tokens, self.min_budget_tokens)
                    + self.per_graph_batch_mib * graph_batch + self.per_gpu_mib * gpus)
        if device_mib > self.floor_above_mib:
            reserved = max(reserved, self.floor_mib)
        return round((device_mib - reserved) / device_mib, 3)


class Memory(_Sourced):
    """How the engine sizes its KV cache at start-up (issue 23)."""

    utilization_default: float = Field(gt=0, le=1, description="gpu_memory_utilization / mem_fraction_static / "
                                       "free_gpu_memory_fraction default (where no rule below applies)")
    utilization_by_tp: tuple[UtilizationByTP, ...] = Field(
        (), description="The default by tensor-parallel size: the first rule with min_tp <= tp wins (SGLang 0.3)"
    )
    reserved_rule: ReservedMemory | None = Field(None, description="The default from an estimate of what the KV pool "
                                                 "must leave free (SGLang 0.5)")
    utilization_of: Literal["total", "free_at_start", "free_after_weights"] = Field(
        description="total: the share of device memory the engine may use for everything (vLLM); "
        "free_at_start: the share of the memory free when the engine starts (after the CUDA context and "
        "communicators) that weights and the KV pool may use (SGLang); "
        "free_after_weights: the share of memory still free after loading weights that goes to KV (TensorRT-LLM)"
    )
    activation_profile: Literal["budget", "none"] = Field(
        description="budget: a profiling forward pass at the token budget sets the activation reserve (vLLM); "
        "none: a fixed reserve (see reserve_gib)"
    )
    sampler_in_profile: bool = Field(
        False, description="The profiling pass also samples one row of logits per request for up to max_num_seqs "
        "requests, so the sampler's peak (requests x vocabulary, fp32) is reserved too (vLLM)"
    )
    sampler: ProfileSampler | None = Field(
        None, description="How the profiling pass's top-k/top-p sampler works, which decides its bytes per logit "
        "(planner/memory/activations.py): torch_sort sorts the logits (vLLM V1's PyTorch path, 0.6.5+ V0), "
        "torch_sort_gather sorts and re-gathers them (V0 to 0.6.4), flashinfer masks without sorting; set exactly "
        "when sampler_in_profile")
    reserve_gib: float = Field(0.0, ge=0, description="Fixed memory kept out of the KV cache beyond the rules above")
    cuda_graph_in_budget: bool = Field(description="CUDA-graph memory is taken out of the KV cache budget")
    sliding_window_kv: Literal["every_token", "window_groups"] = Field(
        "every_token", description="How sliding-window layers keep KV: every_token, like full-attention layers; "
        "window_groups: layers in groups of equal size sharing one pool, a sliding-window group holding only its "
        "window's blocks (vLLM's hybrid KV cache manager, planner/memory/kv.py kv_groups)")

    @model_validator(mode="after")
    def _sampler_when_sampled(self) -> Memory:
        if self.sampler_in_profile != (self.sampler is not None):
            raise ValueError("sampler is set exactly when sampler_in_profile is true")
        return self

    @model_validator(mode="after")
    def _one_rule(self) -> Memory:
        if self.utilization_by_tp and self.reserved_rule is not None:
            raise ValueError("give utilization_by_tp or reserved_rule, not both")
        tps = [rule.min_tp for rule in self.utilization_by_tp]
        if tps != sorted(tps, reverse=True):
            raise ValueError("utilization_by_tp rules must go from the largest min_tp down (the first match wins)")
        return self


class EarlierReleases(_Spec):
    """How the line's releases before `before` executed otherwise: a deployment that names such a
    release (`vllm-0.11@0.10.2`) runs with these execution settings instead of the profile's."""

    before: str = Field(description="The first release of the line that no longer ran so (PEP 440)")
    execution: dict[str, bool] = Field(min_length=1, description="Execution fields and their values in those releases")
    source: str

    @model_validator(mode="after")
    def _known(self) -> EarlierReleases:
        unknown = sorted(set(self.execution) - set(Execution.model_fields))
        if unknown:
            raise ValueError(f"not execution settings: {', '.join(unknown)}")
        Version(self.before)  # an invalid version is refused here, at load
        return self


class EngineProfile(_Spec):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.\-]*$", description="Short id used on the command line")
    display_name: str
    engine: EngineName
    versions: str = Field(description="Releases the profile describes, e.g. '0.10.x-0.11.x'")
    releases: tuple[str, str] | None = Field(
        None, description="First and last release the profile covers (PEP 440, inclusive; the last may be a bound such as "
        "'0.11.99'), for matching a run's engine version; None: not a released engine (ServePlan's own)")
    scheduling: Scheduling
    execution: Execution
    overheads: Overheads
    memory: Memory
    streaming: Streaming | None = Field(
        None, description="None: not established for these releases (a replay whose client times every event "
        "refuses the profile)")
    earlier_releases: tuple[EarlierReleases, ...] = Field(
        (), description="Execution settings of the line's older releases, applied to a deployment that names its release")
    notes: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _ratio_when_needed(self) -> EngineProfile:
        s = self.scheduling
        if (s.admission == "reserve_ratio") != (s.admission_ratio is not None):
            raise ValueError("admission_ratio is set exactly when admission is 'reserve_ratio'")
        return self

    @model_validator(mode="after")
    def _earlier_within_line(self) -> EngineProfile:
        if self.earlier_releases and self.releases is None:
            raise ValueError("earlier_releases needs the line's releases")
        return self

    def as_release(self, release: str) -> EngineProfile:
        """This profile as the line's `release` ran: the execution settings of every earlier-releases
        entry it predates applied. The name stays the line's (the public fit's figures are the line's)."""
        changes = self.earlier_execution(release)
        return self.model_copy(update={"execution": self.execution.model_copy(update=changes)}) if changes else self

    def earlier_execution(self, release: str) -> dict[str, bool]:
        """The execution settings the line's `release` ran with otherwise (those of every earlier-releases
        entry it predates); a release outside the line is refused."""
        if self.releases is None:
            raise InputError("engine release", release, f"{self.name} is not a released engine: name no release")
        try:
            wanted = Version(release)
        except InvalidVersion:
            raise InputError("engine release", release, "must be a version such as 0.10.2 (PEP 440)") from None
        low, high = self.releases
        if not Version(low) <= wanted <= Version(high):
            raise InputError("engine release", release, f"{self.name} describes releases {low} to {high}")
        return {name: value for earlier in self.earlier_releases if wanted < Version(earlier.before)
                for name, value in earlier.execution.items()}

    def _device_rule(self, family: str, memory_gib: float, tp: int) -> DeviceDefaults | None:
        return next((r for r in self.scheduling.device_defaults if r.matches(family, memory_gib, tp)), None)

    def _chunking_rule(self, max_model_len: int | None, chunked_prefill: bool | None = None) -> LongContextChunking | None:
        """The V0 chunked-prefill rule in force: with `chunked_prefill` (the deployment's flag) given, on
        exactly when the flag is; unset, when max_model_len is over the rule's threshold."""
        rule = self.scheduling.long_context_chunking
        if chunked_prefill is not None:
            return rule if chunked_prefill else None
        if rule is None and not self.scheduling.budget_covers_max_model_len:
            return None
        if max_model_len is None:
            raise InputError("max_model_len", None, f"{self.name} picks chunked prefill and its token budget from "
                             "max_model_len; give it")
        return rule if rule is not None and max_model_len > rule.above_max_model_len else None

    def scheduling_defaults(
        self, family: str, memory_gib: float, *, tp: int = 1, offline: bool = False, max_model_len: int | None = None,
        chunked_prefill: bool | None = None,
    ) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) this engine picks on a device of `family` with `memory_gib`,
        for the API server (or the offline LLM class), with chunked prefill as `chunked_prefill` sets it
        (None: the engine's choice); engines whose budget follows max_model_len need it."""
        s, rule = self.scheduling, self._device_rule(family, memory_gib, tp)
        seqs = rule.max_num_seqs if rule and rule.max_num_seqs else s.max_num_seqs
        tokens = rule.max_num_batched_tokens if rule and rule.max_num_batched_tokens else s.max_num_batched_tokens
        if offline:
            tokens = (rule.offline_max_num_batched_tokens if rule and rule.offline_max_num_batched_tokens
                      else s.offline_max_num_batched_tokens or tokens)
        chunking = self._chunking_rule(max_model_len, chunked_prefill)
        if chunking is not None:
            return seqs, chunking.max_num_batched_tokens
        chunked = s.enable_chunked_prefill if chunked_prefill is None else chunked_prefill
        if s.budget_covers_max_model_len and not chunked:
            if max_model_len is None:
                raise InputError("max_model_len", None, f"{self.name} without chunked prefill takes a token budget "
                                 "that covers max_model_len; give it")
            tokens = max(max_model_len, tokens)
        return seqs, tokens

    def attention_kernel(self, family: str, sinks: bool, chosen: AttentionKernel | None = None) -> AttentionKernel:
        """The kernels this engine runs a model's attention in on a GPU `family` (`chosen`: the
        deployment's, None: the engine's own choice): Triton where it has no FlashAttention-class
        kernel for attention sinks, and FlashAttention-class ones cannot be chosen there."""
        triton_only = sinks and family in self.execution.triton_sink_attention_families
        if chosen == "flash" and triton_only:
            raise InputError("attention_kernel", chosen, f"{self.name} has no FlashAttention-class kernel for attention "
                             f"sinks on {family} GPUs: triton, or leave it to the engine")
        return chosen or ("triton" if triton_only else "flash")

    def chunked_prefill_default(self, max_model_len: int | None = None) -> bool:
        return self.scheduling.enable_chunked_prefill or self._chunking_rule(max_model_len) is not None

    def batching_default(self, max_model_len: int | None = None, chunked_prefill: bool | None = None) -> Batching:
        chunking = self._chunking_rule(max_model_len, chunked_prefill)
        return chunking.batching if chunking is not None else self.scheduling.batching

    def max_running_requests(
        self, family: str, memory_gib: float, *, kv_tokens: int, context_len: int, tp: int = 1
    ) -> int:
        """The running-request cap once the KV pool holds `kv_tokens` for a model of `context_len`."""
        seqs, _ = self.scheduling_defaults(family, memory_gib, tp=tp, max_model_len=context_len)
        rule = self.scheduling.running_from_kv
        return seqs if rule is None else min(seqs, rule.cap(kv_tokens, context_len))

    def max_graph_batch_size(self, family: str, memory_gib: float, *, tp: int = 1) -> int:
        rule = self._device_rule(family, memory_gib, tp)
        return rule.max_graph_batch_size if rule and rule.max_graph_batch_size else self.execution.max_graph_batch_size

    def memory_utilization(self, family: str, memory_gib: float, *, tp: int = 1, pp: int = 1) -> float:
        """The default utilisation share on a device with `memory_gib` as the device reports it (SGLang reads
        nvidia-smi's total, e.g. 81559 MiB on an H100 SXM, not the marketed 80 GB)."""
        m = self.memory
        for rule in m.utilization_by_tp:
            if tp >= rule.min_tp:
                return rule.utilization
        if m.reserved_rule is not None:
            _, budget = self.scheduling_defaults(family, memory_gib, tp=tp)
            graph_batch = self.max_graph_batch_size(family, memory_gib, tp=tp)
            return m.reserved_rule.utilization(memory_gib * MIB_PER_GIB, budget, graph_batch, tp * pp)
        return m.utilization_default


    def output_reservation(self) -> OutputReservation | None:
        """What admission keeps free for outputs still to come (None: vLLM's optimistic admission)."""
        s = self.scheduling
        if s.admission == "reserve_output":
            return OutputReservation(1.0, 1.0)
        if s.admission == "reserve_ratio":
            assert s.admission_ratio is not None
            return OutputReservation(s.admission_ratio, s.admission_ratio_min or s.admission_ratio,
                                     s.admission_ratio_decay or 0.0, s.admission_clip_tokens, s.retraction_headroom_steps)
        return None

    def knob_defaults(self, family: str, memory_gib: float, *, tp: int = 1, pp: int = 1,
                      max_model_len: int | None = None, offline: bool = False,
                      chunked_prefill: bool | None = None) -> EngineChoices:
        """Every EngineKnobs setting this engine chooses itself, on a device of `family` with `memory_gib`,
        given the deployment's chunked-prefill flag (None: unset), which the budget and batching follow."""
        seqs, tokens = self.scheduling_defaults(family, memory_gib, tp=tp, offline=offline, max_model_len=max_model_len,
                                                chunked_prefill=chunked_prefill)
        s = self.scheduling
        return EngineChoices(
            block_size_tokens=s.block_size_tokens,
            max_num_batched_tokens=tokens,
            max_num_seqs=seqs,
            enable_chunked_prefill=self.chunked_prefill_default(max_model_len),
            enable_prefix_caching=s.enable_prefix_caching,
            batching=self.batching_default(max_model_len, chunked_prefill),
            num_scheduler_steps=s.num_scheduler_steps,
            gpu_memory_utilization=self.memory_utilization(family, memory_gib, tp=tp, pp=pp),
            max_graph_batch_size=self.max_graph_batch_size(family, memory_gib, tp=tp),
        )


def resolve_deployment(dep: Deployment, hw: HardwareProfile, *, max_model_len: int | None = None, offline: bool = False,
                       kv_tokens: int | None = None) -> Deployment:
    """`dep` with every knob it leaves to the engine set as its engine profile sets it on `hw`. With
    `kv_tokens` (the planned KV pool), engines whose running-request cap follows the pool (SGLang) get it."""
    if dep.knobs.resolved and kv_tokens is None:
        return dep
    engine = get_engine(dep.engine)
    defaults = engine.knob_defaults(hw.family, hw.memory_gib, tp=dep.tensor_parallel, pp=dep.pipeline_parallel,
                                    max_model_len=max_model_len, offline=offline,
                                    chunked_prefill=dep.knobs.enable_chunked_prefill)
    rule = engine.scheduling.running_from_kv
    if kv_tokens is not None and rule is not None and dep.knobs.max_num_seqs is None and max_model_len is not None:
        defaults = replace(defaults, max_num_seqs=min(defaults.max_num_seqs, max(1, rule.cap(kv_tokens, max_model_len))))
    return dep.model_copy(update={"knobs": dep.knobs.with_defaults(defaults)})


def load_engine_profile(path: Path) -> EngineProfile:
    try:
        return EngineProfile.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "top level"
        raise InputError("engine profile", f"{path.name} at {where}", error["msg"][:200]) from None
    except yaml.YAMLError as exc:
        raise InputError("engine profile", path.name, str(exc).splitlines()[0][:200]) from None


@cache
def engine_catalog() -> dict[str, EngineProfile]:
    return profile_folder(PROFILE_DIR, load_engine_profile)


def engine_for_release(engine: EngineName, version: str) -> tuple[str, str | None]:
    """The engine a deployment of `engine` `version` names (`get_engine`): its release line's profile
    as that release ran (`line@version`), or with a note where no line covers it, the nearest line
    (the newest for an unknown or newer version, the oldest for an older one)."""
    lines = sorted(((p.name, Version(p.releases[0]), Version(p.releases[1])) for p in engine_catalog().values()
                    if p.engine == engine and p.releases is not None), key=lambda line: line[1])
    if not lines:
        raise InputError("engine", engine, f"no profile describes a release of {engine}")
    try:
        wanted = Version(version)
    except InvalidVersion:
        return lines[-1][0], f"{engine} version {version!r} unknown: {lines[-1][0]} (the newest line) assumed"
    for name, low, high in lines:
        if low <= wanted <= high:
            return f"{name}@{version}", None
    nearest = lines[0][0] if wanted < lines[0][1] else lines[-1][0]
    return nearest, f"{engine} {version} is outside every profile: {nearest} (the nearest line) assumed"


# Launch flags of vLLM, SGLang and TensorRT-LLM, by the engine's own names, that set an EngineKnobs field.
ENGINE_FLAG_KNOBS: dict[str, str] = {
    "max_num_seqs": "max_num_seqs",
    "max_running_requests": "max_num_seqs",
    "max_batch_size": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "chunked_prefill_size": "max_num_batched_tokens",
    "max_num_tokens": "max_num_batched_tokens",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "enable_prefix_caching": "enable_prefix_caching",
    "num_scheduler_steps": "num_scheduler_steps",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "mem_fraction_static": "gpu_memory_utilization",
    "free_gpu_memory_fraction": "gpu_memory_utilization",
    "block_size": "block_size_tokens",
    "enforce_eager": "enforce_eager",
    "cuda_graph_max_bs": "max_graph_batch_size",
}


def knobs_from_flags(flags: Mapping[str, object]) -> EngineKnobs:
    """The knobs an engine launched with `flags` runs with; flags that set no knob are left out."""
    return EngineKnobs(**{ENGINE_FLAG_KNOBS[name]: value for name, value in flags.items() if name in ENGINE_FLAG_KNOBS})


@cache
def get_engine(name: str) -> EngineProfile:
    """The profile `name` names: a profile's name, or `profile@release` for one release of its line
    (its older releases' execution settings applied, EngineProfile.as_release)."""
    line, _, release = name.partition("@")
    profiles = engine_catalog()
    if line not in profiles:
        raise unknown_name_error("engine", line, profiles)
    return profiles[line].as_release(release) if release else profiles[line]
