"""Scheduling policies: the order in which waiting requests are admitted.

Each request gets one sort key when it arrives and keeps it for its whole life:
- `fcfs`: arrival order (the order of `add_request` calls);
- `priority`: (priority, arrival_time_s, arrival order); lower priority values go first.
A preempted request re-enters the queue with its old key, so it goes ahead of every later
arrival of equal standing. Under `priority` the running list is kept sorted by the same key,
so its last entry is the preemption victim (least important, newest).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from protos.step import RequestId
from scheduler_svc.core.types import Request

POLICIES = ("fcfs", "priority")
SortKey = tuple[float, ...]


class WaitingQueue:
    """Waiting requests in admission order; push, pop and remove are O(log n).

    Removal is lazy: a heap entry is live only while `_live[request_id]` holds its number.
    """

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._keys: dict[RequestId, SortKey] = {}
        self._arrivals = itertools.count()
        self._pushes = itertools.count()
        self._heap: list[tuple[SortKey, int, Request]] = []
        self._live: dict[RequestId, int] = {}

    def register(self, request: Request) -> None:
        """Gives an arriving request its sort key (once, for its whole life)."""
        arrival = next(self._arrivals)
        if self.policy == "priority":
            self._keys[request.request_id] = (request.priority, request.arrival_time_s, arrival)
        else:
            self._keys[request.request_id] = (arrival,)

    def unregister(self, request_id: RequestId) -> None:
        self.discard(request_id)
        self._keys.pop(request_id, None)

    def key(self, request: Request) -> SortKey:
        return self._keys[request.request_id]

    def push(self, request: Request) -> None:
        if request.request_id in self._live:
            raise RuntimeError(f"request {request.request_id} is already waiting")
        number = next(self._pushes)
        self._live[request.request_id] = number
        heapq.heappush(self._heap, (self._keys[request.request_id], number, request))

    def pop(self) -> Request:
        """Removes and returns the first waiting request; IndexError when there is none."""
        while self._heap:
            _, number, request = heapq.heappop(self._heap)
            if self._live.get(request.request_id) == number:
                del self._live[request.request_id]
                return request
        raise IndexError("pop from an empty waiting queue")

    def discard(self, request_id: RequestId) -> None:
        """Takes a request out of the queue, if it is there."""
        if self._live.pop(request_id, None) is None:
            return
        if len(self._heap) > 2 * len(self._live) + 64:  # mostly dead entries: compact
            self._heap = [e for e in self._heap if self._live.get(e[2].request_id) == e[1]]
            heapq.heapify(self._heap)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        """Waiting requests in admission order (a sorted snapshot; O(n log n))."""
        live = [e for e in self._heap if self._live.get(e[2].request_id) == e[1]]
        return iter([e[2] for e in sorted(live, key=lambda e: (e[0], e[1]))])
