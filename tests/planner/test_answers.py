"""Answers that must not mislead (issue 21): steady-state rates without warm-up and drain, a
capacity figure, a quality budget on precision, every hardware's cheapest feasible candidate in one
run, the widening a narrowed question needs, prefix caching in plan and plan's exit status."""

from __future__ import annotations

import pytest

from engine.config import EngineKnobs
from engine.core.metrics import RequestMetrics, StepSample
from engine.errors import InputError
from planner import quality
from planner.cli import main
from planner.hardware import get_hardware
from planner.metrics import PricingBasis, steady_state
from planner.search import PlanResult, plan, probe_requests, probe_workload, widen
from planner.search.slo_capacity import slo_capacity
from planner.sim import simulate
from planner.specs import SLO, Deployment
from planner.workload import get_workload
from tests.planner.test_search import KNOBS, MODEL, RATE_PER_S, SLO_TEXT, SPACE

PRICING = PricingBasis(gpus=1, price_usd_per_gpu_hour=2.0, peak_flops_per_gpu=None, bandwidth_bytes_per_s_per_gpu=None,
                       description="test")


def _request(i: int, arrival: float, admitted: float, service_s: float, output_tokens: int = 20) -> RequestMetrics:
    wait = admitted - arrival
    gap = (service_s - 0.1) / (output_tokens - 1)
    return RequestMetrics(request_id=str(i), arrival_time=arrival, prompt_tokens=100, output_tokens=output_tokens,
                          cached_prompt_tokens=0, queueing_s=wait, ttft_s=wait + 0.1,
                          token_times=tuple(admitted + 0.1 + gap * i for i in range(output_tokens)),
                          tpot_s=gap, e2e_s=wait + service_s, finish_reason="length", num_preemptions=0)


def test_steady_state_of_a_server_that_keeps_up_is_the_arrival_rate() -> None:
    """200 requests at 10/s, each served in 2 s with no wait: the benchmark client's figure divides
    by 19.9 s of arrivals plus the 2 s drain (9.1 req/s); the steady window serves 10/s."""
    reqs = [_request(i, 0.1 * i, 0.1 * i, 2.0) for i in range(200)]
    samples = [StepSample(0, 0.1 * i, 0.1 * i + 0.05, 0.5, 20, 0, 20) for i in range(220)]
    s = steady_state(reqs, samples, PRICING)
    assert s is not None and s.kept_up
    assert s.warmup_s == pytest.approx(2.0) and s.drain_s == pytest.approx(2.0)
    assert s.requests_per_s == pytest.approx(10.0, rel=0.02)
    assert s.output_tokens_per_s == pytest.approx(200.0, rel=0.02)
    assert 200 / (19.9 + 2.0) < 9.2  # what the whole-run definition reports
    assert s.mean_batch_requests == 20
    assert s.usd_per_million_output_tokens == pytest.approx(2.0 / (s.output_tokens_per_s * 3600) * 1e6)


def test_steady_state_of_an_overloaded_server_is_its_capacity() -> None:
    """Arrivals at 10/s, admissions at 5/s (the queue grows): the window's rate is the 5/s served."""
    reqs = [_request(i, 0.1 * i, 0.2 * i, 1.0) for i in range(300)]
    s = steady_state(reqs, [], PRICING)
    assert s is not None and not s.kept_up
    assert s.requests_per_s == pytest.approx(5.0, rel=0.03)
    assert s.mean_batch_requests is None


def test_a_run_too_short_for_a_window_has_no_steady_state() -> None:
    assert steady_state([_request(i, 0.1 * i, 0.1 * i, 5.0) for i in range(20)], [], PRICING) is None


def test_simulated_run_reports_steady_rates_near_the_offered_rate() -> None:
    """The issue's case: a deployment that keeps up with 20 req/s over a 300-request run; the
    whole-run figure (~12 req/s) is pulled down by the drain, the steady one is the offered rate."""
    dep = Deployment(hardware="h100-sxm", tensor_parallel=1, weight_dtype="bf16", kv_dtype="bf16", knobs=EngineKnobs())
    w = probe_workload(get_workload("chat"), 20.0, 300)
    summary = simulate(get_hardware_model(), get_hardware("h100-sxm"), dep, w).summary
    steady = summary.steady_state
    assert steady is not None and steady.kept_up
    assert steady.requests_per_s == pytest.approx(20.0, rel=0.15)
    assert summary.throughput.requests_per_s < 0.7 * steady.requests_per_s
    assert summary.mean_batch_requests is not None and summary.mean_batch_requests > 1


