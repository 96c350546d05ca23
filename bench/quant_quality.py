"""What quantisation costs in quality on SmolLM2-135M: NLL on a fixed text and greedy agreement.

    OMP_NUM_THREADS=1 .venv/bin/python bench/quant_quality.py              # 100 prompts x 24 tokens
    OMP_NUM_THREADS=1 .venv/bin/python bench/quant_quality.py --prompts 20 --json
    OMP_NUM_THREADS=1 .venv/bin/python bench/quant_quality.py --variants int4:auto   # one variant

For each weight dtype (fp32, int8, int8 with the dynamic W8A8 kernel, int4, fp8) with an fp32 KV cache, and each KV-cache dtype
(int8, fp8) with fp32 weights: the mean per-token negative log-likelihood of a fixed English
text (teacher forcing, one prefill through the paged cache, so KV quantisation is exercised),
and greedy agreement with fp32 over the same prompts — the share of continuations identical
token for token, and the mean number of leading tokens that agree. fp32 is the reference run
in the same process.
"""

from __future__ import annotations

import argparse
import json

import torch

from engine.core import SamplingParams
from engine.llm import LLM
from engine.kernels.metadata import build_attention_metadata

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels; later, stored programs let the same hardware run many tasks. Assemblers gave names to "
    "instructions, compilers translated structured languages into machine code, and operating systems "
    "shared one computer among many users. Each layer hid details of the one below, so that people could "
    "think about larger problems. Today a single graphics processor performs trillions of operations per "
    "second, and large language models, trained on much of the written web, answer questions, write code "
    "and summarise documents. Serving such a model efficiently is itself an engineering problem: memory "
    "bandwidth, not arithmetic, often limits how fast the next word can be produced."
)
SUBJECTS = ["the ocean", "a library", "mountains", "coffee", "the moon", "trains", "music", "gardens", "rain",
            "bridges", "honey bees", "winter", "chess", "volcanoes", "bread", "rivers", "clocks", "forests",
            "deserts", "lighthouses"]
FORMS = ["Write one sentence about {}.", "Explain {} to a child.", "List three facts about {}.",
         "What is the most surprising thing about {}?", "Describe {} in a short poem."]
VARIANTS = [("int8", "auto"), ("int8-dynamic", "auto"), ("int8-dynamic+head", "auto"), ("int4", "auto"),
            ("int4+head", "auto"), ("fp8", "auto"), ("auto", "int8"), ("auto", "fp8")]
# Weight variants that are more than a dtype: an int8 kernel, an int8 LM head (+head).
KERNELS = {"int8-dynamic": {"weight_dtype": "int8", "int8_kernel": "dynamic"},
           "int8-dynamic+head": {"weight_dtype": "int8", "int8_kernel": "dynamic", "lm_head_dtype": "int8"},
           "int4+head": {"weight_dtype": "int4", "lm_head_dtype": "int8"}}


def prompts(n: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(SUBJECTS[i // len(FORMS) % len(SUBJECTS)]) for i in range(n)]


@torch.inference_mode()
def text_nll(llm: LLM, text: str) -> float:
    """Mean NLL (nats per token) of `text` under teacher forcing, through the paged KV cache."""
    runner, model = llm.runner, llm.model
    assert runner is not None and model is not None, "an engine in this process (tensor_parallel 1)"
    ids = llm.encode(text)
    n = len(ids)
    block = llm.scheduler.config.block_size
    table = list(range(-(-n // block)))
    positions, meta = build_attention_metadata([n], [n], [table], block, runner.device)
    hidden = model(torch.tensor(ids, device=runner.device), positions, meta, runner.kv_caches)
    logits = model.compute_logits(hidden[:-1]).float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=logits.device)))


def greedy(llm: LLM, texts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(texts, params, chat=True)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    exact = sum(a == b for a, b in zip(reference, other, strict=True)) / len(reference)
    leading = []
    for a, b in zip(reference, other, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        leading.append(k)
    return exact, sum(leading) / len(leading)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--variants", nargs="+", default=[f"{w}:{kv}" for w, kv in VARIANTS],
                    choices=[f"{w}:{kv}" for w, kv in VARIANTS], help="weights:kv_cache pairs to compare with fp32")
    args = ap.parse_args()
    texts = prompts(args.prompts)
    knobs = dict(max_num_seqs=32, max_num_batched_tokens=2048, kv_cache_gib=0.5)

    reference = LLM("smollm2-135m", **knobs)
    ref_nll = text_nll(reference, TEXT)
    ref_tokens = greedy(reference, texts, args.max_tokens)
    del reference
    rows = [{"weights": "fp32", "kv_cache": "fp32", "nll": ref_nll, "nll_delta": 0.0, "exact_match": 1.0,
             "mean_leading_agreement": float(args.max_tokens)}]
    for weights, kv in (v.split(":") for v in args.variants):
        llm = LLM("smollm2-135m", **KERNELS.get(weights, {"weight_dtype": weights}), kv_cache_dtype=kv, **knobs)
        nll = text_nll(llm, TEXT)
        exact, leading = agreement(ref_tokens, greedy(llm, texts, args.max_tokens))
        rows.append({"weights": "fp32" if weights == "auto" else weights, "kv_cache": "fp32" if kv == "auto" else kv,
                     "nll": nll, "nll_delta": nll - ref_nll, "exact_match": exact, "mean_leading_agreement": leading})
        del llm
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"SmolLM2-135M: NLL of a {len(TEXT.split())}-word text; greedy agreement with fp32 over "
          f"{args.prompts} chat prompts x {args.max_tokens} tokens")
    print("| weights | KV cache | NLL (nats/token) | vs fp32 | identical continuations | mean leading tokens agreeing |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['weights']} | {r['kv_cache']} | {r['nll']:.4f} | {r['nll_delta']:+.4f} | {r['exact_match']:.0%} | "
              f"{r['mean_leading_agreement']:.1f} / {args.max_tokens} |")


if __name__ == "__main__":
    main()
