"""Published runs replay as the engine ran them: data-parallel attention, the KV cache and links their sources show."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from planner.memory import plan_memory
from planner.public.calibration import prepare_all
from planner.public.data import PublicRun, public_runs
from planner.public.fit import Figures
from planner.public.replay import ReplayRun, predicted, prepare, stopping_at_eos
from planner.workload import FixedLength, UniformLength, draw_lengths

SOURCE = "gpustack-deepseek-r1-h200"


def _dp_attention_runs() -> list[PublicRun]:
    return [r for r in public_runs() if r.source_key == SOURCE and r.engine.args.get("enable_dp_attention")]


def test_sglang_dp_attention_at_dp_size_1_replays_as_tensor_parallel_attention() -> None:
    """GPUStack served DeepSeek-R1 with `--tp 8 --enable-dp-attention` and no `--dp`: SGLang turns
    the flag off at dp size 1, so the runs replay (saying so) instead of being set aside."""
    runs = _dp_attention_runs()
    prepared = {r.run_key: prepare(r) for r in runs}
    replayed = [p for p in prepared.values() if isinstance(p, ReplayRun)]
    set_aside = {k: p for k, p in prepared.items() if isinstance(p, str)}
    assert len(replayed) == 6
    assert list(set_aside.values()) == ["EAGLE speculative decoding: the draft head's acceptance is not published"]
    for run in replayed:
        assert run.dep.tensor_parallel == 8 and run.dep.attention_data_parallel == 1
        assert any("turns DP attention off at dp size 1" in a for a in run.assumptions)
    smallest = min(replayed, key=lambda r: r.run.client.num_prompts * (r.run.lengths.input_tokens or 10**9))
    values = predicted(smallest, smallest.simulate(Figures().params(smallest)).summary)
    assert values.keys() == {f.id for f in smallest.figures}
    assert all(math.isfinite(v) and v > 0 for v in values.values())


def test_dp_attention_with_a_dp_size_runs_attention_groups_inside_one_engine() -> None:
    run = next(r for r in _dp_attention_runs() if "speculative_algorithm" not in r.engine.args)
    grouped = run.model_copy(update={"deployment": run.deployment.model_copy(update={"data_parallel": 4})})
    replay = prepare(grouped)
    assert isinstance(replay, ReplayRun)
    assert replay.dep.attention_data_parallel == 4 and replay.dep.tensor_parallel == 8
    assert not any("dp size 1" in a for a in replay.assumptions)
    odd = run.model_copy(update={"deployment": run.deployment.model_copy(update={"data_parallel": 3})})
    assert prepare(odd) == "DP attention over 3 groups does not divide tensor parallel 8"
    # Without the flag, data parallelism is engines behind a router, which the data cannot describe.
    plain = grouped.model_copy(update={"engine": run.engine.model_copy(update={"args": {}})})
    assert prepare(plain) == "data-parallel engines behind one client are not replayed"


def test_a_run_replays_with_the_attention_kernels_its_backend_runs() -> None:
    """SGLang's --attention-backend: triton runs its Triton kernels, fa3 and flashinfer FlashAttention-class
    ones; a backend the simulator does not price sets the run aside, saying which."""
    runs = {r.run_key: r for r in public_runs()}
    kernels = {}
    for backend in ("triton", "fa3", "flashinfer"):
        replay = prepare(runs[f"gpustack-qwen3-14b-h100/sglang-fp8-attn-{backend}-sharegpt"])
        assert isinstance(replay, ReplayRun)
        kernels[backend] = replay.dep.attention_kernel
    assert kernels == {"triton": "triton", "fa3": "flash", "flashinfer": "flash"}
    default = prepare(runs["gpustack-qwen3-14b-h100/sglang-fp8-sharegpt"])
    assert isinstance(default, ReplayRun) and default.dep.attention_kernel is None  # the engine's choice
    run = runs["gpustack-qwen3-14b-h100/sglang-fp8-attn-triton-sharegpt"]
    torch_native = run.model_copy(update={"engine": run.engine.model_copy(
        update={"args": {**run.engine.args, "attention_backend": "torch_native"}})})
    assert prepare(torch_native) == "attention backend torch_native not modelled"


def test_a_run_replays_with_the_kv_cache_and_links_its_source_shows() -> None:
    """dennislee22's TP 2 runs: the README prints each test's KV cache per GPU, and the start-up logs
    say the GPUs had no peer access. The replay sizes the cache to the printed figure (the flags that
    led there are unpublished for some tests) and reduces over PCIe."""
    run = next(r for r in public_runs() if r.run_key.endswith("test6-qwen2.5-32b-tp2-random1024x1024-n10"))
    assert run.engine.kv_cache_gib_reported == 8.22 and not run.deployment.peer_access
    replay = prepare(run)
    assert isinstance(replay, ReplayRun)
    assert replay.dep.knobs.kv_cache_gib == 8.22 and not replay.dep.peer_access
    plan = plan_memory(replay.model, replay.hw, replay.dep, replay.max_model_len)
    assert plan.kv_cache_gib == pytest.approx(8.22) and plan.kv_cache_blocks == math.floor(8.22 * 2**30 / plan.kv_bytes_per_block_per_gpu)


def test_no_peer_access_is_recorded_with_where_it_shows() -> None:
    run = next(r for r in public_runs() if not r.deployment.peer_access)
    assert run.deployment.peer_access_source is not None and "lacks GPU P2P" in run.deployment.peer_access_source
    data = run.deployment.model_dump()
    with pytest.raises(ValidationError, match="peer_access_source"):
        type(run.deployment).model_validate({**data, "peer_access_source": None})
    with pytest.raises(ValidationError, match="peer_access_source"):
        type(run.deployment).model_validate({**data, "peer_access": True})


def test_a_run_replays_through_the_endpoint_its_client_called() -> None:
    """Chat runs pass the server's chat-template rendering, completions runs do not, in-process runs
    have no server: each run's deployment says which its client used."""
    seen = set()
    for run in public_runs():
        replay = prepare(run)
        if isinstance(replay, str):
            continue
        endpoint = run.client.endpoint
        assert replay.dep.api_server == (endpoint != "in-process")
        assert replay.dep.api_endpoint == ("completions" if endpoint == "completions" else "chat")
        seen.add(endpoint)
    assert seen == {"chat", "completions", "in-process"}


