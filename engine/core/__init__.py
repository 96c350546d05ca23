"""Torch-free engine core: request state, scheduler and KV-block manager.

Shared by the PyTorch engine and the planner's simulator; imports only the standard library.
"""

from engine.core.compiled import check

check()  # before any compiled module is imported: refuse one built from other sources

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.kv_cache_manager import KVCacheManager, PrefixCacheStats, hash_block_tokens
from engine.core.kv_tiers import BlockCopy, ExternalLoad, KVTiers, KVTransfers, TierStats
from engine.core.metrics import RequestMetrics, StepSample
from engine.core.request import BlockHash, Request, RequestStatus
from engine.core.request_queue import FCFSQueue, PriorityQueue, RequestQueue
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.core.scheduler import (
    RequestUpdate,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)
from engine.core.speculative import Proposer, SpecStats, draft_budget
from engine.core.step_loop import ExecutedStep, Executor, LaunchedStep, StepLoop
from engine.core.window_blocks import WindowGroups, blocks_to_hold

__all__ = [
    "BlockCopy",
    "BlockHash",
    "BlockPool",
    "ExecutedStep",
    "Executor",
    "ExternalLoad",
    "FCFSQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVTiers",
    "KVTransfers",
    "LaunchedStep",
    "PrefixCacheStats",
    "PriorityQueue",
    "Proposer",
    "Request",
    "RequestMetrics",
    "RequestQueue",
    "RequestStatus",
    "RequestUpdate",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SpecStats",
    "StepLoop",
    "StepSample",
    "StructuredOutput",
    "TierStats",
    "WindowGroups",
    "draft_budget",
    "blocks_to_hold",
    "hash_block_tokens",
]
