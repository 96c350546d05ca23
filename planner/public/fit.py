"""Fit the cost model's GPU-family and engine figures to published runs, and check the fit on
sources it never saw.

Parameters belong to a GPU family (how close its kernels get to the datasheet: GEMM, weight
streaming and KV-read efficiencies, prefill-attention efficiency, collectives' time against
nccl-tests) or to an engine profile (host time per step and per scheduled request,
API-server time per request, its fused-MoE kernel's share of the dense roofline); never to a run
or a source. Each is fitted in a transformed space (logit for shares, log for times and scales)
within PLAUSIBLE, with a weak Gaussian prior around the profile's estimate, so a family or engine
with no data keeps its estimate.

The objective is the simulator itself, made fast: every run is simulated once to trace its
schedule (planner/sim/trace.py), the least-squares fit moves the parameters re-timing those traces
(planner/public/retime.py), and the runs are simulated again at the new parameters to refresh the
schedules; a few rounds converge. Residuals are log(predicted / measured), so 10 % too slow and
10 % too fast weigh alike; each source weighs alike whatever its number of figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
import math
import multiprocessing as mp
from typing import Any, TypeVar

import numpy as np
from scipy.optimize import least_squares

from engine.errors import InputError
from planner.costmodel import CostModel, CostParams
from planner.engines import get_engine
from planner.hardware import hardware_catalog
from planner.public.replay import ReplayRun, predicted
from planner.public.retime import figures, retime
from planner.sim.trace import RunTrace

# The figures a fit moves (planner/costmodel/params.py says what each one means).
# Communication is fitted as collective_time_scale, which scales every collective however it is priced
# (the GPU links' measured all-reduce curves do not read interconnect_efficiency). The small-GEMM
# falloff (gemm_half_size_tokens) is not fitted: each GPU profile takes it from kernel measurements
# (0 where none were found), and a log-space fit cannot move a figure away from 0. Nor is a
# kernel's fixed time (kernel_latency_s, the
# profile's graph_kernel_us, from kernel-level measurements): in a step it is a constant per model,
# which trades against an engine's host time per step, and a fit started at the old 0.5 us stayed
# near it (0.41 us on Hopper, cost 0.611 on the 2026-12-05 traces) where holding 3 us costs less (0.603).
HARDWARE_PARAMS: tuple[str, ...] = (
    "compute_efficiency", "memory_efficiency", "attention_memory_efficiency", "attention_compute_efficiency",
    "triton_attention_efficiency", "collective_time_scale", "grouped_gemm_efficiency", "scaled_gemm_efficiency",
    "scaled_gemm_memory_efficiency",
)
ENGINE_PARAMS: tuple[str, ...] = ("step_overhead_s", "per_request_overhead_s", "api_request_s", "api_chat_template_s",
                                  "api_latency_s", "moe_kernel_efficiency", "fp4_moe_kernel_efficiency",
                                  "dense_kernel_efficiency")
_SHARES = frozenset({"compute_efficiency", "memory_efficiency", "attention_memory_efficiency",
                     "attention_compute_efficiency"})
# What a GPU family or an engine can physically be: a fit stays inside these, so that a term the
# cost model lacks shows up as residuals instead of as a family's figure bent to absorb it (an
# unbounded fit drove Hopper's GEMM efficiency to 0.25 to slow prefill for runs whose TTFT it
# under-predicts, and so predicted every prefill-heavy run on H100 and H200 far too slow).
PLAUSIBLE: dict[str, tuple[float, float]] = {
    # Dense bf16/fp8 GEMMs in serving engines reach 50-80 % of the datasheet peak (cuBLAS, CUTLASS).
    "compute_efficiency": (0.4, 0.9),
    # Streaming reads reach 80-93 % of the datasheet bandwidth on A100/H100/MI300X.
    "memory_efficiency": (0.6, 0.95),
    # Paged decode attention: 40-90 % of the bandwidth, by kernel and context length.
    "attention_memory_efficiency": (0.3, 0.95),
    # FlashAttention-2/3 prefill: 35-75 % of the tensor-core peak.
    "attention_compute_efficiency": (0.2, 0.85),
    # Engines' collectives within 3x either way of nccl-tests' curves.
    "collective_time_scale": (1 / 3, 3.0),
    # Host time per step: tens of microseconds (C++ schedulers) to tens of milliseconds.
    "step_overhead_s": (2e-5, 2e-2),
    "per_request_overhead_s": (1e-7, 1e-4),
    # The API server's work per request (HTTP, chat template, tokeniser): 0.1-20 ms.
    "api_request_s": (1e-4, 2e-2),
    # Rendering a chat request's messages with a Jinja template in the server's Python: 0.1-50 ms.
    "api_chat_template_s": (1e-4, 5e-2),
    # A request's latency between client and engine that it spends beside others: 0.1-100 ms.
    "api_latency_s": (1e-4, 0.1),
    # A fused-MoE kernel at best matches dense GEMMs; tuned Triton/CUTLASS/Marlin kernels stay within
    # 5x of them even at a few rows per expert. Fitted in log space: the estimate, 1, is the edge.
    "moe_kernel_efficiency": (0.2, 1.0),
    "fp4_moe_kernel_efficiency": (0.2, 1.0),
    # An engine's dense matmuls against the family's shares (which its fastest engine sets): within
    # 2x. Log space, the estimate 1 the edge, as for the MoE share.
    "dense_kernel_efficiency": (0.5, 1.0),
    # Triton attention kernels against the FlashAttention-2/3 kernels of the same family: from par to
    # several times slower (vLLM's unified Triton kernel took 2.5x FlashAttention's time for an 8k-token
    # prefill on an A100 before its causal tile skipping, issue 18152). Log space, like the kernel shares.
    "triton_attention_efficiency": (0.15, 1.0),
    # The family's share for grouped GEMMs whatever the engine (Triton's fused-MoE kernels do not run
    # Hopper's wgmma/TMA pipelines as cuBLAS's dense GEMMs do): an estimate of the floor, in log space
    # for the same reason.
    "grouped_gemm_efficiency": (0.3, 1.0),
    # Scaled fp8/fp4 matmuls against their format's datasheet rates (activation quantisation, scales,
    # block-scaled kernels); at 0.5 an fp8 GEMM runs at bf16's rate. Log space, the estimate 1 the edge.
    # Math may fall below bf16's (published fp8 prefill: 1.22x bf16's TTFT); weight reads may not: fp8
    # decode published at 0.78-0.80x bf16's TPOT. A refit allowed 0.3 for reads took Hopper's to 0.46,
    # fp8 decode slower than bf16's, bending the figure to absorb what fp8 runs miss elsewhere.
    "scaled_gemm_efficiency": (0.3, 1.0),
    "scaled_gemm_memory_efficiency": (0.5, 1.0),
    # An in-process API server's work on a request that holds the engine's GIL (fitted only where the
    # engine profile says the server shares the engine's process: `calibrate --from-bench`). In log
    # space like the MoE share, so that the whole of it, 1, can be reached.
    "api_hold_share": (0.02, 1.0),
    # The same server's streaming work on the step loop (fitted only from runs of one engine both
    # served and in process): the hand-off of a step's outputs to the event loop, 1 us-5 ms; and
    # each token's SSE event, 0.1 us-2 ms.
    "api_step_s": (1e-6, 5e-3),
    "api_token_s": (1e-7, 2e-3),
}
# Prior: the profile's estimate, one unit wide in the transformed space (a factor e on times, about
# 0.2 on a share near 0.5): decisive where data says nothing, weak against data. Each source's
# residuals weigh ~1 in total, so one source that is 10 % off (0.01) outweighs the prior's cost of
# moving a figure half a unit (0.02 x 0.25).
PRIOR_WIDTH = 1.0
PRIOR_WEIGHT = 0.02
# Published runs carry setups nobody wrote down (a kernel path that falls back, a throttled host):
# SGLang's gpt-oss-20b on an A100 runs 10x slower than on an H100, against 1.2-1.9x for every other
# run of that page. Squared errors let such a run pull a figure every other run of its engine or
# family shares. So a figure's log error e costs e^2 up to about this scale and grows only linearly
# beyond it (soft L1: 2 s^2 (sqrt(1 + (e/s)^2) - 1)): a figure 10 % off counts as its square, one
# 28 % off as 0.83 of it, one 3x off as 0.36, one 10x off as a fifth. Applied to each figure's own
# error before its weight, unlike least_squares' `loss`, which would scale it by the weights (a
# source's many figures each weigh little).
ROBUST_SCALE = 0.25
# Where a fit starts, each figure at least this share of its PLAUSIBLE range inside it. Several
# figures are estimated at an edge (an engine's kernel shares at 1), and the trust-region fit
# started on the edge of one that the data would move inwards stopped at its start: on the last
# round's traces, vLLM's dense-kernel share stayed at 1 (cost 0.768) where moving it alone to 0.8
# costs 0.733.
START_MARGIN = 0.05
# A round that moves no figure by more than this in the fit's space (1 % on a time, ~0.25 % on a
# share near one half) has settled: the next trace would be the same schedule.
SETTLED_X = 0.01
# A least-squares fit stops when a step lowers its cost by less than this share. scipy's default
# (1e-8) goes on creeping long after the figures stop mattering: held-out folds of the public data
# ran up to 18 minutes each, so the 27 folds outlasted a working session. On the last round's traces,
# from the last fit's figures: 12 Jacobians, 202 s, cost 0.7283 (an x tolerance of 1e-4 as well
# stopped a fit on a trust region shrunk by failed steps, so it stays at scipy's default).
FIT_TOLERANCE = 1e-4
_TIME_FLOOR = 1e-7  # a time prior of 0 becomes this in log space
_CONFIDENCE_WEIGHT = {"high": 1.0, "medium": 0.7, "low": 0.4}

# progress(what, total) starts a stage of `total` items (None: unknown) and returns its advance().
Progress = Callable[[str, int | None], Callable[[], None]]


def no_progress(_what: str, _total: int | None) -> Callable[[], None]:
    return lambda: None


@dataclass(frozen=True)
class Figures:
    """What a fit knows of a GPU family and an engine: named figures replacing the profiles' estimates."""

    families: dict[str, dict[str, float]] = field(default_factory=dict)
    engines: dict[str, dict[str, float]] = field(default_factory=dict)

    def params(self, run: ReplayRun) -> CostParams:
        base = CostParams.defaults(run.hw, run.engine)
        values = {**self.families.get(run.hw.family, {}), **self.engines.get(run.engine.name, {})}
        return base.with_values(values) if values else base


