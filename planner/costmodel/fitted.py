"""The fitted GPU-family and engine figures every GPU prediction starts from, and their error bands.

`serveplan calibrate --public` (planner/public) fits the cost model to published measurements and
writes hwprofiles/calibrations/public-gpu.json; this module reads the part predictions need: the
figures per GPU family and per engine profile that replace the profiles' estimates, and the
prediction intervals per metric family from the leave-one-source-out residuals. A family or engine
the fit never saw keeps its profile's estimate, and the report says so.
"""

from __future__ import annotations

from functools import cache
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hwprofiles import PROFILE_DIR

PUBLIC_FIT_FILE = PROFILE_DIR / "calibrations" / "public-gpu.json"
MetricFamily = Literal["throughput", "ttft", "tpot_itl", "e2e"]


class _Fit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Band(_Fit):
    """measured / predicted of held-out figures: its quantiles make a band around a prediction."""

    low: float = Field(gt=0, description="Quantile (1 - coverage) / 2 of measured / predicted")
    median: float = Field(gt=0)
    high: float = Field(gt=0, description="Quantile (1 + coverage) / 2 of measured / predicted")
    coverage: float = Field(gt=0, lt=1, description="Share of held-out figures the band is built to hold")
    held_out_coverage: float = Field(ge=0, le=1, description="Share of figures it held when each source's band came "
                                     "from the other sources only (measured, not assumed)")
    figures: int = Field(ge=0, description="Held-out figures behind it")


class FittedModel(_Fit):
    families: dict[str, dict[str, float]] = Field(description="GPU family -> cost parameter -> fitted value")
    engines: dict[str, dict[str, float]] = Field(description="Engine profile -> cost parameter -> fitted value")
    bands: dict[MetricFamily, Band] = Field(default_factory=dict, description="Prediction intervals per metric family")
    source: str = Field(description="What was fitted, when, with which command")


@cache
def fitted_model(path: Path = PUBLIC_FIT_FILE) -> FittedModel | None:
    """The public fit, or None before one was made (the profiles' estimates apply)."""
    if not path.exists():
        return None
    return FittedModel.model_validate(json.loads(path.read_text())["model"])
