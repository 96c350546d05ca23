"""One replica: the engine's step loop over its own scheduler, on SimPy time.

The loop is engine.core's StepLoop with the cost-model executor; the replica only lets each
step's simulated duration pass between launching it and completing it, and sleeps while idle.
A fleet that scales in stops routing to a replica and waits for `idle()` until it has served
everything it accepted (it drains; nothing is dropped).

A step that ends before anything else is due in the simulation (`env.peek()`), and whose
completion makes no event of its own (no request finishes: `Scheduler.finishes_none`, as for a
step of bulk decodes alone or a prompt's chunk), is completed at once, on the replica's own clock,
which runs ahead of SimPy's: nobody else runs meanwhile, so nobody can tell. The next step that
needs SimPy waits from SimPy's clock for its own end, where a timeout from there lands exactly on
it (float rounding), else it first brings SimPy's clock exactly onto its start (`catch_up`). That
saves a SimPy event per step for the long runs of decode-only steps between arrivals.

The loop runs on timeout callbacks, not as a SimPy process: a process's every wake-up costs a
generator resume, and a replica wakes once a step.

Where the scheduler is certain that the next steps are the same bulk decodes, each a token longer
(`Scheduler.bulk_run`: nobody waits, no member is looked at), the cost model prices a run of them
at once and the loop runs them back to back (`StepLoop.run_bulk`), each scheduled and updated as
one by one, as long as each ends before anything else is due: a lightly loaded replica decoding
one request alone, token after token, costs one pricing a run instead of one a step.
"""

from __future__ import annotations

from collections.abc import Callable

import simpy

from engine.core import LaunchedStep, Request, SchedulerOutput, StepLoop, StepSample
from planner.sim.events import Soon
from planner.sim.executor import CostModelExecutor
from planner.sim.trace import TraceRecorder


# A run priced at once costs a few dozen array operations: worth it from this many steps on. Runs
# are priced up to this many steps at a time.
MIN_RUN_STEPS, MAX_RUN_STEPS = 8, 4096