@dataclass(frozen=True)
class Space:
    """The free parameters: each family's `family_params`, each engine's `engine_params`; every other
    figure is `held` (a staged fit: `calibrate --public --only`), else the profiles' estimate."""

    families: tuple[str, ...]
    engines: tuple[str, ...]
    engine_params: tuple[str, ...] = ENGINE_PARAMS
    family_params: tuple[str, ...] = HARDWARE_PARAMS
    held: Figures = field(default_factory=Figures)

    @classmethod
    def of(cls, runs: Iterable[ReplayRun], engine_params: tuple[str, ...] = ENGINE_PARAMS,
           family_params: tuple[str, ...] = HARDWARE_PARAMS, held: Figures | None = None,
           owners: frozenset[str] | None = None) -> Space:
        """The families and engines of `runs` (only those named in `owners`, where given: a staged fit
        of some families' or engines' figures, the others' held)."""
        runs = list(runs)
        families, engines = {r.hw.family for r in runs}, {r.engine.name for r in runs}
        if owners is not None:
            families, engines = families & owners, engines & owners
        return cls(tuple(sorted(families)), tuple(sorted(engines)), engine_params, family_params, held or Figures())

    @property
    def names(self) -> list[tuple[str, str, str]]:
        """(scope, owner, parameter) per coordinate."""
        return ([("family", f, p) for f in self.families for p in self.family_params]
                + [("engine", e, p) for e in self.engines for p in self.engine_params])

    def prior(self) -> np.ndarray:
        """The profiles' estimates, moved inside PLAUSIBLE where one lies outside."""
        low, high = self.bounds()
        return np.clip([_to_x(p, _estimate(scope, owner, p)) for scope, owner, p in self.names], low, high)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """PLAUSIBLE in the transformed space, per coordinate."""
        if not self.names:
            return np.empty(0), np.empty(0)
        low, high = zip(*(PLAUSIBLE[p] for _scope, _owner, p in self.names), strict=True)
        return (np.array([_to_x(p, v) for (_s, _o, p), v in zip(self.names, low, strict=True)]),
                np.array([_to_x(p, v) for (_s, _o, p), v in zip(self.names, high, strict=True)]))

    def figures(self, x: np.ndarray) -> Figures:
        """The held figures with the coordinates' values of x."""
        families = {f: dict(self.held.families.get(f, {})) for f in sorted({*self.held.families, *self.families})}
        engines = {e: dict(self.held.engines.get(e, {})) for e in sorted({*self.held.engines, *self.engines})}
        for (scope, owner, p), value in zip(self.names, x, strict=True):
            (families if scope == "family" else engines)[owner][p] = _from_x(p, float(value))
        return Figures(families, engines)

    def key(self, run: ReplayRun, x: np.ndarray) -> tuple[float, ...]:
        """The coordinates of x that `run` depends on: its GPU family's and its engine's."""
        return tuple(float(v) for (scope, owner, _p), v in zip(self.names, x, strict=True)
                     if owner == (run.hw.family if scope == "family" else run.engine.name))

    def x_of(self, figures: Figures) -> np.ndarray:
        prior = self.prior()
        out = prior.copy()
        for i, (scope, owner, p) in enumerate(self.names):
            table = figures.families if scope == "family" else figures.engines
            if p in table.get(owner, {}):
                out[i] = _to_x(p, table[owner][p])
        return out


