"""Batch-1 decode tokens/s of ServePlan's engine vs llama.cpp on the same GGUF, same prompts, same run.

    LLAMACPP_PYTHON=/work/llamacpp-venv/bin/python .venv/bin/python bench/engine_vs_llamacpp.py \
        --weight-dtype int4 --lm-head-dtype int8 --threads 1
    .venv/bin/python bench/engine_vs_llamacpp.py --llamacpp-python /work/llamacpp-venv/bin/python --json

llama.cpp runs through llama-cpp-python (the `llamacpp` extra; it builds from source, so it lives in
its own venv: `CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36`), in a
subprocess started once (bench/llamacpp_peer.py), given by --llamacpp-python or $LLAMACPP_PYTHON;
without one this says so and exits 0. Our engine takes every engine flag (`serveplan engine
generate`'s), loading the same file (the packaged SmolLM2-135M-Instruct Q4_1 by default).

Both decode the same chat-formatted prompt token ids greedily for --max-tokens tokens (EOS
ignored), one request at a time, with the same thread count. Decode time is first to last
generated token (prefill excluded). Each repeat runs every prompt on one side, then the other,
alternating which goes first; the result is the median per-request decode rate of each side and
their ratio, with the spread over repeats. llama-cpp-python's API decodes one sequence at a time,
so there is no batched comparison here (bench/engine_vs_hf.py compares batches with transformers).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import statistics
import subprocess

import torch

from engine.cli import add_engine_flags, engine_settings
from engine.core import SamplingParams
from engine.llm import LLM
from engine.model.gguf_checkpoint import PACKAGED_GGUF, packaged_gguf_path

PROMPTS = ["Write one sentence about the ocean.", "Explain trains to a child.", "List three facts about honey bees.",
           "What is the most surprising thing about volcanoes?"]
PEER = Path(__file__).with_name("llamacpp_peer.py")


class LlamaCppPeer:
    """llama.cpp in its own process: the GGUF loaded once, one greedy generation per request."""

    def __init__(self, python: str, model: Path, threads: int, n_ctx: int) -> None:
        self.process = subprocess.Popen(
            [python, str(PEER), "--model", str(model), "--threads", str(threads), "--n-ctx", str(n_ctx)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._read()  # {"ready": true} once the model is loaded

    def generate(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"prompt_ids": prompt_ids, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        reply = self._read()
        return reply["token_ids"], reply["decode_s"]

    def _read(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the llama.cpp peer exited (code {self.process.wait()}); see its stderr above")
        return json.loads(line)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=30)


def ours_generate(llm: LLM, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    [out] = llm.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return out.token_ids, out.metrics.e2e_s - out.metrics.ttft_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a .gguf file, or a catalog name whose GGUF ships in a package")
    parser.add_argument("--llamacpp-python", default=os.environ.get("LLAMACPP_PYTHON"),
                        help="python of a venv with llama-cpp-python (default: $LLAMACPP_PYTHON)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    add_engine_flags(parser)
    args = parser.parse_args()
    if not args.llamacpp_python:
        print("llama.cpp peer not given (--llamacpp-python or $LLAMACPP_PYTHON, a venv's python with "
              "llama-cpp-python installed): nothing to compare against, skipping.")
        return
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2 (decode time runs from the first token to the last)")
    gguf = packaged_gguf_path(args.model) if args.model in PACKAGED_GGUF else Path(args.model)
    settings = engine_settings(args) | {"max_num_seqs": 1}
    llm = LLM(str(gguf), **settings)
    n_ctx = llm.max_model_len if settings.get("max_model_len") else 2048
    peer = LlamaCppPeer(args.llamacpp_python, gguf, settings["threads"], n_ctx)
    prompts = [llm.encode(p, chat=True) for p in PROMPTS]
    sides = {"ours": lambda ids: ours_generate(llm, ids, args.max_tokens),
             "llama.cpp": lambda ids: peer.generate(ids, args.max_tokens)}
    for run in sides.values():  # warm-up: page faults, lazy initialisation
        run(prompts[0])
    rates: dict[str, list[float]] = {side: [] for side in sides}
    repeat_medians: dict[str, list[float]] = {side: [] for side in sides}
    tokens: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for side in (list(sides) if repeat % 2 == 0 else list(reversed(sides))):
            this_repeat = []
            for ids in prompts:
                out, decode_s = sides[side](ids)
                this_repeat.append((len(out) - 1) / decode_s)
                if repeat == 0:
                    tokens.setdefault(side, []).append(out)
            rates[side] += this_repeat
            repeat_medians[side].append(statistics.median(this_repeat))
    peer.close()
    median = {side: statistics.median(r) for side, r in rates.items()}
    ratios = [o / p for o, p in zip(repeat_medians["ours"], repeat_medians["llama.cpp"], strict=True)]
    result = {
        "model": str(gguf), "engine": llm._loaded.source_description, "threads": settings["threads"],
        "max_tokens": args.max_tokens, "prompts": len(prompts), "repeats": args.repeats,
        "ours_decode_tokens_per_s": median["ours"], "llamacpp_decode_tokens_per_s": median["llama.cpp"],
        "ratio": median["ours"] / median["llama.cpp"], "ratio_per_repeat": ratios,
        "greedy_tokens_identical": sum(a == b for a, b in zip(tokens["ours"], tokens["llama.cpp"], strict=True)),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['engine']}\n{settings['threads']} thread(s), batch 1, {args.max_tokens} greedy tokens, "
          f"{len(prompts)} prompts x {args.repeats} repeats (alternating), torch {torch.__version__}")
    print(f"ours      {median['ours']:7.1f} decode tok/s (median)")
    print(f"llama.cpp {median['llama.cpp']:7.1f} decode tok/s (median)")
    print(f"ours / llama.cpp = {result['ratio']:.2f}  (per repeat {min(ratios):.2f}-{max(ratios):.2f}); "
          f"greedy continuations identical: {result['greedy_tokens_identical']} of {len(prompts)}")


if __name__ == "__main__":
    main()
