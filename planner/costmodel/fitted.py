"""The fitted GPU-family and engine figures every GPU prediction starts from, and their error bands.

`serveplan calibrate --public` (planner/public) fits the cost model to published measurements and
writes hwprofiles/calibrations/public-gpu.json; this module reads the part predictions need: the
figures per GPU family and per engine profile that replace the profiles' estimates, and the
prediction intervals per metric family from the leave-one-source-out residuals. A family or engine
the fit never saw keeps its profile's estimate, and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.errors import InputError, from_validation_error
from engine.files import load_json
from hwprofiles import PROFILE_DIR
from planner.metrics import Architecture, ArrivalRegime, LengthSpread, MetricFamily, PredictionInterval, RunSummary
from planner.specs import SLO, HardwareProfile

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from planner.engines import EngineProfile

PUBLIC_FIT_FILE = PROFILE_DIR / "calibrations" / "public-gpu.json"
BAND_PROBABILITIES = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)
BAND_COVERAGE = 0.8  # the interval every result shows: P10..P90


class _Fit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Band(_Fit):
    """How far measurements fell from predictions made without their source: quantiles of
    measured / predicted over held-out figures. A prediction x stands for measurements between
    x * ratio_at(0.1) and x * ratio_at(0.9) in about 80 % of cases, as far as the data can tell."""

    probabilities: list[float] = Field(description="Increasing, in (0, 1)")
    ratios: list[float] = Field(description="measured / predicted at each probability")
    held_out_coverage: float = Field(ge=0, le=1, description="Share of figures inside the P10..P90 band when each "
                                     "source's band came from the other sources only (measured, not assumed)")
    figures: int = Field(ge=0, description="Held-out figures behind it")
    pooled_with: list[str] = Field(default_factory=list, description="Metric families whose held-out figures were "
                                   "pooled with this family's to make the band: its own came from too few sources")

    @model_validator(mode="after")
    def _monotone(self) -> Band:
        if len(self.probabilities) != len(self.ratios) or len(self.ratios) < 2:
            raise ValueError("probabilities and ratios must pair up, at least two of them")
        if any(b <= a for a, b in zip(self.probabilities, self.probabilities[1:])) or any(
                b < a for a, b in zip(self.ratios, self.ratios[1:])):
            raise ValueError("probabilities must increase and ratios must not decrease")
        if self.probabilities[0] <= 0 or self.probabilities[-1] >= 1 or self.ratios[0] <= 0:
            raise ValueError("probabilities must lie in (0, 1) and ratios be positive")
        return self

    def ratio_at(self, probability: float) -> float:
        """measured / predicted that a share `probability` of held-out figures stayed below."""
        probability = round(probability, 9)  # 1 - 0.9 is 0.0999...: a band from P10 must answer it
        if not self.probabilities[0] <= probability <= self.probabilities[-1]:
            raise InputError("confidence", probability,
                             f"the bands hold {self.probabilities[0]:g}..{self.probabilities[-1]:g}")
        return float(np.interp(probability, self.probabilities, self.ratios))

    def interval(self, coverage: float = BAND_COVERAGE) -> tuple[float, float]:
        """(low, high) measured / predicted around the median holding `coverage` of the figures."""
        return self.ratio_at((1 - coverage) / 2), self.ratio_at((1 + coverage) / 2)


class FittedModel(_Fit):
    families: dict[str, dict[str, float]] = Field(description="GPU family -> cost parameter -> fitted value")
    engines: dict[str, dict[str, float]] = Field(description="Engine profile -> cost parameter -> fitted value")
    bands: dict[MetricFamily, Band] = Field(default_factory=dict, description="Prediction intervals per metric family")
    engine_bands: dict[str, dict[MetricFamily, Band]] = Field(
        default_factory=dict, description="Per engine (vllm, sglang, trtllm: every release of it), the prediction "
        "intervals of the metric families whose held-out figures of that engine were enough for a band of their own; "
        "its runs take `bands` for the others")
    architecture_bands: dict[Architecture, dict[MetricFamily, Band]] = Field(
        default_factory=dict, description="Per model architecture (dense, moe), the prediction intervals of the metric "
        "families whose held-out figures of that architecture were enough for a band of their own and fell inside it "
        "clearly nearer the stated share than inside the bands they carry otherwise; its runs take these before an "
        "engine's")
    lengths_bands: dict[str, dict[MetricFamily, Band]] = Field(
        default_factory=dict, description="Per model architecture and spread of request lengths (RunKind.lengths_group: "
        "dense-fixed, dense-varied, moe-fixed, moe-varied; fixed: one prompt and one output length), the prediction "
        "intervals of the metric families whose held-out figures of such runs were enough for a band of their own and "
        "fell inside it clearly nearer the stated share than inside the bands they carry otherwise; its runs take "
        "these before an architecture's or an engine's")
    regime_bands: dict[ArrivalRegime, dict[MetricFamily, Band]] = Field(
        default_factory=dict, description="Per arrival regime (online, offline), the prediction intervals of the metric "
        "families whose held-out figures of that regime were enough for a band of their own and fell inside it clearly "
        "nearer the stated share than inside the bands they carry otherwise; its runs take these before a lengths', "
        "an architecture's or an engine's")
    source: str = Field(description="What was fitted, when, with which command")
    held_out: str = Field(default="published figures, each predicted by a fit that left its source out",
                          description="The figures the bands come from and what each one's prediction left out")

    def bands_for(self, kind: RunKind) -> dict[MetricFamily, Band]:
        """The bands a run of `kind` carries: its arrival regime's where there is one, else that of its
        model architecture with its requests' lengths (RunKind.lengths_group), else its architecture's,
        else its engine's, else all engines'."""
        return {**self.bands, **self.engine_bands.get(kind.engine, {}),
                **self.architecture_bands.get(kind.architecture, {}), **self.lengths_bands.get(kind.lengths_group, {}),
                **self.regime_bands.get(kind.regime, {})}

    def band_owner(self, family: MetricFamily, kind: RunKind) -> str:
        """Whose held-out figures `family`'s band in bands_for(kind) came from, in words."""
        if family in self.regime_bands.get(kind.regime, {}):
            return f"of {kind.regime} runs"
        if family in self.lengths_bands.get(kind.lengths_group, {}):
            return f"of {GROUP_WORDS[kind.lengths_group]} runs"
        if family in self.architecture_bands.get(kind.architecture, {}):
            return f"of {GROUP_WORDS[kind.architecture]} runs"
        return f"of {kind.engine} runs" if family in self.engine_bands.get(kind.engine, {}) else "of all engines"


