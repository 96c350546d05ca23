"""`engine bench`: the real engine replays a workload in real time and reports the simulator's summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import InputError
from engine.llm import LLM
from planner.cli import main
from planner.engine_bench import bench_engine
from planner.playback import Replay
from planner.sim import simulate
from planner.workload import ClosedLoopArrivals, Conversation, FixedLength, PoissonArrivals, SharedPrefix, Workload


def llm(model_dir: Path, **knobs: object) -> LLM:
    return LLM(str(model_dir), random_weights=True, seed=3, block_size_tokens=4, max_num_batched_tokens=256, **knobs)


def workload(**extra: object) -> Workload:
    base = dict(name="tiny", arrival=PoissonArrivals(rate_per_s=200.0), input_tokens=FixedLength(tokens=12),
                output_tokens=FixedLength(tokens=6), num_requests=12, first_token_id=10, vocab_size_tokens=256)
    return Workload(**{**base, **extra})


def test_replays_every_request_and_reports_the_simulator_schema(model_dir: Path) -> None:
    w = workload(shared_prefix=SharedPrefix(num_prefixes=1, prefix_tokens=32, share=1.0))
    summary, record = bench_engine(llm(model_dir), Replay.of(w, 256), model_name="tiny")
    assert summary.source == "engine"
    assert summary.num_finished == summary.num_requests == 12
    assert summary.finish_reasons == {"length": 12}
    assert all(r.output_tokens == 6 and r.prompt_tokens == 44 for r in record.requests)
    assert summary.prefix_cache_hit_rate > 0.5  # 32 of 44 prompt tokens are shared (whole 4-token blocks)
    assert summary.ttft_ms.p50 > 0 and summary.itl_ms.count == 12 * 5
    assert summary.utilisation.mfu is None and summary.cost.usd_per_hour is None
    # Field for field the simulator's schema.
    from engine.catalog import resolve_model
    from planner.hardware import get_hardware
    from planner.specs import Deployment

    sim = simulate(resolve_model("llama-3.1-8b"), get_hardware("h100-sxm"), Deployment(hardware="h100-sxm"),
                   workload()).summary
    assert set(summary.model_dump()) == set(sim.model_dump())


def test_closed_loop_and_follow_ups_use_the_engine_outputs(model_dir: Path) -> None:
    w = workload(arrival=ClosedLoopArrivals(concurrency=2), num_requests=8,
                 conversation=Conversation(min_turns=2, max_turns=2))
    summary, record = bench_engine(llm(model_dir), Replay.of(w, 256), model_name="tiny")
    assert summary.num_finished == 8
    assert max(s.num_running + s.num_waiting for s in record.samples) <= 2
    # Turn 2's prompt = turn 1's prompt + its 6 output tokens + a new 12-token message.
    assert sorted(r.prompt_tokens for r in record.requests) == [12] * 4 + [30] * 4
    assert summary.prefix_cache_hit_rate > 0


def test_a_request_too_long_for_the_engine_is_refused_before_running(model_dir: Path) -> None:
    w = workload(input_tokens=FixedLength(tokens=200), output_tokens=FixedLength(tokens=100))
    with pytest.raises(InputError, match="must fit max_model_len=256"):
        bench_engine(llm(model_dir), Replay.of(w, 256), model_name="tiny")


def test_cli(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "w.json"
    spec.write_text(workload().model_dump_json())
    args = ["engine", "bench", "--model", str(model_dir), "--random-weights", "--workload", str(spec),
            "--requests", "4", "--block-size", "4", "--slo", "ttft_p99_ms<=60000"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_finished"] == 4 and data["goodput"]["slo_met"] is True
    assert main([*args, "--rate", "0"]) == 2
    assert "--rate='0' is invalid" in capsys.readouterr().err


def test_a_speculative_engine_drafts_under_bench(model_dir: Path) -> None:
    """bench runs the engine's own step loop, so an engine built with speculation drafts there too."""
    # The early-exit self-draft proposes at every decoding step, whatever the text.
    engine = llm(model_dir, speculative={"method": "self", "num_speculative_tokens": 2, "draft_layers": 1})
    summary, _ = bench_engine(engine, Replay.of(workload(num_requests=4), 256), model_name="tiny")
    assert summary.num_finished == 4
    stats = engine.spec_stats
    assert stats is not None and stats.num_proposals > 0 and stats.num_drafts > 0 and stats.num_steps > 0


@pytest.mark.parametrize("num_kv_blocks", [1, 2, 7])
def test_warm_up_fits_a_tiny_cache(model_dir: Path, num_kv_blocks: int) -> None:
    """The warm-up used to index past a cache of 7 blocks or fewer; it now sizes itself to the cache."""
    engine = llm(model_dir, num_kv_blocks=num_kv_blocks, max_model_len=4 * num_kv_blocks)
    w = workload(input_tokens=FixedLength(tokens=2), output_tokens=FixedLength(tokens=2), num_requests=3)
    summary, _ = bench_engine(engine, Replay.of(w, 256), model_name="tiny")
    assert summary.num_finished == 3
    assert engine.scheduler.stats().num_requests == 3  # the warm-up's own requests are not the engine's


def test_cli_replays_a_trace_and_keeps_a_workload_files_request_count(tiny_model, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 14 defect 5: a trace was always refused ("--requests does not apply to a trace", from a
    default of 16 requests) and a workload file's num_requests was silently replaced by that 16."""
    spec = tmp_path / "w.json"
    spec.write_text(workload(num_requests=5).model_dump_json())
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.01, "input_tokens": 6, "output_tokens": 2}) + "\n"
                             for i in range(3)))
    model_dir = tiny_model()  # 256 ids: a trace's ids used to start at 1000, above every one of them
    base = ["engine", "bench", "--model", str(model_dir), "--random-weights", "--block-size", "4", "--json"]
    for path, requests in ((spec, 5), (trace, 3)):
        assert main([*base, "--workload", str(path)]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["num_finished"] == requests
