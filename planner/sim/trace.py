"""A simulated run's schedule, kept so that it can be re-timed without simulating again.

What the scheduler decided (which requests ran in which step, with how many tokens) depends on
step times only through arrivals; a fit that moves the cost model's parameters a little keeps
the schedule and re-prices its steps (planner/public/retime.py), then simulates again to refresh
the schedule. The trace holds each step's shape (the cost model's input) and when it ran, and for
each request when it wanted to go in, what released it (closed loop: the finish of its
predecessor), when it reached the engine, the step that first scheduled it and the steps that
delivered its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from engine.core import RequestUpdate, SchedulerOutput
from planner.costmodel import ShapeReader, StepShape
from planner.metrics import ClientStream, streamed_deliveries


@dataclass(frozen=True)
class RunTrace:
    shapes: StepShape[np.ndarray]  # arrays over every step of every replica, in the order they completed
    step_replica: np.ndarray  # int, per step
    step_start_s: np.ndarray  # per step, when it ran in the traced run
    step_end_s: np.ndarray
    hold_s: np.ndarray  # per step: the engine time the replica owed after it, API holds included
    # int, per step: requests whose API time (a server in the engine's process) the replica owed
    # after the step, before its next one (planner/sim/replica.py)
    api_holds: np.ndarray
    api_hold_s: float  # the API time each of those took in the traced run
    # Per request (index = submission order):
    due_s: np.ndarray  # when the client meant to send it (open loop: its arrival; gated: release + think)
    gate: np.ndarray  # int: the request whose finish released it (closed loop, capped clients), -1 if none
    think_s: np.ndarray  # pause after the gate's finish
    arrived_s: np.ndarray  # when it reached the engine (past the API server) in the traced run
    first_step: np.ndarray  # int: the step that first scheduled it
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    # Per delivery (a step handing a request its tokens), grouped by request in time order:
    delivery_request: np.ndarray  # int
    delivery_step: np.ndarray  # int
    delivery_tokens: np.ndarray  # int
    # The API server let requests go on to the engine in rounds (planner/sim/frontend.py): the requests
    # that reached the engine at one instant were handled in one round.
    api_rounds: bool = False
    stream: ClientStream = field(default_factory=ClientStream)  # what the client timed (RunRecord's)

    @property
    def num_steps(self) -> int:
        return len(self.step_replica)

    # Facts of the schedule that re-timing reads again at every new set of step durations.

    @cached_property
    def first_delivery(self) -> np.ndarray:
        """Per request: the index of its first delivery."""
        return np.searchsorted(self.delivery_request, np.arange(len(self.due_s)))

    @cached_property
    def last_delivery(self) -> np.ndarray:
        """Per request: the index of its last delivery."""
        return np.searchsorted(self.delivery_request, np.arange(len(self.due_s)), side="right") - 1

    @cached_property
    def replica_steps(self) -> tuple[np.ndarray, ...]:
        """Each replica's steps, in the order they ran."""
        return tuple(np.flatnonzero(self.step_replica == r) for r in np.unique(self.step_replica))

    @cached_property
    def gate_depth(self) -> int:
        """Longest run of requests each gated by the one before (gates always point back)."""
        depth = [0] * len(self.gate)
        for i, g in enumerate(self.gate.tolist()):  # a gate was submitted before the request it releases
            if g >= 0:
                depth[i] = depth[g] + 1
        return max(depth, default=0)

    @cached_property
    def delivery_gaps(self) -> DeliveryGaps:
        """The inter-token gaps of the schedule, by the pair of steps they lie between; a delivery of
        silent leading tokens only (ClientStream), but a request's last, streams no event."""
        request, step = self.delivery_request, self.delivery_step
        silent = self.stream.silent_leading_tokens
        if silent > 1:
            streams = streamed_deliveries(np.r_[True, request[1:] != request[:-1]], self.delivery_tokens, silent)
            request, step = request[streams], step[streams]
        same = request[1:] == request[:-1]
        earlier, later = step[:-1][same], step[1:][same]
        apart = earlier != later  # deliveries of one step are one chunk: no gap between them
        pairs, count = np.unique(np.stack([earlier[apart], later[apart]]), axis=1, return_counts=True)
        return DeliveryGaps(pairs[0], pairs[1], count)


