"""Per-request KV block tables on top of the block pool: growth, prefix hits, forks, swaps.

Units: `block_size` tokens per block; token counts are in tokens, block counts in blocks.
A request's block table holds `cdiv(num_computed_tokens + scheduled tokens, block_size)`
blocks. Its full blocks are hashed once (chained, `protos.block_hash`) and the hashes are
kept for the request's life, since its tokens never change once known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.block_hash import BlockHash, adapter_extra, block_images, hash_block_tokens
from protos.step import BlockId, RequestId
from scheduler_svc.core.block_pool import BlockPool, SwapPool
from scheduler_svc.core.host_tier import HostTierIndex
from scheduler_svc.core.types import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _RequestKV:
    # Chained hashes of the request's first full blocks (prompt + output), computed lazily.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Leading blocks of the current block table already offered to the prefix cache.
    num_offered_blocks: int = 0
    # Swap blocks holding the request's KV while it is SWAPPED, in block-table order.
    swap_block_ids: list[int] = field(default_factory=list)


class KVCacheManager:
    """Keeps each request's block table long enough for the tokens it will compute.

    Prefix cache: a block is offered to the cache (`cache_computed_blocks`) only once the
    step that computed all its tokens was `update()`d; a waiting request starts from the
    longest run of cached blocks of its tokens (`get_computed_blocks`). Counters are in
    tokens: `prefix_cache_queries` (tokens of admitted requests looked up) and
    `prefix_cache_hits` (of those, tokens whose KV came from the cache).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        tier: HostTierIndex | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.swap = SwapPool(num_swap_blocks)
        self._state: dict[RequestId, _RequestKV] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # The host tier (core/host_tier.py): every block the prefix cache takes in is
        # written through to a slot, by the next step (`take_offloads`).
        self.tier = tier if enable_prefix_caching else None
        self._offloads: list[tuple[BlockId, int, bytes]] = []

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens fits in the whole cache."""
        return self.num_blocks_needed(num_tokens) <= self.pool.num_blocks

    def swap_block_ids(self, request_id: RequestId) -> list[int]:
        state = self._state.get(request_id)
        return list(state.swap_block_ids) if state else []

    # ---- admission -----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[BlockId]:
        """The longest run of cached blocks holding the request's first tokens, confirmed by
        their tokens; no side effects. Only whole blocks within the first `num_tokens - 1`
        tokens count (vLLM's rule), so at least one token is left to compute (for logits) and
        it never lands in a shared block."""
        if not self.enable_prefix_caching:
            return []
        state = self._state_of(request)
        hits: list[BlockId] = []
        parent: BlockHash | None = None
        for index in range((request.num_tokens - 1) // self.block_size):
            block_hash = self._block_hash(request, state, index)
            block_id = self.pool.lookup(block_hash, self._block_tokens(request, index), parent)
            if block_id is None:
                break
            hits.append(block_id)
            parent = block_hash
        return hits

    def allocate_for_admission(
        self, request: Request, computed_blocks: list[BlockId], num_new_tokens: int
    ) -> list[BlockId] | None:
        """Gives a request with no blocks the `computed_blocks` (one more reference each) plus
        fresh blocks for `num_new_tokens` more tokens. Returns the fresh blocks, or None when
        too few are free, in which case nothing changes."""
        assert not request.block_ids, "admission of a request that holds blocks"
        num_hit_tokens = len(computed_blocks) * self.block_size
        num_fresh = self.num_blocks_needed(num_hit_tokens + num_new_tokens) - len(computed_blocks)
        # Hits sitting free in the LRU queue are about to be taken; they cannot be evicted.
        num_free_hits = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        if num_fresh > self.pool.num_free_blocks - num_free_hits:
            return None
        self.pool.take(computed_blocks)
        fresh = self.pool.allocate(num_fresh)
        assert fresh is not None
        request.block_ids = [*computed_blocks, *fresh]
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        return fresh

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[BlockId] | None:
        """Grows `request.block_ids` to hold `num_computed_tokens + num_new_tokens` tokens.

        Returns the newly added block ids (possibly empty), or None when the pool has too
        few free blocks, in which case nothing changes.
        """
        num_missing = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(
            request.block_ids
        )
        if num_missing <= 0:
            return []
        new_blocks = self.pool.allocate(num_missing)
        if new_blocks is None:
            return None
        request.block_ids.extend(new_blocks)
        return new_blocks

    def fork(self, request: Request, leader: Request) -> tuple[BlockId, BlockId] | None:
        """Starts fork `request` on the computed prompt of `leader`: it shares the leader's
        blocks before the one holding the last prompt token and gets a fresh copy of that one
        (it recomputes the last prompt token there, so nothing shared is ever written).
        Returns the (leader block, copy) pair to copy, or None when no block is free."""
        last = (request.num_prompt_tokens - 1) // self.block_size
        copies = self.pool.allocate(1)
        if copies is None:
            return None
        shared = leader.block_ids[:last]
        self.pool.take(shared)
        request.block_ids = [*shared, *copies]
        # Same prompt, same hashes: only blocks made of prompt tokens alone are reused.
        leader_hashes = self._state_of(leader).block_hashes
        num_prompt_blocks = request.num_prompt_tokens // self.block_size
        self._state_of(request).block_hashes = leader_hashes[:num_prompt_blocks]
        return leader.block_ids[last], copies[0]

    # ---- prefix cache --------------------------------------------------------------------

    def cache_computed_blocks(
        self, request: Request, num_computed_tokens: int | None = None
    ) -> None:
        """Offers the request's full blocks below `num_computed_tokens` (default: the
        request's) to the prefix cache.

        Call only when those tokens' KV is really computed: after `update()` of the step
        that scheduled them (a step still in flight has not). Each block is offered once per
        block table.
        """
        state = self._state.get(request.request_id)
        if state is None:
            state = self._state_of(request)
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        num_full = num_computed_tokens // self.block_size
        if num_full <= state.num_offered_blocks or not self.enable_prefix_caching:
            return
        hashes = state.block_hashes
        tier = self.tier
        for index in range(state.num_offered_blocks, num_full):
            block_hash = self._block_hash(request, state, index)
            parent = hashes[index - 1] if index else None
            tokens = self._block_tokens(request, index)
            block_id = request.block_ids[index]
            if self.pool.cache(block_id, block_hash, tokens, parent) and tier is not None:
                slot = tier.reserve(block_hash, tokens, parent)
                if slot is not None:
                    self._offloads.append((block_id, slot, block_hash))
        state.num_offered_blocks = num_full

    def take_offloads(self) -> list[tuple[BlockId, int, bytes]]:
        """The (device block, tier slot, key) writes for the next step, once."""
        offloads, self._offloads = self._offloads, []
        return offloads

    def tier_hits(self, request: Request, num_device_hits: int) -> list[tuple[int, BlockHash]]:
        """(slot, hash) of the run of the request's full blocks the host tier holds right
        after its `num_device_hits` prefix-cache hits, within its first `num_tokens - 1`
        tokens; empty without a tier."""
        if self.tier is None:
            return []
        state = self._state_of(request)
        hits: list[tuple[int, BlockHash]] = []
        for index in range(num_device_hits, (request.num_tokens - 1) // self.block_size):
            block_hash = self._block_hash(request, state, index)
            parent = state.block_hashes[index - 1] if index else None
            slot = self.tier.lookup(block_hash, self._block_tokens(request, index), parent)
            if slot is None:
                break
            hits.append((slot, block_hash))
        return hits

    # ---- release, swap -------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Drops the request's references to its device blocks, last block first, so that the
        tail of a sequence is evicted before its (more shareable) head."""
        self.pool.release(reversed(request.block_ids))
        request.block_ids = []
        state = self._state.get(request.request_id)
        if state is not None:
            state.num_offered_blocks = 0

    def forget(self, request: Request) -> None:
        """Frees everything the request holds (device and swap blocks) and its hashes."""
        self.free(request)
        state = self._state.pop(request.request_id, None)
        if state is not None:
            self.swap.free(state.swap_block_ids)

    def swap_out(self, request: Request) -> list[tuple[BlockId, int]] | None:
        """Copies the request's computed blocks to swap blocks and frees its device blocks.

        Returns the (device block, swap block) pairs the workers must copy before the next
        forward, or None (nothing changes) when swap space is short. Shared blocks are copied
        too: a swapped request owns private copies of all its KV.
        """
        num_blocks = self.num_blocks_needed(request.num_computed_tokens)
        swap_ids = self.swap.allocate(num_blocks) if num_blocks else None
        if swap_ids is None:
            return None
        pairs = list(zip(request.block_ids[:num_blocks], swap_ids))
        self.free(request)
        self._state_of(request).swap_block_ids = swap_ids
        return pairs

    def swap_in(
        self, request: Request, num_new_tokens: int
    ) -> tuple[list[tuple[int, BlockId]], list[int]] | None:
        """Gives a swapped request fresh device blocks for its computed tokens plus
        `num_new_tokens`. Returns the (swap block, device block) pairs to copy and the swap
        blocks, which the caller must free only after this step's swap-outs are decided;
        None (nothing changes) when too few device blocks are free."""
        state = self._state_of(request)
        blocks = self.pool.allocate(
            self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
        )
        if blocks is None:
            return None
        request.block_ids = blocks
        swap_ids, state.swap_block_ids = state.swap_block_ids, []
        return list(zip(swap_ids, blocks)), swap_ids

    def reset_prefix_cache(self) -> int:
        """Forgets the cached blocks no request holds; returns how many. Safe between any
        two calls: blocks in use keep their hash (their KV is valid, and a request sharing
        them may still be admitted); they are dropped by a later reset once freed."""
        return self.pool.drop_free_cached()

    def invalidate_prefix_cache(self) -> None:
        """Forgets every cached block, in use or not (the workers' KV is unknown); requests
        keep their blocks, whose KV is not re-offered."""
        self.pool.reset_cache()

    # ---- hashing -------------------------------------------------------------------------

    def _state_of(self, request: Request) -> _RequestKV:
        state = self._state.get(request.request_id)
        if state is None:
            state = self._state[request.request_id] = _RequestKV()
        return state

    def _block_hash(self, request: Request, state: _RequestKV, index: int) -> BlockHash:
        """The chained hash of full block `index`, hashing any blocks before it not yet hashed."""
        hashes = state.block_hashes
        while len(hashes) <= index:
            next_index = len(hashes)
            hashes.append(
                hash_block_tokens(
                    hashes[-1] if hashes else None,
                    self._block_tokens(request, next_index),
                    self._block_images(request, next_index),
                )
            )
        return hashes[index]

    def _block_images(self, request: Request, index: int) -> bytes:
        """What block `index`'s hash holds beside its tokens: the request's LoRA adapter, and
        the content hashes of the images whose placeholders fall in it (b"" for plain text
        on the base model); the chain carries them into every later block's hash."""
        adapter = adapter_extra(request.lora.name) if request.lora is not None else b""
        if not request.images:
            return adapter
        start = index * self.block_size
        return adapter + block_images(request.images, start, start + self.block_size)

    def _block_tokens(self, request: Request, index: int) -> list[int]:
        """Token ids of full block `index` of the request's prompt + output."""
        start = index * self.block_size
        end = start + self.block_size
        prompt = request.prompt_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            return prompt[start:end]
        output = request.output_token_ids
        if start >= num_prompt:
            return output[start - num_prompt : end - num_prompt]
        return prompt[start:] + output[: end - num_prompt]
