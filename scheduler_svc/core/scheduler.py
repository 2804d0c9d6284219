"""Continuous batching under a token budget: `schedule()` then `update()`, every step.

One step spends `max_num_batched_tokens` over running requests first (one token for a
decode, the rest of a prompt for a prefill, in chunks when `enable_chunked_prefill`, at
most `long_prefill_token_threshold` per request when set), then over waiting requests in
the policy's order (`policy.py`), up to `max_num_seqs` running requests. A waiting request
starts after the longest run of its blocks found in the prefix cache. When the KV cache
runs out of blocks, the last running request (newest under fcfs; least important, newest
under priority) is preempted: its KV is dropped and recomputed later, or with
`preemption_mode="swap"` copied to CPU swap space and back when it resumes.

n > 1 (`add_samples`): the forks wait until the leader's prompt is computed, then
share its full prompt blocks and copy its last prompt block (copy-on-write).

The two passes of a step are in schedule_running.py and schedule_waiting.py, KV moves between
groups in kv_moves.py: `Scheduler` inherits them.
"""

from __future__ import annotations

from protos.step import ModelRunnerOutput, RequestId, SchedulerOutput
from scheduler_svc.core.admission import check_admissible, check_samples, stop_status
from scheduler_svc.core.config import CapacityError, SchedulerConfig, SchedulerStats
from scheduler_svc.core.host_tier import HostTierIndex
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.kv_moves import KVMoving
from scheduler_svc.core.policy import WaitingQueue
from scheduler_svc.core.schedule_running import RunningPass
from scheduler_svc.core.schedule_waiting import WaitingPass
from scheduler_svc.core.spec_decode import Speculation
from scheduler_svc.core.types import HeldKV, KVImport, Request, RequestEvent, RequestStatus

__all__ = ["CapacityError", "Scheduler", "SchedulerConfig", "SchedulerStats"]

_RUNNING = RequestStatus.RUNNING