@dataclass(frozen=True)
class DeliveryGaps:
    """Gaps between consecutive deliveries to one request, as distinct step pairs: `count[k]` gaps
    lie between the end of step `earlier[k]` and the end of step `later[k]`. Far fewer pairs than
    gaps (most tokens follow the previous step), so a re-timing prices each pair once."""

    earlier: np.ndarray
    later: np.ndarray
    count: np.ndarray


@dataclass
class TraceRecorder:
    """Collects a RunTrace while the simulator runs; one per simulation, shared by its replicas."""

    reader: ShapeReader
    api_hold_s: float = 0.0  # the replicas' API time per request that arrives while they run
    api_rounds: bool = False  # the API server's release ("round": RunTrace.api_rounds)
    stream: ClientStream = field(default_factory=ClientStream)  # RunTrace.stream
    _shapes: list[StepShape[float]] = field(default_factory=list)
    _replica: list[int] = field(default_factory=list)
    _times: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, hold after)
    _api_holds: list[int] = field(default_factory=list)
    _index: dict[str, int] = field(default_factory=dict)  # request id -> submission index
    _due: list[float] = field(default_factory=list)
    _gate: list[int] = field(default_factory=list)
    _think: list[float] = field(default_factory=list)
    _arrived: list[float] = field(default_factory=list)
    _first: list[int] = field(default_factory=list)
    _prompt: list[int] = field(default_factory=list)
    _output: list[int] = field(default_factory=list)
    _deliveries: list[tuple[int, int, int]] = field(default_factory=list)  # (request, step, tokens)

    def submitted(self, request_id: str, due_s: float, gate_id: str | None, think_s: float,
                  prompt_tokens: int, output_tokens: int) -> None:
        self._index[request_id] = len(self._due)
        self._due.append(due_s)
        self._gate.append(-1 if gate_id is None else self._index[gate_id])
        self._think.append(think_s)
        self._arrived.append(float("nan"))
        self._first.append(-1)
        self._prompt.append(prompt_tokens)
        self._output.append(output_tokens)

    def arrived(self, request_id: str, now_s: float) -> None:
        """The request reached an engine: the first one, where a prefill instance hands it on."""
        i = self._index[request_id]
        if np.isnan(self._arrived[i]):
            self._arrived[i] = now_s

    def stepped(self, replica: int, output: SchedulerOutput, updates: list[RequestUpdate], start_s: float,
                end_s: float, hold_s: float = 0.0, api_holds: int = 0) -> None:
        step = len(self._replica)
        self._shapes.append(self.reader.read(output))
        self._replica.append(replica)
        self._times.append((start_s, end_s, hold_s))
        self._api_holds.append(api_holds)
        index, first = self._index, self._first
        for s in output.scheduled:
            i = index[s.request_id]
            if first[i] < 0:
                first[i] = step
        self._deliveries += [(index[u.request_id], step, len(u.new_token_ids)) for u in updates if u.new_token_ids]

    def trace(self) -> RunTrace:
        deliveries = sorted(self._deliveries)  # by request, then step
        d = np.array(deliveries, dtype=np.int64).reshape(-1, 3)
        times = np.array(self._times, dtype=float).reshape(-1, 3)
        return RunTrace(
            shapes=StepShape.stack(self._shapes),
            step_replica=np.array(self._replica, dtype=np.int64),
            step_start_s=times[:, 0], step_end_s=times[:, 1], hold_s=times[:, 2],
            api_holds=np.array(self._api_holds, dtype=np.int64),
            api_hold_s=self.api_hold_s,
            due_s=np.array(self._due, dtype=float),
            gate=np.array(self._gate, dtype=np.int64),
            think_s=np.array(self._think, dtype=float),
            arrived_s=np.array(self._arrived, dtype=float),  # SimPy's clock is an int until a float delay
            first_step=np.array(self._first, dtype=np.int64),
            prompt_tokens=np.array(self._prompt, dtype=np.int64),
            output_tokens=np.array(self._output, dtype=np.int64),
            delivery_request=d[:, 0], delivery_step=d[:, 1], delivery_tokens=d[:, 2],
            api_rounds=self.api_rounds, stream=self.stream,
        )
