"""One replica: the engine's own scheduler and KV-cache manager, with time from the cost model.

The loop is the engine's step loop with the forward pass replaced by a timeout:
schedule(now) -> step time -> timeout -> update(sampled tokens, now).
"""

from __future__ import annotations

from collections.abc import Callable

import simpy

from engine.core import Request, Scheduler
from planner.costmodel import CostModel
from planner.metrics import StepSample
from planner.sim.speculative import SyntheticDrafts

# Outputs are synthetic: every sampled token gets this id. Only follow-up turns ever read
# them back (as part of their prompt), and the block hashes chain over everything before
# them, so equal ids never make different conversations share blocks.
SYNTHETIC_TOKEN_ID = 0


class Replica:
    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        scheduler: Scheduler,
        cost_model: CostModel,
        on_finished: Callable[[Request], None],
        samples: list[StepSample],
        drafts: SyntheticDrafts | None = None,
    ) -> None:
        self.env, self.index = env, index
        self.scheduler, self.cost_model = scheduler, cost_model
        self.on_finished = on_finished
        self.samples = samples
        self.drafts = drafts  # speculative decoding: synthetic drafts and their acceptance
        self.outstanding_requests = 0
        self.outstanding_tokens = 0  # prompt + output tokens of unfinished requests: what routers balance
        self.flops = self.bytes = 0.0
        self._wake: simpy.Event | None = None
        env.process(self._serve())

    def submit(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.outstanding_requests += 1
        self.outstanding_tokens += request.num_prompt_tokens + request.max_tokens
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _serve(self):  # noqa: ANN202 (a SimPy process generator)
        env, scheduler, cost_model = self.env, self.scheduler, self.cost_model
        while True:
            if not scheduler.has_unfinished_requests():
                self._wake = env.event()
                yield self._wake
                self._wake = None
            if self.drafts is not None:
                self.drafts.propose(scheduler.running)
            output = scheduler.schedule(env.now)
            if output.is_empty:
                # add_request guarantees every request fits an empty cache, so an empty step
                # with work pending would be a scheduler bug: never spin on it.
                raise RuntimeError(f"replica {self.index}: nothing schedulable with requests pending at t={env.now}")
            cost = cost_model.step(output)
            self.flops += cost.flops
            self.bytes += cost.bytes
            start = env.now
            yield env.timeout(cost.seconds)
            if self.drafts is None:
                sampled = {s.request_id: (SYNTHETIC_TOKEN_ID,) for s in output.scheduled if s.samples}
            else:
                sampled = self.drafts.sampled(output)
            updates = scheduler.update(output, sampled, env.now)
            self.samples.append(StepSample(self.index, start, env.now, output.kv_cache_usage, output.num_running,
                                           output.num_waiting, output.total_num_scheduled_tokens))
            for u in updates:
                if u.finished:
                    request = scheduler.get_request(u.request_id)
                    self.outstanding_requests -= 1
                    self.outstanding_tokens -= request.num_prompt_tokens + request.max_tokens
                    self.on_finished(request)
