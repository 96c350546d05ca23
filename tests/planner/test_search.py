"""The planner: its answer holds up in simulation, nothing cheaper does, answers are cached, and
infeasible questions explain the nearest miss. A small space (2 hardware x TP 1-2 x 2 weight
dtypes, one knob setting) with short probes keeps the file fast; serial executor throughout."""

from __future__ import annotations

import math
import sys

import pytest

from engine.catalog import resolve_model
from engine.config import EngineKnobs
from engine.errors import InputError
from planner import search
from planner.cli import main
from planner.hardware import get_hardware
from planner.memory import plan_memory
from planner.search import PlanResult, plan, probe_requests, probe_workload
from planner.sim import simulate
from planner.specs import SLO, Deployment
from planner.workload import get_workload

MODEL = "llama-3.1-8b"
HARDWARE = ["l4", "l40s"]
RATE_PER_S = 6.0
SLO_TEXT = "ttft_p99_ms<=1500,tpot_p99_ms<=100"
KNOBS = EngineKnobs(max_num_batched_tokens=2048, max_num_seqs=32)
SPACE = dict(hardware=HARDWARE, max_gpus_per_replica=2, weight_dtypes=["bf16", "fp8"], kv_dtypes=["bf16"],
             knobs_grid=[KNOBS], headroom=0.0, requests_per_probe=100, executor="serial", progress=False)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("plan-cache")


@pytest.fixture(scope="module")
def result(cache_dir) -> PlanResult:
    return plan(MODEL, get_workload("chat"), RATE_PER_S, SLO_TEXT, cache_dir=cache_dir, **SPACE)


def test_recommended_plan_meets_the_slo_at_the_requested_rate(result: PlanResult) -> None:
    rec = result.recommended
    assert rec is not None and rec.verdict == "recommended"
    assert result.verification is not None and result.verification.goodput.slo_met
    # Independently of the planner's own verification: the deployment, simulated at the rate.
    model, dep = resolve_model(MODEL), rec.deployment
    w = probe_workload(get_workload("chat"), RATE_PER_S, probe_requests(100, dep) * dep.replicas)
    summary = simulate(model, get_hardware(dep.hardware), dep, w, slo=SLO.parse(SLO_TEXT)).summary
    assert summary.goodput.slo_met
    assert rec.usd_per_hour == pytest.approx(dep.replicas * dep.gpus_per_replica * get_hardware(dep.hardware).price_usd_per_hour)
    assert result.ranked[0] == rec
    assert result.pareto[0] == rec
    assert [p.usd_per_hour for p in result.ranked] == sorted(p.usd_per_hour for p in result.ranked)


def test_no_cheaper_candidate_meets_the_slo_by_brute_force(result: PlanResult) -> None:
    """Every deployment of the space and every replica count cheaper than the recommendation,
    simulated without the planner's pruning: none meets the SLO (or it does not fit)."""
    assert result.recommended is not None and result.recommended.usd_per_hour is not None
    best = result.recommended.usd_per_hour
    model, slo, workload = resolve_model(MODEL), SLO.parse(SLO_TEXT), get_workload("chat")
    longest = max(len(r.prompt_token_ids) + r.output_tokens for r in probe_workload_requests(workload))
    checked = 0
    for name in HARDWARE:
        hw = get_hardware(name)
        for tp in (1, 2):
            for weight in ("bf16", "fp8"):
                dep = Deployment(hardware=name, tensor_parallel=tp, weight_dtype=weight, kv_dtype="bf16", knobs=KNOBS)
                if not plan_memory(model, hw, dep, longest).fits:
                    continue
                price = dep.gpus_per_replica * hw.price_usd_per_hour
                for replicas in range(1, math.ceil(best / price)):
                    if replicas * price >= best - 1e-9:
                        break
                    w = probe_workload(workload, RATE_PER_S / replicas, probe_requests(100, dep))
                    summary = simulate(model, hw, dep, w, slo=slo).summary
                    assert not summary.goodput.slo_met, f"{replicas} x {name} tp{tp} {weight} is cheaper and meets the SLO"
                    checked += 1
    assert checked >= 1  # the space has cheaper candidates: the check is not vacuous


def probe_workload_requests(workload):
    from planner.playback import Replay

    return Replay.of(probe_workload(workload, RATE_PER_S, 100), vocab_size=resolve_model(MODEL).vocab_size).requests


