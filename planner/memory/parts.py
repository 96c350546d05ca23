"""One line of a memory plan: a named amount of memory, the rule that gives it and where the rule comes from.

Every module of planner.memory answers with Parts; the plan adds up those its engine subtracts from
the KV-cache budget and shows all of them, so `serveplan memory` can print each figure beside its
rule and source.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Part:
    key: str  # stable id, e.g. "weights.layers", "activation.sampler"
    label: str
    bytes: float
    rule: str  # the formula with its numbers
    source: str  # a URL at a release tag, a file of this repository, or "estimate: ..." with its reasoning
    in_budget: bool = True  # the engine subtracts it before sizing the KV cache

    @property
    def gib(self) -> float:
        return self.bytes / GIB


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.3g} GiB" if abs(num_bytes) < GIB else f"{num_bytes / GIB:,.2f} GiB"
