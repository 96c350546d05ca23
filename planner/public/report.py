"""`serveplan validate --public`: how close the simulator comes to published GPU measurements.

Reads the public fit (hwprofiles/calibrations/public-gpu.json) and reports signed and absolute
errors per figure and grouped by metric family, benchmark client, engine, GPU and source: held-out first (each
figure predicted by the fit that never saw its source), in-sample beside it. The markdown goes to
docs/validation-public.md with a predicted-vs-measured plot beside it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import InputError, from_validation_error
from engine.files import load_json, output_file
from hwprofiles import PROFILE_DIR
from planner.costmodel.fitted import GROUP_WORDS, PUBLIC_FIT_FILE, Band
from planner.metrics import MetricFamily
from planner.public.calibration import (
    BAND_AXES, GROUP_BAND_GAIN, MIN_BAND_SOURCES, MIN_ENGINE_BAND_FIGURES, MIN_GROUP_BAND_FIGURES, UNITS, BandAxis,
    FigureResult, GroupBand, PublicFit, RunGroups, SkippedRun, bands, carried_coverage, data_digest, engine_bands,
    engine_of, group_bands, group_candidates, held_out_coverage, predict_public, prepare_all, run_groups, unit_of,
)
from planner.public.data import PublicRun, public_runs
from planner.public.fit import Figures, Progress, no_progress

# Issue 16's bar: leave-one-source-out median |error| per metric family, in %.
TARGETS_PCT: dict[str, float] = {"throughput": 10.0, "tpot_itl": 10.0, "e2e": 10.0, "ttft": 20.0}


class GroupError(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    group: str
    figures: int
    held_out_median_abs_pct: float
    held_out_median_signed_pct: float = Field(description="Positive: predictions above the measurements")
    held_out_publisher_median_abs_pct: float = Field(description="With everything the figure's publisher put out left out")
    in_sample_median_abs_pct: float


class ScatterFloor(BaseModel):
    """How much of a metric family's held-out error a constant factor per group could take out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str
    figures: int
    left_pct: dict[str, float] = Field(
        description="Grouping (SCATTER_GROUPS) -> the median |error| left once each figure's held-out prediction is "
        "divided by its group's median held-out ratio predicted / measured: a correction taken from the figures it "
        "is scored on, so a floor for any term constant over that group, not a prediction")


