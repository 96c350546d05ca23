"""SimPy events the simulator schedules with callbacks instead of processes."""

from __future__ import annotations

from collections.abc import Callable

import simpy
from simpy.events import URGENT


class Soon(simpy.Event):
    """Calls `callback` at the current time, before any event of normal priority due now: when a
    process started now would first run. Triggered as SimPy's own Initialize event is, without a
    process to start (a process's every wake-up costs a generator resume)."""

    def __init__(self, env: simpy.Environment, callback: Callable[[simpy.Event], None]) -> None:
        super().__init__(env)
        self.callbacks.append(callback)
        self._ok, self._value = True, None
        env.schedule(self, URGENT)
