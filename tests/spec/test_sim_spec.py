"""Speculative decoding in the simulator: an all-ones acceptance profile cuts decode steps by
about k+1; an all-zeros one keeps the step count and charges the verified drafts; a proposal
rate of 0 is plain decoding; the draft model's cost appears as its own operator; settings the
simulator cannot use are refused."""

from __future__ import annotations

import pytest

from engine.catalog import resolve_model
from engine.config import SpeculativeSettings
from engine.core import SamplingParams, ScheduledRequest, SchedulerOutput
from engine.errors import InputError
from planner.costmodel import CostModel
from planner.hardware import get_hardware
from planner.sim import simulate
from planner.sim.speculative import SyntheticDrafts
from planner.specs import Deployment, EngineKnobs
from planner.workload import ClosedLoopArrivals, FixedLength, Workload

MODEL = resolve_model("llama-3.1-8b")
H100 = get_hardware("h100-sxm")
K = 3
OUT = 64


def decode_heavy(n: int = 4) -> Workload:
    return Workload(name="decode", arrival=ClosedLoopArrivals(concurrency=n), input_tokens=FixedLength(tokens=8),
                    output_tokens=FixedLength(tokens=OUT), num_requests=n)


def dep(spec: dict | None) -> Deployment:
    # ServePlan's own engine in process (no API server in front), so the step counts below are exact.
    return Deployment(hardware="h100-sxm", engine="serveplan", api_server=False, knobs=EngineKnobs(speculative=spec))


def run(spec: dict | None, seed: int = 0):
    return simulate(MODEL, H100, dep(spec), decode_heavy(), seed=seed).summary


def test_all_accepted_cuts_steps_by_k_plus_one() -> None:
    plain = run(None)
    spec = run({"method": "ngram", "num_speculative_tokens": K, "acceptance_profile": [1.0] * K})
    # 1 prefill step + 63 decode steps without; 1 + ceil(63 / (K + 1)) = 17 with.
    assert plain.num_steps == 1 + OUT - 1
    assert spec.num_steps == 1 + -(-(OUT - 1) // (K + 1))
    assert spec.duration_s < plain.duration_s / 2


def test_all_rejected_keeps_the_steps_but_charges_the_drafts() -> None:
    plain = run(None)
    spec = run({"method": "ngram", "num_speculative_tokens": K, "acceptance_profile": [0.0] * K})
    assert spec.num_steps == plain.num_steps
    assert spec.duration_s > plain.duration_s  # each step verified K useless drafts


def test_no_proposals_is_plain_decoding() -> None:
    plain = run(None)
    spec = run({"method": "ngram", "num_speculative_tokens": K, "acceptance_profile": [1.0] * K, "proposal_rate": 0.0})
    assert (spec.num_steps, spec.duration_s) == (plain.num_steps, plain.duration_s)


def test_partial_acceptance_is_seeded_and_in_between() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": K, "acceptance_rate": 0.6}
    a, b, other = run(spec, seed=1), run(spec, seed=1), run(spec, seed=2)
    assert a.num_steps == b.num_steps and a.duration_s == b.duration_s
    assert 1 + -(-(OUT - 1) // (K + 1)) < a.num_steps < OUT
    assert other.num_steps > 0


def test_accepted_counts_follow_the_profile() -> None:
    drafts = SyntheticDrafts(2, [0.5, 0.5], seed=(0, 0), token_id=0)
    counts = [drafts.accepted(2) for _ in range(20_000)]
    # P(0) = 0.5, P(1) = 0.25, P(2) = 0.25
    shares = [counts.count(i) / len(counts) for i in range(3)]
    assert shares == pytest.approx([0.5, 0.25, 0.25], abs=0.02)
    assert drafts.accepted(0) == 0


def decode_step(num_drafts: int, batch: int = 8, context: int = 500) -> SchedulerOutput:
    params = SamplingParams(max_tokens=64)
    scheduled = tuple(
        ScheduledRequest(f"r{i}", (0,) * (1 + num_drafts), context, (), False, num_drafts, True, params, 100, False)
        for i in range(batch))
    return SchedulerOutput(scheduled, batch * (1 + num_drafts), (), (), 0, batch, 0.5)


@pytest.mark.parametrize("method", [{"method": "self", "draft_layers": 8},
                                    {"method": "draft", "draft_model": "llama-3.2-1b"}], ids=["self", "draft"])
def test_draft_model_cost(method: dict) -> None:
    ngram = CostModel(MODEL, H100, dep({"method": "ngram", "num_speculative_tokens": K}))
    drafted = CostModel(MODEL, H100, dep({**method, "num_speculative_tokens": K}))
    step = decode_step(K)
    assert ngram.breakdown(step)["spec_draft"] == 0.0
    breakdown = drafted.breakdown(step)
    assert sum(breakdown.values()) == pytest.approx(drafted.step_time(step))
    draft = breakdown["spec_draft"]
    plain_decode = ngram.step_time(decode_step(0))
    # K sequential passes of a draft far smaller than the target, each over the whole batch.
    assert 0.0 < draft < K * plain_decode
    assert drafted.step_time(decode_step(0)) == ngram.step_time(decode_step(0))  # no drafts, no draft cost


def test_self_draft_costs_a_fraction_of_the_target() -> None:
    quarter = CostModel(MODEL, H100, dep({"method": "self", "draft_layers": 8, "num_speculative_tokens": 1}))
    half = CostModel(MODEL, H100, dep({"method": "self", "draft_layers": 16, "num_speculative_tokens": 1}))
    step = decode_step(1)
    assert quarter.breakdown(step)["spec_draft"] < half.breakdown(step)["spec_draft"]


def test_simulator_needs_an_acceptance_figure() -> None:
    with pytest.raises(InputError, match="needs acceptance_profile") as info:
        run({"method": "ngram", "num_speculative_tokens": K})
    assert info.value.field == "speculative.acceptance_profile"


@pytest.mark.parametrize(("settings", "message"), [
    ({"acceptance_profile": [1.0, 0.5]}, "acceptance_profile has 2 entries"),
    ({"acceptance_profile": [1.0, 0.5, 1.5]}, "must hold probabilities in"),
])
def test_bad_profiles(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeSettings(method="ngram", num_speculative_tokens=K, **settings)
