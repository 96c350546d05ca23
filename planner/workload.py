"""Workloads: what requests arrive, when, and how long their prompts and outputs are.

This module only *describes and draws* requests. It imports neither torch nor SimPy,
because the real engine (wall clock) and the simulator (`env.now`) must replay the very
same drawn list; anything that depends on how fast requests are served (closed-loop
arrivals, follow-up turns of a conversation) is left to the driver, and the requests
say so through `arrival_s=None`, `parent_id` and `think_time_s`.

Token ids are synthetic but real: requests that share a prefix carry *identical* leading
token ids, so the engine's own block hashing decides the prefix-cache hit rate.
"""

from __future__ import annotations

import bisect
import csv
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
import functools
import math
from pathlib import Path
from typing import Annotated, Literal, TypedDict

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine import limits
from engine.errors import InputError, from_validation_error, over_limit, unknown_name_error
from engine.files import iter_lines, load_json, load_yaml, parse_json


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- lengths


class _Bounded(_Spec):
    """A distribution whose draws are rounded and clipped to [min_tokens, max_tokens]."""

    min_tokens: int = Field(1, ge=1, le=limits.MAX_REQUEST_TOKENS, description="Smallest length drawn; lower draws are clipped up")
    max_tokens: int = Field(..., ge=1, le=limits.MAX_REQUEST_TOKENS, description="Largest length drawn; higher draws are clipped down")

    @model_validator(mode="after")
    def _ordered(self) -> _Bounded:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        return self

    def _clip(self, raw: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(raw), self.min_tokens, self.max_tokens).astype(np.int64)


class FixedLength(_Spec):
    """Every request has the same length."""

    kind: Literal["fixed"] = "fixed"
    tokens: int = Field(ge=1, le=limits.MAX_REQUEST_TOKENS, description="Length of every request, tokens")

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.tokens, dtype=np.int64)


class UniformLength(_Bounded):
    """Lengths uniform over the integers min_tokens..max_tokens inclusive."""

    kind: Literal["uniform"] = "uniform"

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.min_tokens, self.max_tokens + 1, size=n, dtype=np.int64)


class NormalLength(_Bounded):
    """Normal lengths, rounded and clipped (so the sample mean drifts if the clip bites)."""

    kind: Literal["normal"] = "normal"
    mean_tokens: float = Field(gt=0, le=limits.MAX_REQUEST_TOKENS, description="Mean before clipping, tokens")
    std_tokens: float = Field(ge=0, le=limits.MAX_REQUEST_TOKENS, description="Standard deviation before clipping, tokens")

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self._clip(rng.normal(self.mean_tokens, self.std_tokens, size=n))


class LognormalLength(_Bounded):
    """Log-normal lengths: the usual shape of chat prompts and outputs (long right tail)."""

    kind: Literal["lognormal"] = "lognormal"
    median_tokens: float = Field(gt=0, le=limits.MAX_REQUEST_TOKENS, description="Median before clipping, tokens")
    sigma: float = Field(ge=0, le=5, description="Standard deviation of log(length); 0 is a fixed length")
    bounds: Literal["clip", "redraw"] = Field(
        "clip", description="What happens to a draw outside [min_tokens, max_tokens]: clipped to the bound, or drawn "
        "again (a truncated distribution: how dataset samplers drop out-of-range requests)")

    @model_validator(mode="after")
    def _reachable(self) -> LognormalLength:
        if self.bounds == "redraw" and _truncated_mass(self) < 1e-3:
            raise ValueError(f"[{self.min_tokens}, {self.max_tokens}] holds under 0.1 % of this distribution: "
                             "redrawing would rarely land in it")
        return self

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.bounds == "clip":
            return self._clip(self.median_tokens * np.exp(self.sigma * rng.standard_normal(n)))
        out = np.empty(n, dtype=np.int64)
        todo = np.arange(n)
        while todo.size:  # the validator guarantees a usable acceptance rate
            draws = np.rint(self.median_tokens * np.exp(self.sigma * rng.standard_normal(todo.size))).astype(np.int64)
            ok = (draws >= self.min_tokens) & (draws <= self.max_tokens)
            out[todo[ok]] = draws[ok]
            todo = todo[~ok]
        return out


def _truncated_mass(d: LognormalLength) -> float:
    """P(min_tokens - 0.5 <= draw <= max_tokens + 0.5) before rounding."""
    if d.sigma == 0:
        return float(d.min_tokens - 0.5 <= d.median_tokens <= d.max_tokens + 0.5)
    z = [(math.log(max(v, 1e-9)) - math.log(d.median_tokens)) / d.sigma for v in (d.min_tokens - 0.5, d.max_tokens + 0.5)]
    return 0.5 * (math.erf(z[1] / math.sqrt(2)) - math.erf(z[0] / math.sqrt(2)))


class EmpiricalLength(_Spec):
    """A histogram: each length in `tokens` is drawn with probability proportional to its weight."""

    kind: Literal["empirical"] = "empirical"
    tokens: list[Annotated[int, Field(ge=1, le=limits.MAX_REQUEST_TOKENS)]] = Field(
        min_length=1, description="Lengths (histogram bins), tokens"
    )
    weights: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(min_length=1, description="Relative frequency of each length")

    @model_validator(mode="after")
    def _matching(self) -> EmpiricalLength:
        if len(self.tokens) != len(self.weights):
            raise ValueError(f"tokens has {len(self.tokens)} entries but weights has {len(self.weights)}")
        if not sum(self.weights) > 0:
            raise ValueError("weights must not all be zero")
        return self

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = np.asarray(self.weights, dtype=float)
        return rng.choice(np.asarray(self.tokens, dtype=np.int64), size=n, p=p / p.sum())


def _int_is_fixed(value: object) -> object:
    # A bare number in YAML or on the command line means "always this many tokens".
    if isinstance(value, int) and not isinstance(value, bool):
        return {"kind": "fixed", "tokens": value}
    return value


LengthDist = Annotated[
    FixedLength | UniformLength | NormalLength | LognormalLength | EmpiricalLength,
    Field(discriminator="kind"),
    BeforeValidator(_int_is_fixed),
]


# --------------------------------------------------------------------------- arrivals


class PoissonArrivals(_Spec):
    """Open loop, exponential inter-arrival times (independent users); optionally a client that
    holds a request back while max_concurrency are in flight (`vllm bench serve --max-concurrency`)."""

    kind: Literal["poisson"] = "poisson"
    rate_per_s: float = Field(gt=0, le=1e6, description="Mean arrivals per second")
    max_concurrency: int | None = Field(
        None, ge=1, le=1_000_000, description="Most requests in flight; a request due while the client is full goes "
        "when one finishes (None: no cap)")

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.cumsum(rng.exponential(1.0 / self.rate_per_s, size=n))

    @property
    def offered_rate_per_s(self) -> float:
        return self.rate_per_s


