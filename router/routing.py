"""Which engine group gets a request: a pure decision over what the registry says."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupLoad:
    """One engine group as its scheduler last reported it."""

    scheduler_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int


class LeastLoadRouter:
    """Picks the group with the fewest running + waiting requests; ties go round-robin.

    Prefix-aware routing (block-hash affinity) builds on this seam in a later issue.
    """

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, groups: list[GroupLoad], exclude: frozenset[str] = frozenset()) -> str | None:
        candidates = sorted(
            (g for g in groups if g.scheduler_id not in exclude), key=lambda g: g.scheduler_id
        )
        if not candidates:
            return None
        least = min(g.num_running + g.num_waiting for g in candidates)
        tied = [g for g in candidates if g.num_running + g.num_waiting == least]
        self._turn += 1
        return tied[self._turn % len(tied)].scheduler_id
