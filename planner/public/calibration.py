"""`serveplan calibrate --public`: fit the GPU-family and engine figures to every published run,
then measure how well the fit generalises by leaving each source out in turn.

1. Every run the simulator can replay is prepared (planner/public/replay.py); the others are
   listed with their reason.
2. The all-data fit: a few rounds of tracing the runs and fitting on the traces (fit.py).
3. Leave-one-source-out: for each source, the figures are fitted again without it (on the
   traces of step 2, starting from its figures), and its runs are simulated at those figures.
   These held-out predictions are the headline: they measure generalisation to a publication the
   fit never saw, not memory.
4. Prediction intervals per metric family from the held-out ratios measured / predicted, and per
   engine where its own figures are enough; their coverage is checked the same way (each
   source's band built from the other sources only).
The file records the data's digest, the figures, each fold's figures, every figure's in-sample
and held-out prediction and the bands: everything `serveplan validate --public` reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
import datetime as dt
from functools import partial
import hashlib
import json
import pickle
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InputError
from planner.costmodel.fitted import (BAND_COVERAGE, BAND_PROBABILITIES, GROUP_WORDS, PUBLIC_FIT_FILE, Band,
                                      FittedModel, load_fitted_model)
from planner.engines import engine_catalog, get_engine
from planner.hardware import hardware_catalog
from planner.metrics import MetricFamily
from planner.public.data import MEASUREMENTS_FILE, PublicRun, public_runs
from planner.public.fit import (ENGINE_PARAMS, HARDWARE_PARAMS, ROBUST_SCALE, Figures, Progress, Rounds, Space, fit_folds,
                                fit_rounds, no_progress, simulate_runs)
from planner.public.replay import Measured, ReplayRun, prepare

class _Rec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The units a held-out prediction leaves out: one publication (the headline, as issue 16 asks), or
# everything one publisher put out (stricter: a lab's pages share its harness and engine builds).
# Trace-and-fit rounds at most for the published runs: each round simulates ~300 runs.
PUBLIC_ROUNDS = 3
Unit = Literal["source", "publisher"]
UNITS: tuple[Unit, ...] = ("source", "publisher")


def unit_of(run: Measured, unit: Unit) -> str:
    return run.source_key if unit == "source" else run.publisher


class HeldOutFigure(_Rec):
    """A measured figure with its in-sample and held-out predictions (what the bands are made of)."""

    id: str
    run_key: str
    source_key: str = Field(description="The unit held out: a publication, or (from bench) a run")
    metric: str
    family: MetricFamily
    measured: float
    in_sample: float = Field(description="Predicted with the all-data fit")
    held_out: float = Field(description="Predicted with the fit that left this figure's source out")


class FigureResult(HeldOutFigure):
    publisher: str
    engine: str = Field(description="Engine profile the run was replayed with")
    hardware: str
    gpu_family: str
    confidence: Literal["high", "medium", "low"]
    held_out_publisher: float = Field(description="Predicted with the fit that left this figure's publisher out")


class SkippedRun(_Rec):
    run_key: str
    source_key: str
    figures: int
    reason: str
    whole_run: bool = Field(True, description="False: only these figures of the run are set aside, the rest predicted")


class FoldFigures(_Rec):
    families: dict[str, dict[str, float]]
    engines: dict[str, dict[str, float]]


class PublicFit(_Rec):
    """hwprofiles/calibrations/public-gpu.json."""

    format_version: int = 1
    created_utc: str
    command: str
    data_sha256: str = Field(description="Digest of planner/data/public_measurements.json the fit read")
    rounds: int
    start_costs: dict[str, float] = Field(
        default_factory=dict, description="The all-data fit's first round: least-squares cost reached from each start "
                                          "(the lowest is kept)")
    model: FittedModel
    folds: dict[Unit, dict[str, FoldFigures]] = Field(
        description="source or publisher -> its name -> the figures fitted without it")
    figures: list[FigureResult]
    skipped: list[SkippedRun]
    notes: list[str]


def prepare_all(runs: Sequence[PublicRun]) -> tuple[list[ReplayRun], list[SkippedRun]]:
    prepared, skipped = [], []
    for run in runs:
        result = prepare(run)
        if isinstance(result, str):
            skipped.append(_skipped(run, result))
            continue
        prepared.append(result)
        if result.set_aside:
            skipped.append(SkippedRun(run_key=run.run_key, source_key=run.source_key, whole_run=False,
                                      reason=result.set_aside_reason, figures=len(run.figures) - len(result.figures)))
    return prepared, skipped


@dataclass(frozen=True)
class Checkpoint:
    """A folder where a long calibration keeps what it has done (the traced, fitted rounds, then each
    held-out fold), so a run that is stopped resumes where it was. Its contents are pickles: keep it
    a folder only you write to. Everything is filed under a key of the data, the code and the rounds,
    so a change to any of them starts afresh."""

    folder: Path

    @classmethod
    def of(cls, root: Path, rounds: int) -> Checkpoint:
        from planner.search.cache import code_version

        key = hashlib.sha256(f"{data_digest()} {code_version()} {rounds}".encode()).hexdigest()[:16]
        folder = root / key
        folder.mkdir(parents=True, exist_ok=True)
        return cls(folder)

    def rounds(self) -> Rounds | None:
        path = self.folder / "rounds.pkl"
        return pickle.loads(path.read_bytes()) if path.exists() else None

    def save_rounds(self, done: Rounds) -> None:
        _replace(self.folder / "rounds.pkl", pickle.dumps(done, protocol=pickle.HIGHEST_PROTOCOL))

    def folds(self, unit: Unit) -> dict[str, Figures]:
        path = self.folder / f"folds-{unit}.json"
        table = json.loads(path.read_text()) if path.exists() else {}
        return {name: Figures(f["families"], f["engines"]) for name, f in table.items()}

    def save_fold(self, unit: Unit, name: str, figs: Figures) -> None:
        table = {n: {"families": f.families, "engines": f.engines} for n, f in self.folds(unit).items()}
        table[name] = {"families": figs.families, "engines": figs.engines}
        _replace(self.folder / f"folds-{unit}.json", json.dumps(table).encode())


def _replace(path: Path, data: bytes) -> None:
    """Write whole or not at all: a run stopped mid-write leaves the previous file."""
    part = path.with_suffix(path.suffix + ".part")
    part.write_bytes(data)
    part.replace(path)


@dataclass(frozen=True)
class Stage:
    """A staged fit: only `params` are fitted, every other figure held at `on`'s (each fold's at
    that fold's), so that a term the cost model gains is fitted without refitting the others."""

    params: tuple[str, ...]
    on: PublicFit
    on_name: str
    owners: frozenset[str] | None = None  # the GPU families and engines whose `params` are fitted (None: all)

    def __post_init__(self) -> None:
        unknown = [p for p in self.params if p not in HARDWARE_PARAMS and p not in ENGINE_PARAMS]
        if unknown or not self.params:
            raise InputError("only", ",".join(unknown) or "(none)",
                             f"allowed: one or more of {', '.join(HARDWARE_PARAMS + ENGINE_PARAMS)}")
        if self.owners is not None:
            known = {hw.family for hw in hardware_catalog().values()} | set(engine_catalog())
            strangers = sorted(self.owners - known) if self.owners else ["(none)"]
            if strangers:
                raise InputError("only_for", ",".join(strangers),
                                 f"allowed: one or more GPU families or engine profiles, of {', '.join(sorted(known))}")

    def space(self, runs: Sequence[ReplayRun]) -> Space:
        return Space.of(runs, tuple(p for p in ENGINE_PARAMS if p in self.params),
                        tuple(p for p in HARDWARE_PARAMS if p in self.params), _figures(self.on.model), self.owners)

    def new_units(self, unit: Unit, names: Iterable[str]) -> list[str]:
        """The sources or publishers among `names` that the fit staged on never saw (runs published since).
        One it saw but has no fold for cannot be staged: its fold's other figures were fitted with it."""
        stored = self.on.folds.get(unit, {})
        seen = {f.source_key if unit == "source" else f.publisher for f in self.on.figures}
        missing = sorted(set(names) - set(stored))
        refitted = [name for name in missing if name in seen]
        if refitted:
            raise InputError("only", ",".join(self.params), f"{self.on_name} has no fold without the {unit} "
                             f"{', '.join(refitted)}: stage on a fit of today's data")
        return missing

    def held_folds(self, unit: Unit, new: Iterable[str]) -> dict[str, Figures]:
        """What each fold holds: the stored fold's figures; the fold of a `new` source or publisher
        (new_units) holds the all-data figures of the fit staged on, fitted without it, so it leaves it out too."""
        folds = {name: _figures(f) for name, f in self.on.folds.get(unit, {}).items()}
        return folds | {name: _figures(self.on.model) for name in new}

    def note(self, new_units: Mapping[Unit, Sequence[str]]) -> str:
        """The staged fit's notes are those of the fit it stages on (how its figures were made), then this."""
        scope = f" of {', '.join(sorted(self.owners))}" if self.owners is not None else ""
        added = "; ".join(f"the {unit} {', '.join(names)} new since that fit: its fold holds that fit's all-data figures "
                          f"(fitted without it)" for unit, names in new_units.items() if names)
        return (f"staged on {self.on_name} (created {self.on.created_utc} by `{self.on.command}`): only "
                f"{', '.join(self.params)}{scope} fitted, every other figure held at that fit's, each fold's at that fold's"
                + (f"; {added}" if added else ""))