class GammaArrivals(_Spec):
    """Open loop, gamma inter-arrival times: cv > 1 is burstier than Poisson, cv < 1 smoother."""

    kind: Literal["gamma"] = "gamma"
    rate_per_s: float = Field(gt=0, le=1e6, description="Mean arrivals per second")
    # Below a thousandth the gaps are constant to within a thousandth (ConstantArrivals), and 1 / cv^2 would
    # overflow long before cv reaches the smallest float.
    cv: float = Field(ge=1e-3, le=100, description="Coefficient of variation of inter-arrival times, 0.001-100; 1 is "
                      "Poisson (steadier than 0.001: constant arrivals)")

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        shape = 1.0 / self.cv**2  # gamma CV is 1/sqrt(shape); the scale then fixes the mean
        return np.cumsum(rng.gamma(shape, 1.0 / (self.rate_per_s * shape), size=n))

    @property
    def offered_rate_per_s(self) -> float:
        return self.rate_per_s


class ConstantArrivals(_Spec):
    """Open loop, one request every 1/rate seconds exactly."""

    kind: Literal["constant"] = "constant"
    rate_per_s: float = Field(gt=0, le=1e6, description="Arrivals per second")

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.arange(1, n + 1, dtype=float) / self.rate_per_s

    @property
    def offered_rate_per_s(self) -> float:
        return self.rate_per_s


# Expected arrivals per cycle of a time-varying schedule, at least: one request a billion cycles.
MIN_ARRIVALS_PER_CYCLE = 1e-9


class RateSegment(_Spec):
    duration_s: float = Field(gt=0, le=1e7, description="Length of this segment, seconds")
    rate_per_s: float = Field(
        ge=0, le=1e6, description="Poisson arrivals per second during the segment; 0 is an idle period"
    )


class TimeVaryingArrivals(_Spec):
    """Piecewise-constant Poisson rate; the schedule repeats until num_requests have arrived."""

    kind: Literal["time_varying"] = "time_varying"
    segments: list[RateSegment] = Field(min_length=1, description="Consecutive segments of constant rate")

    @model_validator(mode="after")
    def _some_traffic(self) -> TimeVaryingArrivals:
        if not any(s.rate_per_s > 0 for s in self.segments):
            raise ValueError("at least one segment needs rate_per_s > 0")
        per_cycle = sum(s.rate_per_s * s.duration_s for s in self.segments)
        if per_cycle < MIN_ARRIVALS_PER_CYCLE:
            # Below it a request arrives after billions of cycles, and a schedule whose mass
            # underflows would put every arrival at infinity.
            raise ValueError(f"the schedule expects {per_cycle:.3g} arrivals a cycle (sum of rate_per_s x "
                             f"duration_s over its segments); it must expect at least {MIN_ARRIVALS_PER_CYCLE:g}")
        return self

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        # Inversion: the points of a unit-rate Poisson process, mapped through the inverse of the
        # integrated rate, are this process's points. One draw per request and no loop over
        # periods, however little traffic a period carries.
        durations = np.array([s.duration_s for s in self.segments])
        rates = np.array([s.rate_per_s for s in self.segments])
        end_s = np.cumsum(durations)
        end_mass = np.cumsum(rates * durations)  # expected arrivals by the end of each segment
        periods, mass = np.divmod(np.cumsum(rng.exponential(1.0, size=n)), end_mass[-1])
        # The first segment whose cumulative mass passes `mass` has a positive rate.
        seg = np.minimum(np.searchsorted(end_mass, mass, side="right"), len(rates) - 1)
        into_s = (mass - (end_mass[seg] - rates[seg] * durations[seg])) / rates[seg]
        return periods * end_s[-1] + (end_s[seg] - durations[seg]) + into_s

    @property
    def offered_rate_per_s(self) -> float:
        total_s = sum(s.duration_s for s in self.segments)
        return sum(s.rate_per_s * s.duration_s for s in self.segments) / total_s


@dataclass(frozen=True)
class CumulativeRate:
    """Expected arrivals since the day's start, inverted: when the count reaches a given number."""

    starts_s: list[float]  # each segment's start
    before: list[float]  # expected arrivals before each segment
    after: list[float]  # ... and by its end
    rates_per_s: list[float]

    @classmethod
    def of(cls, segments: list[RateSegment]) -> CumulativeRate:
        starts = np.concatenate(([0.0], np.cumsum([s.duration_s for s in segments])[:-1]))
        after = np.cumsum([s.rate_per_s * s.duration_s for s in segments])
        before = np.concatenate(([0.0], after[:-1]))
        return cls(starts.tolist(), before.tolist(), after.tolist(), [s.rate_per_s for s in segments])

    def time_of(self, arrivals: float) -> float:
        """When `arrivals` arrivals are expected by; inf when the day ends first."""
        i = bisect.bisect_right(self.after, arrivals)  # the first segment that ends past them: its rate is > 0
        if i == len(self.after):
            return math.inf
        return self.starts_s[i] + (arrivals - self.before[i]) / self.rates_per_s[i]


class OfflineArrivals(_Spec):
    """Every request at once (a benchmark client's request rate inf, an offline batch), optionally
    held to max_concurrency in flight: then a closed loop without think time."""

    kind: Literal["offline"] = "offline"
    max_concurrency: int | None = Field(
        None, ge=1, le=1_000_000, description="Most requests in flight; the rest go as earlier ones finish (None: no cap)")

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.zeros(n)

    @property
    def offered_rate_per_s(self) -> None:
        return None


class ClosedLoopArrivals(_Spec):
    """`concurrency` users, each sending its next request when its previous one finishes.

    Arrival times depend on service speed, so the driver decides them; drawn requests
    carry `arrival_s=None` and the user's `think_time_s`.
    """

    kind: Literal["closed_loop"] = "closed_loop"
    concurrency: int = Field(ge=1, le=1_000_000, description="Users (requests in flight when no one is thinking)")
    think_time_s: float = Field(0.0, ge=0, le=1e6, description="Pause between a reply and the user's next request, s")

    @property
    def offered_rate_per_s(self) -> None:
        return None


Arrival = Annotated[
    PoissonArrivals | GammaArrivals | ConstantArrivals | TimeVaryingArrivals | OfflineArrivals | ClosedLoopArrivals,
    Field(discriminator="kind"),
]


# --------------------------------------------------------------------------- sharing


