"""Waiting queues: the order in which waiting requests are offered to the scheduler."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque

from engine.core.request import Request


class RequestQueue(ABC):
    """Removal from the middle (aborts) is lazy: the entry is skipped when it reaches the front,
    so an abort storm under overload costs O(1) each instead of O(queue length)."""

    def __init__(self) -> None:
        self._removed: set[Request] = set()
        self._len = 0

    @abstractmethod
    def _push(self, request: Request, front: bool) -> None: ...

    @abstractmethod
    def _head(self) -> Request | None: ...

    @abstractmethod
    def _pop_head(self) -> Request: ...

    def add(self, request: Request) -> None:
        self._push(request, front=False)
        self._len += 1

    def prepend(self, request: Request) -> None:
        """Give a preempted request its turn back before newer arrivals."""
        self._push(request, front=True)
        self._len += 1

    def remove(self, request: Request) -> None:
        self._removed.add(request)
        self._len -= 1

    def peek(self) -> Request | None:
        head = self._head()
        while head is not None and head in self._removed:
            self._removed.discard(self._pop_head())
            head = self._head()
        return head

    def pop(self) -> Request:
        if self.peek() is None:
            raise IndexError("pop from an empty request queue")
        self._len -= 1
        return self._pop_head()

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        super().__init__()
        self._q: deque[Request] = deque()

    def _push(self, request: Request, front: bool) -> None:
        if front:
            self._q.appendleft(request)
        else:
            self._q.append(request)

    def _head(self) -> Request | None:
        return self._q[0] if self._q else None

    def _pop_head(self) -> Request:
        return self._q.popleft()


class PriorityQueue(RequestQueue):
    """Ordered by (priority, arrival_time); ties keep insertion order. A preempted request
    simply re-enters at its rank, which already puts it ahead of anything less important."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def _push(self, request: Request, front: bool) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq), request))

    def _head(self) -> Request | None:
        return self._heap[0][3] if self._heap else None

    def _pop_head(self) -> Request:
        return heapq.heappop(self._heap)[3]


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"policy={policy!r} is invalid: must be 'fcfs' or 'priority'")