def _to_x(name: str, value: float) -> float:
    if name in _SHARES:
        v = min(max(value, 1e-4), 1 - 1e-4)
        return math.log(v / (1 - v))
    return math.log(max(value, _TIME_FLOOR))


def _from_x(name: str, x: float) -> float:
    return 1 / (1 + math.exp(-x)) if name in _SHARES else math.exp(x)


def _estimate(scope: str, owner: str, name: str) -> float:
    """The profile's own figure: an engine's overheads, or the mean over a family's hardware profiles."""
    if scope == "engine":
        return float(getattr(CostParams.defaults(next(iter(hardware_catalog().values())), get_engine(owner)), name))
    members = [hw for hw in hardware_catalog().values() if hw.family == owner]
    return float(np.mean([getattr(CostParams.defaults(hw), name) for hw in members]))


# --------------------------------------------------------------------------- traced runs


@dataclass(frozen=True)
class Traced:
    """A run simulated at some parameters: its schedule, and the simulator's own figures."""

    run: ReplayRun
    trace: RunTrace
    simulated: dict[str, float]  # figure id -> value


def trace_run(run: ReplayRun, figs: Figures) -> Traced:
    result = run.simulate(figs.params(run), trace=True)
    assert result.trace is not None
    return Traced(run, result.trace, predicted(run, result.summary))