def _figures(fitted: FittedModel | FoldFigures) -> Figures:
    return Figures(fitted.families, fitted.engines)


def calibrate_public(*, command: str, rounds: int = PUBLIC_ROUNDS, workers: int = 1, runs: Sequence[PublicRun] | None = None,
                     max_nfev: int = 400, progress: Progress = no_progress, checkpoint: Path | None = None,
                     previous: Path | None = None, stage: Stage | None = None) -> PublicFit:
    """The whole study; `runs` defaults to every published run. The all-data fit starts from the
    fit in `previous` (where there is one) and from the profiles' estimates, and keeps the lower
    cost; a `stage` fits only its figures, from the fit it stages on. With `checkpoint` (a folder),
    the rounds and each held-out fold are kept there as they complete, and a new run resumes from them."""
    if stage is not None and checkpoint is not None:
        raise InputError("checkpoint", str(checkpoint), "not with a staged fit: its rounds and folds would be a whole fit's")
    prepared, skipped = prepare_all(list(runs) if runs is not None else public_runs())
    space = stage.space(prepared) if stage is not None else Space.of(prepared)
    if stage is not None and stage.owners is not None and not space.names:
        raise InputError("only_for", ",".join(sorted(stage.owners)), f"no published run has {', '.join(stage.params)} "
                         "of these GPU families or engines to fit")
    store = Checkpoint.of(checkpoint, rounds) if checkpoint is not None else None
    saved = store.rounds() if store is not None else None
    if saved is None:
        begin = {"the fit it stages on": space.held} if stage is not None else starts(space, previous)
        saved = fit_rounds(prepared, space, starts=begin, rounds=rounds, workers=workers, max_nfev=max_nfev,
                           progress=progress)
        if store is not None:
            store.save_rounds(saved)
    figs, traced = saved.figures, saved.traced
    skipped += [_skipped(r.run, saved.refused[r.run.run_key]) for r in prepared if r.run.run_key in saved.refused]
    fitted_runs = [t.run for t in traced]
    folds: dict[Unit, dict[str, Figures]] = {}
    new_units: dict[Unit, list[str]] = {}
    for unit in UNITS:
        names = {unit_of(t.run.run, unit) for t in traced}
        new_units[unit] = stage.new_units(unit, names) if stage is not None else []
        folds[unit] = fit_folds(traced, lambda t: unit_of(t.run.run, unit), figs, workers=workers,
                                max_nfev=max_nfev, progress=progress(f"fitting with each {unit} left out", len(names)),
                                done=store.folds(unit) if store is not None else None,
                                on_fold=partial(store.save_fold, unit) if store is not None else None,
                                engine_params=space.engine_params, family_params=space.family_params,
                                held=stage.held_folds(unit, new_units[unit]) if stage is not None else None,
                                owners=stage.owners if stage is not None else None)
    results, refused_later = predict_public(fitted_runs, figs, folds, workers=workers, progress=progress)
    skipped += refused_later
    own = engine_bands(results)
    model = FittedModel(families=figs.families, engines=figs.engines, bands=bands(results), engine_bands=own,
                        **fitted_group_bands(results, run_groups(prepared), own),
                        source=f"{command} on {dt.date.today().isoformat()}: {len(results)} figures, "
                               f"{len(folds['source'])} sources, {len(folds['publisher'])} publishers")
    return PublicFit(
        created_utc=dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        command=command, data_sha256=data_digest(), rounds=rounds, start_costs=saved.start_costs, model=model,
        folds={u: {name: FoldFigures(families=f.families, engines=f.engines) for name, f in table.items()}
               for u, table in folds.items()},
        figures=results, skipped=skipped,
        notes=[*stage.on.notes, stage.note(new_units)] if stage is not None else [
            "residuals: log(predicted / measured), soft L1 beyond a log error of "
            f"{ROBUST_SCALE:g} (squared below it, linear above), each source weighted alike (1/sqrt(its figures)), "
            "high/medium/low confidence 1/0.7/0.4; a weak prior at the profiles' estimates",
            "all-data fit: least squares from each start in start_costs, on traces made at the first; the lowest cost kept",
            "held_out: the figures fitted without the figure's source (on the all-data traces), then its runs simulated; "
            "held_out_publisher: the same without everything its publisher put out",
            "bands: quantiles of measured / held-out predicted per metric family; held_out_coverage builds each "
            f"source's P{50 * (1 - BAND_COVERAGE):g}..P{50 * (1 + BAND_COVERAGE):g} band from the other sources",
            ENGINE_BANDS_NOTE,
        ],
    )


