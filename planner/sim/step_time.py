"""Where a simulated run's step time goes: two steps that stand for the run, priced by the cost model
the simulator used and split by operator. A planner reads it to see what a deployment is bound by
(the weight reads of a small batch, attention at long context, tensor-parallel all-reduces) before
changing the hardware or the parallelism; `simulate` prints it, its JSON carries it as
`step_time`, and the dashboard draws it."""

from __future__ import annotations

from typing import Literal

from planner.costmodel import CostModel
from planner.metrics import PricedStep, RunRecord


def representative_steps(cost_model: CostModel, record: RunRecord) -> list[PricedStep]:
    """A decode step at the run's mean batch over busy steps, each request at the mean prompt plus
    half the mean output of context (mid-reply), and one prefill chunk of the mean prompt, capped by
    the step's token budget, nothing cached."""
    requests = record.requests
    busy = [s.num_running for s in record.samples if s.num_running > 0]
    batch = max(1, round(sum(busy) / len(busy))) if busy else 1
    prompt = sum(r.prompt_tokens for r in requests) / len(requests) if requests else 1.0
    output = sum(r.output_tokens for r in requests) / len(requests) if requests else 0.0
    context = max(1, round(prompt + output / 2))
    budget = cost_model.dep.knobs.choices.max_num_batched_tokens
    chunk = max(1, min(budget, round(prompt)))
    return [
        _priced("decode", batch, context, cost_model.decode_breakdown(batch, context),
                f"{batch} requests a step (the run's mean batch over its busy steps), each with {context} tokens of "
                "context (the mean prompt and half the mean output)"),
        _priced("prefill", 1, chunk, cost_model.prefill_breakdown(chunk),
                f"one chunk of {chunk} prompt tokens (the mean prompt"
                + ("" if chunk < budget else f", capped by the {budget}-token step budget")
                + "), nothing cached"),
    ]


def _priced(kind: Literal["decode", "prefill"], requests: int, tokens: int, seconds: dict[str, float], basis: str) -> PricedStep:
    return PricedStep(kind=kind, requests=requests, tokens=tokens, total_ms=sum(seconds.values()) * 1e3,
                      operators_ms={op: s * 1e3 for op, s in seconds.items() if s > 0}, basis=basis)
