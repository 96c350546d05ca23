"""Step-time cost model: the named operators of an engine step, their rooflines and efficiency
curves, and the host work around them (`model`); the tunable figures and where they come from
(`params`); a step reduced to what the operators need (`shape`); the operators themselves, built
from a ModelConfig and a Deployment (`operators`)."""

from planner.costmodel.model import (
    NO_COST,
    OPERATORS,
    CostModel,
    StepCost,
    expected_distinct_experts,
    gemm_compute_dtype,
)
from planner.costmodel.operators import DEQUANT_OPS_PER_WEIGHT
from planner.costmodel.params import CostParams
from planner.costmodel.shape import ShapeReader, StepShape

__all__ = [
    "DEQUANT_OPS_PER_WEIGHT",
    "NO_COST",
    "OPERATORS",
    "CostModel",
    "CostParams",
    "ShapeReader",
    "StepCost",
    "StepShape",
    "expected_distinct_experts",
    "gemm_compute_dtype",
]