def simulate_runs(runs: Sequence[ReplayRun], figs: Figures | Callable[[ReplayRun], Figures], *, workers: int = 1,
                  trace: bool = False, catch: bool = False,
                  progress: Callable[[], None] = lambda: None) -> list[Traced | dict[str, float] | str]:
    """Simulate every run (in `workers` processes): Traced when `trace`, else figure id -> value;
    with `catch`, a run the simulator refuses gives its one-line reason instead of raising."""
    pick = figs if callable(figs) else (lambda _run: figs)
    tasks = [(run, pick(run), trace, catch) for run in runs]
    out: list[Traced | dict[str, float] | str] = []
    if workers <= 1:
        for task in tasks:
            out.append(_simulate_one(task))
            progress()
        return out
    with ProcessPoolExecutor(workers) as pool:
        for result in pool.map(_simulate_one, tasks, chunksize=1):
            out.append(result)
            progress()
    return out


def _simulate_one(task: tuple[ReplayRun, Figures, bool, bool]) -> Traced | dict[str, float] | str:
    run, figs, trace, catch = task
    try:
        if trace:
            return trace_run(run, figs)
        return predicted(run, run.simulate(figs.params(run)).summary)
    except InputError as exc:  # a run beyond what the simulator holds (a cache too small, a sequence too long)
        if not catch:
            raise
        return str(exc)


