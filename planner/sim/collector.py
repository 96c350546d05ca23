"""Fewer garbage collections while a simulation runs.

A simulation allocates container objects by the million (requests, their token lists, SimPy events,
step outputs) and frees nearly all of them by reference counting. CPython's cyclic collector still
runs a young-generation pass every 700 net allocations of tracked objects, and each pass walks
every young object and what it holds: a request's prompt list, thousands of token ids, walked
again and again as it ages. At 16 requests/s on 1 x H100 (bench/sim_speed.py) that was ~260
collections and ~10 % of the wall time. With the young generation collected every
YOUNG_THRESHOLD allocations instead, the same run collects ~10 times and runs ~10 % faster; what
little cyclic garbage a run makes waits a little longer for its collection, a bounded amount.

The threshold is process-wide, so it is raised while any simulation runs (in any thread) and put
back as it was once the last one ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
import gc
import threading

YOUNG_THRESHOLD = 20_000

_lock = threading.Lock()
_running = 0
_saved: tuple[int, int, int] = gc.get_threshold()


@contextmanager
def fewer_collections() -> Iterator[None]:
    global _running, _saved
    with _lock:
        if _running == 0:
            _saved = gc.get_threshold()
            if _saved[0]:  # 0: the process turned automatic collection off; leave it so
                gc.set_threshold(max(_saved[0], YOUNG_THRESHOLD), *_saved[1:])
        _running += 1
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if _running == 0:
                gc.set_threshold(*_saved)
