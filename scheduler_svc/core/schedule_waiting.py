"""The second pass of `Scheduler.schedule()`: waiting requests started in the policy's
order (policy.py) with what budget and `max_num_seqs` leave, until one does not fit. A
waiting request starts after the longest run of its blocks in the prefix cache, or as a
fork sharing its leader's prompt blocks (n > 1), or swapped back in, or with the KV it
pulled from another group (kv_moves.py); the workers then get it in full, once."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from protos.step import NewRequestData, RequestId, SchedulerOutput
from scheduler_svc.core.types import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler_svc.core.config import SchedulerConfig
    from scheduler_svc.core.kv_cache_manager import KVCacheManager
    from scheduler_svc.core.policy import WaitingQueue

_RUNNING = RequestStatus.RUNNING


class WaitingPass:
    """The `Scheduler`'s admission of waiting requests (it inherits it, and sets these in its
    __init__)."""

    config: SchedulerConfig
    kv: KVCacheManager
    waiting: WaitingQueue
    running: list[Request]
    _pending_forks: dict[RequestId, Request]  # forks not started yet -> their leader
    _on_workers: set[RequestId]
    _swap_blocks_to_free: list[int]
    num_swap_ins: int
    num_recomputed_tokens: int

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        """Admits waiting requests in policy order until one does not fit; forks whose
        leader's prompt is not computed yet are passed over (they keep their place)."""
        passed_over: list[Request] = []
        adapters = {r.lora.name for r in self.running if r.lora is not None}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.pop()
            lora = request.lora
            if (
                lora is not None
                and lora.name not in adapters
                and len(adapters) >= self.config.max_loras
            ):
                passed_over.append(request)  # its adapter would be one too many this step
                continue
            num_scheduled = self._try_admit(request, output, budget)
            if num_scheduled and lora is not None:
                adapters.add(lora.name)
            if num_scheduled is None:
                passed_over.append(request)
                continue
            if num_scheduled == 0:
                self.waiting.push(request)
                break
            budget -= num_scheduled
        for request in passed_over:
            self.waiting.push(request)

    def _try_admit(self, request: Request, output: SchedulerOutput, budget: int) -> int | None:
        """Starts one waiting request. Returns the tokens scheduled: 0 when it does not fit
        now, None for a fork that must keep waiting for its leader."""
        leader = self._pending_forks.get(request.request_id)
        if leader is not None:
            if leader.status.is_finished:
                del self._pending_forks[request.request_id]  # admitted like any request
            elif not self._prompt_computed(leader, output):
                return None
            else:
                return self._start_fork(request, leader, output)
        if request.status is RequestStatus.SWAPPED:
            return self._resume_swapped(request, output, budget)
        if request.block_ids:  # its KV was pulled from another group (finish_import)
            return self._start_imported(request, output, budget)
        computed_blocks = (
            []
            if request.pooling is not None and self.config.pooling.reads_every_token
            else self.kv.get_computed_blocks(request)
        )
        num_computed = len(computed_blocks) * self.config.block_size
        num_new = self._num_new_tokens(request.num_tokens - num_computed, budget)
        if num_new == 0:
            return 0
        if self.kv.allocate_for_admission(request, computed_blocks, num_new) is None:
            return 0
        request.num_computed_tokens = num_computed
        self._start_running(request, output, num_new)
        return num_new

    def _prompt_computed(self, leader: Request, output: SchedulerOutput) -> bool:
        """Whether the leader's block table holds its whole prompt's KV as of the last
        update (its first token is sampled, and it was not preempted since)."""
        if leader.status is not _RUNNING or not leader.output_token_ids:
            return False
        num_computed_before_step = leader.num_computed_tokens - output.num_scheduled_tokens.get(
            leader.request_id, 0
        )
        return num_computed_before_step >= leader.num_prompt_tokens

    def _start_fork(self, request: Request, leader: Request, output: SchedulerOutput) -> int:
        copy_pair = self.kv.fork(request, leader)
        if copy_pair is None:
            return 0
        del self._pending_forks[request.request_id]
        output.blocks_to_copy.append(copy_pair)
        request.num_computed_tokens = request.num_prompt_tokens - 1
        self._start_running(request, output, 1)
        return 1

    def _resume_swapped(self, request: Request, output: SchedulerOutput, budget: int) -> int:
        num_new = self._num_new_tokens(request.num_tokens - request.num_computed_tokens, budget)
        swapped_in = self.kv.swap_in(request, num_new) if num_new else None
        if swapped_in is None:
            return 0
        pairs, swap_ids = swapped_in
        output.blocks_to_swap_in.extend(pairs)
        self.num_swap_ins += 1
        self._swap_blocks_to_free.extend(swap_ids)
        self._start_running(request, output, num_new)
        return num_new

    def _num_new_tokens(self, num_remaining: int, budget: int) -> int:
        """Tokens to schedule for a request starting this step; 0 when it cannot start."""
        num_new = min(num_remaining, budget)
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        if num_new < num_remaining and not self.config.enable_chunked_prefill:
            return 0
        return max(num_new, 0)

    def _start_running(self, request: Request, output: SchedulerOutput, num_new: int) -> None:
        """Sends a request the workers do not hold, with all its tokens and blocks."""
        if request.output_token_ids:  # its KV was computed before, here or elsewhere
            self.num_recomputed_tokens += max(
                request.num_tokens - 1 - request.num_computed_tokens, 0
            )
        request.status = RequestStatus.RUNNING
        if self.config.policy == "priority":
            bisect.insort(self.running, request, key=self.waiting.key)
        else:
            self.running.append(request)
        self._on_workers.add(request.request_id)
        request.num_tokens_on_workers = request.num_tokens
        output.new_requests.append(
            NewRequestData(
                request_id=request.request_id,
                token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                block_ids=list(request.block_ids),
                num_computed_tokens=request.num_computed_tokens,
                sampling=request.sampling,
                pooling=request.pooling,
                images=request.images,
                lora=request.lora,
            )
        )
        output.num_scheduled_tokens[request.request_id] = num_new
        request.num_computed_tokens += num_new

    if TYPE_CHECKING:  # provided by KVMoving (kv_moves.py)

        def _start_imported(
            self, request: Request, output: SchedulerOutput, budget: int
        ) -> int: ...