class Scheduler(RunningPass, WaitingPass, KVMoving):
    """The pure scheduling core of one engine group.

    Invariants between calls: every live request is in exactly one of `running` (status
    RUNNING) or the waiting queue (WAITING, PREEMPTED, SWAPPED); a block's reference count
    equals the number of live block tables holding it; running requests hold
    `cdiv(num_computed_tokens, block_size)` blocks or more.
    """

    def __init__(self, config: SchedulerConfig, tier: HostTierIndex | None = None) -> None:
        self.config = config
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.num_swap_blocks,
            tier,
        )
        self.requests: dict[RequestId, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        # fcfs: admission order; priority: sorted by the policy key. Either way the last
        # entry is the next preemption victim.
        self.running: list[Request] = []
        # Forks not started yet -> their leader.
        self._pending_forks: dict[RequestId, Request] = {}
        # Requests whose state the workers hold (sent as new once, then as diffs).
        self._on_workers: set[RequestId] = set()
        # Ids the workers must forget; sent with the next step.
        self._finished_ids: list[RequestId] = []
        # Requests in steps now in flight -> how many such steps (more than one step is in
        # flight only with pipeline parallelism). They are not scheduled again, preempted or
        # freed until update(); aborts of these wait for it.
        self._in_flight: dict[RequestId, int] = {}
        self._pending_aborts: set[RequestId] = set()
        # Swap blocks read by this step's swap-ins; reusable once the step's swap-outs are set.
        self._swap_blocks_to_free: list[int] = []
        self._next_step_id = 0
        self._preempted_this_step = False
        self.num_preemptions = 0
        # Preemptions that swapped the KV out, and swap-ins that brought it back: proof that
        # swap mode swapped rather than falling back to recompute.
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        # Speculative decoding (core/spec_decode.py): drafts, their verdicts, totals; None: off.
        self.spec = Speculation(config) if config.speculative else None
        # KV moving between groups (core/kv_moves.py): blocks held for another group, by
        # request id; requests whose KV is being pulled here; and the tokens of resumed
        # requests (ones with output) computed again here rather than pulled or cached.
        self.held: dict[RequestId, HeldKV] = {}
        self._importing: dict[RequestId, KVImport] = {}
        self.num_recomputed_tokens = 0

    # ---- admission and abort -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request. Raises ValueError (CapacityError) if it can never run here."""
        if request.fork_of is not None:
            raise ValueError(f"request {request.request_id}: forks go through add_samples")
        check_admissible(request, self.config, self.requests)
        self._enqueue(request)

    def add_samples(self, requests: list[Request]) -> None:
        """Queues n samples of one prompt: `requests[0]` leads; the others have the same
        prompt and `fork_of` = the leader's id. Each fork waits until the leader's prompt is
        computed, then shares its prompt blocks; if the leader ends first, the fork is admitted
        like any request. All or none are queued; raises ValueError on malformed samples."""
        check_samples(requests)
        leader, forks = requests[0], requests[1:]
        for request in requests:
            check_admissible(request, self.config, self.requests)
        for request in requests:
            self._enqueue(request)
        for fork in forks:
            self._pending_forks[fork.request_id] = leader

    def abort(self, request_id: RequestId) -> RequestEvent | None:
        """Aborts a request. Its blocks are freed now, or right after the step in flight.

        Returns the final event, or None when the request is unknown or already finished,
        or when the abort waits for `update()` (which then returns the event).
        """
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request_id in self._in_flight:
            self._pending_aborts.add(request_id)
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return RequestEvent(request_id, (), request.finish_reason, request.num_prompt_tokens)

    def reset_prefix_cache(self) -> int:
        """Drops every cached block no request holds from the prefix cache (an admin's
        reset, as vLLM's `reset_prefix_cache`): later prompts recompute that KV. Blocks that
        running requests hold stay theirs and stay cached (`stats().num_cached_blocks` after
        the call counts them); nothing in flight changes. Returns the blocks dropped."""
        return self.kv.reset_prefix_cache()

    def invalidate_prefix_cache(self) -> None:
        """Forgets all cached KV, in use or not, e.g. after a failed step left the workers'
        caches unknown."""
        self.kv.invalidate_prefix_cache()

    # ---- the two-call step contract ------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._finished_ids)

    def schedule(self) -> SchedulerOutput:
        """Decides what the next step computes and reserves KV blocks for it.

        Advances each scheduled request's `num_computed_tokens` as if the step succeeds. The
        output's swap and copy lists must be applied by the workers before its forward.
        """
        output = SchedulerOutput(
            step_id=self._next_step_id, append_sampled_tokens=self.config.async_scheduling
        )
        self._next_step_id += 1
        self._preempted_this_step = False
        if self.spec is not None:
            self.spec.plan_step(len(self.running))
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        # Admitting new work right after running out of blocks would only thrash.
        if not self._preempted_this_step:
            self._schedule_waiting(output, budget)
        output.finished_request_ids = self._finished_ids
        self._finished_ids = []
        output.blocks_to_offload = self.kv.take_offloads()
        if self._swap_blocks_to_free:
            self.kv.swap.free(self._swap_blocks_to_free)
            self._swap_blocks_to_free = []
        in_flight = self._in_flight
        requests = self.requests
        for request_id in output.num_scheduled_tokens:
            in_flight[request_id] = in_flight.get(request_id, 0) + 1
            request = requests[request_id]
            if (
                request.num_computed_tokens - len(request.spec_token_ids)
                == request.num_tokens + request.num_pending_tokens
            ):
                request.num_pending_tokens += 1  # this step samples its next token
                if output.append_sampled_tokens:
                    request.num_tokens_on_workers += 1
        return output

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestEvent]:
        """Appends sampled tokens, finishes requests, and returns one event per request touched.

        The step's KV is computed now: full blocks below each scheduled request's
        `num_computed_tokens` enter the prefix cache before anything is freed.
        """
        if result.step_id != output.step_id:
            raise ValueError(f"result of step {result.step_id} given for step {output.step_id}")
        scheduled = output.num_scheduled_tokens
        requests = self.requests
        if self.spec is not None:
            self.spec.observe_step(output, result)
        if self.kv.enable_prefix_caching:
            self._cache_computed_blocks(scheduled)
        events: list[RequestEvent] = []
        any_finished = False
        for request_id, sampled in result.sampled.items():
            if request_id not in scheduled:
                raise ValueError(f"step {output.step_id} sampled unscheduled request {request_id}")
            request = requests.get(request_id)
            if request is None:  # it ended in the step before (async scheduling): a token too many
                continue
            num_drafts = len(request.spec_token_ids)
            accepted = result.spec_sampled.get(request_id, ())
            tokens = (
                sampled,
                *(
                    self.spec.verified(request, sampled, accepted)
                    if self.spec
                    else Speculation.nothing_drafted(request, accepted)
                ),
            )
            output_token_ids = request.output_token_ids
            # The steps in flight after this one have computed their assumed tokens too.
            if request.num_computed_tokens - len(tokens) + 1 != (
                len(request.prompt_token_ids)
                + len(output_token_ids)
                + request.num_pending_tokens
                - 1
            ):
                raise ValueError(f"request {request_id} sampled before its prompt was computed")
            request.num_pending_tokens -= 1
            finish_reason = handoff = None
            for kept, token in enumerate(tokens, 1):
                output_token_ids.append(token.token_id)
                status = stop_status(request)
                if status is not None:  # the tokens after a stop are dropped
                    tokens = tokens[:kept]
                    any_finished = True
                    if (
                        status is RequestStatus.FINISHED_LENGTH
                        and len(output_token_ids) < request.hand_off_below
                    ):
                        handoff = self._hold(request, remove_from_running=False)
                        break
                    self._finish(request, status, remove_from_running=False)
                    finish_reason = request.finish_reason
                    break
            events.append(
                RequestEvent(
                    request_id,
                    tokens,
                    finish_reason,
                    len(request.prompt_token_ids),
                    num_draft_tokens=num_drafts,
                    num_accepted_tokens=len(tokens) - 1 if num_drafts else 0,
                    handoff=handoff,
                )
            )
        if result.draft_token_ids and self.spec is not None:  # a draft model's
            self.spec.offer({r: d for r, d in result.draft_token_ids.items() if r in requests})
        if result.pooled:
            events += self._pooled(output, result.pooled)
            any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        events += self._step_returned(scheduled)
        return events

    def _cache_computed_blocks(self, scheduled: dict[RequestId, int]) -> None:
        """The step's KV enters the prefix cache: each scheduled request's full blocks below
        its `num_computed_tokens`, less its drafts and the tokens of steps still in flight."""
        requests = self.requests
        cache_computed_blocks = self.kv.cache_computed_blocks
        for request_id in scheduled:
            request = requests.get(request_id)  # aborts wait; a stop while in flight doesn't
            if request is not None:  # less the token a step still in flight computes
                cache_computed_blocks(
                    request,
                    request.num_computed_tokens
                    - len(request.spec_token_ids)
                    - max(request.num_pending_tokens - 1, 0),
                )

    def _step_returned(self, scheduled: dict[RequestId, int]) -> list[RequestEvent]:
        """The step's requests are out of flight: the aborts that waited for it happen now.
        Returns their final events."""
        events: list[RequestEvent] = []
        in_flight = self._in_flight
        for request_id in scheduled:
            if in_flight[request_id] == 1:
                del in_flight[request_id]
            else:
                in_flight[request_id] -= 1
        for request_id in [r for r in self._pending_aborts if r not in in_flight]:
            self._pending_aborts.discard(request_id)
            event = self.abort(request_id)
            if event is not None:
                events.append(event)
        return events

    def _pooled(
        self, output: SchedulerOutput, pooled: dict[RequestId, bytes]
    ) -> list[RequestEvent]:
        """Embedding requests whose prompt the step completed: each ends with its vector."""
        events = []
        for request_id, embedding in pooled.items():
            if request_id not in output.num_scheduled_tokens:
                raise ValueError(f"step {output.step_id} pooled unscheduled request {request_id}")
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.pooling is None or request.num_computed_tokens != request.num_tokens:
                raise ValueError(f"request {request_id} pooled before its prompt was computed")
            request.num_pending_tokens -= 1
            self._finish(request, RequestStatus.FINISHED_STOPPED, remove_from_running=False)
            events.append(
                RequestEvent(
                    request_id, (), request.finish_reason, request.num_prompt_tokens, embedding
                )
            )
        return events

    def stats(self) -> SchedulerStats:
        kv = self.kv
        queries = kv.prefix_cache_queries
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=kv.pool.num_free_blocks,
            num_blocks=kv.pool.num_blocks,
            num_preemptions=self.num_preemptions,
            num_swap_outs=self.num_swap_outs,
            num_swap_ins=self.num_swap_ins,
            num_swapped=sum(r.status is RequestStatus.SWAPPED for r in self.requests.values()),
            num_free_swap_blocks=kv.swap.num_free_blocks,
            num_cached_blocks=kv.pool.num_cached_blocks,
            prefix_cache_queries=queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_hit_rate=kv.prefix_cache_hits / queries if queries else 0.0,
            num_drafts=self.spec.num_drafts if self.spec else 0,
            num_draft_tokens=self.spec.num_draft_tokens if self.spec else 0,
            num_accepted_tokens=self.spec.num_accepted_tokens if self.spec else 0,
            num_recomputed_tokens=self.num_recomputed_tokens,
        )

    # ---- finishing -----------------------------------------------------------------------

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.register(request)
        self.waiting.push(request)

    def _finish(
        self, request: Request, status: RequestStatus, remove_from_running: bool = True
    ) -> None:
        """Ends a request and frees all it holds; `update()` prunes `running` once instead."""
        if request.status is _RUNNING:
            if remove_from_running:
                self.running.remove(request)
        else:
            self.waiting.discard(request.request_id)
        request.status = status
        if self.spec is not None:
            self.spec.finished(request)
        self.kv.forget(request)
        self._importing.pop(request.request_id, None)
        self._pending_forks.pop(request.request_id, None)
        self._forget_on_workers(request.request_id)
        self.waiting.unregister(request.request_id)
        del self.requests[request.request_id]

    def _forget_on_workers(self, request_id: RequestId) -> None:
        if request_id in self._on_workers:
            self._on_workers.discard(request_id)
            self._finished_ids.append(request_id)
