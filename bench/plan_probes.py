"""What `plan`'s savings on capacity probes buy: the same question planned with a saving and without
it (its peer), in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_probes.py [--saving stopped-probes] [--hw mi300x] [--repeats 2]

Savings: `stopped-probes`, probes that stop once they have missed the SLO for certain (peer: every
probe run to its end; both answers and reports must be identical); `ttft-bound`, candidates bounded
by their prefill queue as well as the roofline (peer: the roofline alone; the recommendation and
every hardware's best plan must cost the same on as many GPUs; among plans of equal cost the search
keeps the first it finds, which the bound's order can change, and the report differs in why pruned
candidates lost); `bulk-runs`, the simulator's runs of bulk decodes priced at once (planner/sim/
replica.py; peer: every step priced alone; answers and reports identical); `answer-only`, no
hardware sized that cannot beat the cheapest answer on any (`plan(..., every_hardware=False)`; peer:
every hardware's own cheapest deployment; the recommendation must be the same deployment at the
same cost). The bench stops if they differ. The question is the README's (Llama-3.1-70B, chat, 20 req/s, P99
TTFT <= 1 s), on the hardware given, serially and without the plan cache, so that every simulation
runs in this process and its CPU time is counted. Reported: CPU seconds of each (the lower of the
repeats), their ratio, and the simulations each ran with how many of their requests finished.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import time
from typing import Literal, ParamSpec, TypedDict

from planner.search import PlanResult, cache, plan
from planner.sim import SimulationResult, replica, simulate

P = ParamSpec("P")


class Question(TypedDict):
    model: str
    workload: str
    rate_per_s: float
    slo: str


QUESTION = Question(model="llama-3.1-70b", workload="chat", rate_per_s=20.0, slo="ttft_p99_ms<=1000")


class SavingOptions(TypedDict, total=False):
    """The plan options a saving switches."""

    stop_missed_probes: bool
    ttft_queue_bound: bool
    every_hardware: bool


# One of SavingOptions, or bulk_runs: not a plan option (timed_plan sets it).
Flag = Literal["stop_missed_probes", "ttft_queue_bound", "every_hardware", "bulk_runs"]
# saving -> the plan flag and its value with the saving (the peer runs the other value)
SAVINGS: dict[str, tuple[Flag, bool]] = {
    "stopped-probes": ("stop_missed_probes", True), "ttft-bound": ("ttft_queue_bound", True),
    "bulk-runs": ("bulk_runs", True), "answer-only": ("every_hardware", False)}
EXACT = ("stopped-probes", "bulk-runs")  # savings whose plans must be identical
ANSWER_ONLY = ("answer-only",)  # savings that keep the recommendation only


def counting(fn: Callable[P, SimulationResult],
             runs: list[tuple[int, int]]) -> Callable[P, SimulationResult]:
    """`fn`, appending (requests, finished) of each simulation it runs to `runs`."""

    def counted(*args: P.args, **kwargs: P.kwargs) -> SimulationResult:
        out = fn(*args, **kwargs)
        runs.append((out.summary.num_requests, out.summary.num_finished))
        return out

    return counted


def timed_plan(hardware: list[str], flag: Flag, value: bool) -> tuple[PlanResult, float, list[tuple[int, int]]]:
    """The plan with `flag` at `value`, its CPU seconds, and (requests, finished) of each simulation it ran."""
    runs: list[tuple[int, int]] = []
    options: SavingOptions = {}
    # Not a plan option: the peer raises the shortest run priced at once past the longest.
    min_run = replica.MIN_RUN_STEPS
    if flag == "bulk_runs":
        if not value:
            replica.MIN_RUN_STEPS = replica.MAX_RUN_STEPS + 1
    else:
        options[flag] = value

    cache.simulate = counting(simulate, runs)
    try:
        start = time.process_time()
        result = plan(**QUESTION, hardware=hardware, cache_dir=None, executor="serial", progress=False, **options)
        return result, time.process_time() - start, runs
    finally:
        cache.simulate = simulate
        replica.MIN_RUN_STEPS = min_run


def answers(r: PlanResult, every_hardware: bool = True) -> list[tuple[str, int | None, float | None]]:
    """The recommendation's and (with `every_hardware`) each hardware's best plan's hardware, GPUs and cost."""
    return [(p.deployment.hardware, p.gpus, p.usd_per_hour)
            for p in ([r.recommended] if r.recommended else []) + (r.per_hardware if every_hardware else [])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saving", choices=sorted(SAVINGS), default="stopped-probes")
    ap.add_argument("--hw", nargs="+", default=["mi300x"], help="hardware profiles to plan over")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    flag, value = SAVINGS[args.saving]
    best: dict[bool, tuple[PlanResult, float, list[tuple[int, int]]]] = {}
    for _ in range(args.repeats):
        for on in (False, True):
            got = timed_plan(args.hw, flag, value if on else not value)
            if on not in best or got[1] < best[on][1]:
                best[on] = got
    every = args.saving not in ANSWER_ONLY
    with_, without = answers(best[True][0], every), answers(best[False][0], every)
    same = best[True][0] == best[False][0] if args.saving in EXACT else with_ == without
    if not same:
        diff = [f"{a} vs {b}" for a, b in zip(with_, without, strict=False) if a != b]
        raise SystemExit(f"the two plans differ: {args.saving} changed the answer (with vs without): {'; '.join(diff)}")
    rec = best[True][0].recommended
    print(f"question: {QUESTION} on {args.hw}; answer (identical): "
          + (f"{rec.replicas} x {rec.label}, US${rec.usd_per_hour:,.2f}/h" if rec else "none"))
    for on, label in ((False, "without"), (True, "with")):
        result, cpu_s, runs = best[on]
        print(f"{label} {args.saving:15s} {cpu_s:6.1f} CPU s, {result.simulated_candidates} candidates simulated, "
              f"{len(runs)} simulations, {sum(f for _, f in runs):,} of {sum(n for n, _ in runs):,} requests finished")
    print(f"ratio (with / without): {best[True][1] / best[False][1]:.2f}")


if __name__ == "__main__":
    main()