def rebanded(fit: PublicFit, command: str, figures: Sequence[FigureResult], skipped: Sequence[SkippedRun],
             groups: RunGroups) -> PublicFit:
    """`fit` with `figures`, its stored folds' predictions made again by today's simulator (the
    runs it `skipped` set aside), and the bands made from them by today's rules (`groups`:
    run_groups of their runs): the same fitted figures and folds, no refit (`serveplan calibrate
    --public --bands-only`). A fit keeps, this way, the bands of the simulator that uses them."""
    own = engine_bands(figures)
    model = fit.model.model_copy(update={"bands": bands(figures), "engine_bands": own,
                                         **fitted_group_bands(figures, groups, own)})
    note = (f"held-out figures predicted again by the simulator of {dt.date.today().isoformat()} from the stored "
            f"folds, and bands made again from them, by `{command}` (nothing refitted); " + ENGINE_BANDS_NOTE)
    # The notes are the fit's history: a second remake the same day with the same command adds nothing to it.
    notes = fit.notes if fit.notes and fit.notes[-1] == note else [*fit.notes, note]
    return fit.model_copy(update={"model": model, "figures": list(figures), "skipped": list(skipped),
                                  "notes": notes})


def starts(space: Space, previous: Path | None) -> dict[str, Figures]:
    """Where the all-data fit starts: the fit in `previous` where there is one (its runs are
    traced at it, the nearer schedule), and the profiles' estimates."""
    out: dict[str, Figures] = {}
    if previous is not None and previous.exists():
        model = load_fitted_model(previous)
        out[f"the previous fit ({previous.name})"] = Figures(model.families, model.engines)
    out["the profiles' estimates"] = space.figures(space.prior())
    return out


