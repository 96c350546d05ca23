"""The blocks of a model's sliding-window layers, kept for the window only.

A layer that attends to the last W tokens never reads older KV, so an engine with a hybrid KV
cache manager (vLLM V1's, docs.vllm.ai/en/latest/design/hybrid_kv_cache_manager) splits the layers
into groups of equal size that share one block pool: the full-attention group(s) keep a block for
every B tokens of a request, each sliding-window group only the blocks that hold one of the last
W - 1 computed tokens or a token being computed, and gives the older ones back before it allocates.
A pool block then holds B tokens of one group's layers (not of every layer), so the same memory
holds more blocks.

Window blocks are never registered in the prefix cache here: a prefix hit of the full-attention
group is taken as it is, and the window before it is allocated anew (vLLM would find those blocks
cached while the pool has not reused them; this costs their memory once more, never a wrong hit).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_pool import KVCacheBlock
from engine.core.by_fields import PickledByFields


@dataclass(frozen=True)
class WindowGroups(PickledByFields):
    """`groups` groups of sliding-window layers with a window of `window_tokens` tokens, beside the
    full-attention group(s) a KVCacheManager always keeps."""

    groups: int
    window_tokens: int

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"groups={self.groups} is invalid: must be >= 1")
        if self.window_tokens < 1:
            raise ValueError(f"window_tokens={self.window_tokens} is invalid: must be >= 1")

    def live_blocks(self, num_computed: int, num_tokens: int, block_size: int) -> tuple[int, int]:
        """Block positions [first, end) one group needs to compute tokens num_computed..num_tokens - 1:
        those holding the last window_tokens - 1 computed tokens, and the new ones."""
        first = max(0, num_computed - self.window_tokens + 1) // block_size
        return first, -(-num_tokens // block_size)


def blocks_to_hold(num_tokens: int, block_size: int, window: WindowGroups | None, max_step_tokens: int) -> int:
    """The most blocks a request of `num_tokens` KV tokens can hold at once, computing at most
    `max_step_tokens` of them in a step: one per block of tokens, and each window group's blocks for
    its window and the tokens of the step."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    # A step ending at token e holds the most when it starts as early as the budget allows; that count
    # grows by at least one every block_size tokens of e, so its largest is at one of the last
    # block_size ends.
    return max(-(-e // block_size) + window.groups * (-(-e // block_size)
                                                      - window.live_blocks(max(0, e - max_step_tokens), e, block_size)[0])
               for e in range(max(1, num_tokens - block_size + 1), num_tokens + 1))


@dataclass(frozen=True)
class WindowChange(PickledByFields):
    """What one allocation does to a request's window blocks, all groups together."""

    drop: int  # blocks given back: the leading positions, now outside the window
    take: int  # new blocks at the end
    first: int  # the first live position afterwards

    @property
    def net(self) -> int:
        """Blocks the pool gives, less those it gets back first."""
        return self.take - self.drop


class WindowBlocks:
    """Each request's sliding-window blocks, position-major: `groups.groups` blocks per position,
    positions [first, first + held) live."""

    def __init__(self, groups: WindowGroups, block_size: int) -> None:
        self.groups = groups
        self.block_size = block_size
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._first: dict[str, int] = {}

    def change(self, request_id: str, num_computed: int, num_tokens: int) -> WindowChange:
        """The change that makes the request's window cover computing up to `num_tokens` tokens after
        `num_computed` (pure: nothing moves until apply)."""
        first, end = self.groups.live_blocks(num_computed, num_tokens, self.block_size)
        held_first = self._first.get(request_id, 0)
        held_end = held_first + len(self._blocks.get(request_id, ())) // self.groups.groups
        new_first = max(first, held_first)
        drop = min(held_end, new_first) - held_first
        take = max(0, end - max(held_end, new_first))
        return WindowChange(drop * self.groups.groups, take * self.groups.groups, new_first)

    def drop(self, request_id: str, change: WindowChange) -> list[KVCacheBlock]:
        """The first half of `change`: forget the blocks it drops, and return them to be freed."""
        held = self._blocks.setdefault(request_id, [])
        dropped = held[: change.drop]
        del held[: change.drop]
        self._first[request_id] = change.first
        return dropped

    def take(self, request_id: str, change: WindowChange, new_blocks: list[KVCacheBlock]) -> None:
        """The second half of `change`: its new blocks, appended."""
        if len(new_blocks) != change.take:
            raise ValueError(f"request {request_id!r}: {len(new_blocks)} new window blocks, expected {change.take}")
        self._blocks[request_id].extend(new_blocks)

    def pop(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; returns every block it held."""
        self._first.pop(request_id, None)
        return self._blocks.pop(request_id, [])

    def held(self) -> dict[str, list[KVCacheBlock]]:
        """Every request's window blocks (a view: do not change it)."""
        return self._blocks
