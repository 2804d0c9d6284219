"""Per-request KV block allocation on top of the block pool."""

from __future__ import annotations

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.types import BlockId, Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Keeps each request's block table long enough for the tokens it will compute."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens fits in the whole cache."""
        return self.num_blocks_needed(num_tokens) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[BlockId] | None:
        """Grows `request.block_ids` to hold `num_computed_tokens + num_new_tokens` tokens.

        Returns the newly added block ids (possibly empty), or None when the pool has too
        few free blocks, in which case nothing changes.
        """
        num_needed = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
        num_missing = num_needed - len(request.block_ids)
        if num_missing <= 0:
            return []
        new_blocks = self.pool.allocate(num_missing)
        if new_blocks is None:
            return None
        request.block_ids.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Returns all of the request's blocks to the pool."""
        self.pool.free(request.block_ids)
        request.block_ids = []