def predict_public(runs: Sequence[ReplayRun], figs: Figures, folds: dict[Unit, dict[str, Figures]], *,
                   workers: int = 1, progress: Progress = no_progress) -> tuple[list[FigureResult], list[SkippedRun]]:
    """Every figure of `runs` simulated with the all-data figures (in sample) and with the figures
    fitted without its source, then without its publisher (held out); and the runs the simulator
    refused, with why."""
    in_sample = simulate_runs(runs, figs, workers=workers, catch=True, progress=progress("predicting in sample", len(runs)))
    held = {unit: simulate_runs(runs, lambda r: folds[unit][unit_of(r.run, unit)], workers=workers, catch=True,
                                progress=progress(f"predicting each {unit} held out", len(runs)))
            for unit in UNITS}
    results, refused = [], []
    for r, inside, by_source, by_publisher in zip(runs, in_sample, held["source"], held["publisher"], strict=True):
        problem = next((o for o in (inside, by_source, by_publisher) if isinstance(o, str)), None)
        if problem is not None:
            refused.append(_skipped(r.run, problem))
            continue
        assert isinstance(inside, dict) and isinstance(by_source, dict) and isinstance(by_publisher, dict)
        results += [FigureResult(id=f.id, run_key=r.run.run_key, source_key=r.run.source_key, publisher=r.run.publisher,
                                 metric=f.metric, family=f.family, engine=r.engine.name, hardware=r.hw.name,
                                 gpu_family=r.hw.family, confidence=r.run.confidence, measured=f.value,
                                 in_sample=inside[f.id], held_out=by_source[f.id],
                                 held_out_publisher=by_publisher[f.id]) for f in r.figures]
    return results, refused