def surrogate(traced: Traced, figs: Figures) -> dict[str, float]:
    """figure id -> value, re-timing the traced schedule at `figs` instead of simulating again."""
    run = traced.run
    cost_model = CostModel(run.model, run.hw, run.dep, run.params(figs.params(run)))
    step_s = sum(cost_model.times(traced.trace.shapes)[0])
    timeline = retime(traced.trace, np.asarray(step_s, dtype=float), cost_model.front_end_s, cost_model.api_hold_s,
                      cost_model.params.api_latency_s)
    values = figures(traced.trace, timeline, [f.metric for f in run.figures])
    return {f.id: values[f.metric] for f in run.figures}


# --------------------------------------------------------------------------- the fit


def weights(runs: Sequence[ReplayRun]) -> dict[str, float]:
    """figure id -> residual weight: each source weighs alike, confident figures more."""
    per_source: dict[str, int] = {}
    for run in runs:
        per_source[run.run.source_key] = per_source.get(run.run.source_key, 0) + len(run.figures)
    return {f.id: _CONFIDENCE_WEIGHT[run.run.confidence] / math.sqrt(per_source[run.run.source_key])
            for run in runs for f in run.figures}


@dataclass(frozen=True)
class Fitted:
    """Where a least-squares fit stopped: the figures, and its cost there (half the sum of squared
    weighted log errors and prior terms), which ranks fits of the same traces from different starts."""

    figures: Figures
    cost: float


def fit(traced: Sequence[Traced], space: Space, start: Figures | None = None, *, max_nfev: int = 400,
        prior_weight: float = PRIOR_WEIGHT, robust_scale: float = ROBUST_SCALE,
        progress: Callable[[], None] = lambda: None) -> Fitted:
    """Least squares of weighted, soft-L1 log errors over re-timed traces, plus the prior, from
    `start` (the profiles' estimates by default); robust_scale=inf is plain least squares."""
    w = weights([t.run for t in traced])
    measured = {f.id: f.value for t in traced for f in t.run.figures}
    prior, x0 = space.prior(), space.x_of(start) if start is not None else space.prior()
    ids = list(measured)
    log_measured = np.log([measured[i] for i in ids])
    weight = np.array([w[i] for i in ids])
    prior_scale = math.sqrt(prior_weight) / PRIOR_WIDTH

    # A finite-difference column moves one family's or engine's figure: only that owner's runs are
    # re-timed, the others keep the values of their unchanged figures.
    last: dict[int, tuple[tuple[float, ...], dict[str, float]]] = {}

    def residuals(x: np.ndarray) -> np.ndarray:
        figs = space.figures(x)
        values: dict[str, float] = {}
        for k, t in enumerate(traced):
            key = space.key(t.run, x)
            if k not in last or last[k][0] != key:
                last[k] = (key, surrogate(t, figs))
            values.update(last[k][1])
        pred = np.log(np.maximum([values[i] for i in ids], 1e-12))
        progress()
        return np.concatenate([weight * soft_l1(pred - log_measured, robust_scale), prior_scale * (x - prior)])

    low, high = space.bounds()
    margin = START_MARGIN * (high - low)
    result = least_squares(residuals, np.clip(x0, low + margin, high - margin), method="trf", bounds=(low, high),
                           x_scale=1.0, diff_step=1e-3, ftol=FIT_TOLERANCE, max_nfev=max_nfev)
    return Fitted(space.figures(result.x), float(result.cost))


