"""Decode tokens/s of SmolLM2-135M with int8 weights against fp32, measured in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/int8_decode.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/int8_decode.py --batch-sizes 1 4 16 --rounds 5 --json

Three engines over the same chat prompts, greedy, EOS ignored: fp32; int8 weight-only (the
default int8 kernel: on an AVX2 CPU, dequantise then matmul); int8 with `int8_kernel="dynamic"`
(fbgemm's W8A8 matmul, activations quantised per tensor on each call). Decode throughput is
batch x (tokens - 1) / (last token - first token), which leaves the prefill out; each engine's
best of --rounds interleaved rounds is kept, so a noisy neighbour costs a round, not the result.
"""

from __future__ import annotations

import argparse
import json

import torch

from engine.core import SamplingParams
from engine.llm import LLM

PROMPTS = ["Write one sentence about the ocean.", "Explain trains to a child.", "List three facts about honey bees.",
           "What is the most surprising thing about volcanoes?", "Describe rivers in a short poem."]
ENGINES = {"fp32": {}, "int8 weight-only": {"weight_dtype": "int8"},
           "int8 dynamic (W8A8)": {"weight_dtype": "int8", "int8_kernel": "dynamic"}}


def decode_tokens_per_s(llm: LLM, batch: int, max_tokens: int) -> float:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), chat=True)
    first = min(o.metrics.arrival_time + o.metrics.ttft_s for o in outputs)
    last = max(o.metrics.arrival_time + o.metrics.e2e_s for o in outputs)
    return batch * (max_tokens - 1) / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    engines = {name: LLM("smollm2-135m", max_num_seqs=max(args.batch_sizes), kv_cache_gib=0.25, **knobs)
               for name, knobs in ENGINES.items()}
    best = {(name, b): 0.0 for name in engines for b in args.batch_sizes}
    for name, llm in engines.items():  # warm-up: first passes over fresh memory pay page faults
        decode_tokens_per_s(llm, 1, 4)
    for _ in range(args.rounds):
        for batch in args.batch_sizes:
            for name, llm in engines.items():
                best[name, batch] = max(best[name, batch], decode_tokens_per_s(llm, batch, args.max_tokens))
    rows = [{"engine": name, "batch": b, "decode_tokens_per_s": best[name, b],
             "vs_fp32": best[name, b] / best["fp32", b]} for b in args.batch_sizes for name in engines]
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return
    print(f"SmolLM2-135M decode, {torch.get_num_threads()} thread(s), {args.max_tokens} tokens, best of {args.rounds}")
    print("| batch | weights | decode tok/s | vs fp32 |\n|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['engine']} | {r['decode_tokens_per_s']:.1f} | {r['vs_fp32']:.2f}x |")


if __name__ == "__main__":
    main()
