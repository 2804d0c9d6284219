"""The KV cache blocks of one engine group: reference counts and the prefix cache.

A block is *used* while at least one request's block table holds it (`ref_count > 0`) and
*free* otherwise. A free block may still be *cached*: it keeps the hash and token ids of
the full block whose KV it holds, so a later request with the same prefix can take it back
instead of recomputing it. Fresh blocks are handed out first; cached free blocks are
evicted (their hash dropped) least recently freed first, only when no fresh block is left.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from protos.block_hash import BlockHash
from protos.step import BlockId


class BlockPool:
    """Hands out device block ids in `[0, num_blocks)` and counts their references.

    Invariants: `num_free_blocks + num_used_blocks == num_blocks`; a block is free iff its
    ref_count is 0, and then it is in exactly one of the fresh queue (no hash) or the LRU
    queue (hashed); at most one block is cached per hash.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._fresh: deque[BlockId] = deque(range(num_blocks))
        # Free cached blocks, least recently freed first (the eviction order).
        self._lru: OrderedDict[BlockId, None] = OrderedDict()
        # What each cached block holds: hash, token ids, and its parent block's hash.
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._parents: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, BlockId] = {}
        self.num_evictions = 0

    # ---- counts --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached or not."""
        return len(self._fresh) + len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks (used or free) whose KV the prefix cache can hand out."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: BlockId) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: BlockId) -> BlockHash | None:
        return self._hashes[block_id]

    def free_block_ids(self) -> list[BlockId]:
        """Fresh blocks in hand-out order, then cached free blocks in eviction order."""
        return [*self._fresh, *self._lru]

    # ---- references ----------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[BlockId] | None:
        """Takes `num_blocks` free blocks (ref_count 1), fresh ones first, then evicting the
        least recently freed cached ones. Returns None, taking nothing, if too few are free."""
        if num_blocks > self.num_free_blocks:
            return None
        blocks: list[BlockId] = []
        for _ in range(num_blocks):
            if self._fresh:
                block_id = self._fresh.popleft()
            else:
                block_id, _ = self._lru.popitem(last=False)
                self._uncache(block_id)
                self.num_evictions += 1
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def take(self, block_ids: Iterable[BlockId]) -> None:
        """Adds one reference to each block: a prefix-cache hit (a free cached block leaves
        the LRU queue) or a fork sharing its leader's block."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._lru[block_id]  # only cached blocks can be found while free
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[BlockId]) -> None:
        """Drops one reference from each block, in the given order; a block left with none
        becomes free (and, if cached, the most recently used entry of the LRU queue)."""
        for block_id in block_ids:
            ref_count = self._ref_counts[block_id] - 1
            if ref_count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = ref_count
            if ref_count == 0:
                if self._hashes[block_id] is None:
                    self._fresh.append(block_id)
                else:
                    self._lru[block_id] = None

    # ---- prefix cache --------------------------------------------------------------------

    def lookup(
        self, block_hash: BlockHash, token_ids: Sequence[int], parent_hash: BlockHash | None
    ) -> BlockId | None:
        """The cached block for `block_hash`, confirmed by its stored token ids and parent
        hash (a hash alone is never trusted), or None."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        if self._tokens[block_id] != tuple(token_ids) or self._parents[block_id] != parent_hash:
            return None
        return block_id

    def cache(
        self,
        block_id: BlockId,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_hash: BlockHash | None,
    ) -> bool:
        """Offers a used block whose KV for `token_ids` is computed to the prefix cache.

        Returns whether it was cached; a block already cached, or a hash that another block
        already holds (both computed the same tokens in one step), leaves things unchanged.
        """
        if self._hashes[block_id] is not None or block_hash in self._cached:
            return False
        self._hashes[block_id] = block_hash
        self._tokens[block_id] = tuple(token_ids)
        self._parents[block_id] = parent_hash
        self._cached[block_hash] = block_id
        return True

    def drop_free_cached(self) -> int:
        """Forgets every cached block that no request holds (they become fresh, as after an
        eviction); cached blocks in use stay cached. Returns how many were dropped."""
        dropped = list(self._lru)
        for block_id in dropped:
            self._uncache(block_id)
        self._fresh.extend(dropped)
        self._lru.clear()
        return len(dropped)

    def reset_cache(self) -> None:
        """Forgets every cached block (e.g. after the workers lost their KV): used blocks stay
        with their requests, free ones become fresh."""
        for block_id in list(self._cached.values()):
            self._uncache(block_id)
        self._fresh.extend(self._lru)
        self._lru.clear()

    def _uncache(self, block_id: BlockId) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is not None and self._cached.get(block_hash) == block_id:
            del self._cached[block_hash]
        self._hashes[block_id] = None
        self._tokens[block_id] = None
        self._parents[block_id] = None


class SwapPool:
    """Ids of CPU swap blocks in `[0, num_blocks)`; each is held by at most one request."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Returns `num_blocks` swap block ids, or None (taking nothing) if too few are free."""
        if num_blocks > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in blocks:
            self._is_free[block_id] = False
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if self._is_free[block_id]:
                raise RuntimeError(f"swap block {block_id} freed twice")
            self._is_free[block_id] = True
            self._free.append(block_id)
