"""What a structured output's token mask costs per token on this machine, for the simulator to price.

    OMP_NUM_THREADS=1 .venv/bin/python bench/structured_mask.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/structured_mask.py --json

Part 1, the mask alone, per constrained token (engine/structured_output.py's GrammarMasks: fill
the matcher's bitmask, apply it to the fp32 logits, accept the sampled token), with SmolLM2's
49,152-token vocabulary, for four constraints, at batches of 1, 8 and 32 constrained requests
(the masks of a batch are filled one after another on the CPU). Its peer, timed in the same loop:
the sampler's own greedy pick (argmax over the same logits).

Part 2, end to end: SmolLM2-135M (real weights) decodes the same prompts greedily for
--max-tokens tokens with and without a JSON-schema constraint, alternating, batch 1 and batch 8;
the ratio of decode time per token is what a served constrained request pays here.
"""

from __future__ import annotations

import argparse
from importlib.metadata import version
import json
import statistics
import time

import gguf
import torch
import xgrammar as xgr

from engine.core import SamplingParams, StructuredOutput
from engine.llm import LLM
from engine.model import gguf_checkpoint
from engine.structured_output import GrammarCompiler

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "email", "tags", "address"]}
CONSTRAINTS = {
    "json_schema (object, 5 fields)": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "json_object (any object)": StructuredOutput("json_schema", '{"type": "object"}'),
    "regex (date, time, id)": StructuredOutput("regex", r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} [A-Z]{3}-[0-9a-f]{8}"),
    "grammar (EBNF arithmetic)": StructuredOutput(
        "grammar", 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= factor ("*" factor)*\n'
                   'factor ::= [0-9]+ | "(" expr ")"'),
}


def mask_cost(compiler: GrammarCompiler, constraint: StructuredOutput, batch: int, tokens: int, seed: int,
              eos: int) -> dict[str, float]:
    """Median microseconds per constrained token of each step GrammarMasks takes: fill the
    bitmask (host), apply it to the logits, accept the sampled token (host); and the argmax peer.
    A GPU server's CPU pays fill + accept; apply runs where the logits are (here the CPU)."""
    matchers = [compiler.matcher(constraint) for _ in range(batch)]
    rows = list(range(batch))
    gen = torch.Generator().manual_seed(seed)
    phases: dict[str, list[float]] = {"fill_us": [], "apply_us": [], "accept_us": [], "argmax_us": []}
    for _ in range(tokens):
        logits = torch.randn(batch, VOCAB, generator=gen)
        t0 = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(batch, VOCAB)
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        t1 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=VOCAB, indices=rows)
        t2 = time.perf_counter()
        picked = logits.argmax(dim=-1).tolist()
        t3 = time.perf_counter()
        for matcher, token in zip(matchers, picked, strict=True):
            matcher.accept_token(token)
        t4 = time.perf_counter()
        for phase, seconds in zip(phases, (t1 - t0, t2 - t1, t4 - t3, t3 - t2), strict=True):
            phases[phase].append(seconds / batch * 1e6)
        for row, token in enumerate(picked):
            if token == eos:  # that output is complete: the next token starts a new one, as a new request
                matchers[row] = compiler.matcher(constraint)
    out = {phase: statistics.median(values) for phase, values in phases.items()}
    out["mask_us"] = out["fill_us"] + out["apply_us"] + out["accept_us"]
    return out


def end_to_end(llm: LLM, max_tokens: int, batch: int, repeats: int) -> dict[str, float]:
    constraint = StructuredOutput("json_schema", json.dumps(SCHEMA))
    prompts = [f"Describe person number {i} as JSON with name, age, email, tags and address." for i in range(batch)]
    free: list[float] = []
    constrained: list[float] = []
    for _ in range(repeats):  # alternate so machine noise hits both alike
        for tpots, structured in ((free, None), (constrained, constraint)):
            params = [SamplingParams(max_tokens=max_tokens, ignore_eos=structured is None,
                                     structured_output=structured) for _ in prompts]
            tpots += [out.metrics.tpot_s for out in llm.generate(prompts, params, chat=True)]
    f, c = statistics.median(free), statistics.median(constrained)
    return {"free_tpot_ms": f * 1e3, "constrained_tpot_ms": c * 1e3, "ratio": c / f}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200, help="constrained tokens per measurement")
    parser.add_argument("--max-tokens", type=int, default=48, help="output tokens per request, end to end")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    path = gguf_checkpoint.packaged_gguf_path("smollm2-135m")
    tokenizer = gguf_checkpoint.gguf_tokenizer(gguf.GGUFReader(str(path)), path)
    if tokenizer is None:
        raise SystemExit(f"{path} carries no tokenizer: the masks are built from its vocabulary")
    compiler = GrammarCompiler(tokenizer, VOCAB, tokenizer.eos_token_id)
    threads, xgrammar_version = torch.get_num_threads(), version("xgrammar")
    compile_ms: dict[str, float] = {}
    costs: dict[str, dict[str, dict[str, float]]] = {}  # constraint -> batch_<b> -> phase -> us per token
    for name, constraint in CONSTRAINTS.items():
        compile_start = time.perf_counter()
        compiler.compile(constraint)
        compile_ms[name] = (time.perf_counter() - compile_start) * 1e3
        costs[name] = {f"batch_{b}": mask_cost(compiler, constraint, b, args.tokens, seed=b, eos=tokenizer.eos_token_id)
                       for b in (1, 8, 32)}

    llm = LLM("smollm2-135m", num_kv_blocks=256, max_num_seqs=8)
    end_to_end_rows = {f"batch_{b}": end_to_end(llm, args.max_tokens, b, args.repeats) for b in (1, 8)}
    if args.json:
        print(json.dumps({"torch_threads": threads, "vocab_tokens": VOCAB, "xgrammar": xgrammar_version,
                          "mask": {name: {"compile_ms": compile_ms[name], **costs[name]} for name in costs},
                          "end_to_end": end_to_end_rows}, indent=2))
        return
    print(f"xgrammar {xgrammar_version}, vocabulary {VOCAB:,} tokens, torch threads {threads}")
    print("us per constrained token: mask = fill (host) + apply (where the logits are) + accept (host); "
          "argmax = the sampler's own greedy pick over the same logits (peer)")
    print(f"{'constraint':32} {'compile ms':>10} " + " ".join(
        f"{f'b={b} mask':>10} {'fill':>6} {'apply':>6} {'accept':>6} {'argmax':>6}" for b in (1, 8, 32)))
    for name, row in costs.items():
        cells = " ".join(" ".join([f"{row[f'batch_{b}']['mask_us']:10.1f}"] + [
            f"{row[f'batch_{b}'][k]:6.1f}" for k in ("fill_us", "apply_us", "accept_us", "argmax_us")])
            for b in (1, 8, 32))
        print(f"{name:32} {compile_ms[name]:10.1f} {cells}")
    for key, e2e in end_to_end_rows.items():
        print(f"SmolLM2-135M {key}: median TPOT {e2e['free_tpot_ms']:.2f} ms free, "
              f"{e2e['constrained_tpot_ms']:.2f} ms with the JSON schema (x{e2e['ratio']:.3f})")


if __name__ == "__main__":
    main()
