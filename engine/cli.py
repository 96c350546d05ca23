"""`serveplan engine ...`: run the real engine from the shell.

Parsers are declared here without importing torch; the handlers import the engine lazily so
that planning commands start fast.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_engine_commands(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Adds `engine generate`; returns the `engine` subcommands so the planner can add `engine bench`."""
    engine = sub.add_parser("engine", help="run the PyTorch engine").add_subparsers(
        dest="engine_command", required=True, metavar="ACTION"
    )
    p = engine.add_parser("generate", help="generate text for one or more prompts, streaming")
    p.add_argument("prompts", nargs="+", help="prompt text (each argument is one request)")
    p.add_argument("--model", default="smollm2-135m", help="catalog name, checkpoint folder or .gguf file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--raw", action="store_true", help="do not wrap prompts in the model's chat template")
    p.add_argument("--random-weights", action="store_true", help="random weights from the config (no checkpoint)")
    p.add_argument("--device", default="auto")
    p.add_argument("--weight-dtype", default="auto", choices=["auto", "int8", "int4", "fp8"],
                   help="quantise the transformer layers' weights (auto = no quantisation)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV-cache format (auto = the model dtype)")
    p.add_argument("--int8-kernel", default="auto", choices=["auto", "dynamic"],
                   help="int8 weights on the CPU: weight-only (auto) or fbgemm W8A8 with per-token dynamic activations")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--json", action="store_true", help="print outputs and per-request metrics as JSON")
    p.set_defaults(func=cmd_generate)
    add_serve_parser(engine)
    return engine


def cmd_generate(args: argparse.Namespace) -> None:
    from engine.core import SamplingParams
    from engine.errors import InputError
    from engine.llm import LLM

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
        )
    except ValueError as exc:
        raise InputError.from_value_error(exc, rename=lambda field: f"--{field.replace('_', '-')}") from None
    llm = LLM(
        args.model,
        device=args.device,
        random_weights=args.random_weights,
        weight_dtype=args.weight_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        int8_kernel=args.int8_kernel,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    chat = not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template is not None
    request_ids = llm.submit(args.prompts, params, chat=chat)
    single = len(request_ids) == 1
    shown = ""
    for _event in llm.run_until_finished(request_ids):
        if single and not args.json and llm.tokenizer is not None:
            # Decode the whole output each time: a token alone may be half of a character.
            text = llm.output_text(request_ids[0])
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    outputs = [llm.output(r) for r in request_ids]
    if args.json:
        print(json.dumps([_as_dict(o) for o in outputs], indent=2))
        return
    if single:
        print()
    else:
        for prompt, out in zip(args.prompts, outputs, strict=True):
            print(f"--- {prompt!r}\n{out.text}")
    for out in outputs:
        m = out.metrics
        print(
            f"[{out.request_id}] {m.prompt_tokens} prompt + {m.output_tokens} output tokens, finish={out.finish_reason}, "
            f"TTFT {m.ttft_s * 1e3:.1f} ms, TPOT {m.tpot_s * 1e3:.1f} ms, E2E {m.e2e_s * 1e3:.1f} ms",
            file=sys.stderr,
        )


def _as_dict(out: object) -> dict:
    from dataclasses import asdict

    return asdict(out)


# --------------------------------------------------------------------------- serve


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine settings a served or benchmarked engine takes (those of `engine bench`)."""
    p.add_argument("--random-weights", action="store_true", help="random weights from the config (no checkpoint)")
    p.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda[:N]'")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-gib", type=float, help="KV-cache size (default: 1 GiB on CPU, free memory on CUDA)")
    p.add_argument("--num-kv-blocks", type=int, help="exact KV block count (overrides --kv-cache-gib)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per engine step")
    p.add_argument("--max-num-seqs", type=int, default=16, help="most requests running at once")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's context)")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")


def engine_settings(args: argparse.Namespace) -> dict[str, object]:
    """The LLM keyword arguments add_engine_flags' flags give."""
    return dict(
        device=args.device, dtype=args.dtype, random_weights=args.random_weights, kv_cache_gib=args.kv_cache_gib,
        num_kv_blocks=args.num_kv_blocks, block_size_tokens=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def add_serve_parser(engine: argparse._SubParsersAction) -> None:
    p = engine.add_parser("serve", help="serve the engine over an OpenAI-compatible HTTP API (docs/serving.md)")
    p.add_argument("--model", default="smollm2-135m", help="catalog name, checkpoint folder or .gguf file")
    p.add_argument("--served-model-name", help="the name clients send as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (docs/serving.md: there is no authentication)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    add_engine_flags(p)
    p.add_argument("--max-prompt-tokens", type=int, help="longest prompt accepted (default: max model length - 1)")
    p.add_argument("--max-output-tokens", type=int, help="largest max_tokens accepted (default: max model length - 1)")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests waiting for the engine before new ones get 429 Too Many Requests")
    p.add_argument("--retry-after", type=int, default=1, help="Retry-After of a 429, seconds")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body, bytes")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on Ctrl-C / SIGTERM, seconds in-flight requests may take to finish before they are aborted")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    from pydantic import ValidationError

    from engine.errors import InputError
    from engine.llm import LLM
    from engine.serve.api import ServeSettings
    from engine.serve.server import serve

    if not 0 <= args.port <= 65535:
        raise InputError("--port", args.port, "must be in 0..65535")
    flags = {"served_model_name": "model", "retry_after_s": "retry_after", "shutdown_timeout_s": "shutdown_timeout"}
    values = {field: getattr(args, flags.get(field, field)) for field in ServeSettings.model_fields}
    try:
        settings = ServeSettings(**{**values, "served_model_name": args.served_model_name or args.model})
    except ValidationError as exc:
        err = exc.errors()[0]
        flag = "--" + flags.get(str(err["loc"][0]), str(err["loc"][0])).replace("_", "-")
        raise InputError(flag, err.get("input"), err["msg"]) from None
    serve(LLM(args.model, **engine_settings(args)), settings, args.host, args.port)
