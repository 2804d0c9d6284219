"""The host tier's index: which KV block contents the workers' host tiers hold, in which
slot (worker_svc/host_tier.py keeps the bytes, in shared memory outside the worker
process; this scheduler decides what goes where).

Every full block the prefix cache takes in is also written through to a slot (the next
step's `blocks_to_offload`), so the tier holds what the device prefix cache holds and more:
blocks evicted from the device stay in the tier, least recently used first out. A request
admitted with blocks in the tier past its device prefix-cache hits loads them (an import,
as for KV pulled from another group: core/kv_moves.py) rather than recomputing them — and
so does every request carried over when a worker died and was restarted on the same host,
since the index outlives the core (it lives in the engine loop).

A slot is named by the block's chained hash and confirmed by its tokens and parent hash,
as the device prefix cache confirms its blocks; the worker checks each slot's key and
checksum again when loading it, so a slot torn by a killed worker, overwritten since, or a
tier re-created empty is never used: its request recomputes. Each rank's tier has an
epoch; when the epochs the workers report change (a tier lost with its host, or re-made),
the index is cleared.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from protos.block_hash import BlockHash


@dataclass(frozen=True)
class _Entry:
    slot: int
    tokens: tuple[int, ...]
    parent: BlockHash | None


class HostTierIndex:
    """Slots `[0, num_slots)` of every rank's tier (the same slot on each rank holds that
    rank's share of one block)."""

    def __init__(self, num_slots: int, epochs: Sequence[int] = ()) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.epochs = tuple(epochs)
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_stores = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, block_hash: BlockHash, tokens: Sequence[int], parent: BlockHash | None
    ) -> int | None:
        """The slot holding this block, confirmed by its tokens and parent (and made the
        most recently used), or None."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.tokens != tuple(tokens) or entry.parent != parent:
            return None
        self._entries.move_to_end(block_hash)
        return entry.slot

    def reserve(
        self, block_hash: BlockHash, tokens: Sequence[int], parent: BlockHash | None
    ) -> int | None:
        """A slot to write this block to (evicting the least recently used entry when the
        tier is full); None when the tier already holds it."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            _, evicted = self._entries.popitem(last=False)
            slot = evicted.slot
            self.num_evictions += 1
        self._entries[block_hash] = _Entry(slot, tuple(tokens), parent)
        self.num_stores += 1
        return slot

    def forget(self, block_hash: BlockHash) -> None:
        """A slot that failed its check on a worker: no longer offered."""
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self._free.append(entry.slot)

    def reset(self, epochs: Sequence[int]) -> None:
        """The workers' tiers are other ones now (`epochs` differ): nothing is known."""
        self._entries.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.epochs = tuple(epochs)
