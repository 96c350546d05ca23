"""Tensor and expert parallelism across processes give what one process gives.

A rank holds a slice of every weight and sums partial results by all-reduce, so its logits differ
from one process's only by the order fp32 partial sums are added: the tests hold them to 1e-5 of
the largest logit (measured: 6-7e-7 on these models, docs/parallelism.md) and the greedy tokens to
equality. Every test spawns real processes over gloo, as `--tp` does."""

from __future__ import annotations

from collections.abc import Callable
import json
import multiprocessing as mp
from pathlib import Path
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.core import SamplingParams
from engine.errors import InputError
from engine.llm import LLM
from engine.parallel.shm import SLOT_BYTES
from tests.parallel.ranks import logits, rank_all_reduce, rank_logits

# fp32 logits of a sharded model against one process's: max |difference| / max |logit|.
LOGIT_TOLERANCE = 1e-5
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]

# Random weights with a wide initialiser and untied embeddings: logits far apart enough that the
# greedy text varies from token to token (a tied, narrow init only echoes the prompt's last token).
DENSE = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 251, "initializer_range": 0.3}
MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
       "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "initializer_range": 0.3}


def sharded_logits(model_dir: Path, world: int, expert_parallel: bool, prompt: list[int], decode: list[int],
                   tmp_path: Path) -> np.ndarray:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = (tmp_path / f"rendezvous-{world}-{expert_parallel}").as_uri()
    procs = [ctx.Process(target=rank_logits, args=(r, world, init, str(model_dir), prompt, decode, expert_parallel,
                                                   results)) for r in range(world)]
    for p in procs:
        p.start()
    out = results.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


@pytest.mark.parametrize(("name", "changes", "world", "ep"), [
    ("dense", DENSE, 2, False),
    ("kv-replicated", {**DENSE, "num_key_value_heads": 1}, 2, False),  # one KV head shared by both ranks
    ("qkv-bias", {**DENSE, "model_type": "qwen2", "num_key_value_heads": 4}, 4, False),
    ("moe-width", MOE, 2, False),
    ("moe-experts", MOE, 2, True),
])
def test_sharded_logits_match_one_process(tiny_model: Callable[..., Path], tmp_path: Path, name: str,
                                          changes: dict, world: int, ep: bool) -> None:
    model_dir = tiny_model(f"tp-{name}", **changes)
    prompt, decode = [3, 17, 42, 99, 5, 250, 8, 61, 77], [12, 200, 31]
    one = logits(str(model_dir), prompt, decode).numpy()
    many = sharded_logits(model_dir, world, ep, prompt, decode, tmp_path)
    assert many.shape == one.shape == (len(prompt) + len(decode), changes["vocab_size"])
    assert np.abs(many - one).max() <= LOGIT_TOLERANCE * np.abs(one).max()
    assert (many.argmax(-1) == one.argmax(-1)).all()


