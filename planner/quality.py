"""What a storage format costs in model quality, from published evaluations (planner/data/quality.yaml).

A format's figure is the mean relative loss of its published evaluations against the 16-bit
model (a loss below zero, a quantised model that scored higher, is noise and counts as none);
16- and 32-bit formats are the reference and cost nothing. A deployment's cost is its weights'
plus its KV cache's: the two errors add up at worst, and evaluations of both together are rare.
The planner leaves out formats beyond a budget (`max_quality_loss_pct`) unless asked, and says so.
ServePlan's own measurements on SmolLM2-135M (docs/quantisation.md) sit beside each figure: they
are per-token likelihoods of a small model, a different unit, so they inform but do not enter it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from statistics import mean
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.files import load_yaml

QUALITY_FILE = Path(__file__).parent / "data" / "quality.yaml"
REFERENCE_DTYPES = ("fp32", "bf16", "fp16")
DEFAULT_MAX_QUALITY_LOSS_PCT = 1.0  # the usual "99 % of the baseline's accuracy" target
NO_QUALITY_LIMIT_PCT = 100.0  # a budget of 100 % admits every format, even one without a figure
Part = Literal["weights", "kv"]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Evaluation(_Spec):
    model: str
    benchmark: str
    baseline: float = Field(gt=0, description="Score of the 16-bit model")
    quantised: float = Field(ge=0, description="Score of the quantised model")
    source: str

    @property
    def loss_pct(self) -> float:
        return (self.baseline - self.quantised) / self.baseline * 100


class FormatQuality(_Spec):
    method: str
    published: list[Evaluation]
    own: str = Field(description="ServePlan's own measurement (docs/quantisation.md), in its own unit")

    @property
    def loss_pct(self) -> float | None:
        """The figure a budget is held against; None without a published evaluation."""
        return max(0.0, mean(e.loss_pct for e in self.published)) if self.published else None

    def describe(self, dtype: str, part: Part) -> str:
        what = f"{dtype} {'weights' if part == 'weights' else 'KV cache'}"
        if not self.published:
            return f"{what}: no published evaluation on record ({self.method})"
        losses = [e.loss_pct for e in self.published]
        return (f"{what}: {self.loss_pct:.2f} % quality loss (mean of {len(losses)} published evaluations, "
                f"{min(losses):+.2f} to {max(losses):+.2f} %; {self.method})")


class QualityTable(_Spec):
    weights: dict[str, FormatQuality]
    kv: dict[str, FormatQuality]


@cache
def quality_table() -> QualityTable:
    return QualityTable.model_validate(load_yaml(QUALITY_FILE, "quality table"))


def format_quality(part: Part, dtype: str) -> FormatQuality | None:
    """The record of `dtype` as weights or KV cache; None for the 16/32-bit references."""
    if dtype in REFERENCE_DTYPES:
        return None
    return getattr(quality_table(), part).get(dtype) or FormatQuality(method="not recorded", published=[], own="not measured")


def part_loss_pct(part: Part, dtype: str) -> float | None:
    """0 for a reference format; None when no published evaluation gives a figure."""
    record = format_quality(part, dtype)
    return 0.0 if record is None else record.loss_pct


def deployment_loss_pct(weight_dtype: str, kv_dtype: str) -> float | None:
    """Weights' plus KV cache's loss, in % of the 16-bit score; None when either has no figure."""
    weights, kv = part_loss_pct("weights", weight_dtype), part_loss_pct("kv", kv_dtype)
    return None if weights is None or kv is None else weights + kv


def within_budget(weight_dtype: str, kv_dtype: str, max_loss_pct: float) -> bool:
    if max_loss_pct >= NO_QUALITY_LIMIT_PCT:
        return True
    loss = deployment_loss_pct(weight_dtype, kv_dtype)
    return loss is not None and loss <= max_loss_pct


def describe(weight_dtype: str, kv_dtype: str) -> str:
    """One line on what the deployment's formats cost in quality, with the figures' basis."""
    formats: tuple[tuple[Part, str], ...] = (("weights", weight_dtype), ("kv", kv_dtype))
    parts = [(part, dtype, format_quality(part, dtype)) for part, dtype in formats]
    lines = [record.describe(dtype, part) for part, dtype, record in parts if record is not None]
    if not lines:
        return f"{weight_dtype} weights, {kv_dtype} KV cache: the 16-bit reference, no quality loss"
    loss = deployment_loss_pct(weight_dtype, kv_dtype)
    total = "unknown" if loss is None else f"{loss:.2f} %"
    return f"quality loss {total} (weights + KV cache): " + "; ".join(lines)