# Below this many sources, a family's band pools its figures with its partner's (see `bands`):
# end-to-end latency is mostly a request's decode, its output tokens x TPOT.
MIN_BAND_SOURCES = 3
BAND_PARTNERS: dict[MetricFamily, tuple[MetricFamily, ...]] = {"e2e": ("tpot_itl",)}
# An engine's own band of a family needs this many held-out figures of it: ten beyond each end of P10..P90.
MIN_ENGINE_BAND_FIGURES = 100
# A group's own band of a family (group bands: an architecture's, an arrival regime's): six beyond each end
# of P10..P90. The online figures of the public data number 34-128 per family, from 2-8 sources.
MIN_GROUP_BAND_FIGURES = 60
# ... and must hold them this much nearer the stated share than the bands they carry otherwise: the
# bands of the group most figures come from differ from those by noise, and they would replace an
# engine's own band with one that pools all engines (SGLang's bursts would lose their wider band).
GROUP_BAND_GAIN = 0.05
METRIC_FAMILIES: tuple[MetricFamily, ...] = ("throughput", "ttft", "tpot_itl", "e2e")
ENGINE_BANDS_NOTE = (f"engine_bands: the same from one engine's figures (every release of it), for the families where "
                     f"it has {MIN_ENGINE_BAND_FIGURES} figures from {MIN_BAND_SOURCES} sources; architecture_bands, "
                     "lengths_bands and regime_bands: the same from the figures of dense or MoE models' runs, of such "
                     "runs whose requests had one prompt and one output length (fixed) or not (varied), and of runs whose "
                     "requests arrived online (over time, or from users back to back) or offline (all at once), for the "
                     f"families where such a group has {MIN_GROUP_BAND_FIGURES} figures from {MIN_BAND_SOURCES} sources "
                     f"and its own band's held-out coverage of them is at least {100 * GROUP_BAND_GAIN:g} points nearer "
                     f"{BAND_COVERAGE:.0%} than that of the bands they carry otherwise (a regime's before a lengths', a "
                     "lengths' before an architecture's, an architecture's before an engine's)")


def data_digest() -> str:
    return hashlib.sha256(MEASUREMENTS_FILE.read_bytes()).hexdigest()


def _skipped(run: Measured, reason: str) -> SkippedRun:
    return SkippedRun(run_key=run.run_key, source_key=run.source_key, figures=len(run.figures), reason=reason)


def write_fit(result: PublicFit, path: Path = PUBLIC_FIT_FILE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result.model_dump_json(indent=1) + "\n")
    return path


def bands(results: Sequence[HeldOutFigure]) -> dict[MetricFamily, Band]:
    """Per metric family, quantiles of measured / held-out predicted, and the share of each source's
    figures inside the P10..P90 band built from the other sources only.

    A family whose figures come from fewer than MIN_BAND_SOURCES sources pools them with the family
    that makes up most of it (BAND_PARTNERS) where it has one: its own held-out check would build one
    source's band from one or two others (the public data's end-to-end figures come from two
    publications, and their own band covered 42 % of them). The band says so in `pooled_with`."""
    out: dict[MetricFamily, Band] = {}
    for family in METRIC_FAMILIES:
        rows = [r for r in results if r.family == family]
        if len(rows) < 2:
            continue
        basis, partners = _pooled(results, family)
        out[family] = _band(rows, basis, partners)
    return out


def _pooled(results: Sequence[HeldOutFigure], family: MetricFamily) -> tuple[list[HeldOutFigure], tuple[MetricFamily, ...]]:
    """What `family`'s all-engines band is made of: its figures, and its partners' (BAND_PARTNERS)
    where its own come from fewer than MIN_BAND_SOURCES sources; and those partners."""
    rows = [r for r in results if r.family == family]
    partners = BAND_PARTNERS.get(family, ()) if _num_sources(rows) < MIN_BAND_SOURCES else ()
    return rows + [r for r in results if r.family in partners], partners


