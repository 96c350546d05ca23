"""SimPy events the simulator schedules with callbacks instead of processes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import TypeVar

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


T = TypeVar("T")


def play(env: simpy.Environment, items: Iterable[T], due_s: Callable[[T], float], handle: Callable[[T], None]) -> None:
    """Hand each of `items` (in order of `due_s`) to `handle` at its due time, those due together in
    one go, starting where a process started now would first run: a timeout with a callback per
    wait, not a SimPy process, whose every wake-up costs a generator resume."""
    pending = iter(items)

    def next_due(_event: simpy.Event | None = None) -> None:
        for item in pending:
            t = due_s(item)
            if t > env.now:
                env.timeout(t - env.now).callbacks.append(partial(arrive, item))
                return
            handle(item)

    def arrive(item: T, _event: simpy.Event) -> None:
        handle(item)
        next_due()

    Soon(env, next_due)
