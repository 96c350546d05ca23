"""Routers: which data-parallel replica gets a new request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from engine.core import Request
from planner.sim.replica import Replica

RouterName = Literal["round_robin", "least_outstanding_tokens", "prefix_affinity"]


class Router(Protocol):
    def choose(self, request: Request, replicas: Sequence[Replica]) -> int: ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: Request, replicas: Sequence[Replica]) -> int:
        i = self._next % len(replicas)  # an autoscaled fleet may have shrunk since the last choice
        self._next = (i + 1) % len(replicas)
        return i


class LeastOutstandingTokens:
    """The replica with the fewest prompt + output tokens still to serve (ties: lowest index)."""

    def choose(self, request: Request, replicas: Sequence[Replica]) -> int:
        return min(range(len(replicas)), key=lambda i: replicas[i].outstanding_tokens)


class PrefixAffinity:
    """Send requests that start alike to the replica that served that start before, so its
    prefix cache hits; fall back to the least-loaded replica when load is too uneven.

    Starts are compared at a few lengths (`key_lengths`, longest first): a shared system
    prompt, or the earlier turns of a conversation (whose first turn may be short), find the
    replica that already holds them. As in SGLang's cache-aware router, affinity yields to
    balance when the busiest replica has both `balance_abs_requests` more requests in flight
    than the idlest and `balance_rel` times as many.
    """

    def __init__(
        self, key_lengths: tuple[int, ...] = (256, 64, 16), balance_abs_requests: int = 32, balance_rel: float = 1.5
    ) -> None:
        self.key_lengths = tuple(sorted(key_lengths, reverse=True))
        self.balance_abs_requests = balance_abs_requests
        self.balance_rel = balance_rel
        self._home: dict[tuple[int, ...], int] = {}
        self._least = LeastOutstandingTokens()

    def choose(self, request: Request, replicas: Sequence[Replica]) -> int:
        loads = [r.outstanding_requests for r in replicas]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_requests and hi > self.balance_rel * lo:
            return self._least.choose(request, replicas)
        prompt = request.prompt_token_ids
        for n in self.key_lengths:
            if len(prompt) >= n and (home := self._home.get(tuple(prompt[:n]))) is not None:
                return home
        home = self._least.choose(request, replicas)
        n = next((n for n in self.key_lengths if len(prompt) >= n), len(prompt))
        self._home[tuple(prompt[:n])] = home
        return home


ROUTERS: dict[RouterName, type[RoundRobin] | type[LeastOutstandingTokens] | type[PrefixAffinity]] = {
    "round_robin": RoundRobin,
    "least_outstanding_tokens": LeastOutstandingTokens,
    "prefix_affinity": PrefixAffinity,
}