def engine_bands(results: Sequence[FigureResult]) -> dict[str, dict[MetricFamily, Band]]:
    """Per engine (vllm, sglang, trtllm: every release of it), the bands `bands` makes, from that
    engine's figures alone, for each metric family where they number MIN_ENGINE_BAND_FIGURES and come
    from MIN_BAND_SOURCES sources; its runs take the all-engines band of the other families.

    Engines miss in their own ways (SGLang's bursts of requests decode with far longer gaps than
    simulated; vLLM's runs, most of the data, sit nearer their predictions), so one band for all
    engines is too wide for one and too narrow for another (docs/validation-public.md measures both)."""
    by_engine: dict[str, list[FigureResult]] = {}
    for r in results:
        by_engine.setdefault(engine_of(r), []).append(r)
    out: dict[str, dict[MetricFamily, Band]] = {}
    for engine, figures in sorted(by_engine.items()):
        own = {family: _band(rows, rows, ()) for family in METRIC_FAMILIES
               if len(rows := [r for r in figures if r.family == family]) >= MIN_ENGINE_BAND_FIGURES
               and _num_sources(rows) >= MIN_BAND_SOURCES}
        if own:
            out[engine] = own
    return out


# The run attributes whose groups may carry bands of their own, lowest precedence first: a run carries
# the band of the last axis whose group has one for the family (FittedModel.bands_for), else its engine's.
BandAxis = Literal["architecture", "lengths", "regime"]
BAND_AXES: tuple[BandAxis, ...] = ("architecture", "lengths", "regime")


class GroupBand(_Rec):
    """One group's own band of a metric family (the MoE models' runs, the online runs, ...), beside the
    held-out coverage of the same figures by the bands they carry otherwise (a lower axis's group
    band, their engine's, else all engines'). Its runs carry it only where it holds them at least
    GROUP_BAND_GAIN nearer the stated share (`carried`)."""

    axis: BandAxis
    group: str = Field(description="architecture: dense, moe; lengths: dense-fixed, dense-varied, moe-fixed, "
                       "moe-varied; regime: online, offline")
    family: MetricFamily
    band: Band
    otherwise_coverage: float = Field(ge=0, le=1, description="Held-out coverage of the band's figures by the bands "
                                      "they would carry without it")
    shadowed: bool = Field(False, description="Every run of the group carries a later axis's band of the family "
                           "instead (the bands of both regimes, say), so none carries this one")

    @property
    def carried(self) -> bool:
        gain = abs(self.otherwise_coverage - BAND_COVERAGE) - abs(self.band.held_out_coverage - BAND_COVERAGE)
        return gain >= GROUP_BAND_GAIN

    @property
    def used(self) -> bool:
        """Runs of the group carry it (FittedModel.architecture_bands, lengths_bands, regime_bands)."""
        return self.carried and not self.shadowed


# Per band axis: run key -> the run's group on it (run_groups).
RunGroups = Mapping[BandAxis, Mapping[str, str]]


def group_candidates(results: Sequence[FigureResult], groups: RunGroups,
                     own: Mapping[str, Mapping[MetricFamily, Band]]) -> list[GroupBand]:
    """Per band axis in BAND_AXES' order and group on it (`groups`, run_groups), the band `bands`
    makes from that group's figures alone, for each metric family where they number
    MIN_GROUP_BAND_FIGURES from MIN_BAND_SOURCES sources, with the coverage of the same figures by the
    bands they would carry without it: the carried bands of the axes before it, their engine's band
    (`own`), else all engines'.

    Predictions miss differently by group: online, the simulator is optimistic on time to first token
    (a median x1.4 of measured / predicted in the held-out figures of 2026-12-06, where offline it is
    x1.0), so bands made mostly of offline figures held under two thirds of the online ones; the MoE
    models' TPOT/ITL figures miss by a median 17 % where the dense models' miss by 12 %, and the bands
    of all of them held 70 % of the one and 86 % of the other (2026-12-06); runs of varied lengths
    (ShareGPT) come out optimistic where fixed-length ones do not (TPOT/ITL: a median x1.16 of measured
    / predicted against x0.98), and the bands runs carried held 76 % of the one and 87 % of the other
    (2026-12-07): the lengths axis groups runs by architecture too, as a lengths band made mostly of
    dense models' figures held the MoE models' worse than their own."""
    out: list[GroupBand] = []
    for axis in BAND_AXES:
        below = list(out)
        for group in sorted(set(groups[axis].values())):
            for family in METRIC_FAMILIES:
                rows = [r for r in results if r.family == family and groups[axis][r.run_key] == group]
                if len(rows) >= MIN_GROUP_BAND_FIGURES and _num_sources(rows) >= MIN_BAND_SOURCES:
                    out.append(GroupBand(axis=axis, group=group, family=family, band=_band(rows, rows, ()),
                                         otherwise_coverage=_carried_coverage(rows, results, own, below, groups)))
    return [c.model_copy(update={"shadowed": True}) if c.carried and _shadowed(c, out, groups) else c for c in out]


