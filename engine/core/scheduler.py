"""The step scheduler: which requests run next, with how many tokens, in which KV blocks.

One token budget per step covers decode tokens, prefill chunks and draft tokens alike: every
request simply has `num_tokens_with_spec - num_computed_tokens` tokens to catch up on, as in
vLLM v1. Time is always passed in (`now`), never read, so the simulator can drive it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from engine.core.bulk_decodes import NO_BULK, BulkDecodes, BulkShape
from engine.core.by_fields import PickledByFields
from engine.core.errors import InputError
from engine.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from engine.core.kv_tiers import KVTransfers, TierStats
from engine.core.request import FINISH_REASONS, Request, RequestStatus
from engine.core.request_queue import RequestQueue, make_request_queue
from engine.core.sampling_params import SamplingParams

# A place in a step after every running request: where admissions and a step's results come.
_END_OF_STEP = 1 << 62

Policy = Literal["fcfs", "priority"]
Batching = Literal["mixed", "prefill_first"]
PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True)
class OutputReservation(PickledByFields):
    """Admit a request only if the free KV cache also holds the output tokens still to come: `ratio`
    x what every running request may still produce, and the whole of what each request admitted in
    this step may (SGLang's PrefillAdder counts its running batch at new_token_ratio and every request
    of the batch it forms in full). ratio 1 never preempts (TensorRT-LLM's GUARANTEED_NO_EVICT);
    SGLang starts high and decays towards a floor as requests finish early, jumping back up after a
    preemption. None (no reservation) is vLLM's optimistic admission."""

    initial_ratio: float
    min_ratio: float
    decay_per_step: float = 0.0  # ratio lost per step, down to min_ratio
    # A request's outputs still to come count at most this many tokens (SGLang's CLIP_MAX_NEW_TOKENS);
    # None: all of them.
    clip_tokens: int | None = None
    # SGLang's retraction (one-token blocks): a decode step that finds fewer free blocks than running
    # requests first sends requests back to the waiting queue, the fewest output tokens first (among
    # equals the longest prompt), until the free blocks hold this many decodes of every request left;
    # the ratio becomes (their output tokens + this x their number) / their max_tokens, at most 1.
    # None: a request short of blocks preempts as the preemption mode says, the ratio back to its start.
    retract_headroom_steps: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_ratio <= self.initial_ratio <= 1.0:
            raise ValueError(f"output reservation ratios {self.min_ratio}..{self.initial_ratio} are invalid: "
                             "need 0 <= min_ratio <= initial_ratio <= 1")
        if not self.decay_per_step >= 0.0:
            raise ValueError(f"decay_per_step={self.decay_per_step} is invalid: must be >= 0")
        if self.clip_tokens is not None and self.clip_tokens < 1:
            raise ValueError(f"clip_tokens={self.clip_tokens} is invalid: must be >= 1 or None")
        if self.retract_headroom_steps is not None and self.retract_headroom_steps < 1:
            raise ValueError(f"retract_headroom_steps={self.retract_headroom_steps} is invalid: must be >= 1 or None")


@dataclass(frozen=True)
class SchedulerConfig(PickledByFields):
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: Policy = "fcfs"
    num_speculative_tokens: int = 0
    # mixed: a step decodes every running request, then fills the budget with prefill chunks
    # (vLLM V1). prefill_first: while prompts wait or are half done, a step prefills only and the
    # decodes stall (vLLM V0, SGLang).
    batching: Batching = "mixed"
    output_reservation: OutputReservation | None = None
    # Multi-step scheduling (vLLM 0.6): a decode-only batch runs this many steps without being
    # rescheduled, and its tokens are delivered together at the end.
    num_scheduler_steps: int = 1
    # What a preempted request loses: recompute drops its KV (its tokens are prefilled again on
    # resume); swap copies its blocks to the host tier and back (vLLM V0's swap space), falling
    # back to recompute when the host tier has no room.
    preemption_mode: PreemptionMode = "recompute"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if value < 1:
                raise InputError(name, value, "must be >= 1")
        if self.max_model_len < 2:
            raise InputError("max_model_len", self.max_model_len, "must be >= 2 (one prompt token plus one output token)")
        if self.policy not in ("fcfs", "priority"):
            raise InputError("policy", self.policy, "must be 'fcfs' or 'priority'")
        if self.num_speculative_tokens < 0:
            raise InputError("num_speculative_tokens", self.num_speculative_tokens, "must be >= 0")
        if self.batching not in ("mixed", "prefill_first"):
            raise InputError("batching", self.batching, "must be 'mixed' or 'prefill_first'")
        if self.num_scheduler_steps < 1:
            raise InputError("num_scheduler_steps", self.num_scheduler_steps, "must be >= 1")
        if self.num_scheduler_steps > 1 and self.num_speculative_tokens:
            raise InputError("num_scheduler_steps", self.num_scheduler_steps,
                             "must be 1 with speculative decoding (vLLM refuses it too)")
        if self.preemption_mode not in ("recompute", "swap"):
            raise InputError("preemption_mode", self.preemption_mode, "must be 'recompute' or 'swap'")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InputError("max_num_batched_tokens", self.max_num_batched_tokens,
                             f"must be >= max_num_seqs={self.max_num_seqs}, or running requests cannot all decode in one step")
        reservation = self.output_reservation
        if reservation is not None and reservation.retract_headroom_steps is not None and self.block_size != 1:
            raise InputError("block_size", self.block_size, "must be 1 with retraction (SGLang's pool of tokens counts "
                             "a free slot per decode)")


class ScheduledRequest(NamedTuple):
    """One request's share of a step. A NamedTuple rather than a frozen dataclass: the simulator
    builds one per running request per step, and tuple construction is several times cheaper."""

    request_id: str
    token_ids: tuple[int, ...]  # computed this step: known tokens, then num_draft_tokens drafts
    num_computed_tokens: int  # already in the KV cache = position of token_ids[0]
    new_block_ids: tuple[int, ...]
    reset_block_table: bool  # True: new_block_ids is the whole table (first schedule, resume)
    num_draft_tokens: int
    samples: bool  # the step reaches the end of the known tokens, so the runner samples
    sampling_params: SamplingParams
    prompt_len: int
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """KV length attended to by the last token of this step."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput(PickledByFields):
    scheduled: tuple[ScheduledRequest, ...]
    total_num_scheduled_tokens: int
    preempted_request_ids: tuple[str, ...]
    finished_request_ids: tuple[str, ...]  # since the previous schedule(): drop their state
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    # Decodes applied in bulk (only when the scheduler was given a decode_token): one token each,
    # not in `scheduled`, sampling the decode token.
    bulk_decodes: BulkShape = NO_BULK
    # Copies between device blocks, offload tiers and external KV that the runner performs before
    # the forward pass (None: nothing to copy, the common case).
    kv_transfers: KVTransfers | None = None

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return self.total_num_scheduled_tokens - self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        """No request runs in this step (copies may still be due: has_work)."""
        return not self.scheduled and not self.bulk_decodes.num_requests

    @property
    def has_work(self) -> bool:
        """Something for the executor: requests to run, or copies (a swap-out alone) to make."""
        return not self.is_empty or self.kv_transfers is not None


class RequestUpdate(NamedTuple):
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class SchedulerStats(PickledByFields):
    num_requests: int  # accepted by add_request
    num_waiting: int
    num_running: int
    num_finished: Mapping[str, int]  # by finish reason
    num_preemptions: int
    num_steps: int  # non-empty schedules
    prefix_cache: PrefixCacheStats
    offload: TierStats | None = None  # copies to and from the offload tiers; None without tiers


@dataclass
class _StepState:
    """Scratch space of one schedule() call."""

    budget: int
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    num_bulk: int = 0  # bulk decodes counted in
    # Free blocks admission keeps for outputs still to come: the running requests' share, summed as
    # the step's admissions start, and in full each request admitted since.
    reserved_blocks: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, decode_token: int | None = None) -> None:
        """`decode_token`: the token every decode samples, when the executor knows it in advance (the
        simulator's synthetic id). The scheduler then applies decodes in bulk where nothing happens
        to a request (engine/core/bulk_decodes.py), with the same results as one by one; it does so
        unless every decode changes a request anyway (one-token blocks, speculation, multi-step
        groups). None (the engine): every request one by one."""
        if kv_cache_manager.block_size != config.block_size:
            raise ValueError(
                f"kv_cache_manager.block_size={kv_cache_manager.block_size} does not match "
                f"config.block_size={config.block_size}"
            )
        if kv_cache_manager.enable_prefix_caching != config.enable_prefix_caching:
            raise ValueError(
                f"kv_cache_manager.enable_prefix_caching={kv_cache_manager.enable_prefix_caching} does not match "
                f"config.enable_prefix_caching={config.enable_prefix_caching}"
            )
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}  # every request accepted, finished ones until pop_finished()
        self.waiting: RequestQueue = make_request_queue(config.policy)
        self.running: list[Request] = []  # in admission order: FCFS preempts from the end
        self._finished_ids: list[str] = []  # reported by the next schedule()
        self._pending: SchedulerOutput | None = None  # scheduled, not yet updated
        self._num_finished: dict[str, int] = {reason: 0 for reason in FINISH_REASONS.values()}
        self._num_preemptions = 0
        self._num_steps = 0
        self._num_added = 0
        self._num_admitted = 0  # numbers admissions: running_seq
        reservation = config.output_reservation
        self._reserve_ratio = reservation.initial_ratio if reservation is not None else 0.0
        # Multi-step: decode steps left in the current group, and what the group delivers at its end.
        self._group_steps_left = 0
        self._group_updates: list[RequestUpdate] = []
        self._group_requests: list[tuple[Request, int]] = []  # (request, its first token of the group)
        # One-token blocks change every decode (a block each step), as do drafts and multi-step groups.
        bulk = config.block_size > 1 and not config.num_speculative_tokens and config.num_scheduler_steps == 1
        self._bulk = BulkDecodes(decode_token) if bulk and decode_token is not None else None

    # ---- intake ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid, cfg = request.request_id, self.config
        if rid in self.requests:
            raise ValueError(f"request {rid!r} was already added: request ids must be unique")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {rid!r} is not fresh (status {request.status.name}): add new requests only")
        n_prompt, max_tokens = request.num_prompt_tokens, request.max_tokens
        if n_prompt == 0:
            raise ValueError(f"request {rid!r}: prompt is empty: at least 1 token is required")
        if n_prompt + max_tokens > cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt length {n_prompt} + max_tokens {max_tokens} = {n_prompt + max_tokens} "
                f"exceeds max_model_len={cfg.max_model_len}"
            )
        # The KV cache holds at most prompt + max_tokens - 1 tokens: the last sampled token is
        # never fed back, and drafts are capped so they never go past it either.
        if not cfg.enable_chunked_prefill and n_prompt + max_tokens - 1 > cfg.max_num_batched_tokens:
            # Unchunked, a prompt (or a preempted request's prompt and output, recomputed) runs in one
            # step: beyond the budget it could never be scheduled (TensorRT-LLM refuses it too).
            raise ValueError(
                f"request {rid!r}: prompt length {n_prompt} + max_tokens {max_tokens} exceeds "
                f"max_num_batched_tokens={cfg.max_num_batched_tokens}, the most one step computes without chunked prefill"
            )
        blocks_needed = self.kv_cache_manager.max_blocks(n_prompt + max_tokens - 1, cfg.max_num_batched_tokens)
        num_blocks = self.kv_cache_manager.num_blocks
        if blocks_needed > num_blocks:
            raise ValueError(
                f"request {rid!r}: prompt length {n_prompt} + max_tokens {max_tokens} needs {blocks_needed} KV blocks "
                f"of {cfg.block_size} tokens, but the whole cache has {num_blocks}: it could never finish"
            )
        self.requests[rid] = request
        self.waiting.add(request)
        self._num_added += 1

    def abort_request(self, request_id: str, now: float) -> bool:
        """Returns False when the request had already finished. Unknown ids raise KeyError."""
        request = self.requests[request_id]
        if request.is_finished:
            return False
        if request.bulk_since >= 0:
            self._members.leave(request)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)  # a swapped-out request holds host slots
        self._finish(request, RequestStatus.FINISHED_ABORTED, now)
        return True

    # ---- scheduling -----------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        if self._pending is not None:
            raise RuntimeError("schedule() called again before update() consumed the previous output")
        self._check_drafts()
        self.kv_cache_manager.begin_step()
        step = _StepState(budget=self.config.max_num_batched_tokens)
        bulk = self._bulk
        if (bulk is not None and not self.waiting and len(self.running) == bulk.num_requests
                and bulk.next_visit() > bulk.steps):
            # Bulk decodes only, none looked at: what _schedule_running finds, without walking the
            # batch (the budget holds max_num_seqs decodes), and nobody waits to be admitted.
            step.num_bulk = len(self.running)
            step.budget -= step.num_bulk
        elif self._group_steps_left:
            self._schedule_running(step)  # the multi-step group goes on: the same decodes, nobody admitted
        elif not (self.config.batching == "prefill_first" and self._schedule_prefills(step, now)):
            self._retract(step)
            self._schedule_running(step)
            # After a preemption the pool is known to be short: admitting anyone would only thrash,
            # as in vLLM. Prefill-first engines admit in prefill steps only.
            if not step.preempted and self.config.batching == "mixed":
                self._schedule_waiting(step, now)

        shape = NO_BULK
        if bulk is not None:  # the step's owed events, before its pool use is reported
            self._settle(bulk.steps, _END_OF_STEP if step.num_bulk else -1)
            if step.num_bulk:
                shape = bulk.shape()
                if shape.num_requests != step.num_bulk:
                    raise RuntimeError(f"{step.num_bulk} bulk decodes counted in the step but {shape.num_requests} held in bulk")
        output = SchedulerOutput(
            scheduled=tuple(step.scheduled.values()),
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            preempted_request_ids=tuple(r.request_id for r in step.preempted),
            finished_request_ids=tuple(self._finished_ids),
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            kv_cache_usage=self.kv_cache_manager.usage,
            bulk_decodes=shape,
            kv_transfers=self.kv_cache_manager.take_transfers(),
        )
        self._finished_ids.clear()
        if self.config.output_reservation is not None:
            self._update_reserve_ratio(output)
        if not output.is_empty:
            self._pending = output
            self._num_steps += 1
            if not self._group_steps_left and self.config.num_scheduler_steps > 1 and not output.num_prefill_tokens:
                self._group_steps_left = self.config.num_scheduler_steps
        return output

    def _update_reserve_ratio(self, output: SchedulerOutput) -> None:
        """Decay with every decode step (requests keep finishing before max_tokens); back to the
        start after a preemption, which shows the estimate was too low (SGLang's retraction), and
        once the scheduler has nothing left (update)."""
        reservation = self.config.output_reservation
        assert reservation is not None
        if output.preempted_request_ids:
            if reservation.retract_headroom_steps is None:  # a retraction sets its own (_retract)
                self._reserve_ratio = reservation.initial_ratio
        elif output.num_decode_tokens:
            self._reserve_ratio = max(reservation.min_ratio, self._reserve_ratio - reservation.decay_per_step)

    def _schedule_prefills(self, step: _StepState, now: float) -> bool:
        """A prefill-only step: prompts being chunked go on, waiting ones are admitted. False when
        there is no prefill to run, and the step decodes instead."""
        if not self.waiting and not any(r.num_computed_tokens < r.num_tokens - 1 for r in self.running):
            return False
        self._schedule_running(step, prefills_only=True)
        if not step.preempted:
            self._schedule_waiting(step, now)
        return bool(step.scheduled)

    def _check_drafts(self) -> None:
        if self._bulk is not None:
            return  # bulk decodes need k = 0 and an executor that knows its tokens: no proposer sets drafts
        k = self.config.num_speculative_tokens
        for request in self.running:
            if len(request.spec_token_ids) > k:
                raise ValueError(
                    f"request {request.request_id!r} has {len(request.spec_token_ids)} draft tokens, "
                    f"more than num_speculative_tokens={k}"
                )

    def _schedule_running(self, step: _StepState, prefills_only: bool = False) -> None:
        bulk_step = self._bulk.steps if self._bulk is not None else 0
        running = self.running
        i = 0
        while i < len(running) and step.budget > 0:
            request = running[i]
            # Bulk decodes take one token of the budget each, in their place in the order; one is
            # looked at only in the step of its event (prefill steps leave it waiting, as any decode).
            if request.bulk_until > bulk_step:
                end, n = i + 1, len(running)
                while end < n and running[end].bulk_until > bulk_step:
                    end += 1
                if not prefills_only:
                    taken = min(end - i, step.budget)
                    step.budget -= taken
                    step.num_bulk += taken
                i = end
                continue
            if self._bulk is not None:  # what it does here may touch the block pool: events owed before it come first
                self._settle(bulk_step, -1 if prefills_only else request.running_seq)
            if request.bulk_since >= 0 and (prefills_only or self._bulk_event(request)):
                if not prefills_only:
                    step.budget -= 1
                    step.num_bulk += 1
                i += 1
                continue
            num_new = request.num_tokens - request.num_computed_tokens
            if prefills_only and num_new <= 1:  # decoding: it waits for the next decode step
                i += 1
                continue
            if request.spec_token_ids:
                # Drafts past the last token max_tokens allows would be wasted compute and KV.
                num_new += min(len(request.spec_token_ids), request.max_tokens - request.num_output_tokens - 1)
            num_new = min(num_new, step.budget)
            while True:
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
                if new_block_ids is not None:
                    break
                victim_index = self._pick_victim()
                victim = running.pop(victim_index)
                if victim.bulk_since >= 0:
                    if not prefills_only and victim_index < i:  # counted in this step already
                        step.budget += 1
                        step.num_bulk -= 1
                    self._members.leave(victim)
                self._preempt(victim, step)
                if victim is request:
                    break
                if victim_index < i:
                    i -= 1
            if new_block_ids is None:
                # It was the least important itself. Under FCFS it was also the last, which ends
                # the loop; under priority, the more important ones after it still get their turn.
                continue
            self._keep_owed_takes()
            step.scheduled[request.request_id] = self._scheduled_request(
                request, num_new, new_block_ids, reset_block_table=False
            )
            step.budget -= num_new
            i += 1
        # Every bulk decode got its token: the budget holds max_num_seqs decodes, and only the last
        # request admitted can be part-way through its prompt (anyone admitted after it found budget
        # left, so it had finished). schedule() checks that no bulk decode was missed.

    @property
    def _members(self) -> BulkDecodes:
        """The bulk decodes, where the caller holds a request in bulk or an owed event: they are on."""
        assert self._bulk is not None, "bulk decodes are off, so no request can be in bulk"
        return self._bulk

    def _bulk_event(self, request: Request) -> bool:
        """A bulk decode looked at in this step: a block it could not owe, taken here in its place, keeps
        it in bulk (True); its last token, or a pool without a free block, hands it back to one-by-one
        handling (False)."""
        bulk = self._members
        bulk.sync(request)
        if request.num_output_tokens + 1 < request.max_tokens and self.kv_cache_manager.allocate_decode_slot(request):
            self._keep_owed_takes()
            self._plan_bulk(request)
            return True
        bulk.leave(request)
        return False

    def _plan_bulk(self, request: Request) -> None:
        """A member whose fields are exact now (its decode in bulk step `steps` has its slot, or is
        next): owe its next block event, or make it the step it is looked at; with nothing owed it
        is looked at for its last token."""
        bulk, kv = self._members, self.kv_cache_manager
        # Counted in decode steps from bulk step `steps` (0).
        take, full = kv.decode_block_steps(request)
        last = request.max_tokens - request.num_output_tokens - 1
        event = take if full < 0 else min(take, full)
        if event < last and (event < take or kv.num_free_blocks > bulk.num_owed_takes):
            bulk.owe(request, bulk.steps + event, takes=event == take)
            bulk.look_at(request, bulk.steps + last)
        else:
            bulk.look_at(request, bulk.steps + min(event, last))

    def _settle(self, step: int, seq: int) -> None:
        """Pay the block events bulk decodes owe before place `seq` of bulk step `step`, in the order
        one by one meets them (engine/core/bulk_decodes.py)."""
        bulk, kv = self._members, self.kv_cache_manager
        bs = self.config.block_size
        while (owed := bulk.next_owed(step, seq)) is not None:
            request, took = owed
            # After a block's registration comes the block after it; after a block, its registration
            # once full (the step before the next block), or where decodes register nothing, that next block.
            after_take = bs - 1 if kv.registers_decode_blocks(request) else bs
            if not took:
                kv.cache_decode_block(request)
            elif not kv.take_decode_block(request):
                raise RuntimeError(f"request {request.request_id!r} owed a block the pool did not have: members may owe "
                                   "blocks only while the free ones outnumber those owed")
            # What _plan_bulk works out, for a decode whose blocks are as decoding leaves them.
            takes = not took or after_take == bs
            event = bulk.steps + (after_take if took else 1)
            if event < request.bulk_until and (not takes or kv.num_free_blocks > bulk.num_owed_takes):
                bulk.owe(request, event, takes)
            else:
                bulk.look_at(request, min(event, request.bulk_until))

    def _keep_owed_takes(self) -> None:
        """After blocks were taken other than as owed: owed takes the free blocks no longer cover become visits."""
        bulk = self._bulk
        if bulk is not None and bulk.num_owed_takes > self.kv_cache_manager.num_free_blocks:
            bulk.cancel_owed_takes()

    def _join_bulk(self, request: Request) -> None:
        """After a step that sampled for it: into bulk, unless its next decode is its last token anyway."""
        bulk = self._members
        params = request.sampling_params
        if (bulk.token == request.eos_token_id and not params.ignore_eos) or bulk.token in params.stop_token_ids:
            return  # the decode token ends it
        if request.num_output_tokens + 1 < request.max_tokens:
            bulk.join(request)
            self._plan_bulk(request)

    def _retract(self, step: _StepState) -> None:
        """SGLang's retract_decode before a decode step short of a free block per running request
        (OutputReservation.retract_headroom_steps): the requests it sends back, and the ratio after."""
        reservation, kv = self.config.output_reservation, self.kv_cache_manager
        if reservation is None or reservation.retract_headroom_steps is None or kv.num_free_blocks >= len(self.running):
            return
        headroom = reservation.retract_headroom_steps
        # Taken from the end: the fewest output tokens first, among equals the longest prompt.
        kept = sorted(self.running, key=lambda r: (r.num_output_tokens, -r.num_prompt_tokens), reverse=True)
        while kept and (not step.preempted or kv.num_free_blocks < headroom * len(kept)):
            victim = kept.pop()
            self.running.remove(victim)
            self._preempt(victim, step)
        max_tokens = sum(r.max_tokens for r in kept)
        decoded = sum(r.num_output_tokens for r in kept) + headroom * len(kept)
        self._reserve_ratio = min(1.0, decoded / max_tokens) if max_tokens else reservation.initial_ratio

    def _pick_victim(self) -> int:
        if self.config.policy == "fcfs":
            return len(self.running) - 1
        # Least important; among equals the latest arrival, then the latest admitted.
        return max(
            range(len(self.running)),
            key=lambda j: (self.running[j].priority, self.running[j].arrival_time, j),
        )

    def _preempt(self, victim: Request, step: _StepState) -> None:
        undone = step.scheduled.pop(victim.request_id, None)
        if undone is not None:  # priority policy can pick a request already scheduled this step
            step.budget += len(undone.token_ids)
        # Both read num_computed_tokens to spot blocks registered but never filled: reset after.
        swapped = self.config.preemption_mode == "swap" and self.kv_cache_manager.swap_out(victim)
        if not swapped:
            self.kv_cache_manager.free(victim, preempted=True)
            victim.num_computed_tokens = 0  # recompute: output tokens are kept and re-prefilled
        victim.status = RequestStatus.PREEMPTED
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.prepend(victim)
        step.preempted.append(victim)

    def _schedule_waiting(self, step: _StepState, now: float) -> None:
        if self._bulk is not None and self.waiting:  # admissions come after every decode of the step
            self._settle(self._bulk.steps, _END_OF_STEP if step.num_bulk else -1)
        if self.config.output_reservation is not None and self.waiting:
            step.reserved_blocks = self._running_reservation()
        # The head blocks the rest (FCFS: strict order, so nothing starves; priority: nothing
        # less important overtakes it).
        while step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request is None:
                return
            if self.kv_cache_manager.is_swapped(request):
                if not self._resume_swapped(request, step):
                    return
                continue
            kv = self.kv_cache_manager
            computed_blocks, num_device_hit = kv.get_computed_blocks(request)
            tier_hits = kv.get_tier_hits(request, len(computed_blocks))
            num_hit = num_device_hit + len(tier_hits) * self.config.block_size
            first_admission = request.first_scheduled_time is None
            # External KV counts only at first admission: a preempted request recomputes it all.
            num_external = max(0, request.num_external_computed_tokens - num_hit) if first_admission else 0
            num_new = request.num_tokens - num_hit - num_external
            if num_new > step.budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new = step.budget
            num_copied = num_hit - num_device_hit + num_external
            reserved = 0
            if self.config.output_reservation is not None:
                # Blocks this takes from the free pool: new ones, and hits nobody else holds.
                held = -(-(num_hit + num_external + num_new) // self.config.block_size)
                taken = held - len(computed_blocks) + sum(1 for b in computed_blocks if b.ref_cnt == 0)
                chunked = num_hit + num_external + num_new < request.num_tokens
                room = self._room_for_outputs(request, step, taken, held, chunked)
                if room is None:
                    return
                reserved = room
            # Tier hits and external tokens need KV slots but no compute (and none of the step's budget).
            new_block_ids = kv.allocate_slots(request, num_copied + num_new, computed_blocks, tier_hits=tier_hits,
                                              num_loaded_tokens=num_copied)
            if new_block_ids is None:
                return
            self._keep_owed_takes()
            kv.load_external(request, num_hit, num_external)
            self.waiting.pop()
            if first_admission:
                request.first_scheduled_time = now
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit + num_external
            request.running_seq, self._num_admitted = self._num_admitted, self._num_admitted + 1
            self.running.append(request)
            step.reserved_blocks += reserved
            block_table = [b.block_id for b in computed_blocks] + new_block_ids
            step.scheduled[request.request_id] = self._scheduled_request(
                request, num_new, block_table, reset_block_table=True
            )
            step.budget -= num_new

    def _resume_swapped(self, request: Request, step: _StepState) -> bool:
        """Bring a swapped-out request back with its KV (copied from the host tier); False when
        the step has no room for it."""
        num_new = request.num_tokens - request.num_computed_tokens
        if num_new > step.budget:
            if not self.config.enable_chunked_prefill:
                return False
            num_new = step.budget
        taken = -(-(request.num_computed_tokens + num_new) // self.config.block_size)  # at most: some may be cached
        reserved = 0
        if self.config.output_reservation is not None:
            chunked = request.num_computed_tokens + num_new < request.num_tokens
            room = self._room_for_outputs(request, step, taken, taken, chunked)
            if room is None:
                return False
            reserved = room
        block_table = self.kv_cache_manager.allocate_swapped_in(request, num_new)
        if block_table is None:
            return False
        self._keep_owed_takes()
        self.waiting.pop()
        request.status = RequestStatus.RUNNING
        request.running_seq, self._num_admitted = self._num_admitted, self._num_admitted + 1
        self.running.append(request)
        step.reserved_blocks += reserved
        step.scheduled[request.request_id] = self._scheduled_request(request, num_new, block_table, reset_block_table=True)
        step.budget -= num_new
        return True

    def _room_for_outputs(self, request: Request, step: _StepState, num_blocks_taken: int, num_blocks_held: int,
                          chunked: bool) -> int | None:
        """The free blocks admitting `request` keeps for its own outputs, or None when the free pool,
        less the num_blocks_taken it takes now (to hold num_blocks_held), would not also hold those and
        what the step reserves already (`_StepState.reserved_blocks`)."""
        if self.config.block_size == 1:
            # A pool of tokens (SGLang): a request whose prompt this step cuts reserves nothing yet
            # (PrefillAdder: max_new_tokens only if not truncated). A request still prefilling in later
            # steps counts with the running ones, where SGLang counts it in full at its last chunk.
            own = 0 if chunked else self._outputs_left(request)
        else:  # whole blocks per request to its end, prompt chunks to come included (TensorRT-LLM)
            own = self._blocks_to_finish(request, num_blocks_held, 1.0)
        if step.reserved_blocks + own + num_blocks_taken > self.kv_cache_manager.num_free_blocks:
            return None
        return own

    def _running_reservation(self) -> int:
        """Free blocks the running requests' outputs keep at the current ratio, summed once as the step's
        admissions start, as SGLang's PrefillAdder does (a running request's count moves only when it decodes)."""
        ratio = self._reserve_ratio
        if self.config.block_size == 1:
            return int(ratio * sum(self._outputs_left(r) for r in self.running))
        kv = self.kv_cache_manager
        return sum(self._blocks_to_finish(r, kv.num_held_blocks(r.request_id), ratio) for r in self.running)

    def _outputs_left(self, request: Request) -> int:
        """Output tokens `request` may still produce, as a reservation counts them (clipped). Read per
        request: one-token blocks (the pool this serves) decode one by one, so the count is current."""
        left = request.max_tokens - request.num_output_tokens
        clip = self.config.output_reservation.clip_tokens if self.config.output_reservation is not None else None
        return left if clip is None else min(left, clip)

    def _blocks_to_finish(self, request: Request, num_blocks_held: int, ratio: float) -> int:
        """`ratio` of the blocks `request` may still take beyond those it holds: whole blocks for the KV
        of every token but the last one sampled. Summing tokens over requests instead and rounding
        once would miss up to a block per request, and a full reservation would then preempt. (Only
        the prompt and max_tokens are read: a bulk-decoding request's output count lags.)"""
        final = request.num_prompt_tokens + request.max_tokens - 1
        blocks = self.kv_cache_manager.max_blocks(final, self.config.max_num_batched_tokens)
        return math.ceil(ratio * max(0, blocks - num_blocks_held))

    def _scheduled_request(
        self, request: Request, num_new: int, block_ids: Sequence[int], reset_block_table: bool
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        num_tokens = request.num_tokens
        num_known = min(num_new, num_tokens - start)
        num_drafts = num_new - num_known
        token_ids = request.token_slice(start, start + num_known)
        if num_drafts:
            token_ids += tuple(request.spec_token_ids[:num_drafts])
        return ScheduledRequest(
            request.request_id,
            token_ids,
            start,
            tuple(block_ids),
            reset_block_table,
            num_drafts,
            start + num_known == num_tokens,  # samples
            request.sampling_params,
            len(request.prompt_token_ids),
            # is_prefill: anything but feeding back the single last sampled token (a resumed
            # request re-prefills its output tokens too).
            not request.output_token_ids or start < num_tokens - 1,
        )

    # ---- results --------------------------------------------------------------------------

    def update(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]], now: float
    ) -> list[RequestUpdate]:
        """Apply one step's sampled tokens. For a speculative step a request's list holds its
        accepted drafts plus one bonus/correction token. Returns one entry per request that got
        tokens or finished; mid-prefill chunks get none."""
        if output.is_empty:
            return []
        if output is not self._pending:
            raise RuntimeError("update() must receive the output of the latest schedule()")
        requests = self.requests
        # Skip requests aborted between schedule() and update().
        live = [(s, r) for s in output.scheduled if not (r := requests[s.request_id]).status.is_finished]
        self._check_sampled([s for s, _ in live], sampled_token_ids)
        self._pending = None

        updates: list[RequestUpdate] = []
        any_finished = False
        in_group = self._group_steps_left > 0
        for s, request in live:
            request.num_computed_tokens += len(s.token_ids)
            if request.spec_token_ids:
                request.spec_token_ids = []  # the proposer sets fresh ones before the next schedule()
            if not s.samples:
                continue
            sampled = sampled_token_ids[s.request_id]
            if s.num_draft_tokens:
                # Rejected drafts leave garbage KV behind; the next step simply overwrites it.
                request.num_computed_tokens -= s.num_draft_tokens - (len(sampled) - 1)
            if request.first_token_time is None:
                request.first_token_time = now
            output_ids, times = request.output_token_ids, request.token_times
            if in_group:
                self._group_requests.append((request, len(times)))
            stop: RequestStatus | None = None
            num_kept = 0
            for token in sampled:
                output_ids.append(token)
                times.append(now)
                num_kept += 1
                stop = self._stop_status(request, token)
                if stop is not None:
                    break
            if stop is not None:
                self.kv_cache_manager.free(request)
                self._finish(request, stop, now)
                any_finished = True
            updates.append(RequestUpdate(s.request_id, tuple(sampled[:num_kept]), stop is not None, request.finish_reason))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
            reservation = self.config.output_reservation
            if reservation is not None and not self.running and not self.waiting:
                # Nothing left to run: SGLang's loop finds no batch and re-inits its ratio while idle.
                self._reserve_ratio = reservation.initial_ratio
        bulk = self._bulk
        if bulk is not None:
            if output.bulk_decodes.num_requests:
                bulk.advance(now)
            for s, request in live:
                if s.samples and not request.is_finished:
                    self._join_bulk(request)
        return self._deliver(updates, now) if in_group else updates

    def _deliver(self, updates: list[RequestUpdate], now: float) -> list[RequestUpdate]:
        """Multi-step: hold a group's tokens until its last step, then deliver them all at once,
        stamped with that step's time, as vLLM's multi-step streams them."""
        self._group_updates += updates
        self._group_steps_left -= 1
        if self._group_steps_left and self.running:
            return []
        self._group_steps_left = 0
        for request, first in self._group_requests:
            times = request.token_times
            times[first:] = [now] * (len(times) - first)
            if request.finish_time is not None:
                request.finish_time = now
        delivered, self._group_updates, self._group_requests = self._group_updates, [], []
        return delivered

    def _check_sampled(self, live: Sequence[ScheduledRequest], sampled_token_ids: Mapping[str, Sequence[int]]) -> None:
        # Everything is checked before anything changes, so a bad call leaves no half-applied step.
        for s in live:
            sampled = sampled_token_ids.get(s.request_id)
            if not s.samples:
                if sampled:
                    raise ValueError(
                        f"request {s.request_id!r} computed a prompt chunk and cannot sample: got {sampled}"
                    )
            elif sampled is None or not 1 <= len(sampled) <= s.num_draft_tokens + 1:
                raise ValueError(
                    f"request {s.request_id!r} must get 1..{s.num_draft_tokens + 1} sampled tokens "
                    f"(accepted drafts + 1), got {sampled}"
                )

    @staticmethod
    def _stop_status(request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        # A natural stop is reported as such even when it is also the last token allowed.
        if token == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        # add_request guarantees prompt + max_tokens <= max_model_len, so this also
        # enforces max_model_len.
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        request.status = status
        request.finish_time = now
        request.finish_reason = FINISH_REASONS[status]
        request.spec_token_ids = []
        request.block_hashes = []  # only live requests need them; 10,000s of requests add up
        self._num_finished[request.finish_reason] += 1
        self._finished_ids.append(request.request_id)

    def pop_finished(self, request_id: str) -> Request:
        """Drop a finished request from `requests` and return it: a long-running server calls
        this once the request's result is out, or it would keep every request it ever served."""
        request = self.requests[request_id]
        if not request.is_finished:
            raise ValueError(f"request {request_id!r} is {request.status.name}: only a finished request can be dropped")
        del self.requests[request_id]
        return request

    # ---- queries --------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def bulk_steps_ahead(self) -> int:
        """How many steps from the next one are certain to be bulk decodes only (0: the next is not
        one). Nobody waits and no member is looked at before then, so the members stay the same:
        each step they are one token longer. An owed block event may turn into a visit on the way (a
        pool run short), so a run asks again before each of its steps."""
        bulk = self._bulk
        if (bulk is None or self._pending is not None or self.waiting or not bulk.num_requests
                or len(self.running) != bulk.num_requests):
            return 0
        return max(0, bulk.next_visit() - bulk.steps)

    def bulk_run(self) -> tuple[int, BulkShape]:
        """bulk_steps_ahead(), and the next step's shape if it is one (NO_BULK if not): the run's
        shapes follow, its context growing by the members' count a step, its longest by one."""
        ahead = self.bulk_steps_ahead()
        return (ahead, self._members.shape()) if ahead else (0, NO_BULK)

    def finishes_none(self, output: SchedulerOutput) -> bool:
        """Whether applying `output` (the latest schedule()) finishes no request, whatever tokens its
        sampling requests get: each stays below its max_tokens, and its sampled token cannot stop it
        (ignore_eos, no stop tokens). Bulk decodes never finish in a step: each is looked at before
        its last token. Tokens of a multi-step group wait for its last step, finishes with them: no."""
        if self.config.num_scheduler_steps > 1:
            return False
        requests = self.requests
        for s in output.scheduled:
            if not s.samples:
                continue
            request = requests[s.request_id]
            params = request.sampling_params
            if (not params.ignore_eos or params.stop_token_ids
                    or request.num_output_tokens + 1 + s.num_draft_tokens >= params.max_tokens):
                return False
        return True

    def get_request(self, request_id: str) -> Request:
        request = self.requests[request_id]
        if request.bulk_since >= 0:
            self._members.sync(request)
        return request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_requests=self._num_added,
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_finished=dict(self._num_finished),
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            prefix_cache=self.kv_cache_manager.prefix_cache_stats,
            offload=self.kv_cache_manager.tier_stats,
        )
