"""`serveplan calibrate --from-bench`: fit the GPU-family and engine figures to runs that
`serveplan bench --url` measured on a team's own deployment, and say how well the fit predicts a
run it never saw.

A bench run is the same kind of thing as a published run: a workload replayed with a client's
semantics, measured as TTFT/TPOT/E2E/throughput. So it goes through the public fit's machinery
(planner/public/fit.py): a `ReplayRun` per run, trace-and-fit rounds, folds that leave one run out.
What differs is that the requests are known exactly: each request's prompt and output lengths,
when it was due, which request's finish released it and after what pause (the file's
`RequestRecord`s), so the replay is those requests, not a workload drawn again.

Held-out error: leave-one-run-out. For each run, the figures are fitted again on the other runs
and that run is simulated at them; the median |error| over those predictions is the headline.

What a bench file does not hold is assumed and said: prompts are rebuilt with distinct token ids
(the file records lengths, not ids), so prefix sharing between conversations is not reproduced,
while a follow-up turn still extends its parent's prompt and output; an open-loop request arrives
at its `due_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import datetime as dt
from pathlib import Path
import random
import re
import statistics
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.config import ModelConfig
from engine.errors import InputError, from_validation_error
from engine.files import load_json
from hwprofiles import PROFILE_DIR
from planner.costmodel.fitted import FittedModel
from planner.endpoint_bench import BENCH_FILE_VERSION, BenchReport, BenchRun
from planner.engines import EngineProfile
from planner.metrics import RunSummary
from planner.playback import Replay
from planner.public.calibration import HeldOutFigure, bands
from planner.public.data import Figure, Metric, metric_family
from planner.public.fit import ENGINE_PARAMS, Progress, Space, fit_folds, fit_rounds, no_progress, simulate_runs
from planner.public.replay import ReplayRun
from planner.public.retime import summary_value
from planner.specs import Deployment, HardwareProfile
from planner.workload import WorkloadRequest

CALIBRATION_DIR = PROFILE_DIR / "calibrations"
# What a run is fitted on and judged by. Means and medians: a short run's P99 is one request.
FIT_METRICS: tuple[Metric, ...] = ("ttft_mean", "ttft_median", "tpot_mean", "tpot_median", "e2e_mean", "e2e_median",
                                   "request_throughput", "output_throughput")
_UNIT = {"request_throughput": "req/s", "output_throughput": "tokens/s"}
_PROMPT_SEED = 0  # the rebuilt prompts' token ids
# Trace-and-fit rounds at most (fit_rounds stops once the figures settle): bench runs are few and
# short, and open-loop ones need about ten rounds to walk to the fit.
BENCH_ROUNDS = 12
# The engine figures a bench fit moves: the public fit's, less the chat-template time (bench --url
# sends completions of token ids, so no run of it renders a chat template).
BENCH_ENGINE_PARAMS: tuple[str, ...] = tuple(p for p in ENGINE_PARAMS if p != "api_chat_template_s")


@dataclass(frozen=True)
class BenchMeasurement:
    """A bench run's measured figures, as the fit reads a published run's."""

    run_key: str  # "<file>#<run index>"
    figures: tuple[Figure, ...]
    confidence: Literal["high"] = "high"

    @property
    def source_key(self) -> str:
        """Each run is its own source: it weighs alike in the fit and is held out alone."""
        return self.run_key

    @property
    def publisher(self) -> str:
        """Each run is its own publisher too: one team measured them all, so a wider unit than the
        run would hold out every run at once."""
        return self.run_key


class _Rec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BenchFit(_Rec):
    """What `calibrate --from-bench` writes; `simulate --calibration FILE` reads its `model`."""

    format_version: int = 1
    created_utc: str
    command: str
    hardware: str
    engine: str
    model_name: str = Field(description="The model whose configuration the runs were replayed with")
    runs: list[str] = Field(description="The runs fitted on: file#index")
    hold_out: Literal["leave-one-run-out"] = "leave-one-run-out"
    rounds: int
    model: FittedModel
    figures: list[HeldOutFigure]
    held_out_median_abs_error_pct: float
    in_sample_median_abs_error_pct: float
    notes: list[str]


# --------------------------------------------------------------------------- reading bench files


def load_bench(path: str | Path) -> BenchReport:
    """A file `serveplan bench --url --json` wrote; anything else is one InputError naming the field."""
    data = load_json(path, "--from-bench")
    if not isinstance(data, dict) or "runs" not in data:
        raise InputError("--from-bench", str(path), "is not a bench file (`serveplan bench --url ... --json` writes one)")
    if data.get("version") != BENCH_FILE_VERSION:
        raise InputError(f"{path}: version", data.get("version"), f"this ServePlan reads bench files of version "
                         f"{BENCH_FILE_VERSION}")
    try:
        report = BenchReport.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, str(path)) from None
    if not report.runs:
        raise InputError(f"{path}: runs", "0 runs", "a bench file to fit on needs at least one run")
    return report


def bench_replay(run: BenchRun, vocab_size: int, where: str) -> Replay:
    """The run's requests as the simulator replays them: their lengths, due times and gates."""
    failed = [r for r in run.requests if r.error is not None or r.finish_s is None]
    if failed:
        raise InputError(f"{where}: requests", f"{len(failed)} of {len(run.requests)} failed (first: "
                         f"{failed[0].request_id}, HTTP {failed[0].http_status})",
                         "a run to fit on must have every request finished; measure it again below the failures")
    if not run.requests:
        raise InputError(f"{where}: requests", "0 requests", "a run to fit on needs at least one")
    rng = random.Random(_PROMPT_SEED)
    closed = run.client.concurrency is not None
    by_id = {r.request_id: r for r in run.requests}
    requests: list[WorkloadRequest] = []
    for r in sorted(run.requests, key=lambda r: r.due_s):  # a parent is due before its follow-ups
        if r.parent_id is None:
            requests.append(WorkloadRequest(r.request_id, None if closed else r.due_s, _ids(rng, r.prompt_tokens, vocab_size),
                                            r.output_tokens, think_time_s=r.think_s))
            continue
        parent = by_id.get(r.parent_id)
        new = r.prompt_tokens - (parent.prompt_tokens + parent.output_tokens) if parent else 0
        if new < 1:
            raise InputError(f"{where}: request {r.request_id}.parent_id", r.parent_id,
                             "must name an earlier request of the run whose prompt and output its prompt extends")
        requests.append(WorkloadRequest(r.request_id, None, (), r.output_tokens, parent_id=r.parent_id,
                                        new_prompt_token_ids=_ids(rng, new, vocab_size), think_time_s=r.think_s))
    return Replay(name=run.workload, requests=requests, concurrency=run.client.concurrency,
                  description=f"{where}: {len(requests)} requests of workload {run.workload!r} as measured "
                              f"({run.client.arrival}), prompts rebuilt with distinct token ids",
                  max_concurrency=run.client.max_concurrency)