def _shadowed(candidate: GroupBand, candidates: Sequence[GroupBand], groups: RunGroups) -> bool:
    """Whether every run of `candidate`'s group belongs to a group of a later axis that carries its
    family's band (which comes first)."""
    later = {(c.axis, c.group) for c in candidates if c.family == candidate.family and c.carried
             and BAND_AXES.index(c.axis) > BAND_AXES.index(candidate.axis)}
    runs = [run for run, group in groups[candidate.axis].items() if group == candidate.group]
    return all(any((axis, groups[axis][run]) in later for axis in BAND_AXES) for run in runs)


def group_bands(candidates: Sequence[GroupBand], axis: BandAxis) -> dict[str, dict[MetricFamily, Band]]:
    """The bands of `candidates` (group_candidates) on `axis` that runs of their group carry
    (GroupBand.used): a group's band replaces the lower ones only where it is the better calibrated
    by a margin and no later axis's bands cover the whole group (FittedModel.architecture_bands,
    lengths_bands, regime_bands)."""
    out: dict[str, dict[MetricFamily, Band]] = {}
    for c in candidates:
        if c.axis == axis and c.used:
            out.setdefault(c.group, {})[c.family] = c.band
    return out


def carried_group_bands(candidates: Sequence[GroupBand]) -> list[tuple[str, dict[MetricFamily, Band]]]:
    """Whose they are, in words ("MoE-model runs", "online runs"), and the bands of every group that
    carries its own (group_bands), in BAND_AXES' order: what reports list beside the engines' bands."""
    return [(f"{GROUP_WORDS.get(group, group)} runs", table)
            for axis in BAND_AXES for group, table in group_bands(candidates, axis).items()]


def run_groups(runs: Iterable[ReplayRun]) -> dict[BandAxis, dict[str, str]]:
    """Per band axis, run key -> its group: whether its model is a mixture of experts; that and whether
    the requests its replay plays vary in length (ReplayRun.lengths: "moe-varied"); and how they
    arrived (Client.regime)."""
    groups: dict[BandAxis, dict[str, str]] = {axis: {} for axis in BAND_AXES}
    for r in runs:
        assert isinstance(r.run, PublicRun)  # a published run: its client says how the requests arrived
        groups["architecture"][r.run.run_key] = "moe" if r.model.is_moe else "dense"
        groups["lengths"][r.run.run_key] = f"{groups['architecture'][r.run.run_key]}-{r.lengths}"  # RunKind.lengths_group
        groups["regime"][r.run.run_key] = r.run.client.regime
    return groups


def fitted_group_bands(results: Sequence[FigureResult], groups: RunGroups,
                       own: Mapping[str, Mapping[MetricFamily, Band]]) -> dict[str, dict[str, dict[MetricFamily, Band]]]:
    """The FittedModel fields of the group bands runs carry: architecture_bands, lengths_bands and regime_bands."""
    candidates = group_candidates(results, groups, own)
    return {f"{axis}_bands": group_bands(candidates, axis) for axis in BAND_AXES}