class PublicValidation(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    fit_file: str
    figures: int
    sources: int
    runs: int
    skipped: list[SkippedRun]
    by_metric_family: list[GroupError]
    by_client: list[GroupError] = Field(description="By how the benchmark client offered the requests, and metric family")
    by_architecture: list[GroupError] = Field(default_factory=list, description="By the model's architecture (dense, "
                                              "moe), and metric family")
    by_engine: list[GroupError]
    by_gpu: list[GroupError]
    by_source: list[GroupError]
    bands: dict[MetricFamily, Band] = Field(description="Recomputed from these held-out predictions")
    engine_bands: dict[str, dict[MetricFamily, Band]] = Field(
        default_factory=dict, description="Per engine, recomputed from these held-out predictions (calibration.engine_bands)")
    all_engines_coverage: dict[str, dict[MetricFamily, float]] = Field(
        default_factory=dict, description="Per engine with bands of its own: the held-out coverage of its figures by "
        "the all-engines band of the same family, which its runs would carry otherwise")
    group_bands: list[GroupBand] = Field(
        default_factory=list, description="Per model architecture, then per architecture and spread of request "
        "lengths, then per arrival regime, and metric family with "
        "figures enough, its own band beside the coverage of the same figures by the bands they carry otherwise "
        "(calibration.group_candidates); those `carried` are the fit's architecture_bands, lengths_bands and "
        "regime_bands")
    carried_coverage: dict[MetricFamily, dict[str, float]] = Field(
        default_factory=dict, description="Per metric family, the held-out coverage of its figures by the bands their "
        "runs carry (calibration.carried_coverage): of all of them ('all') and of each model architecture's, "
        "architecture and spread of request lengths' and arrival regime's")
    targets_pct: dict[str, float]
    met: dict[str, bool]
    scatter_floors: list[ScatterFloor] = Field(default_factory=list, description="Per metric family (scatter_floors)")
    figure_errors: list[FigureResult]


def group_errors(results: Sequence[FigureResult], key: Callable[[FigureResult], str]) -> list[GroupError]:
    groups: dict[str, list[FigureResult]] = defaultdict(list)
    for r in results:
        groups[key(r)].append(r)
    out = []
    for name in sorted(groups):
        rows = groups[name]
        held = np.array([r.held_out / r.measured - 1 for r in rows])
        publisher = np.array([r.held_out_publisher / r.measured - 1 for r in rows])
        within = np.array([r.in_sample / r.measured - 1 for r in rows])
        out.append(GroupError(group=name, figures=len(rows), held_out_median_abs_pct=100 * float(np.median(np.abs(held))),
                              held_out_median_signed_pct=100 * float(np.median(held)),
                              held_out_publisher_median_abs_pct=100 * float(np.median(np.abs(publisher))),
                              in_sample_median_abs_pct=100 * float(np.median(np.abs(within)))))
    return out


# The groupings a constant correction could follow, each given a figure and its run's kind (run_kinds):
# the finest a fitted figure takes (one per GPU family and engine); that per kind of run, the finest a
# term of the model could key on without knowing the publication; one publication (its machines and
# harness); one benchmark run.
SCATTER_GROUPS: dict[str, Callable[[FigureResult, str], str]] = {
    "GPU family x engine": lambda r, kind: f"{r.gpu_family} x {r.engine}",
    "GPU family x engine x kind of run": lambda r, kind: f"{r.gpu_family} x {r.engine} x {kind}",
    "source": lambda r, kind: r.source_key,
    "run": lambda r, kind: r.run_key,
}


def run_kinds(clients: Mapping[str, str], groups: RunGroups) -> dict[str, str]:
    """run key -> its kind: how its client offered the requests (client_setups), its model's architecture
    and whether its requests' lengths varied (run_groups' lengths), e.g. "offline (every request at
    once), moe-varied"."""
    return {key: f"{clients[key]}, {lengths}" for key, lengths in groups["lengths"].items()}


def scatter_floors(results: Sequence[FigureResult], kinds: Mapping[str, str]) -> list[ScatterFloor]:
    """Per metric family, the held-out median |error| left after taking out each group's own median
    error (in log space, so a group's correction is one factor), for every SCATTER_GROUPS grouping;
    `kinds` (run_kinds) gives each figure's run its kind."""
    families: dict[str, list[FigureResult]] = defaultdict(list)
    for r in results:
        families[r.family].append(r)
    out = []
    for family in sorted(families):
        rows = families[family]
        log_ratio = np.log([r.held_out / r.measured for r in rows])
        left = {}
        for name, key in SCATTER_GROUPS.items():
            groups: dict[str, list[int]] = defaultdict(list)
            for i, r in enumerate(rows):
                groups[key(r, kinds[r.run_key])].append(i)
            residual = log_ratio.copy()
            for members in groups.values():
                residual[members] -= np.median(log_ratio[members])
            left[name] = 100 * float(np.median(np.abs(np.expm1(residual))))
        out.append(ScatterFloor(family=family, figures=len(rows), left_pct=left))
    return out


def load_fit(path: str | Path = PUBLIC_FIT_FILE) -> PublicFit:
    if not Path(path).exists():
        raise InputError("calibration", str(path), "no such file: make it with `serveplan calibrate --public`")
    try:
        return PublicFit.model_validate(load_json(path, "calibration"))
    except ValidationError as exc:
        problem = from_validation_error(exc)
        raise InputError("calibration", str(path), f"not a public fit file ({problem.field}: {problem.allowed}); "
                         "make one with `serveplan calibrate --public`") from None


def validate_public(path: str | Path = PUBLIC_FIT_FILE, *, workers: int = 1, runs: Sequence[PublicRun] | None = None,
                    progress: Progress = no_progress) -> tuple[PublicValidation, PublicFit]:
    """Predict every published figure again with the fit's figures (held out: its fold's), with
    today's simulator, and group the errors."""
    fit = load_fit(path)
    runs = list(runs) if runs is not None else None
    results, skipped, groups = predict_again(fit, path, workers=workers, runs=runs, progress=progress)
    runs = runs if runs is not None else public_runs()
    return validation_of(results, skipped, path, client_setups(runs), groups), fit


def predict_again(fit: PublicFit, path: str | Path, *, workers: int = 1, runs: Sequence[PublicRun] | None = None,
                  progress: Progress = no_progress) -> tuple[list[FigureResult], list[SkippedRun], RunGroups]:
    """Every published figure (`runs`' by default) predicted with today's simulator from the
    figures and folds that `fit` (read from `path`) stores, the runs set aside, with why, and the
    replayed runs' band groups (run_groups)."""
    if runs is None and fit.data_sha256 != data_digest():
        raise InputError("calibration", str(path), "was fitted to other published data than "
                         "planner/data/public_measurements.json holds now; refit with `serveplan calibrate --public`")
    prepared, skipped = prepare_all(list(runs) if runs is not None else public_runs())
    for unit in UNITS:
        unfitted = sorted({unit_of(r.run, unit) for r in prepared} - set(fit.folds.get(unit, {})))
        if unfitted:
            raise InputError("calibration", str(path), f"has no held-out fit for {unit} {unfitted[0]!r} "
                             f"({len(unfitted)} such); refit with `serveplan calibrate --public`")
    folds = {u: {name: Figures(f.families, f.engines) for name, f in table.items()} for u, table in fit.folds.items()}
    results, refused = predict_public(prepared, Figures(fit.model.families, fit.model.engines), folds,
                                      workers=workers, progress=progress)
    return results, skipped + refused, run_groups(prepared)


def client_setups(runs: Iterable[PublicRun]) -> dict[str, str]:
    """run key -> how its benchmark client offered the requests (Client.setup)."""
    return {run.run_key: run.client.setup for run in runs}


def validation_of(results: Sequence[FigureResult], skipped: Sequence[SkippedRun], fit_file: str | Path,
                  clients: Mapping[str, str], groups: RunGroups) -> PublicValidation:
    """The errors of predicted figures grouped every way the report shows them, against the targets;
    `clients` (client_setups) gives each figure's run its benchmark client's setup, `groups`
    (run_groups) its model's architecture, whether its requests' lengths varied and how they arrived."""
    by_family = group_errors(results, lambda r: r.family)
    own = engine_bands(results)
    candidates = group_candidates(results, groups, own)
    met = {g.group: g.held_out_median_abs_pct <= TARGETS_PCT[g.group] for g in by_family if g.group in TARGETS_PCT}
    return PublicValidation(
        fit_file=_shown(fit_file), figures=len(results), sources=len({r.source_key for r in results}),
        runs=len({r.run_key for r in results}), skipped=list(skipped),
        by_metric_family=by_family, by_client=group_errors(results, lambda r: f"{clients[r.run_key]}: {r.family}"),
        by_architecture=group_errors(results, lambda r: f"{groups['architecture'][r.run_key]}: {r.family}"),
        by_engine=group_errors(results, lambda r: r.engine),
        by_gpu=group_errors(results, lambda r: r.hardware), by_source=group_errors(results, lambda r: r.source_key),
        bands=bands(results), engine_bands=own, all_engines_coverage=_all_engines_coverage(results, own),
        group_bands=candidates, carried_coverage=carried_coverage(results, groups, own, candidates),
        targets_pct=TARGETS_PCT, met=met, scatter_floors=scatter_floors(results, run_kinds(clients, groups)), figure_errors=list(results),
    )


def _all_engines_coverage(results: Sequence[FigureResult],
                          own: Mapping[str, Mapping[MetricFamily, Band]]) -> dict[str, dict[MetricFamily, float]]:
    """For each engine's own band, the held-out coverage of the same figures by the all-engines band."""
    def family(name: MetricFamily) -> list[FigureResult]:
        return [r for r in results if r.family == name]

    return {engine: {name: held_out_coverage([r for r in family(name) if engine_of(r) == engine], family(name))
                     for name in table} for engine, table in own.items()}


def check_report_path(path: str | Path, fit_path: str | Path, field: str) -> None:
    """`path` as where write_report may write, checked before the minutes of work: the report, and the
    plot and JSON beside it, each a writable file, none of them the fit file (a report named after it,
    such as FIT.md beside FIT.json, would write its JSON over the fit)."""
    fit_file = Path(fit_path).resolve()
    for out in (Path(path), *(Path(path).with_suffix(suffix) for suffix in (".png", ".json"))):
        output_file(out, field)
        if out.resolve() == fit_file:
            raise InputError(field, str(path), f"would write {out.name} over the fit file {_shown(fit_file)}; "
                             "name the report otherwise")


def write_report(v: PublicValidation, fit: PublicFit, command: str, path: str | Path) -> Path:
    """The markdown report at `path`, its plot (.png) and the validation as JSON (.json, what the
    dashboard's Validate page reads) beside it."""
    out = Path(path)
    image = plot(v, out.with_suffix(".png"))
    out.write_text(markdown(v, fit, command, image.name))
    out.with_suffix(".json").write_text(v.model_dump_json(indent=1))
    return out


def _shown(path: str | Path) -> str:
    """`path` as a report names it: from the project's root when it lies inside (a committed report
    names no machine's folders), else as given."""
    root, resolved = PROFILE_DIR.parent.resolve(), Path(path).resolve()
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else str(path)


def markdown(v: PublicValidation, fit: PublicFit, command: str, plot: str | None) -> str:
    lines = [
        "# Validation against published GPU measurements",
        "",
        f"Generated by `{command}` from `{v.fit_file}` (made by `{fit.command}`, {fit.created_utc}).",
        "",
        f"{v.figures} published figures of {v.runs} benchmark runs from {v.sources} sources "
        f"({set_aside_summary(v.skipped)}, listed below). **Held out** is the headline: each figure is predicted by "
        "the fit that left its whole source out (leave-one-source-out), so it measures how the simulator does on a "
        "publication it never saw. *Publisher held out* is stricter: the fit left out everything the figure's "
        "publisher put out (a lab's pages share its harness, engine builds and habits), the closest this data comes to "
        "a team's own, new deployment. **In sample** uses the fit on everything.",
        "",
        "## By metric family",
        "",
        *_table(v.by_metric_family, extra=lambda g: f"{TARGETS_PCT.get(g.group, float('nan')):g} | "
                f"{'met' if v.met.get(g.group) else 'missed'}", extra_head="target % | |"),
        "",
        "## Where the error lies",
        "",
        "How much of each family's held-out error a constant factor per group could take out: the median |error| "
        "left once each figure's prediction is divided by its group's median held-out ratio. The factor is taken from "
        "the very figures it is scored on, so each column is a floor for a term constant over that group, not a "
        "prediction. The fit's figures are per GPU family and engine (and per operator, which each run mixes in its "
        "own proportions); a kind of run is how the benchmark client offered the requests, the model's architecture and "
        "whether the requests' lengths varied, the finest a term of the model could key on without knowing the "
        "publication; a source is one publication, its machines and its harness; a run leaves only the spread of the "
        "metrics within one benchmark run.",
        "",
        "| metric family | figures | held-out median abs error % | " + " | ".join(f"left, one factor per {g} %"
                                                                          for g in SCATTER_GROUPS) + " |",
        "|---|---:|---:|" + "---:|" * len(SCATTER_GROUPS),
        *(f"| {f.family} | {f.figures} | {_held_out_pct(v, f.family):.1f} | "
          + " | ".join(f"{f.left_pct[g]:.1f}" for g in SCATTER_GROUPS) + " |" for f in v.scatter_floors),
        "",
        "## Prediction intervals",
        "",
        _bands_carried(v, fit) + ": measured / predicted quantiles of the held-out figures. *Held-out coverage* is "
        "measured, not assumed: each source's band was built from the other sources' figures only, and this is the "
        "share of its figures that fell inside. A family whose figures come from fewer than three sources is pooled "
        "with the family that makes up most of it (end-to-end latency with TPOT/ITL).",
        "",
        "| metric family | P5 | P10 | P50 | P90 | P95 | P10..P90 held-out coverage | figures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {name} | " + " | ".join(f"x{b.ratio_at(p):.2f}" for p in (0.05, 0.1, 0.5, 0.9, 0.95))
          + f" | {b.held_out_coverage:.0%} | {b.figures} |" for name, b in
          ((f"{n} (pooled with {', '.join(b.pooled_with)})" if b.pooled_with else n, b) for n, b in v.bands.items())),
        "",
        f"Per engine (every release of it), where its own held-out figures of a family number {MIN_ENGINE_BAND_FIGURES} "
        f"from {MIN_BAND_SOURCES} sources: its runs carry these bands, and the all-engines band above for the other "
        "families. The last column is how many of the same figures the all-engines band held, measured the same way.",
        "",
        "| engine: metric family | P5 | P10 | P50 | P90 | P95 | P10..P90 held-out coverage | figures | all-engines band's coverage |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {engine}: {family} | " + " | ".join(f"x{b.ratio_at(p):.2f}" for p in (0.05, 0.1, 0.5, 0.9, 0.95))
          + f" | {b.held_out_coverage:.0%} | {b.figures} | {v.all_engines_coverage[engine][family]:.0%} |"
          for engine, table in v.engine_bands.items() for family, b in table.items()),
        "",
        f"Per model architecture (dense; MoE: a mixture of experts), then per architecture and spread of request "
        f"lengths (fixed: every request with one prompt length and one output length; varied: ShareGPT, a client's "
        f"uniform draws), then per arrival regime (online: requests over time, Poisson or users back to back; offline: all at "
        f"once), where its held-out figures of a family number {MIN_GROUP_BAND_FIGURES} from {MIN_BAND_SOURCES} "
        "sources: the group's own band, and how many of the same figures it held beside how many the bands they would "
        "carry without it held (the band of the latest axis before theirs that one of their groups keeps, else their "
        "engine's, else all engines'), measured the same way. Runs of that group carry it, a regime's before a "
        f"lengths', a lengths' before an architecture's and an architecture's before their engine's, where it holds "
        f"them at least {100 * GROUP_BAND_GAIN:g} points nearer the stated share; `simulate` and `compare` take a "
        "run's regime and lengths from its requests, `plan` probes online with its workload's lengths.",
        "",
        "| group: metric family | P5 | P10 | P50 | P90 | P95 | P10..P90 held-out coverage | figures | otherwise "
        "| carried |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *(f"| {c.axis} {c.group}: {c.family} | "
          + " | ".join(f"x{c.band.ratio_at(p):.2f}" for p in (0.05, 0.1, 0.5, 0.9, 0.95))
          + f" | {c.band.held_out_coverage:.0%} | {c.band.figures} | {c.otherwise_coverage:.0%} | "
          f"{_carried_words(c)} |" for c in v.group_bands),
        "",
        "What the bands runs carry held, all told: the held-out coverage of each family's figures by the band each "
        "figure's run carries (its regime's, else its lengths', else its architecture's, else its engine's, else all "
        "engines'), of all of them and of each group's; the stated share is 80 %.",
        "",
        *_coverage_table(v.carried_coverage),
        "",
        "## By benchmark client",
        "",
        "How the publication's client offered the requests (offline: all at once; Poisson: an open-loop stream at a "
        "rate; closed loop: a fixed number of users, each sending its next request when the last one ends), per "
        "metric family.",
        "",
        *_table(v.by_client), "",
        "## By model architecture",
        "",
        "Dense models run every weight on every token; mixture-of-experts models (moe) route each token to a few "
        "experts.",
        "",
        *_table(v.by_architecture), "",
        "## By engine", "", *_table(v.by_engine), "",
        "## By GPU", "", *_table(v.by_gpu), "",
        "## By source", "", *_table(v.by_source), "",
    ]
    if plot:
        lines += [f"![predicted vs measured]({plot})", ""]
    lines += ["## Fitted figures", ""]
    if fit.start_costs:
        kept = min(fit.start_costs, key=fit.start_costs.__getitem__)
        lines += ["The all-data fit's least-squares cost from each start (the lowest kept): "
                  + "; ".join(f"{name} {cost:.4g}" + (" (kept)" if name == kept else "")
                              for name, cost in fit.start_costs.items()) + ".", ""]
    lines += ["| scope | name | parameter | value |", "|---|---|---|---:|"]
    for scope, table in (("GPU family", fit.model.families), ("engine", fit.model.engines)):
        for name, values in table.items():
            lines += [f"| {scope} | {name} | {p} | {value:.4g} |" for p, value in values.items()]
    lines += ["", "## Runs set aside", "", "| run | figures | reason |", "|---|---:|---|"]
    lines += [f"| {s.run_key} | {s.figures} | {s.reason[:160]} |" for s in v.skipped]
    lines += ["", "## Notes", "", *(f"- {n}" for n in fit.notes), ""]
    return "\n".join(lines)


