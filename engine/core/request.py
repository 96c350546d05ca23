"""Per-request state: what was asked, what has been computed, and when things happened."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

from engine.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    is_finished: bool  # set on each member below: a plain attribute, read per request per step


for _status in RequestStatus:
    _status.is_finished = _status.name.startswith("FINISHED_")

FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


# Key of a full KV block in the prefix cache: a 120-bit digest chained over every token up to the
# block's end (kv_cache_manager.hash_block_tokens). An int and nothing else, so that a cached block
# costs about 0.2 KB: no copy of its tokens is kept to double-check a hit, as the digest's
# collision odds are negligible (see hash_block_tokens).
BlockHash = NewType("BlockHash", int)

# What may be folded into block hashes beside the tokens (a LoRA id, a cache salt): types whose
# repr is injective, so that two different keys can never hash alike.
ExtraKey = str | int | None


# eq=False: requests are entities (identity), and comparing token lists field by field would
# be slow and meaningless.
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    priority: int = 0  # lower is more important, as in vLLM
    extra_key: ExtraKey = None  # e.g. a LoRA id: folded into block hashes so caches never mix
    # Leading prompt tokens whose KV reaches the engine from outside instead of being computed: a
    # prefill instance's transfer (disaggregation), or calibration's synthetic context, whose
    # values do not matter for timing. Taken as computed at first admission, like a prefix hit.
    num_external_computed_tokens: int = 0
    # No other request can share this one's blocks: the simulator found no other prompt with its first
    # block, and no follow-up turn will extend it. Its blocks then need no content hash (nobody will
    # look them up) until a preemption makes its own resume a possible hit (KVCacheManager.free).
    private_blocks: bool = False

    output_token_ids: list[int] = field(init=False)
    status: RequestStatus = field(init=False)
    num_computed_tokens: int = field(init=False)
    num_cached_tokens: int = field(init=False)  # prefix-cache hit at first admission
    spec_token_ids: list[int] = field(init=False)  # set by the proposer
    first_scheduled_time: float | None = field(init=False)
    first_token_time: float | None = field(init=False)
    token_times: list[float] = field(init=False)
    finish_time: float | None = field(init=False)
    finish_reason: str | None = field(init=False)
    num_preemptions: int = field(init=False)
    # Hashes of the full blocks of known tokens, extended lazily by the KV-cache manager.
    block_hashes: list[BlockHash] = field(init=False, repr=False)
    # While the scheduler applies its decodes in bulk (engine/core/bulk_decodes.py): the bulk step
    # its token fields are exact as of, and the one in which it is next looked at; -1 otherwise.
    bulk_since: int = field(init=False, repr=False)
    bulk_until: int = field(init=False, repr=False)
    # The bulk step of its next block event, owed rather than looked at; -1: none owed.
    bulk_owed: int = field(init=False, repr=False)
    # Its place in the scheduler's running list: admissions are numbered, and the list stays in that order.
    running_seq: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The state fields start here, not as field defaults: mypyc's compiled dataclasses do not set
        # the defaults of fields outside __init__ (engine/core is compiled: Makefile, `core`).
        self.output_token_ids = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.spec_token_ids = []
        self.first_scheduled_time = None
        self.first_token_time = None
        self.token_times = []
        self.finish_time = None
        self.finish_reason = None
        self.num_preemptions = 0
        self.block_hashes = []
        self.bulk_since = -1
        self.bulk_until = -1
        self.bulk_owed = -1
        self.running_seq = -1
        if not 0 <= self.num_external_computed_tokens < max(1, len(self.prompt_token_ids)):
            raise ValueError(
                f"request {self.request_id!r}: num_external_computed_tokens={self.num_external_computed_tokens} "
                f"is invalid: must be in 0..{len(self.prompt_token_ids) - 1} (the last prompt token is always computed)"
            )
        if self.extra_key is not None and not isinstance(self.extra_key, str | int):
            raise ValueError(
                f"request {self.request_id!r}: extra_key={self.extra_key!r} is invalid: must be None, a str or an int"
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus sampled output (draft tokens excluded)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A fresh list of prompt + output; O(length), so hot paths use `token_slice`."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """Known tokens [start, end) without concatenating the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return tuple(self.prompt_token_ids[start:end])
        if start >= p:
            return tuple(self.output_token_ids[start - p : end - p])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids[: end - p])

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens
