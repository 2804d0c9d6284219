"""KV blocks that move between engine groups: the scheduler core's side (no I/O).

A request can leave this group unfinished with its KV kept for the group that continues it
(a prefill group after the first token; a draining group's running request): its block
references move from the request to a *hold* (`HeldKV`), keyed by the request's id, until
the other group has pulled the blocks (`release`) or the hold expires
(scheduler_svc/kv_moves.py keeps the deadlines).

The other way, a request can arrive with the KV of its first tokens held elsewhere: it is
admitted *importing* (`KVImport`): it holds its prefix-cache hits and fresh blocks for the
rest of that KV, waits outside the queue while the workers pull the blocks, and is queued
with them computed when the pull succeeds, or with nothing computed (recompute, the same
result) when it fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from protos.step import RequestId, SchedulerOutput
from scheduler_svc.core.admission import check_admissible
from scheduler_svc.core.kv_cache_manager import KVCacheManager, cdiv
from scheduler_svc.core.types import HeldKV, KVImport, Request, RequestStatus

if TYPE_CHECKING:
    from protos.block_hash import BlockHash
    from scheduler_svc.core.config import SchedulerConfig
    from scheduler_svc.core.policy import WaitingQueue


def num_usable_tokens(token_ids: Sequence[int], held_token_ids: Sequence[int]) -> int:
    """How many of a request's first tokens another group's held KV serves: the run both
    start with, short of the request's last token (always computed here, for its logits)."""
    limit = min(len(held_token_ids), len(token_ids) - 1)
    count = 0
    while count < limit and token_ids[count] == held_token_ids[count]:
        count += 1
    return count


class KVMoving:
    """The `Scheduler`'s KV moves (it inherits them, and sets these in its __init__)."""

    config: SchedulerConfig
    kv: KVCacheManager
    requests: dict[RequestId, Request]
    waiting: WaitingQueue
    _in_flight: dict[RequestId, int]
    held: dict[RequestId, HeldKV]  # blocks held for another group, by request id
    _importing: dict[RequestId, KVImport]  # requests whose KV is being pulled here

    def hand_off(self, request_id: RequestId) -> HeldKV | None:
        """Ends a running request that no step in flight holds, keeping the blocks of its
        computed KV for another group. None (nothing changes) when it is unknown, in a step
        in flight, or has no KV here (waiting, preempted, swapped, an embedding)."""
        request = self.requests.get(request_id)
        if (
            request is None
            or request_id in self._in_flight
            or request.status is not RequestStatus.RUNNING
            or request.pooling is not None
            or request.num_computed_tokens == 0
        ):
            return None
        return self._hold(request)

    def release_held(self, request_id: RequestId) -> bool:
        """The other group is done with a hold (or it expired): its blocks are freed."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self.kv.pool.release(reversed(held.block_ids))
        return held is not None

    def add_importing(self, request: Request, num_held_tokens: int) -> KVImport | None:
        """Admits a request whose first `num_held_tokens` tokens' KV another group holds:
        it takes its prefix-cache hits and fresh blocks for the rest of that KV, and waits
        outside the queue for `finish_import`. Returns the blocks to fill, or None when
        there is nothing to pull or no room (it is then queued to recompute, as by
        `add_request`). Raises ValueError as `add_request` does."""
        check_admissible(request, self.config, self.requests)
        num_tokens = min(num_held_tokens, request.num_tokens - 1)
        hits = (
            self.kv.get_computed_blocks(request)[: num_tokens // self.config.block_size]
            if num_tokens > 0 and request.pooling is None
            else []
        )
        num_hit_tokens = len(hits) * self.config.block_size
        fresh = (
            self.kv.allocate_for_admission(request, hits, num_tokens - num_hit_tokens)
            if num_tokens > num_hit_tokens
            else None
        )
        if not fresh:
            self._enqueue(request)
            return None
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.register(request)
        pulled = self._importing[request.request_id] = KVImport(
            request.request_id, num_tokens, len(hits), tuple(fresh)
        )
        return pulled

    def tier_hits(self, request: Request) -> list[tuple[int, BlockHash]]:
        """(slot, key) of the blocks the host tier holds past the request's prefix-cache
        hits (core/host_tier.py): an import of those instead of recomputing them."""
        if request.pooling is not None or self.kv.tier is None:
            return []
        return self.kv.tier_hits(request, len(self.kv.get_computed_blocks(request)))

    def finish_import(self, request_id: RequestId, pulled: bool) -> bool:
        """Queues an importing request: with its KV computed when `pulled`, else with its
        blocks dropped (it recomputes, as any resumed request). False when it is no longer
        importing (aborted, or this core replaced after a recovery)."""
        imported = self._importing.pop(request_id, None)
        request = self.requests.get(request_id)
        if imported is None or request is None:
            return False
        if pulled:
            request.num_computed_tokens = imported.num_tokens
        else:
            self.kv.free(request)
        self.waiting.push(request)
        return True

    def _hold(self, request: Request, remove_from_running: bool = True) -> HeldKV:
        """Ends `request` as handed off, its computed KV's blocks kept in `held`."""
        num_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        block_ids = tuple(request.block_ids[: cdiv(num_tokens, self.config.block_size)])
        self.release_held(request.request_id)  # an older hold of the same request
        held = self.held[request.request_id] = HeldKV(
            request.request_id, block_ids, tuple(request.all_token_ids[:num_tokens])
        )
        self.kv.pool.take(block_ids)  # the hold's own references
        self._finish(request, RequestStatus.HANDED_OFF, remove_from_running)
        return held

    def _start_imported(self, request: Request, output: SchedulerOutput, budget: int) -> int:
        num_new = self._num_new_tokens(request.num_tokens - request.num_computed_tokens, budget)
        if num_new == 0 or self.kv.allocate_slots(request, num_new) is None:
            return 0
        self._start_running(request, output, num_new)
        return num_new

    if TYPE_CHECKING:  # provided by the Scheduler

        def _enqueue(self, request: Request) -> None: ...
        def _finish(
            self, request: Request, status: RequestStatus, remove_from_running: bool = True
        ) -> None: ...
        def _num_new_tokens(self, num_remaining: int, budget: int) -> int: ...
        def _start_running(
            self, request: Request, output: SchedulerOutput, num_new: int
        ) -> None: ...