def _ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, vocab_size) for _ in range(n))


def measured_figures(summary: RunSummary, run_key: str) -> tuple[Figure, ...]:
    slug = re.sub(r"[^a-z0-9.\-]+", "-", run_key.lower()).strip("-.") or "run"
    out = []
    for metric in FIT_METRICS:
        value = summary_value(summary, metric)
        if value > 0:  # a run of one-token outputs has no TPOT
            out.append(Figure(id=f"{slug}.{metric}", metric=metric, value=value, unit=_UNIT.get(metric, "ms")))
    return tuple(out)


def prepare_bench(paths: Sequence[str | Path], model: ModelConfig, hw: HardwareProfile, engine: EngineProfile,
                  dep: Deployment, max_model_len: int) -> list[ReplayRun]:
    """A ReplayRun per run of every file, served over HTTP as bench --url measured it."""
    dep = dep.model_copy(update={"hardware": hw.name, "engine": engine.name, "api_server": True})
    runs = []
    for path in paths:
        for index, run in enumerate(load_bench(path).runs):
            key = f"{Path(path).name}#{index}"
            replay = bench_replay(run, model.vocab_size, key)
            assert run.summary is not None  # bench_replay refused a run without finished requests
            runs.append(ReplayRun(BenchMeasurement(key, measured_figures(run.summary, key)), model, hw, engine, dep,
                                  replay, max_model_len, None, ()))
    if len(runs) < 2:
        raise InputError("--from-bench", f"{len(runs)} run", "needs at least 2 runs: each is predicted by a fit on the "
                         "others (give more files, or a --rate/--concurrency sweep)")
    return runs


def in_process_run(key: str, summary: RunSummary, replay: Replay, model: ModelConfig, hw: HardwareProfile,
                   engine: EngineProfile, dep: Deployment, max_model_len: int) -> ReplayRun:
    """A run of the same engine measured in process (`engine bench`, no API server), to fit beside
    served runs: with both, the fit can tell the engine's own time from what its HTTP server adds."""
    dep = dep.model_copy(update={"hardware": hw.name, "engine": engine.name, "api_server": False})
    return ReplayRun(BenchMeasurement(key, measured_figures(summary, key)), model, hw, engine, dep, replay,
                     max_model_len, None, ())