def _carried_words(c: GroupBand) -> str:
    if not c.carried:
        return "no"
    return "no: a later axis's bands come first for all its runs" if c.shadowed else "yes"


def _coverage_table(coverage: Mapping[MetricFamily, Mapping[str, float]]) -> list[str]:
    columns = list(dict.fromkeys(group for table in coverage.values() for group in table))
    heads = [GROUP_WORDS.get(c, c) + (" runs" if c != "all" else " figures") for c in columns]
    return [f"| metric family | {' | '.join(heads)} |", "|---|" + "---:|" * len(columns),
            *(f"| {family} | " + " | ".join(f"{table[c]:.0%}" if c in table else "" for c in columns) + " |"
              for family, table in coverage.items())]


def _held_out_pct(v: PublicValidation, family: str) -> float:
    return next(g.held_out_median_abs_pct for g in v.by_metric_family if g.group == family)


def _bands_carried(v: PublicValidation, fit: PublicFit) -> str:
    """Which bands results carry: these, or (a report re-predicted by a later simulator) the fit's,
    which stay until a refit, and how far their P10 and P90 lie from these."""
    carried = {axis: group_bands(v.group_bands, axis) for axis in BAND_AXES}
    fitted: dict[BandAxis, dict[str, dict[MetricFamily, Band]]] = {
        "architecture": dict(fit.model.architecture_bands.items()), "lengths": dict(fit.model.lengths_bands.items()),
        "regime": dict(fit.model.regime_bands.items())}
    if v.bands == fit.model.bands and v.engine_bands == fit.model.engine_bands and carried == fitted:
        return "Every `simulate`, `plan` and `compare` result carries these bands"
    pairs = [(b, fit.model.bands.get(name)) for name, b in v.bands.items()] + [
        (b, fit.model.engine_bands.get(engine, {}).get(name)) for engine, table in v.engine_bands.items()
        for name, b in table.items()] + [
        (b, fitted[axis].get(group, {}).get(name)) for axis, tables in carried.items()
        for group, table in tables.items() for name, b in table.items()]
    shift = max((abs(b.ratio_at(p) / carried.ratio_at(p) - 1) for b, carried in pairs if carried is not None
                 for p in (0.1, 0.9)), default=float("nan"))
    return (f"Measured again here with today's simulator; `simulate`, `plan` and `compare` results carry the "
            f"fit's bands of {fit.created_utc[:10]} until a refit (their P10 and P90 within {100 * shift:.1f} % of "
            "these)")


