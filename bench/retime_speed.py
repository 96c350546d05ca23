"""How fast the public fit re-times a traced run: the figures of a re-timing, per step pair against
every gap materialised, in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/retime_speed.py [--runs 8] [--repeats 20]

The public fit (planner/public/fit.py) prices every run's traced schedule at each new set of
parameters and reads its published figures off the re-timed steps (planner/public/retime.py): a
calibration evaluates that hundreds of times per run and fold. The ITL figures are percentiles over
every inter-token gap; the re-timing prices each distinct pair of steps once and counts how many
gaps lie between them (RunTrace.delivery_gaps), the peer materialises every gap and calls numpy.
Both must give the same figures; the bench stops if they do not. Runs: the `--runs` published runs
with the most deliveries that the simulator replays, traced with the public fit's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from engine.errors import InputError
from planner.costmodel import CostModel
from planner.public import retime as rt
from planner.public.calibration import prepare_all
from planner.public.data import PublicRun, public_runs
from planner.public.fit import Figures, Traced, trace_run
from planner.public.replay import ReplayRun
from planner.public.report import load_fit
from planner.sim.trace import DeliveryGaps, RunTrace


def _materialised(trace: RunTrace, timeline: rt.Timeline, metrics: list[rt.Metric]) -> dict[rt.Metric, float]:
    """figures() with every ITL gap an element of the array numpy takes percentiles of."""
    gaps, expanded = trace.delivery_gaps, dataclasses.replace(trace)
    vars(expanded)["delivery_gaps"] = DeliveryGaps(np.repeat(gaps.earlier, gaps.count), np.repeat(gaps.later, gaps.count),
                                                   np.ones(int(gaps.count.sum()), dtype=gaps.count.dtype))
    return rt.figures(expanded, timeline, metrics)


def _num_prompts(prepared: ReplayRun) -> int:
    """The run's requests as its client sent them (prepare_all prepares published runs only)."""
    run = prepared.run
    assert isinstance(run, PublicRun)
    return run.client.num_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    fit = load_fit()
    figs = Figures(fit.model.families, fit.model.engines)
    prepared, _ = prepare_all(public_runs())
    traced: list[Traced] = []
    for run in sorted(prepared, key=_num_prompts, reverse=True):
        try:
            traced.append(trace_run(run, figs))
        except InputError:  # a run the simulator refuses
            continue
        if len(traced) == args.runs:
            break
    timelines = []
    for t in traced:
        cost_model = CostModel(t.run.model, t.run.hw, t.run.dep, t.run.params(figs.params(t.run)))
        timelines.append(rt.retime(t.trace, np.asarray(sum(cost_model.times(t.trace.shapes)[0]), dtype=float),
                                   cost_model.front_end_s, cost_model.api_hold_s, cost_model.params.api_latency_s))
    for t in traced:  # the schedule's facts are read once per trace, at its first re-timing: not timed
        t.trace.delivery_gaps, t.trace.first_delivery, t.trace.last_delivery  # noqa: B018
    seconds, results = {}, {}
    for name, fn in (("per step pair", rt.figures), ("materialised", _materialised)):
        start = time.perf_counter()
        for _ in range(args.repeats):
            results[name] = [fn(t.trace, tl, [f.metric for f in t.run.figures]) for t, tl in zip(traced, timelines, strict=True)]
        seconds[name] = (time.perf_counter() - start) / args.repeats
    for fast, slow in zip(results["per step pair"], results["materialised"], strict=True):
        for metric, value in fast.items():
            if abs(value - slow[metric]) > 1e-9 * abs(slow[metric]):
                raise SystemExit(f"figures differ: {metric} {value} vs {slow[metric]}")
    gaps = sum(int(t.trace.delivery_gaps.count.sum()) for t in traced)
    pairs = sum(len(t.trace.delivery_gaps.count) for t in traced)
    print(f"{len(traced)} runs, {gaps:,} inter-token gaps over {pairs:,} step pairs")
    for name, s in seconds.items():
        print(f"  {name:14} {s * 1e3:8.1f} ms per pass over the runs")
    print(f"  per step pair is x{seconds['materialised'] / seconds['per step pair']:.1f} faster; same figures")


if __name__ == "__main__":
    main()
