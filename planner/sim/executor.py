"""The simulator's executor: a step's time from the cost model, its tokens made up.

It stands where the engine's model runner stands in the shared step loop. Outputs are
synthetic: every sampled token gets SYNTHETIC_TOKEN_ID (only follow-up turns ever read them
back, as part of their prompt, and block hashes chain over everything before them, so equal ids
never make different conversations share blocks); with speculation, how many drafts a request
keeps is drawn by `SyntheticDrafts`, which also proposed them.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.core import ExecutedStep, SchedulerOutput
from planner.costmodel import CostModel
from planner.costmodel.model import StepCosts
from planner.sim.speculative import SyntheticDrafts

SYNTHETIC_TOKEN_ID = 0


class CostModelExecutor:
    def __init__(self, cost_model: CostModel, drafts: SyntheticDrafts | None = None) -> None:
        self.cost_model, self.drafts = cost_model, drafts
        self.flops = self.bytes = 0.0  # work of every step so far, per GPU: for MFU and bandwidth use
        self.comm_s = 0.0  # seconds of those steps spent in collectives and pipeline hand-offs

    def execute(self, output: SchedulerOutput) -> ExecutedStep:
        cost = self.cost_model.step(output)
        self.flops += cost.flops
        self.bytes += cost.bytes
        self.comm_s += cost.comm_seconds
        sampled: dict[str, tuple[int, ...]]
        if self.drafts is None:
            sampled = {s.request_id: (SYNTHETIC_TOKEN_ID,) for s in output.scheduled if s.samples}
        else:
            sampled = self.drafts.sampled(output)
        return ExecutedStep(sampled, cost.seconds)

    def account(self, costs: StepCosts, steps: int) -> None:
        """Count the first `steps` of steps priced at once (CostModel.bulk_run) as execute() counts
        each: one after another, so the sums are the same floats."""
        for flops, nbytes, comm_s in zip(costs.flops[:steps].tolist(), costs.bytes[:steps].tolist(),
                                         costs.comm_seconds[:steps].tolist(), strict=True):
            self.flops += flops
            self.bytes += nbytes
            self.comm_s += comm_s

    def forget(self, request_ids: Iterable[str]) -> None:
        """Nothing to drop: the cost model keeps no per-request state."""
