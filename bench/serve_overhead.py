"""What the HTTP path adds: `serveplan bench --url` against `serveplan engine serve` versus
`serveplan engine bench` in process, same engine settings, same workload, same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/serve_overhead.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/serve_overhead.py --model smollm2-135m --requests 16

The server runs in its own process (`serveplan engine serve`, as deployed), the client in this
one. Each workload is closed loop with fixed prompt and output lengths, so TTFT, TPOT and E2E
compare request for request. The runs alternate (engine, endpoint, engine, endpoint, ...) and the
medians of the repeats are reported, so machine noise hits both alike; each pair draws new
prompts (a new seed), so no prefix cache holds them from an earlier run, and both sides warm up
on a run of their own first. Differences:
- per request: endpoint TTFT - engine TTFT (HTTP request, JSON, admission through the engine
  thread's queue, the first SSE event);
- per token: endpoint TPOT - engine TPOT (one SSE event per token through the event loop);
and the endpoint / engine ratio of output-token throughput. The default model is a tiny random-weight
Llama (a step takes about a millisecond), so the HTTP share is as large as it gets.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import TypedDict

import httpx
import torch

from engine.llm import LLM
from planner.endpoint_bench import bench_endpoint
from planner.engine_bench import bench_engine
from planner.playback import Replay
from planner.workload import ClosedLoopArrivals, FixedLength, Workload

TINY_VOCAB = 256
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": TINY_VOCAB,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
ENGINE = {"num_kv_blocks": 1024, "block_size_tokens": 16, "max_num_seqs": 16, "max_num_batched_tokens": 2048}
STARTUP_TIMEOUT_S = 300


class Point(TypedDict):
    """One concurrency's medians, per side, and what the HTTP path adds."""

    engine: dict[str, float]
    endpoint: dict[str, float]
    per_request_overhead_ms: float
    per_token_overhead_ms: float
    throughput_ratio: float


def start_server(model: str, random_weights: bool, port: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "planner.cli", "engine", "serve", "--model", model, "--served-model-name", "bench",
           "--port", str(port), "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--block-size",
           str(ENGINE["block_size_tokens"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
           "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"])]
    if random_weights:
        cmd.append("--random-weights")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            assert server.stderr is not None  # stderr=PIPE
            raise SystemExit(f"the server exited: {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.2)
    server.terminate()
    raise SystemExit("the server did not start")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="catalog name, folder or .gguf (default: a tiny random-weight Llama)")
    parser.add_argument("--requests", type=int, default=48, help="requests per run")
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8", help="closed-loop users, comma list")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    folder = None
    if args.model is None:
        folder = Path(tempfile.mkdtemp(prefix="serve-overhead-"))
        (folder / "config.json").write_text(json.dumps(TINY))
    model, random_weights = (str(folder), True) if folder is not None else (args.model, False)
    llm = LLM(model, random_weights=random_weights, **ENGINE)
    port = free_port()
    server = start_server(model, random_weights, port)
    url = f"http://127.0.0.1:{port}/v1"
    points: dict[str, Point] = {}
    results = {"model": args.model or "tiny random-weight Llama (2 layers, hidden 64)", "engine": ENGINE,
               "torch_threads_client": torch.get_num_threads(), "points": points}
    try:
        for users in (int(c) for c in args.concurrency.split(",")):
            def replay(seed: int, users: int = users) -> Replay:
                # A new seed, new prompts: neither side's prefix cache holds them from an earlier run.
                workload = Workload(name=f"c{users}-s{seed}", arrival=ClosedLoopArrivals(concurrency=users),
                                    input_tokens=FixedLength(tokens=args.input_tokens),
                                    output_tokens=FixedLength(tokens=args.output_tokens), num_requests=args.requests,
                                    first_token_id=10, vocab_size_tokens=min(llm.config.vocab_size, 30_000), seed=seed)
                return Replay.of(workload, llm.config.vocab_size)

            bench_endpoint(url, "bench", replay(10_000), arrival="closed_loop")  # warm both up, untimed
            bench_engine(llm, replay(20_000), model_name="bench")
            rows: dict[str, list[dict[str, float]]] = {"engine": [], "endpoint": []}
            for seed in range(args.repeats):
                local, _ = bench_engine(llm, replay(seed), model_name="bench")
                remote = bench_endpoint(url, "bench", replay(seed), arrival="closed_loop").summary
                if remote is None:
                    raise SystemExit(f"concurrency {users}, seed {seed}: no request to the endpoint finished")
                for side, s in (("engine", local), ("endpoint", remote)):
                    rows[side].append({"ttft_ms": s.ttft_ms.p50, "tpot_ms": s.tpot_ms.p50, "e2e_ms": s.e2e_ms.p50,
                                       "output_tokens_per_s": s.throughput.output_tokens_per_s})
            med = {side: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for side, runs in rows.items()}
            points[f"concurrency_{users}"] = {
                "engine": med["engine"],
                "endpoint": med["endpoint"],
                "per_request_overhead_ms": med["endpoint"]["ttft_ms"] - med["engine"]["ttft_ms"],
                "per_token_overhead_ms": med["endpoint"]["tpot_ms"] - med["engine"]["tpot_ms"],
                "throughput_ratio": med["endpoint"]["output_tokens_per_s"] / med["engine"]["output_tokens_per_s"],
            }
    finally:
        server.terminate()
        server.wait(timeout=60)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{results['model']}; {args.requests} requests of {args.input_tokens} + {args.output_tokens} tokens per run, "
          f"median of {args.repeats} alternating runs (P50 latencies, ms)")
    print(f"{'users':>5} {'side':>9} {'TTFT':>8} {'TPOT':>8} {'E2E':>9} {'out tok/s':>10}")
    for point, row in points.items():
        for side, r in (("engine", row["engine"]), ("endpoint", row["endpoint"])):
            print(f"{point.split('_')[1]:>5} {side:>9} {r['ttft_ms']:8.2f} {r['tpot_ms']:8.3f} {r['e2e_ms']:9.1f} "
                  f"{r['output_tokens_per_s']:10.1f}")
        print(f"      HTTP adds {row['per_request_overhead_ms']:.2f} ms per request (TTFT), "
              f"{row['per_token_overhead_ms']:.3f} ms per token (TPOT); throughput x{row['throughput_ratio']:.3f}")


if __name__ == "__main__":
    main()
