"""The pool of KV cache blocks of one engine group."""

from __future__ import annotations

from collections import deque

from scheduler_svc.core.types import BlockId


class BlockPool:
    """Hands out block ids in `[0, num_blocks)` and takes them back.

    Invariant: every block is either free or owned by exactly one request, so
    `num_free_blocks + num_used_blocks == num_blocks`. (Prefix caching will add
    reference counts; the seam is `allocate`/`free`.)
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[BlockId] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[BlockId] | None:
        """Returns `num_blocks` free block ids, or None (and takes nothing) if too few are free."""
        if num_blocks > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in blocks:
            self._is_free[block_id] = False
        return blocks

    def free(self, block_ids: list[BlockId]) -> None:
        """Returns blocks to the pool; freeing a free block is a bug and raises."""
        for block_id in block_ids:
            if self._is_free[block_id]:
                raise RuntimeError(f"block {block_id} freed twice")
            self._is_free[block_id] = True
            self._free.append(block_id)