# --------------------------------------------------------------------------- the fit


def calibrate_from_bench(runs: Sequence[ReplayRun], *, command: str, model_name: str, rounds: int = BENCH_ROUNDS,
                         workers: int = 1, max_nfev: int = 400, progress: Progress = no_progress) -> BenchFit:
    space = Space.of(runs, fitted_engine_params(runs))
    done = fit_rounds(runs, space, rounds=rounds, workers=workers, max_nfev=max_nfev, progress=progress)
    figs, traced, refused = done.figures, done.traced, done.refused
    if refused:
        key, reason = next(iter(refused.items()))
        raise InputError(f"run {key}", "replayed on this deployment", f"the simulator refused it: {reason}")
    folds = fit_folds(traced, lambda t: t.run.run.run_key, figs, workers=workers, max_nfev=max_nfev,
                      progress=progress("fitting with each run left out", len(traced)), engine_params=space.engine_params)
    in_sample = simulate_runs(runs, figs, workers=workers, progress=progress("predicting in sample", len(runs)))
    held = simulate_runs(runs, lambda r: folds[r.run.run_key], workers=workers,
                         progress=progress("predicting each run held out", len(runs)))
    results = [HeldOutFigure(id=f.id, run_key=r.run.run_key, source_key=r.run.run_key, metric=f.metric,
                           family=metric_family(f.metric), measured=f.value, in_sample=inside[f.id], held_out=out[f.id])  # type: ignore[index]
               for r, inside, out in zip(runs, in_sample, held, strict=True) for f in r.figures]
    hw, engine = runs[0].hw, runs[0].engine
    model = FittedModel(families=figs.families, engines=figs.engines, bands=bands(results),
                        held_out="figures of bench runs, each predicted by a fit that left its run out",
                        source=f"{command} on {dt.date.today().isoformat()}: {len(runs)} bench runs on {hw.name} "
                               f"with {engine.name}")
    return BenchFit(
        created_utc=dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(), command=command,
        hardware=hw.name, engine=engine.name, model_name=model_name, runs=[r.run.run_key for r in runs], rounds=rounds,
        model=model, figures=results,
        held_out_median_abs_error_pct=median_abs_error_pct(results, "held_out"),
        in_sample_median_abs_error_pct=median_abs_error_pct(results, "in_sample"),
        notes=[
            f"fitted on {', '.join(FIT_METRICS)} of each run (the client's RunSummary); residuals log(predicted / "
            "measured), each run weighted alike; a weak prior at the profiles' estimates",
            "held_out: leave-one-run-out, each run predicted by the figures fitted on the other runs",
            "replay: each request's measured prompt and output lengths, due time, releasing request and pause; "
            "prompts rebuilt with distinct token ids (prefix sharing between conversations not reproduced); "
            + ("served runs over HTTP (the engine's API figures priced), in-process runs without an API server"
               if "api_step_s" in space.engine_params else "served over HTTP (the engine profile's API figures priced)"),
            f"the figures apply to GPU family {hw.family!r} and engine profile {engine.name!r} wherever "
            "`simulate --calibration` is given this file",
        ],
    )


def fitted_engine_params(runs: Sequence[ReplayRun]) -> tuple[str, ...]:
    """The engine figures the runs can tell apart. A server in the engine's process (ServePlan's)
    also takes a share of its request time from the step loop (`api_hold_share`); and where the
    same engine was measured both served and in process, its per-step and per-token streaming cost
    (`api_step_s`, `api_token_s`) is what separates the two, so it is fitted too. Served runs
    alone cannot separate it from the engine's own step time."""
    if not any(r.engine.overheads.api_hold_share for r in runs):
        return BENCH_ENGINE_PARAMS
    if len({r.dep.api_server for r in runs}) == 2:
        return BENCH_ENGINE_PARAMS + ("api_hold_share", "api_step_s", "api_token_s")
    return BENCH_ENGINE_PARAMS + ("api_hold_share",)


def median_abs_error_pct(results: Sequence[HeldOutFigure], which: Literal["held_out", "in_sample"]) -> float:
    return statistics.median(abs(getattr(r, which) / r.measured - 1) * 100 for r in results)


def default_path(hw: HardwareProfile, engine: EngineProfile) -> Path:
    return CALIBRATION_DIR / f"from-bench__{hw.name}__{engine.name}.json"


def write_bench_fit(fit: BenchFit, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(fit.model_dump_json(indent=1) + "\n")
    return path


__all__ = ["BenchFit", "calibrate_from_bench", "in_process_run", "load_bench", "prepare_bench", "write_bench_fit"]