def _dennislee22(name: str) -> PublicRun:
    return next(r for r in public_runs() if r.run_key == f"dennislee22-vllm-benchmarking/{name}")


def test_a_run_replays_on_the_server_history_its_log_shows() -> None:
    """dennislee22's test 4 server ran n=10, n=1, then n=20 of the same seeded 1024-token prompts,
    each after vllm bench serve's test request (the run's first prompt): the n=20 run meets its
    first ten prompts cached (the page's log: 40.6 % cumulative, which those runs give). Each hit
    is the prompt's 63 full blocks of 16 (the last token is recomputed): 10 x 1008 of 20 x 1024."""
    run = prepare(_dennislee22("test4-qwen2.5-7b-tp1-random1024x1024-n20"))
    assert isinstance(run, ReplayRun)
    assert [p.num_prompts for p in run.run.client.served_before or ()] == [10, 1] and run.test_request
    summary = run.simulate(Figures().params(run)).summary
    assert summary.prefix_cache_hit_rate == pytest.approx(10 * 1008 / (20 * 1024))
    first = prepare(_dennislee22("test4-qwen2.5-7b-tp1-random1024x1024-n10"))
    assert isinstance(first, ReplayRun) and first.run.client.served_before == ()
    # A fresh server: only the test request's prompt 0 is warm.
    assert first.simulate(Figures().params(first)).summary.prefix_cache_hit_rate == pytest.approx(1008 / (10 * 1024))


def test_a_run_after_unpublished_runs_sets_its_ttft_aside() -> None:
    """The log shows the server had served these prompts in runs the page does not list: the cache
    at the start is unknown, so TTFT (prefill on that cache) is not predicted; decode figures are."""
    raw = _dennislee22("test4-qwen2.5-7b-tp1-random1024x1024-n1000")
    assert raw.client.served_unpublished and any(f.family == "ttft" for f in raw.figures)
    run = prepare(raw)
    assert isinstance(run, ReplayRun)
    assert {f.family for f in run.figures} == {"throughput", "tpot_itl"}
    assert any("TTFT and E2E figures set aside" in a for a in run.assumptions)
    prepared, set_aside = prepare_all([raw])  # the report lists them under what it set aside
    assert [p.run.run_key for p in prepared] == [raw.run_key]
    assert [(s.whole_run, s.figures) for s in set_aside] == [(False, 3)]


def test_a_server_history_of_other_prompt_lengths_is_refused() -> None:
    """vLLM's random prompts of another length share prefixes with these, which the replay does not draw."""
    data = _dennislee22("test4-qwen2.5-7b-tp1-random1024x1024-n20").model_dump()
    data["client"]["served_before"] = [{"num_prompts": 10, "input_tokens": 4096, "output_tokens": 4096}]
    with pytest.raises(ValidationError, match="served_before is replayed for random prompts of the run's own input"):
        PublicRun.model_validate(data)
    data["client"]["served_before"], data["client"]["served_unpublished"] = [], True
    with pytest.raises(ValidationError, match="served_before lists the server's whole history"):
        PublicRun.model_validate(data)