def carried_coverage(results: Sequence[FigureResult], groups: RunGroups, own: Mapping[str, Mapping[MetricFamily, Band]],
                     candidates: Sequence[GroupBand]) -> dict[MetricFamily, dict[str, float]]:
    """Per metric family, the held-out coverage of its figures by the bands their runs carry (the
    carried `candidates`, their engine's band in `own`, else all engines'): of all of them ("all") and
    of each group's on every band axis: what the stated share is measured against."""
    out: dict[MetricFamily, dict[str, float]] = {}
    for family in METRIC_FAMILIES:
        rows = [r for r in results if r.family == family]
        if not rows:
            continue
        out[family] = {"all": _carried_coverage(rows, results, own, candidates, groups)}
        for axis in BAND_AXES:
            for group in sorted(set(groups[axis].values())):
                if mine := [r for r in rows if groups[axis][r.run_key] == group]:
                    out[family][group] = _carried_coverage(mine, results, own, candidates, groups)
    return out


def _carried_coverage(rows: Sequence[FigureResult], results: Sequence[FigureResult],
                      own: Mapping[str, Mapping[MetricFamily, Band]], below: Sequence[GroupBand],
                      groups: RunGroups) -> float:
    """Held-out coverage of `rows` (one metric family) by the bands they would carry without a band
    of their own group: the last carried band in `below` of a group of theirs, else their engine's
    where `own` has one for the family, else all engines' (bands, partners pooled)."""
    family = rows[0].family
    carried = [c for c in below if c.family == family and c.carried]

    def basis_of(r: FigureResult) -> tuple[BandAxis, str] | str:
        """The group band it carries (axis, group), else its engine's name, else "" (all engines')."""
        mine = [c for c in carried if groups[c.axis][r.run_key] == c.group]
        if mine:
            return mine[-1].axis, mine[-1].group
        return engine_of(r) if family in own.get(engine_of(r), {}) else ""

    by_basis: dict[tuple[BandAxis, str] | str, list[FigureResult]] = {}
    for r in rows:
        by_basis.setdefault(basis_of(r), []).append(r)
    inside = 0.0
    for key, mine in by_basis.items():
        basis: Sequence[HeldOutFigure]
        if isinstance(key, tuple):
            axis, group = key
            basis = [r for r in results if r.family == family and groups[axis][r.run_key] == group]
        elif key:  # engine_bands' basis: the engine's figures of the family
            basis = [r for r in results if r.family == family and engine_of(r) == key]
        else:
            basis, _ = _pooled(results, family)
        inside += held_out_coverage(mine, basis) * len(mine)
    return inside / len(rows)


def engine_of(result: FigureResult) -> str:
    """The engine (vllm, sglang, ...) whose release replayed the figure's run: what its band is kept by."""
    return get_engine(result.engine).engine


def held_out_coverage(rows: Sequence[HeldOutFigure], basis: Sequence[HeldOutFigure]) -> float:
    """Share of `rows` inside the P10..P90 band of measured / predicted that `basis` makes without
    their source: each source's figures against the band of every other source's."""
    lo_q, hi_q = (1 - BAND_COVERAGE) / 2, (1 + BAND_COVERAGE) / 2
    inside = []
    for source in {r.source_key for r in rows}:
        others = [r.measured / r.held_out for r in basis if r.source_key != source]
        if others:
            lo, hi = np.quantile(others, [lo_q, hi_q])
            inside += [lo <= r.measured / r.held_out <= hi for r in rows if r.source_key == source]
    return float(np.mean(inside)) if inside else 0.0


def _num_sources(rows: Sequence[HeldOutFigure]) -> int:
    return len({r.source_key for r in rows})


def _band(rows: Sequence[HeldOutFigure], basis: Sequence[HeldOutFigure], partners: Sequence[MetricFamily]) -> Band:
    """The band of `rows` from the ratios of `basis` (rows, and any partners' figures)."""
    quantiles = np.quantile([r.measured / r.held_out for r in basis], BAND_PROBABILITIES)
    return Band(probabilities=list(BAND_PROBABILITIES), ratios=[float(q) for q in quantiles],
                held_out_coverage=held_out_coverage(rows, basis), figures=len(rows), pooled_with=list(partners))


__all__ = ["PublicFit", "FigureResult", "GroupBand", "HeldOutFigure", "SkippedRun", "bands", "engine_bands", "engine_of",
           "carried_coverage", "carried_group_bands", "fitted_group_bands", "group_bands", "group_candidates",
           "run_groups",
           "held_out_coverage", "rebanded", "calibrate_public", "predict_public", "write_fit", "Stage"]