def soft_l1(error: np.ndarray, scale: float = ROBUST_SCALE) -> np.ndarray:
    """The residual whose square is the soft-L1 cost of `error`, with its sign: `error` where it is
    small against `scale`, growing as sqrt(2 scale |error|) where it is large; `error` itself at an
    infinite scale. (2 s^2 (sqrt(1 + x^2) - 1) written as 2 s^2 x^2 / (sqrt(1 + x^2) + 1), exact
    for small x.)"""
    return error * np.sqrt(2.0 / (1.0 + np.sqrt(1.0 + (error / scale) ** 2)))


def fit_from(traced: Sequence[Traced], space: Space, starts: Mapping[str, Figures], *, workers: int = 1,
             max_nfev: int = 400, progress: Callable[[], None] = lambda: None) -> dict[str, Fitted]:
    """The fit from each named start (in up to `workers` processes; one start runs in this one), by
    start. Where a fit stops can depend on where it starts (a figure of one engine's API work trades
    against a family's GEMM share over the same runs): callers keep the lowest cost."""
    shared = (traced, space, starts, max_nfev)
    _index_traces(traced)
    fitted = dict(_forked(_fit_start, list(starts), shared, min(workers, len(starts)), progress))
    return {name: fitted[name] for name in starts}


def _fit_start(name: str) -> Fitted:
    traced, space, starts, max_nfev = _SHARED  # set by fit_from
    return fit(traced, space, starts[name], max_nfev=max_nfev)


def fit_folds(traced: Sequence[Traced], group: Callable[[Traced], str], start: Figures, *, workers: int = 1,
              max_nfev: int = 400, progress: Callable[[], None] = lambda: None,
              done: Mapping[str, Figures] | None = None,
              on_fold: Callable[[str, Figures], None] | None = None,
              engine_params: tuple[str, ...] = ENGINE_PARAMS, family_params: tuple[str, ...] = HARDWARE_PARAMS,
              held: Mapping[str, Figures] | None = None, owners: frozenset[str] | None = None) -> dict[str, Figures]:
    """For each group (a source, a publisher), the figures fitted on every other group's traces,
    from `start`, over the same `engine_params` and `family_params` (of the same `owners`) as
    `start`'s fit, every other figure at the group's own `held` ones (a staged fit) else the
    profiles' estimates. A family or
    engine only the left-out group has keeps the profiles' estimates: never figures fitted on the
    group itself. Groups in `done` (a checkpoint) are not fitted again; `on_fold` hears of each fold
    as it completes."""
    names = sorted({group(t) for t in traced})
    folds = {name: figs for name, figs in (done or {}).items() if name in names}
    todo = [name for name in names if name not in folds]
    _index_traces(traced)
    shared = (traced, group, start, max_nfev, engine_params, family_params, held or {}, owners)
    for name, figs in _forked(_fit_fold, todo, shared, workers, progress):
        folds[name] = figs
        if on_fold is not None:
            on_fold(name, figs)
    return {name: folds[name] for name in names}


def _fit_fold(left_out: str) -> Figures:
    traced, group, start, max_nfev, engine_params, family_params, held, owners = _SHARED  # set by fit_folds
    keep = [t for t in traced if group(t) != left_out]
    space = Space.of((t.run for t in keep), engine_params, family_params, held.get(left_out), owners)
    return fit(keep, space, _restrict(start, space), max_nfev=max_nfev).figures if keep else held.get(left_out, Figures())


