"""Torch-free engine core: request state, scheduler and KV-block manager.

Shared by the PyTorch engine and the planner's simulator; imports only the standard library.
"""

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.kv_cache_manager import KVCacheManager, PrefixCacheStats, hash_block_tokens
from engine.core.request import BlockHash, Request, RequestStatus, SamplingParams
from engine.core.request_queue import FCFSQueue, PriorityQueue, RequestQueue
from engine.core.scheduler import (
    RequestUpdate,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)

__all__ = [
    "BlockHash",
    "BlockPool",
    "FCFSQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "PriorityQueue",
    "Request",
    "RequestQueue",
    "RequestStatus",
    "RequestUpdate",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "hash_block_tokens",
]