def test_outputs_that_stopped_at_eos_replay_at_the_published_mean() -> None:
    """vllm bench serve leaves EOS on: GPUStack's gpt-oss-20b asked for 200 tokens and generated
    107 per request, and the replay generates that many. SGLang's client ignores EOS, so its
    drawn lengths stand whatever a run's mean says; a mean at the asked length changes nothing."""
    run = next(r for r in public_runs() if r.run_key == "gpustack-gpt-oss-20b-a100/vllm-mxfp4-random4000x200")
    assert run.client.tool == "vllm-bench-serve" and run.lengths.mean_output_tokens == 107.06
    replay = prepare(run)
    assert isinstance(replay, ReplayRun)
    assert replay.workload.output_tokens == FixedLength(tokens=107)
    # SGLang's client at range ratio 1 asks for exactly 200 tokens, and gets them.
    as_sglang = run.model_copy(update={"client": run.client.model_copy(update={"tool": "sglang-bench-serving"}),
                                       "lengths": run.lengths.model_copy(update={"random_range_ratio": 1.0})})
    replay = prepare(as_sglang)
    assert isinstance(replay, ReplayRun) and replay.workload.output_tokens == FixedLength(tokens=200)
    assert stopping_at_eos(FixedLength(tokens=200), 200.0) == FixedLength(tokens=200)
    # A spread of asked lengths keeps its shape: each request generates the same share of its ask.
    assert stopping_at_eos(UniformLength(min_tokens=100, max_tokens=300), 150.0) == UniformLength(min_tokens=75, max_tokens=225)


def test_a_sharegpt_run_replays_the_sample_its_client_drew() -> None:
    """GPUStack's latency runs sampled 100 ShareGPT prompts whose replies average 220.6 tokens
    (ShareGPT's average under vLLM's filters is 201.6): the replay draws 100 requests with the
    published means, not the dataset's."""
    run = next(r for r in public_runs() if r.run_key == "gpustack-qwen3-8b-h100-latency/vllm-bf16-sharegpt-c4")
    assert run.client.num_prompts == 100 and run.lengths.mean_output_tokens == 220.61
    replay = prepare(run)
    assert isinstance(replay, ReplayRun)
    inputs, outputs = draw_lengths(replay.workload)
    assert inputs.mean() == pytest.approx(run.lengths.mean_input_tokens, rel=1e-3)
    assert outputs.mean() == pytest.approx(220.61, rel=1e-3)


def test_a_run_counts_the_streamed_events_its_client_times() -> None:
    """vllm bench serve times every SSE event with a choice (the server's role and finish chunks too);
    SGLang's bench_serving only events with text: each replay says which its client did."""
    seen = set()
    for run in public_runs():
        replay = prepare(run)
        if isinstance(replay, str):
            continue
        assert replay.times_every_event == (run.client.tool == "vllm-bench-serve" and replay.dep.api_server)
        seen.add(replay.times_every_event)
    assert seen == {True, False}


def test_a_run_replays_on_its_release_and_says_what_that_release_changes() -> None:
    """vLLM 0.10.x replayed decode steps as piecewise graphs; 0.11.0 made whole decode graphs the default.
    DennisLee22's 0.10.1.1 runs replay as their release ran, and say so; GPUStack's 0.11.0 runs as the line."""
    runs = {r.run_key: r for r in public_runs()}
    older = prepare(runs["dennislee22-vllm-benchmarking/test2-qwen2.5-7b-tp2-random1024x1024-n1"])
    newer = prepare(runs["gpustack-qwen3-8b-h100-latency/vllm-bf16-sharegpt-c1"])
    assert isinstance(older, ReplayRun) and isinstance(newer, ReplayRun)
    assert older.dep.engine == "vllm-0.11@0.10.1.1" and older.engine.execution.piecewise_decode_graphs
    assert newer.dep.engine == "vllm-0.11@0.11.0" and not newer.engine.execution.piecewise_decode_graphs
    assert [a for a in older.assumptions if "as it ran" in a] == [
        "vllm 0.10.1.1 as it ran, not as vllm-0.11's newest release: execution piecewise_decode_graphs=True "
        "(the profile's earlier_releases)"]
    assert not any("as it ran" in a for a in newer.assumptions)