class SharedPrefix(_Spec):
    """A share of requests start with one of a few common prefixes (system prompt, tool specs, documents).

    The prefix is *prepended* to the request's own prompt, whose length input_tokens draws.
    """

    num_prefixes: int = Field(ge=1, le=100_000, description="Distinct prefixes")
    prefix_tokens: int = Field(ge=1, le=limits.MAX_REQUEST_TOKENS, description="Length of each prefix, tokens")
    share: float = Field(ge=0, le=1, description="Fraction of requests (conversations) that start with a prefix")
    popularity: Literal["uniform", "zipf"] = Field(
        "uniform", description="How a prefixed request picks its prefix: equally, or Zipf (prefix i ~ 1/(i+1)^s)"
    )
    zipf_exponent: float = Field(1.0, gt=0, le=10, description="Zipf exponent s when popularity is 'zipf'")

    def weights(self) -> np.ndarray:
        w: np.ndarray
        if self.popularity == "uniform":
            w = np.ones(self.num_prefixes)
        else:
            w = 1.0 / np.arange(1, self.num_prefixes + 1) ** self.zipf_exponent
        return w / w.sum()


class Conversation(_Spec):
    """Multi-turn chats: turn k's prompt = turn k-1's prompt + its output + a new user message.

    input_tokens then draws the length of each *new user message*; the first turn's prompt
    is that message (after any shared prefix).
    """

    min_turns: int = Field(1, ge=1, le=10_000, description="Fewest turns in a conversation")
    max_turns: int = Field(ge=1, le=10_000, description="Most turns in a conversation (uniform in between)")
    think_time_s: float = Field(0.0, ge=0, le=1e6, description="Pause between a reply and the next turn, seconds")

    @model_validator(mode="after")
    def _ordered(self) -> Conversation:
        if self.min_turns > self.max_turns:
            raise ValueError(f"min_turns={self.min_turns} must be <= max_turns={self.max_turns}")
        return self

    @property
    def mean_turns(self) -> float:
        return (self.min_turns + self.max_turns) / 2


# --------------------------------------------------------------------------- workload


class Workload(_Spec):
    """Everything needed to draw the same request list again: the spec plus its seed."""

    name: str = Field("custom", min_length=1, max_length=64, description="Short id used in reports and request ids")
    description: str = Field("", max_length=1000, description="One line for humans")
    arrival: Arrival = Field(description="When requests (or conversations) arrive")
    input_tokens: LengthDist = Field(description="Prompt length (per turn's new message in conversations), tokens")
    output_tokens: LengthDist = Field(description="Tokens to generate per request (exact: drivers set ignore_eos)")
    num_requests: int = Field(ge=1, le=limits.MAX_REQUESTS, description="Requests to draw, follow-up turns included")
    max_total_tokens: int | None = Field(
        None, ge=2, le=limits.MAX_REQUEST_TOKENS, description="A request whose prompt + output would exceed this is "
        "drawn again (ShareGPT samplers drop such pairs; None: no cap)")
    shared_prefix: SharedPrefix | None = Field(None, description="Common prefixes shared by a share of requests")
    conversation: Conversation | None = Field(None, description="Multi-turn conversations; None is single-turn")
    first_token_id: int = Field(
        1000, ge=0, description="Lowest synthetic token id; ids below are left to special tokens"
    )
    vocab_size_tokens: int = Field(
        30_000, ge=2, description="Synthetic token ids are < this (and < the model's vocab when drawing for one)"
    )
    seed: int = Field(0, ge=0, description="Seed of every random draw")

    @field_validator("name")
    @classmethod
    def _printable(cls, name: str) -> str:
        # The name is part of every request id, printed in tables and sent to endpoints: a newline
        # or a terminal escape sequence in it would forge lines or colours there.
        if any(not ch.isprintable() for ch in name):
            raise ValueError("must be printable: no control characters (newlines, tabs, escape sequences)")
        return name

    @property
    def requests_per_arrival(self) -> float:
        """Requests each arrival brings on average: a conversation's turns, else one. An arrival
        rate (Poisson, a plan's --rate) counts conversation starts in a multi-turn workload."""
        return 1.0 if self.conversation is None else self.conversation.mean_turns

    @model_validator(mode="after")
    def _id_range(self) -> Workload:
        if self.first_token_id >= self.vocab_size_tokens:
            raise ValueError(
                f"first_token_id={self.first_token_id} must be < vocab_size_tokens={self.vocab_size_tokens}"
            )
        return self


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request as drivers replay it.

    Exactly one of `prompt_token_ids` and `new_prompt_token_ids` is non-empty: a follow-up
    turn (`parent_id` set) only knows its new user message until its parent finishes; the
    driver then builds the prompt with `build_prompt`.
    """

    request_id: str
    arrival_s: float | None  # None: the driver decides (closed loop, follow-up turns)
    prompt_token_ids: tuple[int, ...]
    output_tokens: int  # max_tokens, generated exactly (ignore_eos)
    prefix_id: int | None = None
    conversation_id: int | None = None
    turn: int = 0
    parent_id: str | None = None
    new_prompt_token_ids: tuple[int, ...] = ()
    think_time_s: float = 0.0  # pause after the previous request of this user/conversation finishes

    @property
    def is_follow_up(self) -> bool:
        return self.parent_id is not None


def build_prompt(parent_prompt: Sequence[int], parent_output: Sequence[int], new_tokens: Sequence[int]) -> list[int]:
    """The prompt of a follow-up turn: the whole previous exchange, then the new user message."""
    return [*parent_prompt, *parent_output, *new_tokens]


def follow_ups(requests: list[WorkloadRequest]) -> dict[str, WorkloadRequest]:
    """parent request_id -> the turn to submit after that parent finishes (plus its think time)."""
    return {r.parent_id: r for r in requests if r.parent_id is not None}


_STREAMS = ("arrivals", "input", "output", "prefix_choice", "prefix_tokens", "turns", "tokens")


class _RequestFields(TypedDict):
    """The WorkloadRequest fields that `draw` sets alike for a conversation's first and later turns."""

    request_id: str
    output_tokens: int
    prefix_id: int | None
    conversation_id: int | None
    turn: int