def get_hardware_model():
    from engine.catalog import resolve_model

    return resolve_model(MODEL)


# --------------------------------------------------------------------------- quality budget


def test_published_quality_figures_put_int4_beyond_the_default_budget() -> None:
    assert quality.part_loss_pct("weights", "bf16") == 0.0
    assert quality.deployment_loss_pct("int4", "bf16") > quality.DEFAULT_MAX_QUALITY_LOSS_PCT
    assert quality.within_budget("fp8", "fp8", quality.DEFAULT_MAX_QUALITY_LOSS_PCT)
    assert not quality.within_budget("int4", "bf16", quality.DEFAULT_MAX_QUALITY_LOSS_PCT)
    assert quality.within_budget("int4", "bf16", quality.NO_QUALITY_LIMIT_PCT)
    assert not quality.within_budget("fp4", "bf16", 50)  # no published figure: only without a limit
    assert "2 published evaluations" in quality.describe("int4", "bf16")
    for part in ("weights", "kv"):
        for record in getattr(quality.quality_table(), part).values():
            assert all(e.source.startswith("https://") for e in record.published)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("answers-cache")


def _impossible(cache_dir, **kw) -> PlanResult:
    """A plan whose SLO the analytic screen rules out everywhere: every candidate, no simulation."""
    return plan(MODEL, get_workload("chat"), RATE_PER_S, "ttft_p99_ms<=5", cache_dir=cache_dir,
                **{**SPACE, "weight_dtypes": ["bf16", "int4"], **kw})


def test_plan_leaves_out_formats_beyond_the_quality_budget_and_says_so(cache_dir) -> None:
    r = _impossible(cache_dir)
    assert {p.deployment.weight_dtype for p in r.rejected} == {"bf16"}
    assert r.space is not None and r.space.weight_dtypes == ["bf16"]
    assert any(line.startswith("int4 weights with bf16 KV cache") for line in r.space.excluded_for_quality)
    assert any("quality loss" in line for line in r.assumptions)
    asked = _impossible(cache_dir, max_quality_loss_pct=100)
    assert {p.deployment.weight_dtype for p in asked.rejected} == {"bf16", "int4"}
    assert all(p.quality_loss_pct is not None for p in asked.rejected)


def test_a_quality_budget_that_leaves_nothing_is_one_clear_error(cache_dir) -> None:
    with pytest.raises(InputError) as exc:
        _impossible(cache_dir, weight_dtypes=["int4"])
    assert exc.value.field == "max_quality_loss_pct" and "int4/bf16" in exc.value.allowed


def test_recommendation_states_its_quality_cost_and_capacity(cache_dir) -> None:
    r = plan(MODEL, get_workload("chat"), RATE_PER_S, SLO_TEXT, cache_dir=cache_dir, **SPACE)
    rec = r.recommended
    assert rec is not None and r.quality is not None
    assert rec.deployment.weight_dtype in r.quality or "16-bit reference" in r.quality
    cap = r.capacity
    assert cap is not None and cap.rate_per_s is not None and cap.failed_rate_per_s is not None
    # The deployment serves the target rate, and its capacity was bracketed within the tolerance.
    assert cap.rate_per_s >= RATE_PER_S * 0.9
    assert cap.failed_rate_per_s / cap.rate_per_s <= 1 + cap.tolerance + 1e-9
    assert cap.usd_per_million_output_tokens is not None


# --------------------------------------------------------------------------- every hardware, one run


def test_every_hardware_gets_its_cheapest_feasible_candidate_in_one_run(cache_dir) -> None:
    """At 15 req/s L4 wins; L40S's answer used to be a lower bound only (its candidates pruned
    against L4's cost). Now L40S's own cheapest candidate that meets the SLO is found too."""
    r = plan(MODEL, get_workload("chat"), 15.0, SLO_TEXT, cache_dir=cache_dir, **SPACE)
    answers = {p.deployment.hardware: p for p in r.per_hardware}
    assert set(answers) == {"l4", "l40s"} and answers["l4"] == r.recommended
    l40s = answers["l40s"]
    assert l40s.replicas is not None and l40s.usd_per_hour is not None  # simulated and feasible, not a bound
    assert l40s.usd_per_hour == min(p.usd_per_hour for p in r.ranked if p.deployment.hardware == "l40s")
    dep = l40s.deployment
    w = probe_workload(get_workload("chat"), 15.0 / dep.replicas, probe_requests(100, dep, get_workload("chat")))
    one = dep.model_copy(update={"replicas": 1})
    assert simulate(get_hardware_model(), get_hardware("l40s"), one, w, slo=SLO.parse(SLO_TEXT)).summary.goodput.slo_met