def set_aside_summary(skipped: Sequence[SkippedRun]) -> str:
    """'26 runs set aside', and the figures set aside from runs otherwise predicted."""
    whole = sum(s.whole_run for s in skipped)
    parts = [s for s in skipped if not s.whole_run]
    return f"{whole} runs set aside" + (f", and {sum(s.figures for s in parts)} figures of {len(parts)} more" if parts else "")


def _table(groups: Sequence[GroupError], extra: Callable[[GroupError], str] | None = None, extra_head: str = "") -> list[str]:
    head = ("| group | figures | held-out median abs error % | held-out median signed % | publisher held out, median "
            "abs % | in-sample median abs % |")
    rule = "|---|---:|---:|---:|---:|---:|"
    if extra:
        head, rule = head + f" {extra_head}", rule + "---:|---|"
    rows = [f"| {g.group} | {g.figures} | {g.held_out_median_abs_pct:.1f} | {g.held_out_median_signed_pct:+.1f} | "
            f"{g.held_out_publisher_median_abs_pct:.1f} | {g.in_sample_median_abs_pct:.1f} |" + (f" {extra(g)} |" if extra else "")
            for g in groups]
    return [head, rule, *rows]


def plot(v: PublicValidation, path: Path) -> Path:
    """Held-out predicted vs measured, log-log, one colour per metric family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    for ax, family in zip(axes, ("throughput", "ttft", "tpot_itl", "e2e"), strict=True):
        rows = [r for r in v.figure_errors if r.family == family]
        if rows:
            m, p = np.array([r.measured for r in rows]), np.array([r.held_out for r in rows])
            ax.loglog(m, p, ".", alpha=0.4, markersize=4)
            lo, hi = min(m.min(), p.min()), max(m.max(), p.max())
            ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
            ax.plot([lo, hi], [lo * 1.2, hi * 1.2], "k:", lw=0.6)
            ax.plot([lo, hi], [lo / 1.2, hi / 1.2], "k:", lw=0.6)
        ax.set_title(f"{family} ({len(rows)} figures)")
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted, source held out")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
