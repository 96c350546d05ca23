"""`serveplan engine ...`: run the real engine from the shell.

Parsers are declared here without importing torch; the handlers import the engine lazily so
that planning commands start fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.cpu import default_threads
from engine.knobs import add_flags, command, settings, values

if TYPE_CHECKING:
    from engine.llm import RequestOutput

ENGINE = settings(EngineConfig)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Every engine setting as a flag, for each command that runs the engine."""
    # A CPU engine serves a handful of sequences at once; the Python API keeps EngineKnobs' defaults.
    add_flags(p, ENGINE, max_num_seqs=16, max_num_batched_tokens=2048)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings the flags give; threads default to the physical cores (engine/cpu.py),
    shared out among the ranks of a parallel engine (each rank's torch runs that many)."""
    ranks = max(args.tensor_parallel, args.expert_parallel)
    return values(args, ENGINE) | {"threads": args.threads or max(1, default_threads() // ranks)}


def add_engine_commands(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Adds `engine generate`; returns the `engine` subcommands so the planner can add `engine bench`."""
    engine = sub.add_parser("engine", help="run the PyTorch engine").add_subparsers(
        dest="engine_command", required=True, metavar="ACTION"
    )
    p = engine.add_parser("generate", help="generate text for one or more prompts, streaming")
    p.add_argument("prompts", nargs="+", help="prompt text (each argument is one request)")
    p.add_argument("--model", default="smollm2-135m", help="catalog name, checkpoint folder or .gguf file")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--raw", action="store_true", help="do not wrap prompts in the model's chat template")
    add_engine_flags(p)
    p.add_argument("--json", action="store_true", help="print outputs and per-request metrics as JSON")
    command(p, cmd_generate)
    add_serve_parser(engine)
    return engine


def cmd_generate(args: argparse.Namespace) -> None:
    from engine.core import SamplingParams
    from engine.llm import LLM

    # SamplingParams raises InputError naming its field (`temperature`); `serveplan` names the flag.
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    llm = LLM(args.model, **engine_settings(args))
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


def _as_dict(out: RequestOutput) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(out)


# --------------------------------------------------------------------------- serve


def add_serve_parser(engine: argparse._SubParsersAction) -> None:
    from engine.serve.settings import ServeSettings

    p = engine.add_parser("serve", help="serve the engine over an OpenAI-compatible HTTP API (docs/serving.md)")
    p.add_argument("--model", default="smollm2-135m", help="catalog name, checkpoint folder or .gguf file")
    add_flags(p, settings(ServeSettings))
    add_engine_flags(p)
    command(p, cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    from engine.llm import LLM
    from engine.serve.server import serve
    from engine.serve.settings import ServeSettings

    served = ServeSettings(**values(args, settings(ServeSettings)))
    serve(LLM(args.model, **engine_settings(args)), served.model_copy(
        update={"served_model_name": served.served_model_name or args.model}))
