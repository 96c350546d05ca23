"""Engine profiles: what differs between serving engines and their versions (vLLM, SGLang,
TensorRT-LLM, ServePlan's own), one YAML file each under planner/engines/, validated at load.

A profile says how the engine schedules (default budgets, chunked prefill, mixed or prefill-first
batching, admission and preemption), how it executes (CUDA-graph sizes, whether host work overlaps
the GPU), what its server adds (API server and tokeniser time), how it sizes its KV cache at
start-up (memory rules), and its per-step host costs. Every default carries its source; the costs
are estimates until the public fit (planner/public) replaces them.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
import yaml

from engine.errors import InputError, unknown_name_error

PROFILE_DIR = Path(__file__).parent
EngineName = Literal["vllm", "sglang", "trtllm", "serveplan"]
DEFAULT_ENGINE = "vllm-0.11"  # the most widely used engine, its current release line


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceDefaults(_Spec):
    """Scheduling defaults an engine picks by device (vLLM V1: larger budgets on >= 70 GiB GPUs but A100)."""

    min_memory_gib: float | None = Field(None, ge=0, description="Applies to devices with at least this memory")
    max_memory_gib: float | None = Field(None, ge=0, description="... and at most this memory")
    families: tuple[str, ...] | None = Field(None, description="Only these hardware families (profile `family`)")
    not_families: tuple[str, ...] = Field((), description="Never these families")
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    source: str


class Scheduling(_Spec):
    max_num_seqs: int = Field(ge=1, description="Default most requests running at once")
    max_num_batched_tokens: int = Field(ge=1, description="Default token budget per step (chunked-prefill chunk)")
    device_defaults: tuple[DeviceDefaults, ...] = Field((), description="First matching rule wins over the defaults")
    enable_chunked_prefill: bool = Field(description="Default; without it a prompt is prefilled whole in one step")
    enable_prefix_caching: bool
    batching: Literal["mixed", "prefill_first"] = Field(
        description="mixed: a step runs decodes and prefill chunks together (vLLM V1, TensorRT-LLM in-flight batching); "
        "prefill_first: while prompts wait and fit, a step prefills only and decodes stall (vLLM V0, SGLang)"
    )
    admission: Literal["optimistic", "reserve_output", "reserve_ratio"] = Field(
        description="optimistic: admit while the prompt's blocks fit, preempt when decodes run out (vLLM); "
        "reserve_output: admit only if prompt + max_tokens fit (TensorRT-LLM GUARANTEED_NO_EVICT); "
        "reserve_ratio: reserve admission_ratio x max_tokens of future output per running request (SGLang)"
    )
    admission_ratio: float | None = Field(None, gt=0, le=1, description="reserve_ratio: share of max_tokens reserved")
    preemption: Literal["recompute", "swap"] = "recompute"
    num_scheduler_steps: int = Field(1, ge=1, description="Decode steps per scheduling decision (vLLM 0.6 multi-step)")
    block_size_tokens: int = Field(ge=1, description="KV-cache page size")
    sources: tuple[str, ...] = Field(min_length=1)


class Execution(_Spec):
    cuda_graphs: bool = Field(description="Decode steps replay captured graphs by default")
    max_graph_batch_size: int = Field(ge=1, description="Largest decode batch captured")
    overlap_host: bool = Field(
        description="Host work of step n+1 (scheduling, input preparation) overlaps the GPU work of step n "
        "(SGLang's overlap scheduler, TensorRT-LLM); otherwise it adds to every step"
    )
    kv_scale_format: Literal["per_tensor", "per_token_head"] = Field(
        description="FP8 KV-cache scales: one per tensor (no extra bytes) or one per (token, head) (ServePlan's engine)"
    )
    sources: tuple[str, ...] = Field(min_length=1)


class Overheads(_Spec):
    """Host-side costs; estimates until fitted (planner/public replaces them with fitted values)."""

    step_us: float = Field(ge=0, description="Host time per engine step: scheduling, input preparation, output handling")
    per_request_us: float = Field(ge=0, description="Host time per scheduled request per step")
    api_request_ms: float = Field(
        ge=0, description="API server time per request before it reaches the engine (HTTP, chat template, tokeniser); "
        "requests pass the server one at a time, so a burst queues here"
    )
    provenance: str


class Memory(_Spec):
    """How the engine sizes its KV cache at start-up (issue 23)."""

    utilization_default: float = Field(gt=0, le=1, description="gpu_memory_utilization / mem_fraction_static / "
                                       "free_gpu_memory_fraction default")
    utilization_of: Literal["total", "free_after_weights"] = Field(
        description="total: the share of device memory the engine may use for everything (vLLM, SGLang); "
        "free_after_weights: the share of memory still free after loading weights that goes to KV (TensorRT-LLM)"
    )
    activation_profile: Literal["budget", "none"] = Field(
        description="budget: a profiling forward pass at the token budget sets the activation reserve (vLLM); "
        "none: a fixed reserve (see reserve_gib)"
    )
    reserve_gib: float = Field(0.0, ge=0, description="Fixed memory kept out of the KV cache beyond the rules above")
    cuda_graph_in_budget: bool = Field(description="CUDA-graph memory is taken out of the KV cache budget")
    sources: tuple[str, ...] = Field(min_length=1)


class EngineProfile(_Spec):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.\-]*$", description="Short id used on the command line")
    display_name: str
    engine: EngineName
    versions: str = Field(description="Releases the profile describes, e.g. '0.10.x-0.11.x'")
    scheduling: Scheduling
    execution: Execution
    overheads: Overheads
    memory: Memory
    notes: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _ratio_when_needed(self) -> EngineProfile:
        s = self.scheduling
        if (s.admission == "reserve_ratio") != (s.admission_ratio is not None):
            raise ValueError("admission_ratio is set exactly when admission is 'reserve_ratio'")
        return self

    def scheduling_defaults(self, family: str, memory_gib: float) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) this engine picks on a device of `family` with `memory_gib`."""
        s = self.scheduling
        for rule in s.device_defaults:
            if rule.min_memory_gib is not None and memory_gib < rule.min_memory_gib:
                continue
            if rule.max_memory_gib is not None and memory_gib > rule.max_memory_gib:
                continue
            if (rule.families is not None and family not in rule.families) or family in rule.not_families:
                continue
            return rule.max_num_seqs or s.max_num_seqs, rule.max_num_batched_tokens or s.max_num_batched_tokens
        return s.max_num_seqs, s.max_num_batched_tokens


def load_engine_profile(path: Path) -> EngineProfile:
    try:
        data = yaml.safe_load(path.read_text())
        return EngineProfile.model_validate(data)
    except (yaml.YAMLError, ValueError) as exc:
        raise InputError("engine profile", path.name, str(exc).splitlines()[0][:200]) from None


@cache
def engine_catalog() -> dict[str, EngineProfile]:
    profiles = {}
    for path in sorted(PROFILE_DIR.glob("*.yaml")):
        profile = load_engine_profile(path)
        if profile.name != path.stem:
            raise InputError(f"{path.name}: name", profile.name, f"must equal the file name {path.stem!r}")
        profiles[profile.name] = profile
    return profiles


def get_engine(name: str) -> EngineProfile:
    profiles = engine_catalog()
    if name not in profiles:
        raise unknown_name_error("engine", name, profiles)
    return profiles[name]
