"""What stopping missed probes saves `plan`: the same question planned with probes that stop once
they have missed the SLO for certain and with every probe run to its end, in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_probes.py [--hw mi300x] [--repeats 2]

The question is the README's (Llama-3.1-70B, chat, 20 req/s, P99 TTFT <= 1 s), on the hardware
given, serially and without the plan cache, so that every simulation runs in this process and its
CPU time is counted. Both answers must be identical, reports included; the bench stops if not.
Reported: CPU seconds of each (the lower of the repeats), their ratio, and the simulations each ran
with how many of their requests finished.
"""

from __future__ import annotations

import argparse
import time

from planner.search import PlanResult, cache, plan
from planner.sim import simulate

QUESTION = dict(model="llama-3.1-70b", workload="chat", rate_per_s=20.0, slo="ttft_p99_ms<=1000")


def timed_plan(hardware: list[str], stop: bool) -> tuple[PlanResult, float, list[tuple[int, int]]]:
    """The plan, its CPU seconds, and (requests, finished) of each simulation it ran."""
    runs: list[tuple[int, int]] = []

    def counted(*args: object, **kwargs: object):  # noqa: ANN202
        out = simulate(*args, **kwargs)
        runs.append((out.summary.num_requests, out.summary.num_finished))
        return out

    cache.simulate = counted
    try:
        start = time.process_time()
        result = plan(**QUESTION, hardware=hardware, cache_dir=None, executor="serial", progress=False,
                      stop_missed_probes=stop)
        return result, time.process_time() - start, runs
    finally:
        cache.simulate = simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hw", nargs="+", default=["mi300x"], help="hardware profiles to plan over")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    best: dict[bool, tuple[PlanResult, float, list[tuple[int, int]]]] = {}
    for _ in range(args.repeats):
        for stop in (False, True):
            got = timed_plan(args.hw, stop)
            if stop not in best or got[1] < best[stop][1]:
                best[stop] = got
    if best[True][0] != best[False][0]:
        raise SystemExit("the two plans differ: stopping missed probes changed the answer")
    rec = best[True][0].recommended
    print(f"question: {QUESTION} on {args.hw}; answer (identical): "
          + (f"{rec.replicas} x {rec.label}, US${rec.usd_per_hour:,.2f}/h" if rec else "none"))
    for stop, label in ((False, "every probe to its end"), (True, "missed probes stopped")):
        _, cpu_s, runs = best[stop]
        print(f"{label:24s} {cpu_s:6.1f} CPU s, {len(runs)} simulations, "
              f"{sum(f for _, f in runs):,} of {sum(n for n, _ in runs):,} requests finished")
    print(f"ratio (stopped / whole): {best[True][1] / best[False][1]:.2f}")


if __name__ == "__main__":
    main()
