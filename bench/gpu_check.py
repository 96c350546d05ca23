"""The prepared GPU check of issue #8, for a session that is lent a CUDA device.

    .venv/bin/python bench/gpu_check.py --hw h200 --out "$OUT/gpu_check.json"

1. Kernels natively: a tiny random Llama on CUDA (its Triton kernels: paged attention, KV write,
   fused add+RMSNorm, rotary, int8 matmul) against the same weights on the CPU torch path, over one
   step mixing a prefill chunk and decodes; fp32 and int8 weights. Reports the largest differences.
2. Decode bandwidth: Llama-3.1-8B-shaped random weights in bf16, decode steps at several batch
   sizes over 512-token contexts, timed with CUDA events, with decode graphs and with
   enforce_eager. Achieved bandwidth = (weights read + KV read) / step time, as a share of the
   hardware profile's peak.

Everything it measured goes to --out as JSON (and a summary to stdout); docs/benchmarks.md takes
the figures with this command line.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
import tempfile
import time
from typing import TypedDict

import torch

from engine.core import SamplingParams
from engine.dtypes import QuantWeightDtype
from engine.llm import LLM
from engine.kernels.metadata import build_attention_metadata
from engine.model.loader import load_model
from engine.model.quantize import quantize_model
from planner.hardware import get_hardware

TINY_VOCAB = 1024
TINY = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": TINY_VOCAB,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
KERNEL_WEIGHTS: tuple[QuantWeightDtype | None, ...] = (None, "int8")  # None: the checkpoint's fp32


class DecodeRow(TypedDict):
    batch: int
    eager: bool
    step_ms: float
    host_step_ms: float
    bandwidth_gb_s: float
    share_of_peak: float


def kernels_vs_torch(folder: Path, weight_dtype: QuantWeightDtype | None) -> dict[str, float]:
    """Largest |difference| of the final hidden states and of the KV caches, CUDA (Triton) vs CPU (torch)."""
    models = {}
    for device in ("cpu", "cuda"):
        model = load_model(str(folder), random_weights=True, seed=3, device=device).model
        if weight_dtype:
            quantize_model(model, weight_dtype)
        models[device] = model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY_VOCAB, (67,), generator=gen)
    # A 64-token prefill chunk after 200 cached tokens, then three decodes of 700, 33 and 1 tokens.
    tables = [list(range(0, 17)), list(range(17, 61)), list(range(61, 64)), [64]]
    query_lens, seq_lens = [64, 1, 1, 1], [264, 700, 33, 1]
    caches = models["cpu"].allocate_kv_caches(65, 16)
    for cache in caches:
        cache.normal_(generator=gen)
    outs = {}
    for device, model in models.items():
        positions, metadata = build_attention_metadata(query_lens, seq_lens, tables, 16, device)
        kv = [c.to(device) for c in caches]
        with torch.inference_mode():
            outs[device] = (model(ids.to(device), positions, metadata, kv).float().cpu(), [c.cpu() for c in kv])
    return {
        "hidden_max_abs_diff": (outs["cuda"][0] - outs["cpu"][0]).abs().max().item(),
        "kv_max_abs_diff": max((a - b).abs().max().item() for a, b in zip(outs["cuda"][1], outs["cpu"][1], strict=True)),
    }


def decode_bandwidth(model: str, batch_sizes: list[int], eager: bool, peak_gb_s: float, steps: int) -> list[DecodeRow]:
    llm = LLM(model, device="cuda", dtype="bfloat16", random_weights=True, max_model_len=1024, kv_cache_gib=8,
              max_num_seqs=max(batch_sizes), enable_prefix_caching=False, enforce_eager=eager)
    assert llm.model is not None, "an engine in this process (tensor_parallel 1)"
    c = llm.config
    weight_bytes = (sum(p.numel() for p in llm.model.parameters()) - c.vocab_size * c.hidden_size * (not c.tie_word_embeddings)) * 2
    kv_bytes_per_token = c.num_layers * c.kv_elements_per_token_per_layer() * 2
    rows: list[DecodeRow] = []
    for batch in batch_sizes:
        gen = torch.Generator().manual_seed(batch)
        ids = [llm.add_request(torch.randint(0, c.vocab_size, (512,), generator=gen).tolist(),
                               SamplingParams(max_tokens=steps + 8, ignore_eos=True)) for _ in range(batch)]
        while any(llm.scheduler.requests[i].num_output_tokens == 0 for i in ids):  # prefills
            llm.step()
        for _ in range(3):
            llm.step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        end.record()
        torch.cuda.synchronize()
        step_s = start.elapsed_time(end) / 1e3 / steps
        context = 512 + 3 + steps / 2
        moved = weight_bytes + batch * context * kv_bytes_per_token
        rows.append({"batch": batch, "eager": eager, "step_ms": step_s * 1e3, "host_step_ms": (time.perf_counter() - t0) / steps * 1e3,
                     "bandwidth_gb_s": moved / step_s / 1e9, "share_of_peak": moved / step_s / 1e9 / peak_gb_s})
        while llm.scheduler.has_unfinished_requests():
            llm.step()
    del llm
    gc.collect()  # the runner and its graphs reference each other: free the weights before the next engine
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hw", default="h200", help="hardware profile whose peak bandwidth is the reference")
    parser.add_argument("--model", default="llama-3.1-8b", help="catalog model (random weights, bf16)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run it where the device tool lends one")
    peak = get_hardware(args.hw).memory_bandwidth_gb_s
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "hardware_profile": args.hw, "peak_gb_s": peak}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY))
        report["kernels"] = {str(w or "fp32"): kernels_vs_torch(Path(tmp), w) for w in KERNEL_WEIGHTS}
    print(json.dumps(report["kernels"], indent=2), flush=True)
    decode = [row for eager in (False, True) for row in
              decode_bandwidth(args.model, args.batch_sizes, eager, peak, args.steps)]
    report["decode"] = decode
    for row in decode:
        print(f"batch {row['batch']:>3} {'eager' if row['eager'] else 'graph'}: {row['step_ms']:.2f} ms/step, "
              f"{row['bandwidth_gb_s']:,.0f} GB/s = {row['share_of_peak']:.0%} of {peak:,.0f}", flush=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
