"""Output tokens/s of ServePlan's engine vs Hugging Face `generate`, same model, prompts and run.

    .venv/bin/python bench/engine_vs_hf.py                 # SmolLM2-135M, batch 1 and 16
    .venv/bin/python bench/engine_vs_hf.py --batch-sizes 1 4 16 --max-tokens 64 --json
    .venv/bin/python bench/engine_vs_hf.py --weight-dtype int8 --int8-kernel dynamic --lm-head-dtype int8

Both decode greedily for exactly --max-tokens tokens (EOS ignored) from the same chat-formatted
prompts on the same threads. transformers runs fp32 on the fp32 weights our loader reads
(`hf_state_dict` of an unquantised load); our engine takes every engine flag (`serveplan engine
generate`'s), so a quantised engine is compared with fp32 transformers, and its greedy tokens
then agree only as far as the quantisation allows. --repeats alternates the two sides and
reports the median time of each. The ratio, not the absolute figure, is the result: it cancels
the machine's speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.cli import add_engine_flags, engine_settings
from engine.core import SamplingParams
from engine.llm import LLM
from engine.model.loader import hf_state_dict

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a GPU do?",
]


def hf_peer(model_name: str) -> LlamaForCausalLM:
    """transformers' Llama on the fp32 weights our loader reads for model_name."""
    loaded = LLM(model_name, num_kv_blocks=1)
    assert loaded.model is not None, "an engine in this process (tensor_parallel 1)"
    config = LlamaConfig.from_dict(loaded.config.hf_config)
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(loaded.model), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"state dicts differ: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    return model


def time_ours(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outputs]


@torch.inference_mode()
def time_hf(model: LlamaForCausalLM, prompts: list[list[int]], max_tokens: int, pad_id: int) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding for decoder-only
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
        do_sample=False, pad_token_id=pad_id,
    )
    return time.perf_counter() - start, out[:, width:].tolist()


def same_until_eos(ours: list[list[int]], theirs: list[list[int]], eos: int | None) -> bool:
    """Equal up to each row's first EOS: from there `min_new_tokens` makes transformers mask EOS and
    pick the runner-up, while our ignore_eos keeps the EOS and carries on."""
    for a, b in zip(ours, theirs, strict=True):
        end = a.index(eos) if eos in a else len(a)
        if a[:end] != b[:end]:
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    add_engine_flags(parser)
    args = parser.parse_args()

    settings = engine_settings(args) | {"max_num_seqs": max(args.batch_sizes), "max_num_batched_tokens": 2048,
                                        "enable_prefix_caching": False}
    llm = LLM(args.model, **settings)
    if llm.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: the bench encodes chat prompts")
    peer = hf_peer(args.model)
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    rows = []
    for batch in args.batch_sizes:
        prompts = [llm.encode(PROMPTS[i % len(PROMPTS)], chat=True) for i in range(batch)]
        time_ours(llm, prompts[:1], 2)  # warm-up, both sides
        time_hf(peer, prompts[:1], 2, pad_id)
        ours_times, hf_times = [], []
        for repeat in range(args.repeats):  # alternate which side goes first
            for side in (("ours", "hf") if repeat % 2 == 0 else ("hf", "ours")):
                if side == "ours":
                    ours_s, ours_tokens = time_ours(llm, prompts, args.max_tokens)
                    ours_times.append(ours_s)
                else:
                    hf_s, hf_tokens = time_hf(peer, prompts, args.max_tokens, pad_id)
                    hf_times.append(hf_s)
        ours_s, hf_s = statistics.median(ours_times), statistics.median(hf_times)
        generated = batch * args.max_tokens
        rows.append({
            "batch": batch,
            "max_tokens": args.max_tokens,
            "ours_tokens_per_s": generated / ours_s,
            "hf_tokens_per_s": generated / hf_s,
            "ratio": hf_s / ours_s,
            "ratio_per_repeat": [h / o for o, h in zip(ours_times, hf_times, strict=True)],
            "greedy_outputs_identical": same_until_eos(ours_tokens, hf_tokens, llm.eos_token_id),
        })
    if args.json:
        print(json.dumps({"model": args.model, "engine": llm._loaded.source_description,
                          "threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return
    print(f"{llm._loaded.source_description}\n{torch.get_num_threads()} threads, {args.max_tokens} output tokens "
          f"per request, median of {args.repeats} alternating repeats; transformers fp32")
    print(f"{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>9} {'ours/HF':>8} {'per repeat':>12} {'same tokens':>12}")
    for r in rows:
        spread = f"{min(r['ratio_per_repeat']):.2f}-{max(r['ratio_per_repeat']):.2f}"
        print(f"{r['batch']:>5} {r['ours_tokens_per_s']:>11.1f} {r['hf_tokens_per_s']:>9.1f} {r['ratio']:>8.2f} "
              f"{spread:>12} {str(r['greedy_outputs_identical']):>12}")


if __name__ == "__main__":
    main()
