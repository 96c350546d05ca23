"""llama.cpp's side of bench/engine_vs_llamacpp.py, run by the python of a venv that has
llama-cpp-python (not this project's: it builds from source and needs neither torch nor us).

    /work/llamacpp-venv/bin/python bench/llamacpp_peer.py --model F.gguf --threads 2 --n-ctx 512

Loads the GGUF once, then answers one JSON request per stdin line, {"prompt_ids": [...],
"max_tokens": N}, with one JSON line: the greedy token ids and the seconds from the first
generated token to the last (decode only, prefill excluded, as the engine's side measures).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from llama_cpp import Llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--n-ctx", type=int, default=512)
    args = parser.parse_args()
    llm = Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                seed=0, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        tokens: list[int] = []
        first = last = time.perf_counter()
        # reset=True: no KV reuse between requests, each prompt is prefilled in full as ours is.
        for token in llm.generate(request["prompt_ids"], top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            last = time.perf_counter()
            if not tokens:
                first = last
            tokens.append(int(token))
            if len(tokens) == request["max_tokens"]:
                break
        print(json.dumps({"token_ids": tokens, "decode_s": last - first}), flush=True)


if __name__ == "__main__":
    main()
