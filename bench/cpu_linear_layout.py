"""Engine decode steps on a CPU with fp32 matmul weights column-major (the engine's layout) against
row-major (torch's default), measured in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_linear_layout.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_linear_layout.py --model smollm2-135m --json

Two engines over the same weights; one has `lay_out_cpu_matmul_weights` (engine/model/layers.py)
undone, so F.linear multiplies by the stored [out, in] matrix transposed, as torch's nn.Linear does.
Each decode step is timed as `serveplan calibrate` times its grid (planner/calibrate.py
`measure_steps`: the engine's own step loop, the median of --repeats); the two engines alternate
step by step over --rounds, and each keeps its fastest round, so a noisy neighbour costs a round,
not the result. Reported: each engine's step time and the row-major / column-major ratio.
"""

from __future__ import annotations

import argparse
import json

import torch

from engine.llm import LLM
from planner.calibrate import grid_blocks_needed, measure_steps

VALIDATION_MODEL = "planner/validation_models/qwen3-wide-52m"


def row_major(llm: LLM) -> None:
    """Undo the engine's layout: every column-major weight back to a contiguous [out, in]."""
    assert llm.runner is not None, "an engine in this process (tensor_parallel 1)"
    for weight in llm.runner.model.parameters():
        if weight.dim() == 2 and not weight.is_contiguous():
            weight.data = weight.data.contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=VALIDATION_MODEL, help="catalog name or checkpoint folder")
    parser.add_argument("--random-weights", action=argparse.BooleanOptionalAction, default=None,
                        help="default: on for the validation model, off otherwise")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32])
    parser.add_argument("--context", type=int, default=64, help="tokens of context per decode")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    random_weights = args.model == VALIDATION_MODEL if args.random_weights is None else args.random_weights

    grid = [(f"decode b{b} ctx{args.context}", [(1, args.context - 1, False)] * b) for b in args.batch_sizes]
    settings = {"device": "cpu", "dtype": "float32", "random_weights": random_weights, "enable_prefix_caching": False,
                "num_kv_blocks": grid_blocks_needed(grid, 16, args.repeats), "threads": torch.get_num_threads()}
    engines = {"column-major": LLM(args.model, **settings), "row-major": LLM(args.model, **settings)}
    row_major(engines["row-major"])
    best: dict[str, dict[int, float]] = {name: {} for name in engines}
    for _ in range(args.rounds):
        for batch, step in zip(args.batch_sizes, grid, strict=True):
            for name, llm in engines.items():
                (measured,) = measure_steps(llm, [step], args.repeats)
                best[name][batch] = min(best[name].get(batch, float("inf")), measured.measured_s)

    rows = [{"batch": b, "column_major_ms": 1e3 * best["column-major"][b], "row_major_ms": 1e3 * best["row-major"][b],
             "row_over_column": best["row-major"][b] / best["column-major"][b]} for b in args.batch_sizes]
    if args.json:
        print(json.dumps({"model": args.model, "context_tokens": args.context, "threads": torch.get_num_threads(),
                          "rows": rows}, indent=2))
        return
    print(f"{args.model}, decode at {args.context} tokens of context, {torch.get_num_threads()} thread(s)")
    print("batch  column-major ms  row-major ms  row / column")
    for r in rows:
        print(f"{r['batch']:>5}  {r['column_major_ms']:>15.1f}  {r['row_major_ms']:>12.1f}  {r['row_over_column']:>12.2f}")


if __name__ == "__main__":
    main()