def test_all_reduce_gives_every_rank_the_same_sum_on_both_paths(tmp_path: Path) -> None:
    """Messages up to a slot go through shared memory, larger ones through gloo: both sum within
    float rounding, and every rank holds the same bits, or tensor-parallel ranks drift apart."""
    limit = SLOT_BYTES // 4
    numels = [4, 1024, limit, limit + 4]  # fp32 elements: up to the limit, then just past it
    world = 3  # three addends: an order of summation can differ between ranks
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_all_reduce, args=(r, world, (tmp_path / "rv").as_uri(), numels, results))
             for r in range(world)]
    for p in procs:
        p.start()
    by_rank = dict(results.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for i, n in enumerate(numels):
        summed, exact = by_rank[0][i]
        assert summed.shape == (n,)
        np.testing.assert_allclose(summed, exact, rtol=1e-5, atol=1e-5)
        for rank in range(1, world):
            assert np.array_equal(by_rank[rank][i][0], summed), (n, rank)


def batch(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


@pytest.mark.parametrize(("changes", "parallel"), [(DENSE, {"tensor_parallel": 2}), (MOE, {"expert_parallel": 2})])
def test_engine_generates_what_one_process_does(tiny_model: Callable[..., Path], changes: dict, parallel: dict) -> None:
    """The whole engine: continuous batching, chunked prefill and prefix hits over two ranks."""
    model_dir = tiny_model("tp-engine-" + "-".join(parallel), **changes)
    knobs = {"random_weights": True, "seed": 3, "num_kv_blocks": 96, "block_size_tokens": 4,
             "max_num_batched_tokens": 24, "max_num_seqs": 4}
    prompts = batch(6, seed=1) + [batch(1, seed=1)[0] + [7, 7]]  # the last shares the first's prefix
    expected = [o.token_ids for o in LLM(str(model_dir), **knobs).generate(prompts, GREEDY)]
    llm = LLM(str(model_dir), **knobs, **parallel)
    assert llm.runner is None and llm.engine_config.tensor_parallel == 2
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    # A second engine over the same ranks (as validation makes one per workload) starts clean.
    again = llm.with_settings(num_kv_blocks=48)
    assert [o.token_ids for o in again.generate(prompts[:3], GREEDY)] == expected[:3]
    seconds, calls = again.executor.comm_stats()[0]  # type: ignore[attr-defined]
    assert calls["all_reduce"] > 0 and seconds["all_reduce"] > 0
    assert ("all_to_all" in calls) == ("expert_parallel" in parallel)


def test_a_rank_that_dies_stops_the_engine_with_a_message(tiny_model: Callable[..., Path]) -> None:
    llm = LLM(str(tiny_model("tp-dies", **DENSE)), random_weights=True, num_kv_blocks=16, tensor_parallel=2)
    llm._loaded._procs[1].kill()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        llm.generate([[1, 2, 3]], GREEDY)


def test_settings_a_parallel_engine_cannot_run_are_refused(tiny_model: Callable[..., Path]) -> None:
    model_dir = str(tiny_model("tp-refused", **DENSE))
    with pytest.raises(InputError, match="tensor_parallel.*must divide the 4 attention heads"):
        LLM(model_dir, random_weights=True, tensor_parallel=3)
    with pytest.raises(InputError, match="expert_parallel.*no routed experts"):
        LLM(model_dir, random_weights=True, expert_parallel=2)
    with pytest.raises(InputError, match="every tensor-parallel rank or on none"):
        LLM(model_dir, random_weights=True, tensor_parallel=4, expert_parallel=2)
    with pytest.raises(InputError, match="speculative.*ngram.*tensor_parallel=1 only"):
        LLM(model_dir, random_weights=True, tensor_parallel=2,
            speculative={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(InputError, match="weight_dtype.*int8.*tensor_parallel=1 only"):
        LLM(model_dir, random_weights=True, tensor_parallel=2, weight_dtype="int8")


@pytest.fixture(scope="module", params=[(DENSE, ["--tp", "2"]), (MOE, ["--ep", "2"])], ids=["dense-tp2", "moe-ep2"])
def text_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A random-weight Qwen3 (dense, or MoE for expert parallelism) that reads and writes text:
    SmolLM2's tokenizer beside its config; with the flags that split it over two processes."""
    from engine.model.loader import load_model

    config, flags = request.param
    folder = tmp_path_factory.mktemp("parallel-text")
    tokenizer = load_model("smollm2-135m").tokenizer
    assert tokenizer is not None
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "max_position_embeddings": 256,
                                                    "vocab_size": len(tokenizer)}))
    return folder, flags


def test_cli_generate_over_two_processes_prints_the_text_of_one(text_model: tuple[Path, list[str]]) -> None:
    """`engine generate --tp 2` (dense) and `--ep 2` (MoE) against one process."""
    folder, flags = text_model

    def generate(*extra: str) -> list[dict]:
        cmd = [sys.executable, "-m", "planner.cli", "engine", "generate", "--model", str(folder), "--random-weights",
               "--raw", "--max-tokens", "12", "--threads", "1", "--json", *extra, "The capital of France is", "Hello"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    one, parallel = generate(), generate(*flags)
    assert [o["text"] for o in parallel] == [o["text"] for o in one]
    assert all(o["text"] and len(o["token_ids"]) == 12 for o in one)