def test_without_every_hardware_the_recommendation_is_the_same_from_fewer_simulations(cache_dir) -> None:
    """Pruned against the cheapest answer on any hardware, L40S is not sized: its answer is the least
    it would cost, above L4's, and the recommendation is L4's, as when every hardware is sized."""
    every = plan(MODEL, get_workload("chat"), 15.0, SLO_TEXT, cache_dir=cache_dir, **SPACE)
    fast = plan(MODEL, get_workload("chat"), 15.0, SLO_TEXT, cache_dir=cache_dir, every_hardware=False, **SPACE)
    assert fast.recommended is not None and every.recommended is not None
    assert (fast.recommended.label, fast.recommended.replicas, fast.recommended.usd_per_hour) == (
        every.recommended.label, every.recommended.replicas, every.recommended.usd_per_hour)
    assert fast.simulated_candidates < every.simulated_candidates and fast.probes < every.probes
    l40s = next(p for p in fast.per_hardware if p.deployment.hardware == "l40s")
    assert l40s.replicas is None and l40s.verdict == "cost"
    assert l40s.cost_bound_usd_per_hour is not None and l40s.cost_bound_usd_per_hour > fast.recommended.usd_per_hour
    assert f"above the cheapest on any hardware, US${fast.recommended.usd_per_hour:,.2f}/h" in l40s.reason


def test_the_answer_comes_first_and_every_hardware_is_sized_as_before(cache_dir) -> None:
    """plan(on_answer=...) hands over the recommendation found without sizing every hardware, then
    finishes the very search plan() runs without it: the same result, field for field."""
    heard: list[object] = []
    with_answer = plan(MODEL, get_workload("chat"), 15.0, SLO_TEXT, cache_dir=cache_dir, on_answer=heard.append, **SPACE)
    without = plan(MODEL, get_workload("chat"), 15.0, SLO_TEXT, cache_dir=cache_dir, **SPACE)
    assert with_answer == without
    (first,) = heard
    assert first is not None and with_answer.recommended is not None
    assert (first.label, first.replicas, first.usd_per_hour) == (
        with_answer.recommended.label, with_answer.recommended.replicas, with_answer.recommended.usd_per_hour)


