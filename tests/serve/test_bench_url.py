"""`serveplan bench --url` against our own server agrees with `engine bench` on the same workload.

Counts and lengths must agree exactly (requests, prompt and output tokens of every request,
follow-up prompts built from real outputs, one chunk per token); times are only checked for
order (send <= first token <= chunks <= finish). How much the HTTP path adds is measured by
bench/serve_overhead.py and reported in docs/serving.md, not asserted here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import re
import socket

import pytest

from engine.llm import LLM
from planner.cli import main
from planner.endpoint_bench import BenchReport, bench_endpoint
from planner.engine_bench import bench_engine
from planner.playback import Replay
from planner.workload import ClosedLoopArrivals, Conversation, FixedLength, PoissonArrivals, SharedPrefix, Workload

from .helpers import RunningServer, running_server

VOCAB = 256


def engine(byte_model: Path) -> LLM:
    return LLM(str(byte_model), random_weights=True, seed=3, block_size_tokens=4, num_kv_blocks=512,
               max_num_batched_tokens=256, max_num_seqs=8)


def workload(**changes: object) -> Workload:
    base = dict(name="tiny", arrival=PoissonArrivals(rate_per_s=100.0), input_tokens=FixedLength(tokens=12),
                output_tokens=FixedLength(tokens=6), num_requests=12, first_token_id=10, vocab_size_tokens=VOCAB)
    return Workload(**{**base, **changes})


@pytest.fixture(scope="module")
def server(byte_model: Path) -> Iterator[RunningServer]:
    with running_server(engine(byte_model)) as s:
        yield s


WORKLOADS = {
    "poisson with shared prefixes": workload(shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=16, share=0.5)),
    "closed loop, two-turn conversations": workload(arrival=ClosedLoopArrivals(concurrency=3), num_requests=10,
                                                    conversation=Conversation(min_turns=2, max_turns=2)),
}


@pytest.mark.parametrize("name", WORKLOADS)
def test_bench_url_agrees_with_engine_bench(byte_model: Path, server: RunningServer, name: str) -> None:
    w = WORKLOADS[name]
    local_summary, local = bench_engine(engine(byte_model), Replay.of(w, VOCAB), model_name="tiny")
    run = bench_endpoint(server.base_url, "tiny", Replay.of(w, VOCAB), arrival=w.arrival.kind)
    remote = run.summary
    assert remote is not None and remote.source == "endpoint"

    assert remote.num_requests == local_summary.num_requests == w.num_requests
    assert remote.num_finished == local_summary.num_finished == w.num_requests
    assert remote.finish_reasons == local_summary.finish_reasons == {"length": w.num_requests}
    by_id = {m.request_id: m for m in local.requests}
    for r in run.requests:
        m = by_id[r.request_id]
        assert (r.prompt_tokens, r.server_prompt_tokens, r.output_tokens) == (m.prompt_tokens,) * 2 + (m.output_tokens,)
        assert r.chunk_tokens == [1] * r.output_tokens  # one step, one token, one chunk
        assert r.send_s <= r.first_token_s <= r.chunk_times_s[-1] <= r.finish_s
        assert r.chunk_times_s == sorted(r.chunk_times_s) and r.due_s <= r.send_s
    assert remote.itl_ms.count == local_summary.itl_ms.count
    assert remote.throughput.input_tokens_per_s > 0 and remote.queueing_ms.count == 0  # not visible to a client
    assert run.client.token_count_source == "token_ids"


def test_released_by_and_think_times_record_the_replay_rules(server: RunningServer) -> None:
    w = workload(arrival=ClosedLoopArrivals(concurrency=2, think_time_s=0.01), num_requests=6,
                 conversation=Conversation(min_turns=3, max_turns=3))
    run = bench_endpoint(server.base_url, "tiny", Replay.of(w, VOCAB), arrival="closed_loop")
    finish = {r.request_id: r.finish_s for r in run.requests}
    for r in run.requests:
        if r.parent_id is not None:
            assert r.released_by == r.parent_id
        if r.released_by is not None:
            assert r.due_s == pytest.approx(finish[r.released_by] + r.think_s)
    assert sum(r.released_by is None for r in run.requests) == 2  # each user's first turn


def test_cli_sweeps_concurrency_and_writes_the_bench_file(server: RunningServer, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "w.json"
    spec.write_text(workload().model_dump_json())
    args = ["bench", "--url", server.base_url, "--model", "tiny", "--workload", str(spec), "--requests", "6",
            "--vocab-size", str(VOCAB), "--slo", "ttft_p99_ms<=60000"]
    assert main([*args, "--concurrency", "1,3", "--json"]) == 0
    result = BenchReport.model_validate_json(capsys.readouterr().out)
    assert result.sweep == "concurrency" and [r.client.concurrency for r in result.runs] == [1, 3]
    assert all(r.summary.num_finished == 6 and r.summary.goodput.slo_met for r in result.runs)
    assert result.max_goodput_point in (1, 3) and result.max_goodput_requests_per_s > 0
    assert main([*args, "--rate", "200", "--max-concurrency", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tiny, 6 of 6 requests finished" in out and "(measured)" in out and "max goodput" not in out


def test_cli_refusals(server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wide = tmp_path / "wide-vocabulary.json"
    wide.write_text(workload(vocab_size_tokens=30_000).model_dump_json())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"  # bound, not listening: refused at once
    cases = [
        (["--url", closed, "--model", "tiny"], "--url=.* cannot reach"),
        (["--url", server.base_url, "--model", "gpt-4o"], r"serves \['tiny'\], not --model 'gpt-4o'"),
        (["--url", "ftp://x", "--model", "tiny"], "must be an http:// or https:// base URL"),
        (["--url", server.base_url, "--model", "tiny", "--rate", "1,x"], "--rate='1,x' is invalid: must be a comma"),
        (["--url", server.base_url, "--model", "tiny", "--rate", "1", "--concurrency", "2"], "not both"),
        (["--url", server.base_url, "--model", "tiny", "--workload", str(wide)],
         r"refused bench's first request \(HTTP 400\): prompt=.* token ids must lie in \[0, 260\)"),
    ]
    for flags, message in cases:
        assert main(["bench", *flags, "--requests", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("serveplan: error: ") and re.search(message, err) and "Traceback" not in err, err