def _index_traces(traced: Sequence[Traced]) -> None:
    """Builds each trace's indexes (ITL step pairs, replicas' steps, first and last deliveries)
    here, once, rather than in every forked worker that re-times it (~40 s a worker otherwise)."""
    for t in traced:  # reading a cached property builds it
        _ = (t.trace.delivery_gaps, t.trace.replica_steps, t.trace.first_delivery, t.trace.last_delivery,
             t.trace.gate_depth)


# What the forked workers of fit_from and fit_folds read: the traces and what to fit on them.
_SHARED: Any = None
_R = TypeVar("_R")


def _forked(task: Callable[[str], _R], names: Sequence[str], shared: object, workers: int,
            progress: Callable[[], None]) -> Iterator[tuple[str, _R]]:
    """(name, task(name)) for each name as it completes, in `workers` forked processes that inherit
    `shared`: the traces are never pickled."""
    global _SHARED
    _SHARED = shared
    try:
        if workers <= 1:
            for name in names:
                yield name, task(name)
                progress()
            return
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
            futures = {pool.submit(task, name): name for name in names}
            for future in as_completed(futures):
                yield futures[future], future.result()
                progress()
    finally:
        _SHARED = None


def _restrict(figs: Figures, space: Space) -> Figures:
    return Figures({f: figs.families.get(f, {}) for f in space.families}, {e: figs.engines.get(e, {}) for e in space.engines})


@dataclass(frozen=True)
class Rounds:
    """What fit_rounds found: the figures, the last round's traces, the runs the simulator refused
    in the first round (by run key, why), and the first round's cost from each start, by start."""

    figures: Figures
    traced: list[Traced]
    refused: dict[str, str]
    start_costs: dict[str, float]


def fit_rounds(runs: Sequence[ReplayRun], space: Space, *, starts: Mapping[str, Figures] | None = None, rounds: int = 3,
               workers: int = 1, max_nfev: int = 400, progress: Progress = no_progress) -> Rounds:
    """Trace every run at the first start, fit on the traces from every start and keep the lowest
    cost; trace at those figures and fit from them again, up to `rounds` times, and sooner once a
    round moves no figure by more than SETTLED_X. `starts` defaults to the profiles' estimates alone.
    The runs the simulator refuses in the first round (a cache too small, a sequence too long) are
    properties of the deployment, not of the figures: later rounds leave them out.

    Each round is needed because a re-timed trace keeps its schedule: an open-loop request stays in
    the step that admitted it, so slower steps re-timed make it wait for that step and the fit sees
    a far worse run than a simulation would give. A round can therefore only move the figures a
    little from where the runs were traced, and several rounds walk to the fit (bench runs at
    Poisson rates needed about ten: docs/serving.md)."""
    starts = dict(starts or {"the profiles' estimates": space.figures(space.prior())})
    figs = next(iter(starts.values()))
    traced: list[Traced] = []
    refused: dict[str, str] = {}
    start_costs: dict[str, float] = {}
    for i in range(rounds):
        todo = [r for r in runs if r.run.run_key not in refused]
        outcomes = simulate_runs(todo, figs, workers=workers, trace=True, catch=True,
                                 progress=progress(f"round {i + 1}/{rounds}: simulating runs", len(todo)))
        traced = [o for o in outcomes if isinstance(o, Traced)]
        round_starts = starts if i == 0 else {"the previous round": figs}
        fitted = fit_from(traced, space, round_starts, workers=workers, max_nfev=max_nfev,
                          progress=progress(f"round {i + 1}/{rounds}: fitting {len(space.names)} figures "
                                            f"from {len(round_starts)} start(s)", len(round_starts)))
        if i == 0:
            refused = {r.run.run_key: o for r, o in zip(todo, outcomes, strict=True) if isinstance(o, str)}
            start_costs = {name: f.cost for name, f in fitted.items()}
        best = min(fitted.values(), key=lambda f: f.cost).figures
        moved = float(np.max(np.abs(space.x_of(best) - space.x_of(figs)), initial=0.0))
        figs = best
        if moved < SETTLED_X:
            break
    return Rounds(figs, traced, refused, start_costs)
