"""Which engine group gets a request: pure decisions over what the router knows.

- `round_robin`: groups in turn.
- `least_load`: the group with the fewest outstanding tokens (prompt + still to generate of
  the requests this router has in flight there), then the fewest running + waiting requests
  its scheduler reported.
- `prefix_aware` (default): the group that most likely holds the longest prefix of the
  prompt's KV blocks, from an approximate index of where this router sent each block hash
  (the same chained hashes the schedulers cache by, `protos/block_hash.py`). When that
  group is much busier than the least-loaded one (bounded imbalance), least_load decides.

A request for a LoRA adapter picks among the groups holding it first (`adapter_groups`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from protos.block_hash import BlockHash

POLICIES = ("round_robin", "least_load", "prefix_aware")


@dataclass(frozen=True)
class GroupLoad:
    """One engine group as the router sees it."""

    scheduler_id: str
    num_running: int = 0  # as its scheduler last reported
    num_waiting: int = 0
    num_free_blocks: int = 0
    outstanding_tokens: int = 0  # of this router's requests in flight there


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "prefix_aware"
    # prefix_aware falls back to least_load when the prefix group's outstanding tokens exceed
    # the least-loaded group's by more than this many tokens AND by this factor.
    balance_abs_threshold_tokens: int = 4096
    balance_rel_threshold: float = 1.5
    # Block hashes remembered by the prefix index (least recently routed forgotten first).
    max_indexed_blocks: int = 200_000

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {self.policy!r}")
        if self.balance_abs_threshold_tokens < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance thresholds must be >= 0 tokens and >= 1.0")
        if self.max_indexed_blocks < 1:
            raise ValueError("max_indexed_blocks must be >= 1")


class PrefixIndex:
    """Approximately which group holds which KV block: block hash -> groups that were sent
    a prompt containing it. Bounded; least recently routed hashes are forgotten first."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._groups: OrderedDict[BlockHash, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._groups)

    def match(self, block_hashes: Sequence[BlockHash], group_ids: Sequence[str]) -> dict[str, int]:
        """How many leading blocks of the prompt each group is believed to hold."""
        matched = dict.fromkeys(group_ids, 0)
        alive = set(group_ids)
        for block_hash in block_hashes:
            holders = self._groups.get(block_hash)
            alive &= holders if holders is not None else set()
            if not alive:
                break
            for group_id in alive:
                matched[group_id] += 1
        return matched

    def record(self, block_hashes: Sequence[BlockHash], group_id: str) -> None:
        for block_hash in block_hashes:
            holders = self._groups.get(block_hash)
            if holders is None:
                self._groups[block_hash] = {group_id}
            else:
                holders.add(group_id)
                self._groups.move_to_end(block_hash)
        while len(self._groups) > self.max_blocks:
            self._groups.popitem(last=False)

    def forget_group(self, group_id: str) -> None:
        """A group left (its KV is gone): drop it from every entry."""
        for block_hash in list(self._groups):
            holders = self._groups[block_hash]
            holders.discard(group_id)
            if not holders:
                del self._groups[block_hash]


class RoutingPolicy:
    """Picks a group for each request under one policy; `exclude` skips groups that
    already failed this request."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self.index = PrefixIndex(config.max_indexed_blocks)
        self._turn = 0

    def pick(
        self,
        groups: Sequence[GroupLoad],
        block_hashes: Sequence[BlockHash] = (),
        exclude: frozenset[str] = frozenset(),
    ) -> str | None:
        candidates = sorted(
            (g for g in groups if g.scheduler_id not in exclude), key=lambda g: g.scheduler_id
        )
        if not candidates:
            return None
        if self.config.policy == "round_robin":
            self._turn += 1
            return candidates[self._turn % len(candidates)].scheduler_id
        least = self._least_loaded(candidates)
        if self.config.policy == "least_load" or not block_hashes:
            return least.scheduler_id
        matched = self.index.match(block_hashes, [g.scheduler_id for g in candidates])
        best = max(candidates, key=lambda g: (matched[g.scheduler_id], -_load_key(g)[0]))
        if matched[best.scheduler_id] == 0 or self._too_busy(best, least):
            return least.scheduler_id
        return best.scheduler_id

    def adapter_groups(
        self,
        holders: Sequence[GroupLoad],
        with_room: Sequence[GroupLoad],
        full: Sequence[GroupLoad],
    ) -> Sequence[GroupLoad]:
        """Where a request for a LoRA adapter may go: the groups holding it; when none does,
        those with room to load it, then any serving LoRA (it lets its least recently named
        adapter go). When even the least busy holder is much busier than the least busy
        group with room (bounded imbalance, as prefix_aware's), that group: it loads the
        adapter too, and a hot adapter spreads."""
        if holders and with_room:
            holder = min(holders, key=_load_key)
            spare = min(with_room, key=_load_key)
            return [spare] if self._too_busy(holder, spare) else holders
        return holders or with_room or full

    def record(self, block_hashes: Sequence[BlockHash], group_id: str) -> None:
        """The request went to `group_id`: its blocks will be cached there."""
        if self.config.policy == "prefix_aware":
            self.index.record(block_hashes, group_id)

    def _least_loaded(self, candidates: list[GroupLoad]) -> GroupLoad:
        least = min(_load_key(g) for g in candidates)
        tied = [g for g in candidates if _load_key(g) == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def _too_busy(self, best: GroupLoad, least: GroupLoad) -> bool:
        extra = best.outstanding_tokens - least.outstanding_tokens
        return (
            extra > self.config.balance_abs_threshold_tokens
            and best.outstanding_tokens
            > self.config.balance_rel_threshold * least.outstanding_tokens
        )


def _load_key(group: GroupLoad) -> tuple[int, int]:
    return (group.outstanding_tokens, group.num_running + group.num_waiting)
