"""N-gram speculative decoding on this CPU: measured speed-up at batch 1, and the simulator's
prediction of it from the measured acceptance profile.

    OMP_NUM_THREADS=1 .venv/bin/python bench/spec_ngram.py            # SmolLM2-135M, k=3, 64 tokens
    OMP_NUM_THREADS=1 .venv/bin/python bench/spec_ngram.py --k 4 --json

Both engines (one without speculation, one with n-gram speculation) load the same weights and
decode the same raw (chat=False) repetitive / code-like prompts greedily for exactly
--max-tokens tokens, one request at a time, alternating prompt by prompt so that machine noise
hits both alike. Greedy outputs must be token-identical. The simulator then replays the same
requests on the calibrated cost model (hwprofiles/calibrations/, when one exists for the model)
with and without speculation, using the engine's measured acceptance profile.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import time
from typing import TypedDict

import torch

from engine.core import SamplingParams
from engine.llm import LLM
from engine.core import SpecStats
from engine.dtypes import SHORT_NAME
from planner.calibrate import CALIBRATION_DIR, load_calibration
from planner.sim import simulate
from planner.specs import Deployment, EngineKnobs
from planner.workload import ClosedLoopArrivals, FixedLength, Workload

PROMPTS = [
    "Repeat this list three times.\nList: apple, banana, cherry, date, elderberry, fig, grape, honeydew.\n"
    "1. apple, banana, cherry, date, elderberry, fig, grape, honeydew.\n2.",
    "def add_numbers(first_number, second_number):\n    return first_number + second_number\n\n\n"
    "def subtract_numbers(first_number, second_number):\n    return first_number - second_number\n\n\n"
    "def multiply_numbers(first_number, second_number):\n",
    '[{"id": 1, "name": "alpha", "status": "active", "score": 10},\n'
    ' {"id": 2, "name": "beta", "status": "active", "score": 20},\n'
    ' {"id": 3, "name": "gamma", "status": "active", "score": 30},\n',
    "for index in range(10):\n    total_value = total_value + values[index]\n    print(index, total_value)\n"
    "for index in range(20):\n    total_value = total_value + values[index]\n",
]


class Prediction(TypedDict):
    calibration: str
    plain_tokens_per_s: float
    ngram_tokens_per_s: float
    predicted_speedup: float
    error_pct: float


def run(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    [out] = llm.generate([prompt], params)
    return time.perf_counter() - start, out.token_ids


def find_calibration(model: str, dtype: str) -> Path | None:
    matches = sorted(CALIBRATION_DIR.glob(f"*__{model}__{SHORT_NAME[dtype]}.json"))
    return matches[-1] if matches else None


def predicted_seconds(llm: LLM, cal_path: Path, lengths: list[int], max_tokens: int,
                      speculative: dict | None) -> float:
    """Simulated wall time of the requests one after another, as the engine ran them."""
    cal = load_calibration(cal_path, model=llm.config)
    dtype = SHORT_NAME[llm.engine_config.dtype]
    knobs = EngineKnobs(block_size_tokens=llm.engine_config.block_size_tokens, speculative=speculative)
    dep = Deployment(hardware=cal.hardware_profile, weight_dtype=dtype, kv_dtype=dtype, knobs=knobs)
    total = 0.0
    for i, n in enumerate(lengths):
        workload = Workload(name=f"prompt-{i}", arrival=ClosedLoopArrivals(concurrency=1),
                            input_tokens=FixedLength(tokens=n), output_tokens=FixedLength(tokens=max_tokens),
                            num_requests=1)
        result = simulate(llm.config, cal.profile, dep, workload, calibration=cal.cost_params(),
                          max_model_len=llm.max_model_len, kv_cache_blocks=llm.num_blocks, seed=i)
        total += result.summary.duration_s
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step")
    parser.add_argument("--ngram-min-n", type=int, default=2)
    parser.add_argument("--ngram-max-n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompt set")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the calibration's count)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "ngram_min_n": args.ngram_min_n, "ngram_max_n": args.ngram_max_n}
    plain, fast = LLM(args.model), LLM(args.model, speculative=spec)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [plain.encode(p) for p in PROMPTS]
    for llm in (plain, fast):  # warm-up: first-call allocations stay out of the timings
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    fast.loop.spec_stats = SpecStats(args.k)  # count the timed runs only
    plain_s = fast_s = 0.0
    identical = True
    for _ in range(args.repeats):
        for prompt in prompts:
            t_plain, tokens_plain = run(plain, prompt, params)
            t_fast, tokens_fast = run(fast, prompt, params)
            plain_s, fast_s = plain_s + t_plain, fast_s + t_fast
            identical &= tokens_plain == tokens_fast
    generated = args.repeats * len(prompts) * args.max_tokens
    stats = fast.spec_stats
    assert stats is not None
    measured = plain_s / fast_s
    result: dict[str, object] = {
        "model": args.model, "threads": torch.get_num_threads(), "k": args.k, "max_tokens": args.max_tokens,
        "requests": args.repeats * len(prompts), "plain_tokens_per_s": generated / plain_s,
        "ngram_tokens_per_s": generated / fast_s, "measured_speedup": measured,
        "greedy_outputs_identical": identical, "spec": stats.as_dict(),
    }
    cal_path = find_calibration(args.model, plain.engine_config.dtype)
    pred: Prediction | str
    if cal_path is None:
        pred = f"no calibration for {args.model} under {CALIBRATION_DIR}: prediction skipped"
    else:
        lengths = [len(p) for p in prompts] * args.repeats
        profiled = {**spec, "acceptance_profile": list(stats.acceptance_profile), "proposal_rate": stats.proposal_rate}
        sim_plain = predicted_seconds(plain, cal_path, lengths, args.max_tokens, None)
        sim_fast = predicted_seconds(plain, cal_path, lengths, args.max_tokens, profiled)
        predicted = sim_plain / sim_fast
        pred = {
            "calibration": str(cal_path.relative_to(CALIBRATION_DIR.parent.parent)),
            "plain_tokens_per_s": generated / sim_plain, "ngram_tokens_per_s": generated / sim_fast,
            "predicted_speedup": predicted, "error_pct": 100 * (predicted / measured - 1),
        }
    result["prediction"] = pred
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.model}, fp32, {result['threads']} thread(s), batch 1, k={args.k}, "
          f"{result['requests']} requests x {args.max_tokens} tokens, greedy")
    print(f"engine  plain {result['plain_tokens_per_s']:.2f} tok/s   n-gram {result['ngram_tokens_per_s']:.2f} tok/s   "
          f"speed-up {measured:.2f}x   outputs identical: {identical}")
    print(f"acceptance profile {[round(a, 3) for a in stats.acceptance_profile]}   proposal rate "
          f"{stats.proposal_rate:.3f}   acceptance rate "
          f"{stats.acceptance_rate:.3f}   mean accepted length {stats.mean_accepted_length:.2f}   "
          f"draft {stats.draft_s:.2f} s, verify {stats.verify_s:.2f} s")
    if isinstance(pred, str):
        print(pred)
    else:
        print(f"simulator  plain {pred['plain_tokens_per_s']:.2f} tok/s   n-gram {pred['ngram_tokens_per_s']:.2f} tok/s   "
              f"predicted speed-up {pred['predicted_speedup']:.2f}x   error {pred['error_pct']:+.1f}%   ({pred['calibration']})")


if __name__ == "__main__":
    main()