def draw(workload: Workload, vocab_size: int | None = None, max_model_len: int | None = None, *,
         prefix_seed: int | None = None) -> list[WorkloadRequest]:
    """Draw the requests of `workload`; the same workload always gives the same list.

    `vocab_size` is the model's vocabulary: token ids stay below it too. Ids do not depend
    on it while it is at least `vocab_size_tokens`, so every large model sees the same prompts.
    Arrival times, lengths and the token total are checked against the limits (and each
    request against `max_model_len`, when given) before any token id is drawn. `prefix_seed`
    seeds the shared prefixes' token ids (default: the workload's seed), so a stream drawn in
    chunks of different seeds keeps one set of prefixes.
    """
    hi = workload.vocab_size_tokens if vocab_size is None else min(vocab_size, workload.vocab_size_tokens)
    if hi <= workload.first_token_id:
        raise InputError("vocab_size", vocab_size, f"must exceed first_token_id={workload.first_token_id}")
    rngs = _streams(workload)
    if prefix_seed is not None:
        stream = np.random.SeedSequence(prefix_seed).spawn(len(_STREAMS))[_STREAMS.index("prefix_tokens")]
        rngs["prefix_tokens"] = np.random.default_rng(stream)
    lo, n = workload.first_token_id, workload.num_requests
    if n > limits.MAX_REQUESTS:  # the field's own bound, for a Workload built without validation
        raise over_limit("num_requests", n, "MAX_REQUESTS", "the request count")

    conv = workload.conversation
    if conv is None:
        turns = np.ones(n, dtype=np.int64)
    else:
        # Enough conversations to cover n requests even if every one has min_turns.
        turns = rngs["turns"].integers(conv.min_turns, conv.max_turns + 1, size=math.ceil(n / conv.min_turns))
        turns = turns[: int(np.searchsorted(np.cumsum(turns), n)) + 1]
        turns[-1] -= int(turns.sum()) - n  # the last conversation is cut short at n requests
    num_roots = len(turns)

    arrival = workload.arrival
    times = None if isinstance(arrival, ClosedLoopArrivals) else arrival.times(rngs["arrivals"], num_roots)
    root_think_s = arrival.think_time_s if isinstance(arrival, ClosedLoopArrivals) else 0.0
    if times is not None and not times[-1] <= limits.MAX_ARRIVAL_S:
        raise over_limit("arrival", f"{arrival.offered_rate_per_s:g} requests/s", "MAX_ARRIVAL_S",
                         f"the last of {num_roots:,} arrivals, at {times[-1]:.3g} s,")

    sp = workload.shared_prefix
    prefix_ids = np.full(num_roots, -1, dtype=np.int64)  # per conversation; -1: no shared prefix
    if sp is not None:
        crng = rngs["prefix_choice"]
        chosen = crng.choice(sp.num_prefixes, size=num_roots, p=sp.weights())
        uses = crng.random(num_roots) < sp.share
        prefix_ids = np.where(uses, chosen, -1)

    inputs, outputs = _lengths(workload, rngs)
    _check_sizes(workload, turns, prefix_ids, inputs, outputs, max_model_len)
    prefixes: list[tuple[int, ...]] = []
    if sp is not None:
        prng = rngs["prefix_tokens"]
        prefixes = [tuple(prng.integers(lo, hi, size=sp.prefix_tokens).tolist()) for _ in range(sp.num_prefixes)]
    ids = _token_ints(rngs["tokens"].integers(lo, hi, size=int(inputs.sum())), hi)
    bounds = np.concatenate(([0], np.cumsum(inputs))).tolist()

    # Python objects per request only now, after the limits (a million of them are ~400 MB).
    prefix_of: list[int | None] = [None if p < 0 else p for p in prefix_ids.tolist()]
    requests: list[WorkloadRequest] = []
    k = 0  # request index, in the order lengths were drawn
    for c in range(num_roots):
        parent = None
        prefix_id = prefix_of[c]
        for t in range(int(turns[c])):
            own = tuple(ids[bounds[k] : bounds[k + 1]])
            rid = f"{workload.name}-{k}"
            common: _RequestFields = dict(request_id=rid, output_tokens=int(outputs[k]), prefix_id=prefix_id,
                                          conversation_id=c if conv is not None else None, turn=t)
            if t == 0:
                prefix = prefixes[prefix_id] if prefix_id is not None else ()
                arrival_s = None if times is None else float(times[c])
                requests.append(WorkloadRequest(arrival_s=arrival_s, prompt_token_ids=prefix + own,
                                                think_time_s=root_think_s, **common))
            else:
                assert conv is not None  # only conversations have turns after the first
                requests.append(WorkloadRequest(arrival_s=None, prompt_token_ids=(), parent_id=parent,
                                                new_prompt_token_ids=own, think_time_s=conv.think_time_s, **common))
            parent = rid
            k += 1
    return requests


# Ids below this are handed out as shared int objects: a run of 10,000 chat prompts holds 4 million ids,
# which as ints of their own cost ~110 MB and a third of the draw's time.
_POOLED_IDS = 1 << 18


def _token_ints(ids: np.ndarray, hi: int) -> list[int]:
    """`ids` (each < hi) as a list of Python ints: the same values, shared int objects where hi is small."""
    return _int_pool(hi)[ids].tolist() if hi <= _POOLED_IDS else ids.tolist()


@functools.lru_cache(maxsize=2)
def _int_pool(hi: int) -> np.ndarray:
    """range(hi) as an object array: indexing it hands out its int objects instead of making new ones."""
    pool = np.empty(hi, dtype=object)
    pool[:] = range(hi)
    return pool


def _streams(workload: Workload) -> dict[str, np.random.Generator]:
    # One child stream per concern, so that changing one knob (say, the arrival rate) leaves
    # the lengths and token ids of every request as they were.
    children = np.random.SeedSequence(workload.seed).spawn(len(_STREAMS))
    return {stream: np.random.default_rng(child) for stream, child in zip(_STREAMS, children)}


