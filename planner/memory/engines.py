"""How each engine turns device memory into a KV-cache budget (profile.memory.utilization_of).

- vLLM ("total"): KV = gpu_memory_utilization x the device's reported total - (weights + the profiling
  pass's torch peak + non-torch memory gained since start-up). The CUDA context and communicators
  exist before its start-up snapshot and CUDA graphs are captured after the KV cache: both live in
  the remaining 1 - utilization share.
- SGLang ("free_at_start"): KV = mem_fraction_static x the memory free once the context and the
  communicators exist - the weights. No profiling pass: activations and graphs share the rest.
- TensorRT-LLM ("free_after_weights"): KV = free_gpu_memory_fraction x (total - peak), the peak
  measured after the CUDA graphs are captured and dummy requests fill max_num_tokens, so everything
  but the KV cache comes out first.
- ServePlan's engine: KV = gpu_memory_utilization x total - what the process holds after loading (the
  context and the weights) on CUDA; 1 GiB on other devices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.engines import EngineProfile
from planner.memory.parts import GIB, Part, gib
from planner.specs import Deployment, HardwareProfile

# ServePlan's engine off CUDA: LLM sizes the cache to 1 GiB unless kv_cache_gib or num_kv_blocks is given.
SERVEPLAN_CPU_KV_GIB = 1.0
SERVEPLAN_CPU_SOURCE = "engine/llm.py LLM._blocks_that_fit"
# An explicit KV-cache size per GPU sets aside gpu_memory_utilization (vLLM 0.11's kv_cache_memory_bytes,
# `--kv-cache-memory`; ServePlan's engine's kv_cache_gib).
KV_CACHE_GIB_SOURCE = "https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/config/cache.py"


@dataclass(frozen=True)
class Budget:
    """What the engine lets itself use for weights, activations, runtime and KV, and the lines it subtracts."""

    usable: Part
    parts: tuple[Part, ...]  # every line, in budget or not

    @property
    def kv_bytes(self) -> float:
        return self.usable.bytes - sum(p.bytes for p in self.parts if p.in_budget)


def engine_budget(engine: EngineProfile, hw: HardwareProfile, dep: Deployment, total: Part, weights: list[Part],
                  activations: list[Part], runtime: list[Part], graphs: list[Part]) -> Budget:
    """The engine's rule applied to the parts: `runtime` holds the CUDA context ('runtime.context'), kernel
    modules ('runtime.modules') and NCCL buffers ('runtime.nccl'); the rule decides which it counts. An
    explicit KV-cache size (knobs.kv_cache_gib) replaces what the rule would leave for the cache."""
    budget = _rule_budget(engine, hw, dep, total, weights, activations, runtime, graphs)
    kv_gib = dep.knobs.kv_cache_gib
    if kv_gib is None:
        return budget
    counted = sum(p.bytes for p in budget.parts if p.in_budget)
    usable = Part("budget", "the engine may use", counted + kv_gib * GIB,
                  f"kv_cache_gib {kv_gib:g} GiB + every line counted in the budget (the engine's own rule set aside)",
                  KV_CACHE_GIB_SOURCE)
    return Budget(usable, budget.parts)


def _rule_budget(engine: EngineProfile, hw: HardwareProfile, dep: Deployment, total: Part, weights: list[Part],
                 activations: list[Part], runtime: list[Part], graphs: list[Part]) -> Budget:
    rule = engine.memory.utilization_of
    share = dep.knobs.choices.gpu_memory_utilization
    source = engine.memory.field_sources.get("utilization_of", engine.memory.sources[0])
    if engine.memory.reserve_gib:
        weights = [*weights, Part("runtime.reserve", "fixed reserve of the engine", engine.memory.reserve_gib * GIB,
                                  f"{engine.memory.reserve_gib:g} GiB", f"planner/engines/{engine.name}.yaml reserve_gib")]
    context = [p for p in runtime if p.key == "runtime.context"]
    after_start = [p for p in runtime if p.key != "runtime.context"]
    if engine.engine == "serveplan":
        return _serveplan(hw, share, total, weights, activations, context)
    if rule == "total":  # the start-up snapshot follows the context: only what appears after it is counted
        usable = Part("budget", "the engine may use", share * total.bytes,
                      f"gpu_memory_utilization {share:g} x {gib(total.bytes)} reported", source)
        return Budget(usable, tuple([*weights, *activations, *after_start, *map(_outside, context), *graphs]))
    if rule == "free_at_start":  # the context and the communicators exist when free memory is read
        at_start = [*context, *(p for p in after_start if p.key == "runtime.nccl")]
        free = total.bytes - sum(p.bytes for p in at_start)
        usable = Part("budget", "the engine may use", share * free,
                      f"mem_fraction_static {share:g} x {gib(free)} free at start ({gib(total.bytes)} - "
                      f"{' - '.join(p.label for p in at_start)})", source)
        later = [p for p in after_start if p.key != "runtime.nccl"]
        return Budget(usable, tuple([*weights, *map(_outside, [*at_start, *later, *activations, *graphs])]))
    if rule == "free_after_weights":  # the peak is measured after graph capture, context included
        peak = [*context, *weights, *activations, *after_start, *graphs]
        peak_bytes = sum(p.bytes for p in peak)
        kept = (1 - share) * (total.bytes - peak_bytes)
        usable = Part("budget", "the engine may use", total.bytes - kept,
                      f"{gib(total.bytes)} - (1 - free_gpu_memory_fraction {share:g}) x ({gib(total.bytes)} - "
                      f"peak {gib(peak_bytes)})", source)
        return Budget(usable, tuple(replace(p, in_budget=True) for p in peak))
    raise AssertionError(f"unknown memory rule {rule}")  # the profile schema allows only the three above


def _serveplan(hw: HardwareProfile, share: float, total: Part, weights: list[Part], activations: list[Part],
               context: list[Part]) -> Budget:
    outside = [_outside(p) for p in activations]
    if hw.kind != "gpu":
        usable = Part("budget", "the engine may use", sum(p.bytes for p in weights) + SERVEPLAN_CPU_KV_GIB * GIB,
                      f"weights + a {SERVEPLAN_CPU_KV_GIB:g} GiB KV cache (the engine's size off CUDA)",
                      SERVEPLAN_CPU_SOURCE)
        return Budget(usable, tuple([*weights, *outside]))
    usable = Part("budget", "the engine may use", share * total.bytes,
                  f"gpu_memory_utilization {share:g} x {gib(total.bytes)} reported (free - total x (1 - share))",
                  SERVEPLAN_CPU_SOURCE)
    return Budget(usable, tuple([*weights, *(replace(p, in_budget=True) for p in context), *outside]))


def _outside(part: Part) -> Part:
    return replace(part, in_budget=False)