def test_second_ask_comes_from_the_cache(result: PlanResult, cache_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_simulation(*args: object, **kwargs: object) -> None:
        raise AssertionError("simulate() called although every result is cached")

    monkeypatch.setattr(search.cache, "simulate", no_simulation)
    again = plan(MODEL, get_workload("chat"), RATE_PER_S, SLO_TEXT, cache_dir=cache_dir, **SPACE)
    assert again == result


def test_every_rejection_says_why(result: PlanResult) -> None:
    assert result.rejected
    for p in result.rejected:
        assert p.reason.startswith({"memory": "memory: ", "slo": "SLO: ", "cost": "cost: ", "budget": "budget: "}[p.verdict])
    assert result.candidates == 1 + len(result.rejected)


def test_budget_too_small_names_the_cheapest_plan(result: PlanResult, cache_dir) -> None:
    r = plan(MODEL, get_workload("chat"), RATE_PER_S, SLO_TEXT, cache_dir=cache_dir, budget_usd_per_hour=0.1, **SPACE)
    assert r.recommended is None and r.verification is None
    assert r.nearest_miss is not None and "within US$0.10/h" in r.nearest_miss
    assert f"US${result.recommended.usd_per_hour:,.2f}/h" in r.nearest_miss
    assert all(p.verdict == "budget" for p in r.ranked)


def test_slo_no_hardware_meets_names_the_closest_miss(cache_dir) -> None:
    r = plan(MODEL, get_workload("chat"), RATE_PER_S, "ttft_p99_ms<=5", cache_dir=cache_dir, **SPACE)
    assert r.recommended is None and not r.ranked
    assert r.nearest_miss is not None and "no candidate meets the SLO; the closest is" in r.nearest_miss
    closest = min((p for p in r.rejected if p.slo_miss_ratio is not None), key=lambda p: p.slo_miss_ratio)
    assert closest.label in r.nearest_miss and closest.slo_miss_ratio > 1
    assert "ms > 5" in r.nearest_miss  # the observed latency against the limit


def test_model_that_fits_nowhere_names_the_least_shortfall(cache_dir) -> None:
    r = plan("llama-3.1-405b", get_workload("chat"), RATE_PER_S, SLO_TEXT, cache_dir=cache_dir, **SPACE)
    assert r.recommended is None and all(p.verdict == "memory" for p in r.rejected)
    closest = min(r.rejected, key=lambda p: p.memory_shortfall_gib)
    assert r.nearest_miss.startswith(f"the model fits on no candidate; the closest is {closest.label}")
    assert "GiB per GPU short" in r.nearest_miss


def test_ray_executor_without_ray_is_a_clear_input_error(cache_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the optional extra were not installed
    with pytest.raises(InputError, match=r"serveplan\[cluster\]"):
        plan(MODEL, "chat", RATE_PER_S, SLO_TEXT, cache_dir=cache_dir, **{**SPACE, "executor": "ray"})


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--hw", "h100-sxmm"], "hardware='h100-sxmm' is invalid: unknown name; did you mean h100-sxm"),
        (["--hw", "m4-max"], "--hw='m4-max' is invalid: has no price_usd_per_hour"),
        (["--rate", "0"], "--rate=0.0 is invalid: must be > 0"),
        (["--slo", "ttft<=500"], "--slo='ttft<=500' is invalid"),
        (["--workload", "chatt"], "workload='chatt' is invalid"),
        (["--max-gpus", "0"], "--max-gpus=0 is invalid"),
        (["--kv-dtypes", "int4"], "--kv-dtypes='int4' is invalid"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--model": MODEL, "--rate": "1", "--slo": "ttft_p99_ms<=500", "--hw": "l4", "--no-cache": None}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    args = ["plan"] + [x for k, v in base.items() for x in ((k,) if v is None else (k, v))]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("serveplan: error: ") and needle in err, err


def test_cli_compare_two_deployments(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("hardware: l40s\ntensor_parallel: 1\nweight_dtype: bf16\n")
    b.write_text("hardware: l40s\ntensor_parallel: 1\nweight_dtype: fp8\nkv_dtype: fp8\nmodel: llama-3.1-8b\n")
    assert main(["compare", str(a), str(b), "--rate", "2", "--requests", "60", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    rows = {m["metric"]: m for m in out["metrics"]}
    tpot = rows["TPOT P50, ms"]
    assert tpot["b"] < tpot["a"]  # fp8 weights: fewer bytes per decode step
    assert tpot["delta"] == pytest.approx(tpot["b"] - tpot["a"])
    assert tpot["delta_pct"] == pytest.approx(100 * (tpot["b"] - tpot["a"]) / tpot["a"])
    a.write_text("hardware: l40s\ntensor_parallel: 3\n")
    assert main(["compare", str(a), str(b), "--requests", "10"]) == 2
    assert "tp=3 is invalid" in capsys.readouterr().err
