"""The disaggregated engine: prefill and decode workers in two processes give the greedy tokens of
one engine, move exactly each prompt's KV, wait for staging room when it is full, and refuse bad
input before any worker sees it."""

from __future__ import annotations

import math
from pathlib import Path
import random

import pytest

from engine.core import SamplingParams
from engine.disagg import DisaggregatedLLM
from engine.errors import InputError
from engine.llm import LLM

KNOBS = {"random_weights": True, "seed": 7, "max_num_batched_tokens": 512, "max_num_seqs": 16, "block_size_tokens": 4,
         "threads": 1}
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # tiny Llama: layers x K/V x block x KV heads x head_dim x fp32


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(256) for _ in range(16)]
    out = [[rng.randrange(256) for _ in range(rng.randrange(3, 40))] for _ in range(5)]
    out += [prefix + [rng.randrange(256) for _ in range(rng.randrange(1, 9))] for _ in range(3)]  # decode-side prefix hits
    return out + [[42]]  # a one-token prompt: nothing to send


def test_two_processes_give_the_tokens_of_one_engine(model_dir: Path) -> None:
    ps = prompts()
    expected = [o.token_ids for o in LLM(str(model_dir), **KNOBS).generate(ps, PARAMS)]
    # 12 staging blocks for prompts of up to 10: sends wait for the decode side to release staging.
    with DisaggregatedLLM(str(model_dir), decode_workers=2, kv_transfer_gib=12 * BLOCK_BYTES / 2**30, **KNOBS) as llm:
        outs = llm.generate(ps, PARAMS)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    for p, o in zip(ps, outs, strict=True):
        blocks = math.ceil((len(p) - 1) / 4)
        if blocks == 0:
            assert o.transfer is None
            continue
        assert o.transfer.num_blocks == blocks and o.transfer.nbytes == blocks * BLOCK_BYTES
        assert o.transfer.send_s >= 0 and o.transfer.wire_s >= 0
        assert 0 <= o.metrics.queueing_s <= o.metrics.ttft_s <= o.metrics.e2e_s
    assert {o.decode_worker for o in outs} == {0, 1}
    roles = [s.role for s in stats]
    assert roles == ["prefill", "decode", "decode"]
    # The prefill worker ran every request for one token; the decode workers every token.
    assert stats[0].scheduler.num_finished["length"] == len(ps)
    assert sum(s.scheduler.num_finished["length"] for s in stats[1:]) == len(ps)


def test_a_preempting_decode_worker_still_gives_the_same_tokens(model_dir: Path) -> None:
    rng = random.Random(3)
    ps = [[rng.randrange(256) for _ in range(rng.randrange(20, 40))] for _ in range(8)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(model_dir), **KNOBS).generate(ps, params)]
    # 40 decode blocks for 8 requests of up to 63 tokens: the decode worker must preempt.
    with DisaggregatedLLM(str(model_dir), decode={"num_kv_blocks": 40}, **KNOBS) as llm:
        outs = llm.generate(ps, params)
        decode_stats = llm.stats()[1].scheduler
    assert [o.token_ids for o in outs] == expected
    assert decode_stats.num_preemptions > 0


def test_bad_input_is_refused_before_a_worker_sees_it(model_dir: Path) -> None:
    with pytest.raises(InputError, match="prefill_workers"):
        DisaggregatedLLM(str(model_dir), prefill_workers=0, **KNOBS)
    with pytest.raises(InputError, match="max_num_seqs"):
        DisaggregatedLLM(str(model_dir), decode={"max_num_seqs": 0}, **KNOBS)
    with pytest.raises(InputError, match="tensor_parallel"):  # a worker's KV moves from one process's caches
        DisaggregatedLLM(str(model_dir), prefill={"tensor_parallel": 2}, **KNOBS)
    with DisaggregatedLLM(str(model_dir), kv_transfer_gib=4 * BLOCK_BYTES / 2**30, **KNOBS) as llm:
        with pytest.raises(InputError, match="staging"):
            llm.add_request(list(range(40)), PARAMS)  # 10 blocks to send, 4 staging slots
        with pytest.raises(InputError, match="token ids"):
            llm.add_request([999], PARAMS)
        with pytest.raises(InputError, match="max_model_len"):
            llm.add_request([1] * 250, PARAMS)
        [out] = llm.generate([[1, 2, 3, 4, 5]], PARAMS)  # still serving
        assert len(out.token_ids) == PARAMS.max_tokens


def test_a_workload_replayed_through_the_workers_reports_every_request_and_transfer(model_dir: Path) -> None:
    from planner.engine_bench import bench_disaggregated
    from planner.playback import Replay
    from planner.workload import ConstantArrivals, FixedLength, Workload

    w = Workload(name="tiny", arrival=ConstantArrivals(rate_per_s=200.0), input_tokens=FixedLength(tokens=13),
                 output_tokens=FixedLength(tokens=5), num_requests=6, first_token_id=10, vocab_size_tokens=256)
    with DisaggregatedLLM(str(model_dir), **KNOBS) as llm:
        summary, record = bench_disaggregated(llm, Replay.of(w, 256), model_name="tiny")
    assert summary.num_finished == summary.num_requests == 6 and summary.finish_reasons == {"length": 6}
    assert all(r.output_tokens == 5 for r in record.requests)
    # Each prompt's KV but its last token: 12 tokens, three 4-token blocks.
    assert summary.kv_transfer.requests == 6
    assert summary.kv_transfer.mb_per_request_mean == pytest.approx(3 * BLOCK_BYTES / 1e6)
