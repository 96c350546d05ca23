"""What a request asks of sampling: the user's settings, checked field by field.

Not compiled with the rest of the core (engine/core/compiled.py): these are built from what users
pass, and a compiled dataclass would refuse a value of the wrong type with mypyc's own message,
before the checks below could name the field, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.core.errors import InputError

StructuredOutputKind = Literal["json_schema", "regex", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, which the sampler applies as a token mask: a JSON
    schema (as JSON text), a regular expression, or an EBNF grammar (xgrammar's dialect). Plain
    strings, so that SamplingParams stays hashable and the core stays free of the grammar library."""

    kind: StructuredOutputKind
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "regex", "grammar"):
            raise InputError("structured_output.kind", self.kind, "must be 'json_schema', 'regex' or 'grammar'")
        if not self.spec:
            raise InputError("structured_output.spec", self.spec, "must not be empty")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InputError("max_tokens", self.max_tokens, "must be >= 1")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InputError("temperature", self.temperature, "must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise InputError("top_k", self.top_k, "must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError("top_p", self.top_p, "must be in (0, 1]")
        if self.seed is not None and self.seed < 0:
            raise InputError("seed", self.seed, "must be None or >= 0")
        # A list would make the params unhashable and mutable behind the scheduler's back.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(t < 0 for t in self.stop_token_ids):
            raise InputError("stop_token_ids", self.stop_token_ids, "token ids must be >= 0")
        if self.structured_output is not None and self.ignore_eos:
            # A complete structured output ends on EOS, the only token its mask then allows.
            raise InputError("ignore_eos", True, "cannot go with a structured_output: the output ends when it is complete")