class Replica:
    def __init__(
        self,
        env: simpy.Environment,
        loop: StepLoop,
        executor: CostModelExecutor,
        on_finished: Callable[[Request], None],
        samples: list[StepSample] | None,
        recorder: TraceRecorder | None = None,
        api_hold_s: float = 0.0,
    ) -> None:
        self.env, self.loop, self.executor, self.index = env, loop, executor, loop.replica
        # The loop's clock: SimPy's, or ahead of it after steps completed at once (module docstring).
        self.now = env.now
        loop.clock = lambda: self.now
        self.recorder = recorder
        self.scheduler = loop.scheduler
        self.on_finished = on_finished
        self.outstanding_requests = 0
        self.outstanding_tokens = 0  # prompt + output tokens of unfinished requests: what routers balance
        # Engine time owed once the current step ends (a CPU prefill instance copying a finished
        # prompt's KV out to its decode instance): the next step starts that much later.
        self.hold_s = 0.0
        # An API server in the engine's process (CostParams.api_hold_share) takes its time on each
        # request that arrives while the replica runs from the step loop: owed like hold_s, and
        # counted (api_holds) for the trace, which re-times it (planner/public/retime.py).
        self.api_hold_s = api_hold_s
        self.api_holds = 0
        self._wake: simpy.Event | None = None
        self._idle: simpy.Event | None = None  # fired when the replica next runs out of work
        loop.on_finished = self._finished
        if samples is not None:  # a day-long fleet keeps no per-step record

            def record(output: SchedulerOutput, sample: StepSample) -> None:
                samples.append(sample)

            loop.on_step = record
        Soon(env, self._serve)  # when a process started here would first run

    def submit(self, request: Request) -> None:
        if self.recorder is not None:
            self.recorder.arrived(request.request_id, self.env.now)
        if self.api_hold_s and self.scheduler.has_unfinished_requests():
            self.hold_s += self.api_hold_s
            self.api_holds += 1
        self.scheduler.add_request(request)
        self.outstanding_requests += 1
        self.outstanding_tokens += request.num_prompt_tokens + request.max_tokens
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def idle(self) -> simpy.Event:
        """An event fired when the replica has no unfinished request (at once if it has none now)."""
        if not self.scheduler.has_unfinished_requests():
            return self.env.event().succeed()
        if self._idle is None:
            self._idle = self.env.event()
        return self._idle

    def _finished(self, request: Request) -> None:
        self.outstanding_requests -= 1
        self.outstanding_tokens -= request.num_prompt_tokens + request.max_tokens
        self.on_finished(request)
        # Reported: the scheduler lets go of it, so memory follows live requests, not all served.
        self.scheduler.pop_finished(request.request_id)

    def _serve(self, _event: simpy.Event | None = None) -> None:
        """Launch steps until one must let SimPy's time pass, or there is no work; a callback of its
        timeout (or of the wake-up) goes on."""
        env, loop = self.env, self.loop
        while True:
            if not self.scheduler.has_unfinished_requests():
                if self._idle is not None:
                    self._idle.succeed()
                    self._idle = None
                self._wake = env.event()
                self._wake.callbacks.append(self._woken)
                return
            launched = loop.launch()
            if launched is None:
                # add_request guarantees every request fits an empty cache, so an empty step
                # with work pending would be a scheduler bug: never spin on it.
                raise RuntimeError(f"replica {self.index}: nothing schedulable with requests pending at t={self.now}")
            duration = launched.executed.duration_s
            end = self.now + duration
            if (self.recorder is None and not self.hold_s and end < env.peek()
                    and (not launched.output.scheduled or self.scheduler.finishes_none(launched.output))):
                self.now = end  # completed at once (module docstring)
                loop.complete(launched)
                self._run_bulk(duration)
                continue
            if env.now < self.now and env.now + (end - env.now) != end:
                # Behind after steps completed at once, too far for one timeout to land on its end.
                catch_up(env, self.now, lambda: self._wait(launched))
            else:
                self._wait(launched)
            return

    def _wait(self, launched: LaunchedStep) -> None:
        """Let the step's time pass on SimPy's clock: from its start, as one by one, or from behind
        (after steps completed at once) where a timeout from there lands exactly on its end."""
        env, start = self.env, self.now
        duration = launched.executed.duration_s
        delay = start + duration - env.now if env.now < start else duration
        env.timeout(delay).callbacks.append(lambda _event: self._stepped(launched, start))

    def _stepped(self, launched: LaunchedStep, start: float) -> None:
        self.now = self.env.now
        updates = self.loop.complete(launched)
        if self.recorder is not None:
            self.recorder.stepped(self.index, launched.output, updates, start, self.now, self.hold_s, self.api_holds)
        if self.hold_s:
            hold, self.hold_s, self.api_holds = self.hold_s, 0.0, 0
            self.env.timeout(hold).callbacks.append(self._woken)
            return
        self._serve()

    def _woken(self, _event: simpy.Event) -> None:
        """After idling, or holding for engine time owed: on from SimPy's clock."""
        self._wake = None
        self.now = self.env.now
        self._serve()

    def _run_bulk(self, last_duration_s: float) -> None:
        """After a step completed at once: the steps that are certain to be the same bulk decodes,
        priced at once and run back to back while each ends before anything else is due (module
        docstring). Steps take no less time as contexts grow, so no more than the time left over the
        last step's fit before the next event."""
        if last_duration_s <= 0:
            return
        ahead, first = self.scheduler.bulk_run()
        before = self.env.peek()
        fit = (before - self.now) / last_duration_s  # inf when nothing else is due at all
        count = min(ahead, MAX_RUN_STEPS, int(fit) + 1 if fit < MAX_RUN_STEPS else MAX_RUN_STEPS)
        if count < MIN_RUN_STEPS:
            return
        costs = self.executor.cost_model.bulk_run(first, count)
        ran, self.now = self.loop.run_bulk(first, costs.seconds.tolist(), self.now, before)
        self.executor.account(costs, ran)


def catch_up(env: simpy.Environment, to: float, then: Callable[[], None]) -> None:
    """Bring SimPy's clock exactly onto `to`, where nothing else is due before it (module
    docstring), then call `then`. A timeout lands on now + delay rounded, so `to - now` can miss
    `to`; it is exact when now >= to / 2 (Sterbenz), so a clock further behind first doubles (now +
    now is exact). The extra wake-ups find nothing else due, so they change no order; the step's
    own timeout is then made at its start, as one by one makes it, and lands on the same float sum."""
    if 0.0 < env.now < to / 2:
        env.timeout(env.now).callbacks.append(lambda _event: catch_up(env, to, then))
    else:
        env.timeout(to - env.now).callbacks.append(lambda _event: then())