# Band groups in words, where the group's name alone would not say what its runs share.
GROUP_WORDS: dict[str, str] = {
    "dense": "dense-model", "moe": "MoE-model",
    **{f"{arch}-{spread}": f"{spread}-length {words}" for arch, words in (("dense", "dense-model"), ("moe", "MoE-model"))
       for spread in ("fixed", "varied")},
}


@dataclass(frozen=True)
class RunKind:
    """What decides the bands a run carries (FittedModel.bands_for): the engine that serves it
    (EngineProfile.engine: vllm, sglang, ...), how its requests arrive, whether their lengths vary
    and its model's architecture."""

    engine: str
    regime: ArrivalRegime
    lengths: LengthSpread
    architecture: Architecture

    @classmethod
    def of(cls, engine: EngineProfile, regime: ArrivalRegime, lengths: LengthSpread, model: ModelConfig) -> RunKind:
        return cls(engine.engine, regime, lengths, "moe" if model.is_moe else "dense")

    @property
    def lengths_group(self) -> str:
        """Its group on the lengths band axis: its model architecture and its requests' length spread
        ("moe-varied"); the public runs of the two architectures miss differently by lengths."""
        return f"{self.architecture}-{self.lengths}"


def fitted_model(path: Path = PUBLIC_FIT_FILE) -> FittedModel | None:
    """The public fit, or None before one was made (the profiles' estimates apply)."""
    if not path.exists():
        return None
    return _read_model(path, path.stat().st_mtime_ns)


@cache
def _read_model(path: Path, _mtime_ns: int) -> FittedModel:
    # Every simulated GPU run asks; the file (with its per-figure results) is parsed once per version.
    return FittedModel.model_validate(json.loads(path.read_text())["model"])


def load_fitted_model(path: str | Path) -> FittedModel:
    """The fitted figures of a file `serveplan calibrate --public` or `--from-bench` wrote, or one
    InputError saying why the file is not one."""
    data = load_json(path, "calibration")
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise InputError("calibration", str(path), "is not a fit file (`serveplan calibrate --public` or "
                         "`--from-bench` writes one)")
    try:
        return FittedModel.model_validate(data["model"])
    except ValidationError as exc:
        raise from_validation_error(exc, f"{path}: model") from None


