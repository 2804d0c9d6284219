"""Continuous batching under a token budget: `schedule()` then `update()`, every step.

One step spends `max_num_batched_tokens` over running requests first (one token for a
decode, the rest of a prompt for a prefill, in chunks when `enable_chunked_prefill`), then
over waiting requests in arrival order, up to `max_num_seqs` running requests. When the KV
cache runs out of blocks the newest running request is preempted: it loses its blocks and
is recomputed from its tokens later.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.types import (
    CachedRequestSchedule,
    NewRequestSchedule,
    Request,
    RequestEvent,
    RequestId,
    RequestStatus,
    SchedulerOutput,
    StepResult,
)

logger = logging.getLogger(__name__)


class CapacityError(ValueError):
    """The request can never fit this engine group's KV cache, however long it waits."""


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size)
        self.requests: dict[RequestId, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests whose state the workers hold (sent as new once, then as diffs).
        self._on_workers: set[RequestId] = set()
        # Ids the workers must forget; sent with the next step.
        self._finished_ids: list[RequestId] = []
        # Requests scheduled in the step now in flight; aborts of these wait for update().
        self._in_flight: set[RequestId] = set()
        self._pending_aborts: set[RequestId] = set()
        self._next_step_id = 0
        self._preempted_this_step = False
        self.num_preemptions = 0

    # ---- admission and abort -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request. Raises ValueError if it can never run on this cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        max_len = request.num_prompt_tokens + request.max_tokens
        if max_len > self.config.max_model_len:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens}) + max_tokens ({request.max_tokens}) "
                f"exceeds max_model_len ({self.config.max_model_len})"
            )
        if not self.kv.can_ever_fit(max_len):
            raise CapacityError(
                f"request needs up to {self.kv.num_blocks_needed(max_len)} KV blocks but the "
                f"cache has {self.kv.pool.num_blocks}; lower max_tokens or shorten the prompt"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: RequestId) -> RequestEvent | None:
        """Aborts a request. Its blocks are freed now, or right after the step in flight.

        Returns the final event, or None when the request is unknown or already finished.
        """
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request_id in self._in_flight:
            self._pending_aborts.add(request_id)
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return RequestEvent(request_id, (), request.finish_reason, request.num_prompt_tokens)

    # ---- the two-call step contract ------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._finished_ids)

    def schedule(self) -> SchedulerOutput:
        """Decides what the next step computes and reserves KV blocks for it.

        Advances each scheduled request's `num_computed_tokens` as if the step succeeds.
        """
        output = SchedulerOutput(step_id=self._next_step_id)
        self._next_step_id += 1
        budget = self.config.max_num_batched_tokens
        self._preempted_this_step = False
        budget = self._schedule_running(output, budget)
        # Admitting new work right after running out of blocks would only thrash.
        if not self._preempted_this_step:
            self._schedule_waiting(output, budget)
        output.finished_request_ids = self._finished_ids
        self._finished_ids = []
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        self._in_flight = set(output.num_scheduled_tokens)
        return output

    def update(self, output: SchedulerOutput, result: StepResult) -> list[RequestEvent]:
        """Appends sampled tokens, finishes requests, and returns one event per request touched."""
        if result.step_id != output.step_id:
            raise ValueError(f"result of step {result.step_id} given for step {output.step_id}")
        events: list[RequestEvent] = []
        for request_id, sampled in result.sampled.items():
            request = self.requests.get(request_id)
            if request is None or request_id not in output.num_scheduled_tokens:
                raise ValueError(f"step {output.step_id} sampled unscheduled request {request_id}")
            if request.num_computed_tokens != request.num_tokens:
                raise ValueError(f"request {request_id} sampled before its prompt was computed")
            request.output_token_ids.append(sampled.token_id)
            status = self._check_stop(request, sampled.token_id)
            if status is not None:
                self._finish(request, status)
            events.append(RequestEvent(request_id, (sampled,), request.finish_reason,
                                       request.num_prompt_tokens))
        self._in_flight = set()
        for request_id in self._pending_aborts:
            event = self.abort(request_id)
            if event is not None:
                events.append(event)
        self._pending_aborts.clear()
        return events

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=self.kv.pool.num_free_blocks,
            num_blocks=self.kv.pool.num_blocks,
            num_preemptions=self.num_preemptions,
        )

    # ---- internals -----------------------------------------------------------------------

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:  # nothing to compute until a token arrives
                index += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new)
            if new_blocks is None:  # the request itself was preempted
                continue
            output.cached_requests.append(
                CachedRequestSchedule(request.request_id, new_blocks, request.num_computed_tokens)
            )
            output.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[int] | None:
        """Allocates blocks for `request`, preempting the newest others until it fits.

        Returns None when `request` itself had to be preempted.
        """
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return None

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_remaining = request.num_tokens - request.num_computed_tokens
            if num_remaining > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_remaining, budget)
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._on_workers.add(request.request_id)
            output.new_requests.append(
                NewRequestSchedule(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids,
                    num_prompt_tokens=request.num_prompt_tokens,
                    block_ids=list(request.block_ids),
                    num_computed_tokens=request.num_computed_tokens,
                    sampling=request.sampling,
                    min_tokens=request.min_tokens,
                    stop_token_ids=request.stop_token_ids,
                )
            )
            output.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the request's KV and queue it first in line."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_this_step = True
        self._forget_on_workers(request.request_id)
        self.waiting.appendleft(request)
        logger.info("preempted request %s (%d tokens)", request.request_id, request.num_tokens)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        num_output = len(request.output_token_ids)
        if token_id in request.stop_token_ids and num_output >= request.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        self._forget_on_workers(request.request_id)
        del self.requests[request.request_id]

    def _forget_on_workers(self, request_id: RequestId) -> None:
        if request_id in self._on_workers:
            self._on_workers.discard(request_id)
            self._finished_ids.append(request_id)
