"""A narrowed question nothing answers: where its space is narrower than the default one, the
default space (joined with the question's own choices), and what of the wider answer lies outside
the question's space, in words and as the settings a front end can apply."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from engine.config import EngineKnobs
from planner.hardware import hardware_catalog
from planner.search.report import PlanResult, SearchSpace, Widening
from planner.search.space import (
    DEFAULT_KNOBS_GRID, DEFAULT_KV_DTYPES, DEFAULT_MAX_GPUS_PER_REPLICA, DEFAULT_WEIGHT_DTYPES, knobs_label,
)
from planner.specs import HardwareProfile


def _default_hardware() -> list[str]:
    return [name for name, hw in hardware_catalog().items() if hw.price_usd_per_hour is not None]


def narrower_than_default(profiles: Sequence[HardwareProfile], max_gpus: int, weight_dtypes: Sequence[str] | None,
                          kv_dtypes: Sequence[str], knobs_grid: Sequence[EngineKnobs]) -> list[str]:
    """Each dimension of the question's space that leaves out part of the default space, in words."""
    out = []
    default_hw, names = _default_hardware(), {hw.name for hw in profiles}
    if missing := [n for n in default_hw if n not in names]:
        out.append(f"hardware: {len(default_hw) - len(missing)} of the {len(default_hw)} profiles with a price "
                   f"(not {', '.join(missing)})")
    if max_gpus < DEFAULT_MAX_GPUS_PER_REPLICA:
        out.append(f"max GPUs per replica: {max_gpus} (default {DEFAULT_MAX_GPUS_PER_REPLICA})")
    if weight_dtypes is not None and (missing := [d for d in DEFAULT_WEIGHT_DTYPES if d not in weight_dtypes]):
        out.append(f"weight formats: not {', '.join(missing)}")
    if missing := [d for d in DEFAULT_KV_DTYPES if d not in kv_dtypes]:
        out.append(f"KV-cache formats: not {', '.join(missing)}")
    if missing_knobs := [k for k in DEFAULT_KNOBS_GRID if k not in knobs_grid]:
        out.append(f"engine settings: not {'; '.join(knobs_label(k) for k in missing_knobs)}")
    return out


class WiderSpace(TypedDict):
    """The plan(...) arguments that set the search space."""

    hardware: list[str | HardwareProfile]
    max_gpus_per_replica: int
    weight_dtypes: list[str] | None
    kv_dtypes: list[str]
    knobs_grid: list[EngineKnobs]


def wider_space(profiles: Sequence[HardwareProfile], max_gpus: int, weight_dtypes: Sequence[str] | None,
                kv_dtypes: Sequence[str], knobs_grid: Sequence[EngineKnobs]) -> WiderSpace:
    """plan(...) arguments for the default space joined with the question's own choices."""
    names = {hw.name for hw in profiles}
    weights = None if weight_dtypes is None or set(weight_dtypes) <= set(DEFAULT_WEIGHT_DTYPES) else \
        list(dict.fromkeys([*weight_dtypes, *DEFAULT_WEIGHT_DTYPES]))
    return {
        "hardware": [*profiles, *(n for n in _default_hardware() if n not in names)],
        "max_gpus_per_replica": max(max_gpus, DEFAULT_MAX_GPUS_PER_REPLICA),
        "weight_dtypes": weights,
        "kv_dtypes": list(dict.fromkeys([*kv_dtypes, *DEFAULT_KV_DTYPES])),
        "knobs_grid": list(dict.fromkeys([*knobs_grid, *DEFAULT_KNOBS_GRID])),
    }


def what_to_widen(wider: PlanResult, space: SearchSpace) -> Widening:
    """The wider space's answer and which of its choices the question's space lacks."""
    rec = wider.recommended
    if rec is None:
        return Widening(changes=[], hardware=[], max_gpus_per_replica=None, weight_dtypes=[], kv_dtypes=[],
                        recommended=None, nearest_miss=wider.nearest_miss)
    d = rec.deployment
    hardware = [d.hardware] if d.hardware not in space.hardware else []
    gpus = d.gpus_per_replica if d.gpus_per_replica > space.max_gpus_per_replica else None
    weights = [d.weight_dtype] if d.weight_dtype not in space.weight_dtypes else []
    kvs = [d.kv_dtype] if d.kv_dtype not in space.kv_dtypes else []
    changes = [*(f"add hardware {h}" for h in hardware),
               *([f"raise max GPUs per replica to {gpus}"] if gpus else []),
               *(f"add {w} weights" for w in weights), *(f"add the {k} KV cache" for k in kvs)]
    if not changes:  # then it differs only in engine settings the question did not try
        changes = [f"add the {line}".replace("engine settings: not ", "engine settings ")
                   for line in space.narrower_than_default if line.startswith("engine settings")]
    return Widening(changes=changes, hardware=hardware, max_gpus_per_replica=gpus, weight_dtypes=weights,
                    kv_dtypes=kvs, recommended=rec, nearest_miss=None)