# The RunSummary figures each metric family's band applies to.
BANDED_FIGURES: dict[MetricFamily, tuple[str, ...]] = {
    "throughput": tuple(f"throughput.{f}" for f in ("requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
                                                    "total_tokens_per_s")),
    "ttft": tuple(f"ttft_ms.{s}" for s in ("mean", "p50", "p90", "p99")),
    "tpot_itl": tuple(f"{m}.{s}" for m in ("tpot_ms", "itl_ms") for s in ("mean", "p50", "p90", "p99")),
    "e2e": tuple(f"e2e_ms.{s}" for s in ("mean", "p50", "p90", "p99")),
}


def prediction_interval(summary: RunSummary, hw: HardwareProfile, engine: EngineProfile, kind: RunKind,
                        model: FittedModel | None = None) -> PredictionInterval | None:
    """The P10..P90 band around a simulated run's figures (a run of `kind`, served by `engine`),
    from `model` (a fit given: `--calibration`) or the public GPU fit: for each metric family the
    band FittedModel.bands_for picks. None without bands, and on a CPU the fit never saw: GPUs'
    bands say nothing of it (its own calibration and validation apply); a bench fit on this CPU does."""
    model = model or fitted_model()
    if model is None or not model.bands or (hw.kind == "cpu" and hw.family not in model.families):
        return None
    bands = model.bands_for(kind)
    ranges: dict[str, tuple[float, float]] = {}
    for family, band in bands.items():
        low, high = band.interval()
        for name in BANDED_FIGURES[family]:
            value = summary.figure(name)
            assert value is not None  # latencies and rates are always set
            ranges[name] = (value * low, value * high)
    whose = ", ".join(f"{f} {model.band_owner(f, kind)} "
                      f"({b.figures} figures, held-out coverage {b.held_out_coverage:.0%})" for f, b in bands.items())
    caveats = []
    if hw.family not in model.families:
        caveats.append(f"GPU family {hw.family!r} was not in the fit (no published runs): its figures are the "
                       "profile's estimates and the band, measured on fitted families, likely understates the error")
    if engine.name not in model.engines:
        caveats.append(f"engine profile {engine.name!r} was not in the fit: its host overheads are the profile's estimates")
    return PredictionInterval(
        coverage=BAND_COVERAGE, ranges=ranges,
        basis=f"P10..P90 of measured / predicted over {model.held_out} ({model.source}): {whose}"
              + "".join(f"; {c}" for c in caveats))


@dataclass(frozen=True)
class Pessimism:
    """What sizing at a confidence changes: latency targets divided by the measured / predicted
    ratio that held-out figures stayed below that often, the rate divided by the throughput ratio
    they stayed above that often."""

    slo: SLO
    rate_factor: float  # size for rate x this
    note: str


_TARGET_FAMILY: dict[str, MetricFamily] = {"ttft": "ttft", "tpot": "tpot_itl", "itl": "tpot_itl", "e2e": "e2e"}


def pessimistic(slo: SLO, confidence: float, kind: RunKind, model: FittedModel | None = None) -> Pessimism:
    """Sizing of a deployment whose runs are of `kind` at `confidence`, from the bands they carry."""
    model = model or fitted_model()
    if model is None or not model.bands:
        raise InputError("confidence", confidence, "needs a fit's bands: the public fit's (`serveplan calibrate "
                         "--public` makes it) or those of the fit given")
    bands = model.bands_for(kind)
    factors: dict[str, float] = {}
    targets: dict[str, float] = {}
    for name, limit in slo.targets.items():
        band = bands.get(_TARGET_FAMILY[name.split("_")[0]])
        if band is None:
            raise InputError("confidence", confidence, f"the fit has no band for {name}")
        factors[name] = band.ratio_at(confidence)
        targets[name] = limit / factors[name]
    throughput = bands.get("throughput")
    rate_factor = 1.0 if throughput is None else 1 / throughput.ratio_at(1 - confidence)
    shown = ", ".join(f"{name} {slo.targets[name]:g} -> {targets[name]:.4g} ms (/{f:.2f})" for name, f in factors.items())
    note = (f"sized at confidence {confidence:g}: latency targets divided by the P{100 * confidence:g} of measured / "
            f"predicted over the fit's {model.held_out} ({shown}); rate x {rate_factor:.2f} (1 / the throughput "
            f"ratio's P{100 * (1 - confidence):g}); bands "
            + ", ".join(f"{f} {model.band_owner(f, kind)}" for f in bands))
    return Pessimism(slo.model_copy(update=targets), rate_factor, note)
