"""The search space: hardware x TP/PP/EP x weight and KV dtypes x engine knobs, one replica each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
import itertools
import math

from pydantic import ValidationError

from engine.config import EngineKnobs, ModelConfig
from engine.errors import InputError
from planner.hardware import get_hardware, hardware_catalog
from planner.memory import MemoryPlan, plan_memory
from planner.engines import resolve_deployment
from planner.specs import Deployment, Disaggregation, Dtype, HardwareProfile, PlanSettings

DEFAULT_KV_DTYPES: tuple[Dtype, ...] = ("bf16", "fp8")
DEFAULT_MAX_GPUS_PER_REPLICA: int = PlanSettings.model_fields["max_gpus_per_replica"].default
# The engine's own defaults, then (max_num_batched_tokens, max_num_seqs) variants: a small chunk
# favours TTFT of queued requests and TPOT of running ones; a large one prefills faster. Everything
# else (chunked prefill, prefix caching, batching) is the engine's.
DEFAULT_KNOBS_GRID: tuple[EngineKnobs, ...] = (EngineKnobs(), *(
    EngineKnobs(max_num_batched_tokens=tokens, max_num_seqs=seqs) for tokens in (2048, 8192) for seqs in (64, 256)))
MAX_TP_LOG2 = 10  # tensor parallelism is tried in powers of two up to 1024
PIPELINE_STAGES = (2, 4, 8, 16)
# Each candidate costs a memory plan and a screen before any simulation; the default space has ~2,000.
MAX_CANDIDATES = 100_000


@dataclass(frozen=True)
class Candidate:
    """One replica of `dep` on `hw`, with its memory plan at the workload's longest request."""

    hw: HardwareProfile
    dep: Deployment
    memory: MemoryPlan

    @property
    def label(self) -> str:
        d = self.dep
        par = f"tp{d.tensor_parallel}" + (f" pp{d.pipeline_parallel}" if d.pipeline_parallel > 1 else "") + (
            f" ep{d.expert_parallel}" if d.expert_parallel > 1 else "")
        extras = (f" {d.disaggregation.label}" if d.disaggregation is not None else "") + (
            f" host-kv{d.knobs.kv_offload_host_gib:g}G" if d.knobs.kv_offload_host_gib else "")
        return (f"{self.hw.name} {par} w:{d.weight_dtype} kv:{d.kv_dtype} "
                f"mbt{d.knobs.max_num_batched_tokens} seqs{d.knobs.max_num_seqs}{extras}")

    @property
    def price_usd_per_gpu_hour(self) -> float:
        assert self.hw.price_usd_per_hour is not None  # profiles without a price are refused by priced_profiles
        return self.hw.price_usd_per_hour

    def usd_per_hour(self, replicas: int) -> float:
        """A replica is all its instances: x + y of them when disaggregated."""
        return replicas * self.dep.gpus_per_group * self.price_usd_per_gpu_hour


_SHORT = {"max_num_batched_tokens": "mbt", "max_num_seqs": "seqs"}


def knobs_label(knobs: EngineKnobs) -> str:
    """How one setting of the knob grid reads: 'engine defaults', 'mbt2048 seqs64, enable_prefix_caching=False'."""
    set_ = knobs.model_dump(exclude_defaults=True)
    if not set_:
        return "engine defaults"
    short = " ".join(f"{_SHORT[name]}{set_.pop(name)}" for name in list(set_) if name in _SHORT)
    return ", ".join(filter(None, [short, *(f"{name}={value}" for name, value in set_.items())]))


def priced_profiles(hardware: Sequence[str | HardwareProfile] | None) -> list[HardwareProfile]:
    """The named profiles (default: every catalog profile with a price), each once; all need a price."""
    if hardware is None:
        return [hw for hw in hardware_catalog().values() if hw.price_usd_per_hour is not None]
    profiles = [get_hardware(h) if isinstance(h, str) else h for h in hardware]
    if not profiles:
        raise InputError("hw", "", "needs at least one hardware profile")
    for hw in profiles:
        if hw.price_usd_per_hour is None:
            raise InputError("hw", hw.name, "has no price_usd_per_hour to rank by; give a profile YAML with a price")
    return list({hw.name: hw for hw in profiles}.values())


def checked_dtypes(field: str, spec_field: str, dtypes: Sequence[str]) -> list[str]:
    """Each dtype once, as the Deployment spec accepts it for `spec_field`; the error says what is allowed."""
    if not dtypes:
        raise InputError(field, "", "needs at least one dtype")
    for d in dtypes:
        try:
            Deployment(hardware="check", **{spec_field: d})
        except ValidationError as exc:
            raise InputError(field, d, exc.errors()[0]["msg"]) from None
    return list(dict.fromkeys(dtypes))


DEFAULT_WEIGHT_DTYPES: tuple[Dtype, ...] = ("bf16", "fp8", "int8", "int4")


def weight_dtypes_for(hw: HardwareProfile, requested: Sequence[str] | None) -> list[str]:
    if requested is not None:
        return list(requested)
    # fp8 only where the tensor units have it: elsewhere it is int8's bytes with extra dequantisation.
    return [d for d in DEFAULT_WEIGHT_DTYPES if d != "fp8" or hw.peak_tflops.fp8]