def _lengths(workload: Workload, rngs: dict[str, np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
    n = workload.num_requests
    inputs = workload.input_tokens.draw(rngs["input"], n)
    outputs = workload.output_tokens.draw(rngs["output"], n)
    if workload.max_total_tokens is not None:
        _redraw_over(workload, inputs, outputs, rngs["input"], rngs["output"])
    return inputs, outputs


def draw_lengths(workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    """The (prompt, output) lengths `draw` gives `workload`'s requests, in order, without their
    token ids or the limits' checks."""
    return _lengths(workload, _streams(workload))


def _redraw_over(workload: Workload, inputs: np.ndarray, outputs: np.ndarray, rng_in: np.random.Generator,
                 rng_out: np.random.Generator, max_rounds: int = 10_000) -> None:
    """Draw both lengths of every pair over max_total_tokens again, in place: the pairs kept then
    follow the distribution conditioned on the cap, as a sampler that drops such pairs yields."""
    cap = workload.max_total_tokens
    assert cap is not None
    over = np.flatnonzero(inputs + outputs > cap)
    for _ in range(max_rounds):
        if not over.size:
            return
        inputs[over] = workload.input_tokens.draw(rng_in, over.size)
        outputs[over] = workload.output_tokens.draw(rng_out, over.size)
        over = over[inputs[over] + outputs[over] > cap]
    raise InputError("max_total_tokens", cap, "is too small for these input_tokens and output_tokens: almost every "
                     "pair exceeds it")


def _check_sizes(workload: Workload, turns: np.ndarray, prefix_ids: np.ndarray, inputs: np.ndarray,
                 outputs: np.ndarray, max_model_len: int | None) -> None:
    """Refuse, from the drawn lengths alone, a request beyond the model's context or a workload
    beyond MAX_WORKLOAD_TOKENS: before a single token id is drawn."""
    # Requests are ordered by conversation, then turn; a turn's prompt holds the whole
    # conversation before it (prompts and outputs) and the conversation's shared prefix.
    conv_of = np.repeat(np.arange(len(turns)), turns)
    sp = workload.shared_prefix
    prefix_len = np.where(prefix_ids >= 0, sp.prefix_tokens if sp is not None else 0, 0)
    spent = np.cumsum(inputs + outputs)
    first = np.cumsum(turns) - turns  # index of each conversation's first request
    totals = prefix_len[conv_of] + spent - (spent[first] - inputs[first] - outputs[first])[conv_of]
    if max_model_len is not None and totals.max() > max_model_len:
        k = int(np.argmax(totals > max_model_len))
        raise context_error(f"{workload.name}-{k}", int(totals[k] - outputs[k]), int(outputs[k]), max_model_len)
    total = int(totals.sum()) + (sp.num_prefixes * sp.prefix_tokens if sp is not None else 0)
    if total > limits.MAX_WORKLOAD_TOKENS:
        raise over_limit("num_requests", workload.num_requests, "MAX_WORKLOAD_TOKENS",
                         f"with these input_tokens, output_tokens and shared_prefix, its {total:,} tokens")


def context_error(request_id: str, prompt_tokens: int, output_tokens: int, max_model_len: int) -> InputError:
    """A request that cannot fit the model's context, named as drivers name it."""
    return InputError(f"request {request_id}", f"{prompt_tokens} prompt + {output_tokens} output tokens",
                      f"must fit max_model_len={max_model_len}")


# --------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class LengthStats:
    mean: float
    p50: float
    p90: float
    p99: float
    max: int

    @classmethod
    def of(cls, values: list[int]) -> LengthStats:
        a = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(float(a.mean()), float(p50), float(p90), float(p99), int(a.max()))


@dataclass(frozen=True)
class WorkloadSummary:
    """Shape of a drawn request list, for reports and sanity checks.

    Follow-up turns count only their new message in `input_tokens`: their full prompt is
    unknown until the previous turn has run.
    """

    num_requests: int
    num_follow_ups: int
    input_tokens: LengthStats
    output_tokens: LengthStats
    duration_s: float | None  # last timed arrival; None for closed loop
    offered_rate_per_s: float | None  # timed arrivals (conversation starts, if multi-turn) / duration_s
    prefix_share: float  # shared-prefix tokens / prompt tokens: an upper bound on the prefix-cache hit rate


def summary(requests: list[WorkloadRequest], prefix_tokens: dict[int, int] | None = None) -> WorkloadSummary:
    """Summarise `requests`; `prefix_tokens` (prefix id -> length) defaults to the longest common

    leading run of token ids within each prefix group, which is what block hashing can share.
    """
    if not requests:
        raise InputError("requests", [], "need at least one request to summarise")
    if prefix_tokens is None:
        prefix_tokens = _common_prefix_lengths(requests)
    own = [len(r.prompt_token_ids) or len(r.new_prompt_token_ids) for r in requests]
    shared = sum(prefix_tokens.get(r.prefix_id, 0) for r in requests if r.prefix_id is not None and not r.is_follow_up)
    timed = [r.arrival_s for r in requests if r.arrival_s is not None]
    duration = max(timed) if timed else None
    return WorkloadSummary(
        num_requests=len(requests),
        num_follow_ups=sum(r.is_follow_up for r in requests),
        input_tokens=LengthStats.of(own),
        output_tokens=LengthStats.of([r.output_tokens for r in requests]),
        duration_s=duration,
        offered_rate_per_s=len(timed) / duration if duration else None,
        prefix_share=shared / sum(own),
    )


def _common_prefix_lengths(requests: list[WorkloadRequest]) -> dict[int, int]:
    first: dict[int, tuple[int, ...]] = {}
    lengths: dict[int, int | None] = {}
    for r in requests:
        if r.prefix_id is None or r.is_follow_up:
            continue
        if r.prefix_id not in first:
            first[r.prefix_id], lengths[r.prefix_id] = r.prompt_token_ids, None
            continue
        a, b, known = first[r.prefix_id], r.prompt_token_ids, lengths[r.prefix_id]
        m = min(len(a) if known is None else known, len(b))
        if a[:m] != b[:m]:
            m = int(np.argmax(np.asarray(a[:m]) != np.asarray(b[:m])))
        lengths[r.prefix_id] = m
    # A prefix that no second request uses shares nothing.
    return {pid: m or 0 for pid, m in lengths.items()}


# --------------------------------------------------------------------------- traces

_TRACE_FIELDS = ("arrival_s", "input_tokens", "output_tokens", "prefix_id", "conversation_id")


@dataclass(frozen=True)
class _TraceRow:
    line: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    prefix: str | None
    conversation: str | None


def load_trace(path: str | Path, prefix_tokens: int | None = None, seed: int = 0, first_token_id: int | None = None,
               vocab_size_tokens: int = 30_000, max_model_len: int | None = None) -> list[WorkloadRequest]:
    """Requests recorded in a JSONL or CSV trace, with synthetic token ids of the recorded lengths.

    Columns: arrival_s, input_tokens, output_tokens, and optionally prefix_id and
    conversation_id (any labels). Rules, so that hit rates come from real block hashing:
    - Rows are sorted by arrival_s (stably), not rejected: merged logs are often slightly
      out of order. Times are replayed as recorded (open loop).
    - Requests with the same prefix_id start with the same `prefix_tokens` token ids (cut to
      a shorter prompt's length); by default half the shortest prompt of the group.
    - Within a conversation_id, each request starts with the previous request's prompt (cut
      to its own length), then fresh tokens. Its previous *output* is not in there (the trace
      has no token ids), so replay slightly under-counts the cache hits of real multi-turn chat.
    Token ids are in [first_token_id, vocab_size_tokens). The file is streamed; every row is
    checked (against `max_model_len` too, when given) and the limits on rows and tokens are
    enforced before any token id is drawn.
    """
    path = Path(path)
    if first_token_id is None:
        # Ids below 1000 are left to special tokens, as a workload's are; a vocabulary too small
        # for that (a byte-level model's 256) keeps only its lowest tenth, so prompts still have
        # most of it to draw from.
        first_token_id = min(1000, vocab_size_tokens // 10)
    if prefix_tokens is not None and prefix_tokens < 1:
        raise InputError("prefix_tokens", prefix_tokens, "must be >= 1 (or None for half the shortest prompt)")
    if not 0 <= first_token_id < vocab_size_tokens:
        raise InputError("first_token_id", first_token_id, f"must be in [0, vocab_size_tokens={vocab_size_tokens})")
    rows = sorted(_read_trace(path, max_model_len), key=lambda r: r.arrival_s)
    if not rows:
        raise InputError("trace", str(path), "the trace holds no requests")

    rng = np.random.default_rng(seed)
    group_len: dict[str, tuple[int, int]] = {}  # prefix label -> its shortest and longest prompt
    for r in rows:
        if r.prefix is not None:
            shortest, longest = group_len.get(r.prefix, (r.input_tokens, r.input_tokens))
            group_len[r.prefix] = (min(shortest, r.input_tokens), max(longest, r.input_tokens))
    # A prefix is cut to each prompt: ids past the group's longest prompt would never be used.
    prefixes = {label: tuple(rng.integers(first_token_id, vocab_size_tokens,
                                          size=min(prefix_tokens, longest) if prefix_tokens else max(1, shortest // 2)
                                          ).tolist())
                for label, (shortest, longest) in group_len.items()}
    prefix_num = {label: i for i, label in enumerate(prefixes)}
    conv_num: dict[str, int] = {}
    conv_turns: dict[str, int] = {}
    last_in_conv: dict[str, tuple[int, ...]] = {}

    requests = []
    for r in rows:
        if r.conversation is not None and r.conversation in last_in_conv:
            head = last_in_conv[r.conversation]
        else:
            head = prefixes[r.prefix] if r.prefix is not None else ()
        head = head[: r.input_tokens]
        prompt = head + tuple(rng.integers(first_token_id, vocab_size_tokens, size=r.input_tokens - len(head)).tolist())
        turn = 0
        if r.conversation is not None:
            turn = conv_turns.get(r.conversation, 0)
            conv_turns[r.conversation] = turn + 1
            conv_num.setdefault(r.conversation, len(conv_num))
            last_in_conv[r.conversation] = prompt
        requests.append(WorkloadRequest(
            request_id=f"{path.stem}-L{r.line}", arrival_s=r.arrival_s, prompt_token_ids=prompt,
            output_tokens=r.output_tokens, prefix_id=prefix_num.get(r.prefix) if r.prefix is not None else None,
            conversation_id=conv_num.get(r.conversation) if r.conversation is not None else None, turn=turn))
    return requests


# A trace's lengths become a histogram of at most this many bins (quantiles beyond it).
TRACE_LENGTH_BINS = 512


def workload_from_trace(path: str | Path, seed: int = 0, max_model_len: int | None = None) -> Workload:
    """The workload a trace records, for questions asked at other rates (`plan`): its prompt and
    reply lengths as histograms, its prefix groups as a shared prefix (as `load_trace` replays them:
    half the group's shortest prompt, the median over groups; prefixes picked equally) and Poisson
    arrivals at its mean rate. Multi-turn traces are refused: turn-by-turn growth of the context is
    not summarised (simulate the trace itself instead). Rows are streamed and checked as in `load_trace`."""
    path = Path(path)
    rows = list(_read_trace(path, max_model_len))
    if not rows:
        raise InputError("trace", str(path), "the trace holds no requests")
    if any(r.conversation is not None for r in rows):
        raise InputError("trace", str(path), "has conversation_id (multi-turn): a plan summarises single requests; "
                         "simulate the trace itself to replay its conversations")
    shortest: dict[str, int] = {}
    for r in rows:
        if r.prefix is not None:
            shortest[r.prefix] = min(shortest.get(r.prefix, r.input_tokens), r.input_tokens)
    prefix = int(np.median([max(1, n // 2) for n in shortest.values()])) if shortest else 0
    own = [r.input_tokens - (prefix if r.prefix is not None else 0) for r in rows]
    times = [r.arrival_s for r in rows]
    span = max(times) - min(times)
    if span <= 0:
        raise InputError("trace", str(path), "needs arrivals spread over time to have a rate (all arrive at once)")
    prefixed, rate = sum(r.prefix is not None for r in rows), (len(rows) - 1) / span
    shared = (f"{len(shortest):,} shared prefix{'es' if len(shortest) > 1 else ''} of {prefix:,} tokens on {prefixed / len(rows):.0%} of requests, "
              if shortest else "no shared prefix, ")
    return Workload(
        name=_trace_name(path), arrival=PoissonArrivals(rate_per_s=rate),
        description=f"trace {_trace_name(path)} ({len(rows):,} requests) as its prompt and reply lengths, {shared}"
                    f"Poisson arrivals at its mean rate ({rate:,.2f} req/s)",
        input_tokens=_histogram(np.maximum(own, 1)), output_tokens=_histogram(np.array([r.output_tokens for r in rows])),
        num_requests=len(rows), seed=seed,
        shared_prefix=SharedPrefix(num_prefixes=len(shortest), prefix_tokens=prefix, share=prefixed / len(rows))
        if shortest else None,
    )


def _trace_name(path: Path) -> str:
    name = "".join(ch for ch in path.stem if ch.isprintable())[:64]
    return name or "trace"


def _histogram(lengths: np.ndarray) -> EmpiricalLength:
    values, counts = np.unique(lengths, return_counts=True)
    if values.size > TRACE_LENGTH_BINS:
        values, counts = np.unique(np.round(np.quantile(lengths, (np.arange(TRACE_LENGTH_BINS) + 0.5) / TRACE_LENGTH_BINS)),
                                   return_counts=True)
    return EmpiricalLength(tokens=[int(v) for v in values], weights=[float(c) for c in counts])


def _read_trace(path: Path, max_model_len: int | None) -> Iterator[_TraceRow]:
    """The rows of a trace, checked one by one as the file streams in."""
    total_tokens = 0
    rows: Iterator[tuple[int, Mapping[str, object]]] = (
        _csv_rows(path) if path.suffix.lower() == ".csv" else _jsonl_rows(path))
    for num_rows, (line, row) in enumerate(rows, 1):
        if num_rows > limits.MAX_REQUESTS:
            raise over_limit("trace", str(path), "MAX_REQUESTS", f"its row count (line {line:,})")
        parsed = _parse_row(path, line, row)
        tokens = parsed.input_tokens + parsed.output_tokens
        if max_model_len is not None and tokens > max_model_len:
            raise context_error(f"{path.stem}-L{line}", parsed.input_tokens, parsed.output_tokens, max_model_len)
        total_tokens += tokens
        if total_tokens > limits.MAX_WORKLOAD_TOKENS:
            raise over_limit("trace", str(path), "MAX_WORKLOAD_TOKENS", f"its tokens up to line {line:,}, {total_tokens:,},")
        yield parsed


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    reader = csv.reader(text for _, text in iter_lines(path, "trace"))
    try:
        header = next((values for values in reader if values), None)  # blank lines before it are skipped
        if header is None:
            return
        duplicated = sorted({name for name in header if header.count(name) > 1})
        if duplicated:
            raise InputError(f"{path}:{reader.line_num}: columns", duplicated, "each column may appear once")
        unknown = set(header) - set(_TRACE_FIELDS)
        if unknown == set(header):  # not a trace at all: say so without echoing its first line
            raise InputError("trace", f"{path}:{reader.line_num}",
                             f"the header names none of the trace columns {', '.join(_TRACE_FIELDS)}")
        if unknown:
            raise InputError(f"{path}:{reader.line_num}: columns", sorted(unknown), f"known columns: {', '.join(_TRACE_FIELDS)}")
        for values in reader:
            if not values:
                continue  # a blank line
            if len(values) != len(header):
                raise InputError(f"{path}:{reader.line_num}: row", f"{len(values)} values",
                                 f"the header names {len(header)} columns")
            yield reader.line_num, dict(zip(header, values))
    except csv.Error as exc:
        raise InputError("trace", f"{path}:{reader.line_num}", f"malformed CSV ({exc})") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    for line_no, line in iter_lines(path, "trace"):
        line = line.strip()
        if not line:
            continue
        obj = parse_json(line, "trace", f"{path}:{line_no}")  # the line itself is not echoed
        if not isinstance(obj, dict):
            raise InputError(f"{path}:{line_no}: line", type(obj).__name__, "each line must be a JSON object")
        unknown = set(obj) - set(_TRACE_FIELDS)
        if unknown:
            raise InputError(f"{path}:{line_no}: fields", sorted(unknown), f"known fields: {', '.join(_TRACE_FIELDS)}")
        yield line_no, obj


def _parse_row(path: Path, line: int, row: Mapping[str, object]) -> _TraceRow:
    def where(field: str) -> str:
        return f"{path}:{line}: {field}"

    def number(field: str, integer: bool, limit: str) -> float:
        raw = row.get(field)
        if raw is None or raw == "" or isinstance(raw, bool):
            raise InputError(where(field), raw, "required: a number")
        if not isinstance(raw, (int, float, str)):
            raise InputError(where(field), raw, "must be a number")
        try:
            value = float(raw)
        except (ValueError, OverflowError):
            raise InputError(where(field), raw, "must be a number") from None
        if not math.isfinite(value) or (integer and value != int(value)):
            raise InputError(where(field), raw, "must be a finite " + ("integer" if integer else "number"))
        if value > getattr(limits, limit):
            raise over_limit(where(field), raw, limit, "the value")
        return value

    def label(field: str) -> str | None:
        raw = row.get(field)
        if raw is None or raw == "":
            return None
        if isinstance(raw, bool) or not isinstance(raw, (str, int)):  # an id, not a structure to print
            raise InputError(where(field), raw, "must be a text or an integer id")
        return str(raw)

    arrival_s = number("arrival_s", integer=False, limit="MAX_ARRIVAL_S")
    if arrival_s < 0:
        raise InputError(where("arrival_s"), row["arrival_s"], "must be >= 0 seconds")
    tokens = {}
    for field in ("input_tokens", "output_tokens"):
        tokens[field] = int(number(field, integer=True, limit="MAX_REQUEST_TOKENS"))
        if tokens[field] < 1:
            raise InputError(where(field), row[field], "must be >= 1 token")
    return _TraceRow(line, arrival_s, tokens["input_tokens"], tokens["output_tokens"],
                     label("prefix_id"), label("conversation_id"))


# --------------------------------------------------------------------------- presets

# ShareGPT as benchmark clients sample it: prompt = a conversation's first turn, output = the length
# of its reply. The clients' filters (vLLM benchmarks/datasets.py, SGLang before 2025: drop pairs
# with a side under 4 tokens, a prompt over 1024 or a pair over 2048; SGLang since 2025: a side
# under 2). The spread is that of the first-round pairs of the vLLM paper's artifact
# (github.com/sosp-ae-39/sosp-ae-astra @ 3180d2f8, datasets/sharegpt_opt_text_completion_length.pkl,
# 84,226 pairs) under vLLM's filters: log-normal with sigma 1.35 (prompts) and 1.01 (replies).
# The artifact is an older ShareGPT dump, so only its spread is used; the medians are solved so
# that the means are those a run printed (vllm bench serve, seed 0, 1,000 prompts, Qwen3
# tokenizer: 217.4 and 201.6 tokens, GPUStack's performance lab; other tokenizers print 214-230).
SHAREGPT_SIGMA_INPUT, SHAREGPT_SIGMA_OUTPUT = 1.35, 1.01
SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT = 217.4, 201.6
SHAREGPT_RULES: dict[str, tuple[int, int | None, int | None]] = {  # (shortest side, longest prompt, longest pair)
    "vllm": (4, 1024, 2048),
    "sglang": (2, None, None),
}
_SHAREGPT_LONGEST = 32_768  # an uncapped client still meets the model's context; ShareGPT holds nothing longer


def sharegpt_lengths(mean_input_tokens: float | None = None, mean_output_tokens: float | None = None,
                     client: str = "vllm") -> tuple[LognormalLength, LognormalLength, int | None]:
    """(prompt lengths, output lengths, pair cap) of ShareGPT sampled by `client`'s rules, with the
    given means (default: the published vLLM-client means above)."""
    if client not in SHAREGPT_RULES:
        raise unknown_name_error("client", client, SHAREGPT_RULES)
    shortest, longest_prompt, longest_pair = SHAREGPT_RULES[client]
    targets = (mean_input_tokens or SHAREGPT_MEAN_INPUT, mean_output_tokens or SHAREGPT_MEAN_OUTPUT)
    medians = _sharegpt_medians(targets, shortest, longest_prompt or _SHAREGPT_LONGEST, longest_pair)
    prompt_cap = longest_prompt or _SHAREGPT_LONGEST
    output_cap = (longest_pair - shortest) if longest_pair else _SHAREGPT_LONGEST
    return (LognormalLength(median_tokens=medians[0], sigma=SHAREGPT_SIGMA_INPUT, min_tokens=shortest,
                            max_tokens=prompt_cap, bounds="redraw"),
            LognormalLength(median_tokens=medians[1], sigma=SHAREGPT_SIGMA_OUTPUT, min_tokens=shortest,
                            max_tokens=output_cap, bounds="redraw"),
            longest_pair)


def _sharegpt_medians(targets: tuple[float, float], shortest: int, longest_prompt: int,
                      longest_pair: int | None) -> tuple[float, float]:
    """Medians whose truncated, pair-capped means are `targets`: fixed-point iteration over one
    seeded sample (the truncation shifts each mean by less than the median moves it)."""
    z = np.random.default_rng(20230923).standard_normal((2, 200_000))
    medians = list(targets)
    for _ in range(60):
        x = np.rint(medians[0] * np.exp(SHAREGPT_SIGMA_INPUT * z[0]))
        y = np.rint(medians[1] * np.exp(SHAREGPT_SIGMA_OUTPUT * z[1]))
        keep = (x >= shortest) & (y >= shortest) & (x <= longest_prompt) & (y <= _SHAREGPT_LONGEST)
        if longest_pair is not None:
            keep &= x + y <= longest_pair
        means = (x[keep].mean(), y[keep].mean())
        if all(abs(m / t - 1) < 1e-4 for m, t in zip(means, targets)):
            break
        medians = [m * t / mean for m, t, mean in zip(medians, targets, means)]
    return medians[0], medians[1]


# Shapes are approximate, read off public dataset statistics; they are starting points,
# not measurements of anyone's traffic. Rates are per replica-sized deployments and meant
# to be overridden (get_workload(name, arrival=...)).
_SHAREGPT_IN, _SHAREGPT_OUT, _SHAREGPT_PAIR = sharegpt_lengths()
PRESETS: dict[str, Workload] = {
    # ShareGPT as `vllm bench serve` samples it (see sharegpt_lengths), all at once: the most
    # published serving benchmark.
    "sharegpt": Workload(
        name="sharegpt", description="ShareGPT as vLLM's benchmark client samples it; every request at once",
        arrival=OfflineArrivals(), input_tokens=_SHAREGPT_IN, output_tokens=_SHAREGPT_OUT,
        max_total_tokens=_SHAREGPT_PAIR, num_requests=1000,
    ),
    # ShareGPT (vLLM's benchmark subset) and LMSYS-Chat-1M: prompts with a median of a few
    # hundred tokens and a long tail, replies with a median near 200 (approximate).
    "chat": Workload(
        name="chat", description="ShareGPT-like chat: short prompts, medium replies, Poisson arrivals",
        arrival=PoissonArrivals(rate_per_s=4.0),
        input_tokens=LognormalLength(median_tokens=250, sigma=1.0, min_tokens=4, max_tokens=8192),
        output_tokens=LognormalLength(median_tokens=200, sigma=0.8, min_tokens=4, max_tokens=2048),
        num_requests=1000,
    ),
    # Retrieval-augmented QA: top-k of ~5-10 chunks of 512-1k tokens plus a question, short
    # grounded answers (approximate, typical of LangChain/LlamaIndex defaults).
    "rag": Workload(
        name="rag", description="RAG: long retrieved-context prompts (4-8k), short answers; prefill-heavy",
        arrival=PoissonArrivals(rate_per_s=1.0),
        input_tokens=NormalLength(mean_tokens=6000, std_tokens=1200, min_tokens=4000, max_tokens=8000),
        output_tokens=LognormalLength(median_tokens=250, sigma=0.4, min_tokens=32, max_tokens=1024),
        num_requests=500,
    ),
    # Coding agents (SWE-agent / IDE assistants): a system prompt with tool specs and repo
    # context of ~8k tokens reused by most calls, many turns of tool output and edits
    # (approximate, from published agent prompts and SWE-bench trajectories).
    "code-agent": Workload(
        name="code-agent", description="Coding agent: ~8k shared prefix, multi-turn tool loops, 300-500 token outputs",
        arrival=PoissonArrivals(rate_per_s=0.5),
        input_tokens=LognormalLength(median_tokens=400, sigma=0.8, min_tokens=16, max_tokens=8192),
        output_tokens=LognormalLength(median_tokens=400, sigma=0.4, min_tokens=32, max_tokens=2048),
        num_requests=500,
        shared_prefix=SharedPrefix(num_prefixes=4, prefix_tokens=8192, share=0.9, popularity="zipf"),
        conversation=Conversation(min_turns=2, max_turns=8, think_time_s=2.0),
    ),
    # Reasoning models (DeepSeek-R1, o1-style) on math/code benchmarks: short questions,
    # thinking traces of ~1-4k tokens with a tail to the 16k-32k budget (approximate).
    "reasoning": Workload(
        name="reasoning", description="Reasoning: short questions, long heavy-tailed outputs (median 2k, up to 16k)",
        arrival=PoissonArrivals(rate_per_s=0.5),
        input_tokens=LognormalLength(median_tokens=150, sigma=0.8, min_tokens=16, max_tokens=2048),
        output_tokens=LognormalLength(median_tokens=2000, sigma=0.9, min_tokens=64, max_tokens=16384),
        num_requests=500,
    ),
    # Offline jobs (summarisation, extraction, evals): a queue drained as fast as possible,
    # medium documents and answers (approximate).
    "batch": Workload(
        name="batch", description="Offline batch: closed loop at high concurrency, medium lengths; for throughput",
        arrival=ClosedLoopArrivals(concurrency=256),
        input_tokens=NormalLength(mean_tokens=1000, std_tokens=300, min_tokens=64, max_tokens=4096),
        output_tokens=NormalLength(mean_tokens=300, std_tokens=100, min_tokens=16, max_tokens=1024),
        num_requests=2000,
    ),
}


def get_workload(name_or_path: str, **overrides: object) -> Workload:
    """A preset by name, or a Workload from a YAML/JSON file, with top-level fields overridden.

    Overrides replace whole fields: get_workload("chat", arrival={"kind": "poisson", "rate_per_s": 10}).
    """
    key = name_or_path.strip().lower()
    if key in PRESETS:
        base, source = PRESETS[key].model_dump(), "workload"
    elif key.endswith((".yaml", ".yml", ".json")):
        loaded = (load_json if key.endswith(".json") else load_yaml)(name_or_path, "workload")
        if not isinstance(loaded, dict):
            raise InputError("workload", name_or_path, "a workload file must be a mapping of fields")
        base, source = loaded, Path(name_or_path).name
    else:
        raise unknown_name_error("workload", name_or_path, PRESETS)
    try:
        return Workload.model_validate({**base, **overrides})
    except ValidationError as exc:
        raise from_validation_error(exc, source) from None