def test_the_search_per_hardware_reuses_the_first_passs_searches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a cache, the answer first costs fewer simulations than the two searches run apart (here
    none more than the search per hardware alone): that search takes each first-pass outcome whose
    replica range is the same."""
    from planner.search import cache

    runs: list[object] = []

    def counted(*args: object, **kwargs: object):  # noqa: ANN202
        runs.append(args[3])
        return simulate(*args, **kwargs)

    monkeypatch.setattr(cache, "simulate", counted)
    question = (MODEL, get_workload("chat"), 15.0, SLO_TEXT)
    first_pass = plan(*question, cache_dir=None, every_hardware=False, **SPACE)
    counts = []
    for flags in ({}, {"on_answer": lambda _answer: None}):
        runs.clear()
        plan(*question, cache_dir=None, **flags, **SPACE)
        counts.append(len(runs))
    per_hardware, both = counts
    # The first pass's capacity probes, simulated again in full, would make the difference first_pass.probes.
    assert 0 <= both - per_hardware < first_pass.probes


# --------------------------------------------------------------------------- widening


def test_a_narrowed_question_nothing_answers_gets_the_widening(cache_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """L4 alone, one GPU, bf16 weights: too slow for the TPOT target. The default space (shrunk
    here to L4 and L40S, two GPUs, one knob setting, to stay fast) answers; the widening names
    what of that answer the question left out."""
    monkeypatch.setattr(widen, "_default_hardware", lambda: ["l4", "l40s"])
    monkeypatch.setattr(widen, "DEFAULT_MAX_GPUS_PER_REPLICA", 2)
    monkeypatch.setattr(widen, "DEFAULT_WEIGHT_DTYPES", ("bf16", "fp8"))
    monkeypatch.setattr(widen, "DEFAULT_KV_DTYPES", ("bf16",))
    monkeypatch.setattr(widen, "DEFAULT_KNOBS_GRID", (KNOBS,))
    slo = "ttft_p99_ms<=1500,tpot_p99_ms<=40"
    narrow = {**SPACE, "hardware": ["l4"], "max_gpus_per_replica": 1, "weight_dtypes": ["bf16"]}
    r = plan(MODEL, get_workload("chat"), RATE_PER_S, slo, cache_dir=cache_dir, widen=True, **narrow)
    assert r.recommended is None
    assert r.space is not None and len(r.space.narrower_than_default) == 3  # hardware, GPUs, weights
    w = r.widening
    assert w is not None and w.recommended is not None and w.changes
    d = w.recommended.deployment
    outside = [d.hardware != "l4", d.gpus_per_replica > 1, d.weight_dtype != "bf16"]
    assert any(outside)
    assert bool(w.hardware) == outside[0] and bool(w.max_gpus_per_replica) == outside[1]
    assert bool(w.weight_dtypes) == outside[2]
    assert w.summary.startswith("widen the search: " + w.changes[0]) and w.recommended.label in w.summary
    assert plan(MODEL, get_workload("chat"), RATE_PER_S, slo, cache_dir=cache_dir, **narrow).widening is None


# --------------------------------------------------------------------------- the CLI


def test_cli_plan_without_a_recommendation_exits_1(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    argv = ["plan", "--rate", "2", "--slo", "ttft_p99_ms<=5", "--hw", "l4", "--max-gpus", "1", "--weight-dtypes", "bf16",
            "--kv-dtypes", "bf16", "--requests-per-probe", "50", "--executor", "serial", "--cache-dir", str(tmp_path)]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "no recommendation" in out and "narrower than the default search" in out
    # The search's first answer is printed before every hardware is sized (not in --json output).
    assert out.startswith("answer after ") and "nothing meets the SLO; now sizing every hardware" in out.splitlines()[0]


def test_cli_plan_switches_prefix_caching_in_every_candidate(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    import json

    argv = ["plan", "--rate", "2", "--slo", "ttft_p99_ms<=5", "--hw", "l4", "--max-gpus", "1", "--weight-dtypes", "bf16",
            "--kv-dtypes", "bf16", "--requests-per-probe", "50", "--executor", "serial", "--cache-dir", str(tmp_path),
            "--no-prefix-caching", "--json"]
    assert main(argv) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["rejected"] and all(p["deployment"]["knobs"]["enable_prefix_caching"] is False for p in r["rejected"])
    assert all("enable_prefix_caching=False" in k for k in r["space"]["knobs"])


def test_compare_deltas_are_on_steady_state_and_capacity(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both sides serve every request of a short run; compare's rates are the steady window's (not
    first arrival to last finish, which counts each side's drain tail) and each side's capacity."""
    import json

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    # An L4 with a loose SLO keeps each capacity search to small batches (seconds).
    a.write_text("hardware: l4\nweight_dtype: bf16\n")
    b.write_text("hardware: l4\nweight_dtype: fp8\nkv_dtype: fp8\n")
    assert main(["compare", str(a), str(b), "--rate", "1", "--requests", "100", "--slo",
                 "ttft_p99_ms<=2000,tpot_p99_ms<=200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {m["metric"]: m for m in out["metrics"]}
    assert not {"requests/s", "output tokens/s", "US$ per 1M output tokens"} & set(rows)  # whole-run rates
    for side, key in ((out["a"], "a"), (out["b"], "b")):
        steady, capacity = side["summary"]["steady_state"], side["capacity"]
        assert rows["requests/s, steady state"][key] == pytest.approx(steady["requests_per_s"])
        assert rows["US$ per 1M output tokens, steady state"][key] == pytest.approx(steady["usd_per_million_output_tokens"])
        assert rows["capacity within the SLO, requests/s"][key] == pytest.approx(capacity["requests_per_s"])
        assert rows["US$ per 1M output tokens at capacity"][key] == pytest.approx(capacity["usd_per_million_output_tokens"])
        assert capacity["rate_per_s"] >= 1.0  # it met the SLO at the offered rate, so its capacity is no lower
    # Both kept up with 1 req/s: their steady rates differ by sampling, not by a drain tail.
    assert abs(rows["requests/s, steady state"]["delta_pct"]) < 10
    # fp8 halves the bytes per decode step: more capacity and cheaper tokens there.
    assert rows["capacity within the SLO, requests/s"]["delta_pct"] > 20
    assert rows["US$ per 1M output tokens at capacity"]["delta_pct"] < 0


# Conversations of 2-4 turns (their starts are the arrivals) on an L4 running at most 8 requests at once.
TALKS = get_workload("chat", conversation={"min_turns": 2, "max_turns": 4, "think_time_s": 1.0}, num_requests=24)
SMALL_BATCH = EngineKnobs(max_num_batched_tokens=2048, max_num_seqs=8)


def test_capacity_of_a_multi_turn_workload_is_a_rate_the_deployment_sustains() -> None:
    """A conversation's turns run one after another, so a probe of as many conversations as the
    batch holds never queues however fast they start: its 'capacity' ran away (Q2 of issue 21: 64
    conversations/s, 28k output tokens/s, from an H100 kept 99 % busy by 685). The capacity's token
    rate is bounded by what the deployment delivers overloaded (known answer: its steady rate with
    the batch full all along)."""
    model, hw = get_hardware_model(), get_hardware("l4")
    dep = Deployment(hardware="l4", weight_dtype="bf16", kv_dtype="bf16", knobs=SMALL_BATCH)
    talks = TALKS
    cap = slo_capacity(model, hw, dep, talks, SLO.parse("ttft_p99_ms<=2000"), start_rate_per_s=1.0,
                       requests_per_probe=talks.num_requests)
    overloaded = simulate(model, hw, dep, probe_workload(talks, 50.0, 240)).summary.steady_state
    assert overloaded is not None and overloaded.mean_batch_requests > 7.5  # of 8: saturated
    assert cap.rate_per_s is not None and cap.output_tokens_per_s is not None
    assert cap.output_tokens_per_s <= 1.15 * overloaded.output_tokens_per_s, (cap, overloaded.output_tokens_per_s)
    # 3 x 8 conversations of 3 turns on average; the rate counts their starts, and the basis says so.
    assert cap.requests_per_probe >= 3 * 8 * 3 and "conversations, whose starts the rate counts" in cap.basis
    assert cap.requests_per_s is not None and cap.requests_per_s > 2 * cap.rate_per_s  # each start brings its turns


def test_plan_of_a_multi_turn_workload_prices_every_turns_tokens(cache_dir) -> None:
    """The rate counts conversation starts, each bringing its turns' replies: US$ per 1M output
    tokens at the target rate is the cost over that token rate (known answer from the drawn
    requests); it divided by one reply per start, about 3 x too dear here."""
    from planner.playback import Replay

    rate = 0.05
    r = plan(MODEL, TALKS, rate, "ttft_p99_ms<=2000", hardware=["l4"], max_gpus_per_replica=1, weight_dtypes=["bf16"],
             kv_dtypes=["bf16"], knobs_grid=[SMALL_BATCH], headroom=0.0, requests_per_probe=TALKS.num_requests,
             executor="serial", progress=False, cache_dir=cache_dir)
    rec = r.recommended
    assert rec is not None and rec.usd_per_hour is not None
    drawn = Replay.of(probe_workload(TALKS, rate, TALKS.num_requests), get_hardware_model().vocab_size).requests
    starts = sum(q.parent_id is None for q in drawn)
    output_per_start = sum(q.output_tokens for q in drawn) / starts
    assert len(drawn) / starts > 2  # the draw has conversations, so the two readings differ
    assert rec.usd_per_million_output_tokens == pytest.approx(rec.usd_per_hour / (rate * output_per_start * 3600) * 1e6)
    assert any("mean turns" in a and "the rate counts conversation starts" in a for a in r.assumptions)


def test_cli_simulate_prints_its_steady_state(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--hw", "l40s", "--rate", "2", "--requests", "60"]) == 0
    out = capsys.readouterr().out
    steady = next(line for line in out.splitlines() if line.startswith("steady state ("))
    assert "warm-up" in steady and "drain" in steady and "req/s" in steady and "mean batch" in steady
    assert "throughput (first arrival to last finish, drain included)" in out


# --------------------------------------------------------------------------- traces and shared prefixes in plan


def _write_trace(path, rows) -> None:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_trace_summarised_for_planning_keeps_its_lengths_prefixes_and_rate(tmp_path) -> None:
    from planner.workload import draw, workload_from_trace

    rows = [{"arrival_s": 0.5 * i, "input_tokens": 1000 + (i % 2) * 200 if i % 4 else 300, "output_tokens": 50 + i % 3,
             **({"prefix_id": f"p{i % 2}"} if i % 4 else {})} for i in range(41)]
    _write_trace(tmp_path / "agents.jsonl", rows)
    w = workload_from_trace(tmp_path / "agents.jsonl")
    assert w.arrival.offered_rate_per_s == pytest.approx(2.0)  # 40 gaps of 0.5 s
    sp = w.shared_prefix
    # Groups p0 (1000-token prompts) and p1 (1200): half the shortest prompt of each, the median of the two.
    assert sp is not None and sp.num_prefixes == 2 and sp.prefix_tokens == 550 and sp.share == pytest.approx(30 / 41)
    # Own prompts: 300 unprefixed, 1000 - 550 and 1200 - 550 prefixed; replies 50..52, as often as recorded.
    assert dict(zip(w.input_tokens.tokens, w.input_tokens.weights)) == {300: 11, 450: 10, 650: 20}
    assert dict(zip(w.output_tokens.tokens, w.output_tokens.weights)) == {50: 14, 51: 14, 52: 13}
    assert "2 shared prefixes of 550 tokens" in w.description and "2.00 req/s" in w.description
    assert len(draw(w)) == 41


def test_a_multi_turn_or_unreadable_trace_is_one_clear_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from planner.workload import workload_from_trace

    _write_trace(tmp_path / "chat.jsonl", [{"arrival_s": i, "input_tokens": 10, "output_tokens": 5, "conversation_id": "c"}
                                          for i in range(3)])
    with pytest.raises(InputError, match="multi-turn"):
        workload_from_trace(tmp_path / "chat.jsonl")
    secret = tmp_path / "secret.csv"
    secret.write_text("password,hunter2\nroot,toor\n")
    assert main(["plan", "--workload", str(secret), "--slo", SLO_TEXT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hunter2" not in err and "trace columns" in err


def test_cli_plan_sizes_for_a_trace_at_its_own_rate(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"arrival_s": 0.25 * i, "input_tokens": 400 + 10 * (i % 7), "output_tokens": 60, "prefix_id": "sys"}
            for i in range(81)]
    _write_trace(tmp_path / "agent.jsonl", rows)
    args = ["plan", "--workload", str(tmp_path / "agent.jsonl"), "--slo", SLO_TEXT, "--hw", "l40s", "--max-gpus", "1",
            "--weight-dtypes", "fp8", "--kv-dtypes", "bf16", "--requests-per-probe", "40",
            "--executor", "serial", "--cache-dir", str(tmp_path / "cache")]
    assert main([*args, "--json"]) == 0
    result = PlanResult.model_validate_json(capsys.readouterr().out)
    assert result.rate_per_s == pytest.approx(4.0) and result.recommended is not None
    assert main([*args, "--prefix-tokens", "100"]) == 2  # a trace records its own prefixes
    assert "--prefix-tokens=100 is invalid: does not apply to a trace" in capsys.readouterr().err


def test_shared_prefix_flags_become_the_workloads_shared_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.specs import WorkloadOverrides

    fields = WorkloadOverrides(prefix_tokens=2000, prefix_share=0.5).workload_fields()
    w = get_workload("chat", **fields)
    assert w.shared_prefix is not None and (w.shared_prefix.prefix_tokens, w.shared_prefix.num_prefixes,
                                            w.shared_prefix.share) == (2000, 1, 0.5)
    with pytest.raises(ValueError, match="num_prefixes=3 is invalid: applies to a shared prefix"):
        WorkloadOverrides(num_prefixes=3)
    assert main(["simulate", "--hw", "h100-sxm", "--rate", "4", "--requests", "60", "--prefix-tokens", "2000",
                 "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["prefix_cache_hit_rate"] > 0.5  # most of each prompt is the prefix