def check_size(profiles: Sequence[HardwareProfile], weight_dtypes: Sequence[str] | None, kv_dtypes: Sequence[str],
               knobs_grid: Sequence[EngineKnobs]) -> None:
    """Refuse a space over MAX_CANDIDATES (counting every TP and PP size) before any candidate is made."""
    size = sum(len(weight_dtypes_for(hw, weight_dtypes)) for hw in profiles) * len(kv_dtypes) * len(knobs_grid)
    if size * (MAX_TP_LOG2 + 1 + len(PIPELINE_STAGES)) > MAX_CANDIDATES:
        raise InputError("search_space", f"{size:,} hardware x dtypes x knobs", (
            f"at most {MAX_CANDIDATES:,} candidates with every TP and PP size (a limit of the planner); "
            "narrow the hardware, dtypes or knobs"))


def scale_up_domain(hw: HardwareProfile) -> int:
    if hw.scale_up is not None:
        return hw.scale_up.domain_size
    return hw.pcie.domain_size if hw.pcie is not None else 1


def make_deployment(model: ModelConfig, hw: HardwareProfile, tp: int, pp: int, weight: str, kv: str,
                    knobs: EngineKnobs, engine: str) -> Deployment:
    # Experts spread over the tensor-parallel ranks, as far as the expert count divides.
    ep = math.gcd(tp, model.moe.num_experts) if model.moe is not None else 1
    return resolve_deployment(Deployment(hardware=hw.name, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                                         weight_dtype=weight, kv_dtype=kv, engine=engine, knobs=knobs),
                              hw, max_model_len=model.max_position_embeddings)


def enumerate_candidates(model: ModelConfig, profiles: Sequence[HardwareProfile], max_gpus: int,
                         weight_dtypes: Sequence[str] | None, kv_dtypes: Sequence[str],
                         knobs_grid: Sequence[EngineKnobs], context_tokens: int, engine: str,
                         formats_allowed: Callable[[str, str], bool] = lambda weight, kv: True) -> list[Candidate]:
    """Every candidate with its memory plan, for each (weight, KV) format pair `formats_allowed`;
    pipeline stages only where tensor parallelism alone does not fit."""
    out: list[Candidate] = []
    for hw in profiles:
        domain = min(max_gpus, scale_up_domain(hw))
        tps = []
        for tp in (2**i for i in range(MAX_TP_LOG2 + 1)):
            if tp > domain:
                break
            try:
                plan_memory(model, hw, make_deployment(model, hw, tp, 1, "bf16", "bf16", EngineKnobs(), engine), 1)
            except InputError:  # TP does not divide the heads
                continue
            tps.append(tp)

        def candidate(tp: int, pp: int, weight: str, kv: str, knobs: EngineKnobs) -> Candidate:
            dep = make_deployment(model, hw, tp, pp, weight, kv, knobs, engine)
            return Candidate(hw, dep, plan_memory(model, hw, dep, context_tokens))

        for weight, kv, knobs in itertools.product(weight_dtypes_for(hw, weight_dtypes), kv_dtypes, knobs_grid):
            if not formats_allowed(weight, kv):
                continue
            tried = [candidate(tp, 1, weight, kv, knobs) for tp in tps]
            for pp in PIPELINE_STAGES if tps and not any(c.memory.fits for c in tried) else ():
                fitting = [t for t in tps if t * pp <= max_gpus]
                if not fitting or pp > model.num_layers:
                    break
                tried.append(candidate(max(fitting), pp, weight, kv, knobs))
                if tried[-1].memory.fits:
                    break
            out += tried
    # A knob setting that is the engine's own default on this hardware (vLLM's 2,048 tokens and 256
    # sequences on an A100) makes the same deployment as the defaults: each is searched once.
    unique: dict[str, Candidate] = {}
    for c in out:
        unique.setdefault(c.dep.model_dump_json(), c)
    return list(unique.values())


def variants(candidates: Sequence[Candidate], knobs: EngineKnobs, ratios: Sequence[tuple[int, int]],
             host_tier: bool) -> list[Candidate]:
    """Disaggregated (xPyD per ratio) and host-KV-tier versions of the candidates that fit with the
    engine knobs `knobs` (the grid's first: one setting, so the space grows by a few times, not a
    few times per knob). A host tier holds half the host memory the profile lists per GPU."""
    out: list[Candidate] = []
    for c in candidates:
        if not c.memory.fits or c.dep.knobs != knobs.with_defaults(c.dep.knobs.choices):
            continue
        for prefill, decode in ratios:
            dep = c.dep.model_copy(update={"disaggregation": Disaggregation(prefill_instances=prefill, decode_instances=decode)})
            out.append(Candidate(c.hw, dep, c.memory))
        if host_tier and c.hw.host_memory is not None:
            gib = c.hw.host_memory.capacity_gib * c.dep.gpus_per_replica / 2
            out.append(Candidate(c.hw, c.dep.model_copy(update={"knobs": c.dep.knobs.model_copy(
                update={"kv_offload_host_gib": gib})}), c.memory))
    return out
