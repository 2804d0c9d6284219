"""The step loop: schedule, run the step on the workers, update, stream tokens out — and,
when a worker dies, re-form the engine group and carry every request over to it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from pagemesh.runtime.registry_entries import GroupStatus
from protos.step import ModelRunnerOutput, RequestId, SchedulerOutput
from scheduler_svc.core.host_tier import HostTierIndex
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.types import Request, RequestEvent, RequestStatus
from scheduler_svc.engine_group import EngineGroup, FormedGroup, host_tier_for
from scheduler_svc.executor import Executor
from scheduler_svc.messages import KVHandoffRef, KVImportJob, TierSource
from scheduler_svc.step_watchdog import StepWatchdog, WatchdogConfig
from scheduler_svc.tracing import RequestTracing
from scheduler_svc.worker_client import WorkerGroupClient

logger = logging.getLogger(__name__)

MAX_RECOVERIES_WITHOUT_PROGRESS = 3


class StepHung(Exception):
    """A member of the group stopped answering while a step ran (frozen or cut off), or a
    recovery was asked for while the step waited: the step is given up."""


class StepFailed(Exception):
    """The request cannot continue here (no engine group could be re-formed in time, or the
    scheduler is draining); the router resumes it elsewhere."""


class RequestSink(Protocol):
    """Where a request's events go: a Submit call's queue, or a router's Connect stream
    (which turns each step's events of all its requests into one message)."""

    def deliver(self, events: list[RequestEvent]) -> None:
        """One step's events of this sink's requests, in the core's order."""

    def fail(self, request_id: RequestId, message: str) -> None:
        """The request cannot go on here (the router resumes it elsewhere); no event follows."""


class QueueSink:
    """A sink for one Submit call: each step's events (a list), or a StepFailed, on a queue."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[RequestEvent] | StepFailed] = asyncio.Queue()

    def deliver(self, events: list[RequestEvent]) -> None:
        self.queue.put_nowait(events)

    def fail(self, request_id: RequestId, message: str) -> None:
        self.queue.put_nowait(StepFailed(message))


class EngineLoop:
    """Owns the scheduler core on the event loop; one step at a time.

    Each submitted request names a `RequestSink` that receives its `RequestEvent`s, grouped
    per step and sink, or a failure when it cannot go on here. A failed step does not end requests:
    the loop
    marks the group degraded, re-forms it (`group`), rebuilds the core on the new workers
    and re-queues every request with the tokens it already has; their streams just pause.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        workers: Executor,
        max_steps_in_flight: int = 1,
        group: EngineGroup | None = None,
        recovery_timeout_s: float = 300.0,
        watchdog: WatchdogConfig | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.workers = workers
        # One per pipeline stage; async scheduling keeps the next step planned ahead.
        if scheduler.config.async_scheduling:
            max_steps_in_flight = max(max_steps_in_flight, 2)
        self.max_steps_in_flight = max_steps_in_flight
        self.group = group
        self.recovery_timeout_s = recovery_timeout_s
        self.watchdog = StepWatchdog(watchdog)  # when a step in flight is suspect
        self._streams: dict[RequestId, RequestSink] = {}
        self._wakeup = asyncio.Event()
        self.num_steps = 0
        self.last_step_time_ms = 0.0
        self.status = GroupStatus.READY
        self.num_recoveries = 0
        self._recovery_reason: str | None = None
        # Recoveries since the last step that succeeded: a step that fails again and again
        # on fresh workers is not a dead worker but a request the group cannot run.
        self._recoveries_without_progress = 0
        self.on_status: list[Callable[[GroupStatus], Awaitable[None]]] = []
        self.on_step: list[Callable[[], None]] = []
        self.tracing = RequestTracing()  # the requests' spans, fed from every step
        # Called with each non-empty step as it is scheduled, before it is sent (metrics).
        self.on_schedule: list[Callable[[SchedulerOutput], None]] = []
        # A drain's hand-over, once asked for: the loop stops scheduling, lets the steps in
        # flight return, then hands every request off (`hand_off_all`).
        self._hand_off: asyncio.Future[tuple[int, int]] | None = None
        # The host tier's index (core/host_tier.py): it outlives the core, which a
        # re-formation replaces. And who runs imports (KVMoves.pull), set by the service.
        self.tier: HostTierIndex | None = scheduler.kv.tier
        self.importer: Callable[[list[KVImportJob]], None] | None = None
        self.handed_off: set[RequestId] = set()  # the last hand_off_all's holds

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def submit(
        self,
        requests: list[Request],
        sink: RequestSink,
        handoffs: Mapping[RequestId, KVHandoffRef] | None = None,
    ) -> list[KVImportJob]:
        """Admits one request, or n > 1 samples of one prompt (with `fork_of` set, the
        first one leads and the others fork from its computed prompt; resumed samples come
        without). Every sample's events go to `sink`. Raises ValueError when they can never
        be served here. A sample whose KV another group holds (`handoffs`), or whose blocks
        this group's host tier holds, is admitted importing it: returns those, which wait
        for their import (`KVMoves.pull`)."""
        imports: list[KVImportJob] = []
        if any(r.fork_of is not None for r in requests):
            self.scheduler.add_samples(requests)
        else:
            added: list[Request] = []
            try:
                for request in requests:
                    job = self._admit(
                        request, handoffs.get(request.request_id) if handoffs else None
                    )
                    if job is not None:
                        imports.append(job)
                    added.append(request)
            except ValueError:
                for request in added:
                    self.scheduler.abort(request.request_id)
                raise
        for request in requests:
            self._streams[request.request_id] = sink
        self._wakeup.set()
        return imports

    def _admit(self, request: Request, handoff: KVHandoffRef | None) -> KVImportJob | None:
        core = self.scheduler
        if handoff is not None:
            imported = core.add_importing(request, handoff.num_tokens)
            return KVImportJob(request, imported, handoff) if imported else None
        tier_hits = core.tier_hits(request)
        if not tier_hits:
            core.add_request(request)
            return None
        num_device_blocks = len(core.kv.get_computed_blocks(request))
        imported = core.add_importing(
            request, (num_device_blocks + len(tier_hits)) * core.config.block_size
        )
        if imported is None:
            return None
        slots, keys = zip(*tier_hits[: len(imported.block_ids)])
        return KVImportJob(request, imported, TierSource(tuple(slots), tuple(keys)))

    def wake(self) -> None:
        """Something became runnable outside a step (an import finished)."""
        self._wakeup.set()

    async def hand_off_all(self) -> tuple[int, int]:
        """Hands every request over to other groups (a drain): once no step is in flight,
        each running one ends here with its KV held for the group that continues it; the
        others (waiting, preempted, importing) fail here, for their router to resume them
        elsewhere by recomputing. Returns (handed off with KV, without)."""
        if self._hand_off is None:
            self._hand_off = asyncio.get_running_loop().create_future()
            self._wakeup.set()
        return await asyncio.shield(self._hand_off)

    def _hand_off_now(self) -> None:
        """Every hold first, then the failures: a request whose samples end both ways gets
        its handoffs out before its stream fails."""
        assert self._hand_off is not None
        streams, self._streams = self._streams, {}
        failed: list[tuple[RequestId, RequestSink]] = []
        for request_id, sink in streams.items():
            request = self.scheduler.requests.get(request_id)
            held = self.scheduler.hand_off(request_id)
            if held is None or request is None:
                failed.append((request_id, sink))
                continue
            sink.deliver(
                [RequestEvent(request_id, (), None, request.num_prompt_tokens, handoff=held)]
            )
        for request_id, sink in failed:
            self.scheduler.abort(request_id)
            sink.fail(request_id, "this group is draining: resume on another group")
        self.handed_off = {rid for rid in streams if rid in self.scheduler.held}
        if not self._hand_off.done():
            self._hand_off.set_result((len(streams) - len(failed), len(failed)))
        self._hand_off = None

    def abort(self, request_id: RequestId) -> None:
        """Aborts a request whose client went away; its blocks are freed before the next step."""
        self._streams.pop(request_id, None)
        self.scheduler.abort(request_id)
        self._wakeup.set()

    def supersede(self, request_ids: list[RequestId]) -> bool:
        """A resumed Submit for requests still live here (their router died, the new one
        resumed before this one noticed): the old streams end and the requests are aborted.
        Returns False while an abort waits for the step in flight."""
        for request_id in request_ids:
            sink = self._streams.pop(request_id, None)
            if sink is not None:
                sink.fail(request_id, "superseded by a resumed stream of this request")
            self.scheduler.abort(request_id)
        self._wakeup.set()
        return not any(r in self.scheduler.requests for r in request_ids)

    def request_recovery(self, reason: str) -> None:
        """A member was found dead between steps: re-form before the next one."""
        if self._recovery_reason is None:
            self._recovery_reason = reason
            self._wakeup.set()

    def fail_all(self, message: str) -> None:
        """Fails every request (the router resumes them elsewhere)."""
        streams, self._streams = self._streams, {}
        for request_id, sink in streams.items():
            self.scheduler.abort(request_id)
            sink.fail(request_id, message)

    async def set_status(self, status: GroupStatus) -> None:
        if status != self.status:
            logger.warning("engine group status: %s -> %s", self.status, status)
            self.status = status
            for hook in self.on_status:
                await hook(status)

    async def run(self) -> None:
        """Schedules up to `max_steps_in_flight` steps ahead (pipeline parallelism keeps one
        per stage in flight so no stage idles), then updates with the oldest as it returns."""
        pending: deque[tuple[SchedulerOutput, asyncio.Task[ModelRunnerOutput]]] = deque()
        try:
            while True:
                if self._recovery_reason is not None:
                    self._abandon(pending)
                    await self._recover()
                    continue
                if self._hand_off is not None and not pending:
                    self._hand_off_now()
                    continue
                while (
                    len(pending) < self.max_steps_in_flight
                    and self._hand_off is None
                    and self.scheduler.has_work()
                ):
                    output = self.scheduler.schedule()
                    if output.is_empty:  # e.g. everything runnable is already in flight
                        break
                    for hook in self.on_schedule:
                        hook(output)
                    traceparents = self.tracing.on_scheduled(output, self.scheduler.requests)
                    task = asyncio.create_task(self.workers.execute(output, traceparents))
                    pending.append((output, task))
                if not pending:
                    if self.scheduler.has_work() and self._hand_off is None:
                        await asyncio.sleep(0.001)  # nothing fits right now (just preempted)
                    else:
                        self._wakeup.clear()
                        await self._wakeup.wait()
                    continue
                output, task = pending[0]
                started = time.perf_counter()
                try:
                    result = await self._await_step(output, task)
                except Exception as exc:
                    if self.group is None:
                        self._abandon(pending)
                        self.scheduler.invalidate_prefix_cache()
                        self.fail_all(f"engine group step failed: {exc}")
                        continue
                    self._recovery_reason = f"step {output.step_id} failed: {exc}"
                    continue
                pending.popleft()
                self._recoveries_without_progress = 0
                self.last_step_time_ms = (time.perf_counter() - started) * 1000
                self.num_steps += 1
                self._deliver(self.scheduler.update(output, result))
                for hook in self.on_step:
                    hook()
        finally:
            # Stopped (cancelled): steps not started yet must not start on an executor
            # the caller closes next.
            for _, task in pending:
                task.cancel()

    async def _await_step(
        self, output: SchedulerOutput, task: asyncio.Task[ModelRunnerOutput]
    ) -> ModelRunnerOutput:
        """The step's result, watched (scheduler_svc/step_watchdog.py): once the step is
        suspect, members that do not answer a probe fail it with StepHung; so does a
        recovery asked for meanwhile (a member found dead between two probes)."""
        watchdog = self.watchdog
        started = time.monotonic()
        check_at = started + watchdog.suspect_after_s()
        probes = 0
        while True:
            # Wake at least twice a second: a recovery asked for must not wait for the step.
            timeout = min(max(0.0, check_at - time.monotonic()), 0.5)
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if done:
                watchdog.observe(time.monotonic() - started)
                return task.result()
            if self._recovery_reason is not None:
                raise StepHung(self._recovery_reason)
            if time.monotonic() < check_at:
                continue
            watchdog.num_probes += 1
            probes += 1
            silent = await self.workers.unresponsive(watchdog.config.probe_timeout_s)
            if task.done():
                continue  # it answered meanwhile
            age_s = time.monotonic() - started
            if silent:
                raise StepHung(
                    f"step {output.step_id} ran {age_s:.1f} s and "
                    f"{', '.join(silent)} did not answer a probe within "
                    f"{watchdog.config.probe_timeout_s:g} s"
                )
            if probes == 1:
                watchdog.num_slow_steps += 1
                logger.info(
                    "step %d has run %.1f s (recent p99 %.3f s); every member "
                    "answers, so it is slow, not hung",
                    output.step_id,
                    age_s,
                    watchdog.p99_s() or 0.0,
                )
            check_at = time.monotonic() + watchdog.config.probe_interval_s

    def _deliver(self, events: list[RequestEvent]) -> None:
        """Hands one step's events to their sinks: one call per sink, not per event."""
        self.tracing.on_events(events)
        streams = self._streams
        by_sink: dict[int, tuple[RequestSink, list[RequestEvent]]] = {}
        for event in events:
            sink = streams.get(event.request_id)
            if sink is None:
                continue
            entry = by_sink.get(id(sink))
            if entry is None:
                by_sink[id(sink)] = (sink, [event])
            else:
                entry[1].append(event)
            if event.ends_stream:
                del streams[event.request_id]
        for sink, sink_events in by_sink.values():
            sink.deliver(sink_events)

    def _abandon(self, pending: deque[tuple[SchedulerOutput, asyncio.Task[object]]]) -> None:
        """Drops the steps in flight: no token of theirs is delivered. Their requests keep
        the tokens they had, so nothing is lost or repeated."""
        for output, task in pending:
            task.cancel()
            self._deliver(self.scheduler.update(output, ModelRunnerOutput(step_id=output.step_id)))
        pending.clear()

    async def _recover(self) -> None:
        assert self.group is not None
        logger.error(
            "engine group failed (%s); re-forming it with %d requests in flight",
            self._recovery_reason,
            len(self.scheduler.requests),
        )
        await self.set_status(GroupStatus.DEGRADED)
        started = time.monotonic()
        formed: FormedGroup | None = None
        assert isinstance(self.workers, WorkerGroupClient)  # only a gRPC group re-forms
        previous: WorkerGroupClient | None = self.workers
        while formed is None:
            try:
                formed = await self.group.form(previous, timeout_s=self.recovery_timeout_s)
            except Exception as exc:
                logger.error("could not re-form the engine group: %s", exc)
                if self._streams:
                    self.fail_all(
                        f"engine group down for {time.monotonic() - started:.0f} s: {exc}"
                    )
                await asyncio.sleep(1.0)
            previous = None
        carried = [
            _fresh_copy(r) for r in self.scheduler.requests.values() if not r.status.is_finished
        ]
        self.workers = formed.workers
        self.tier = host_tier_for(formed.infos, self.tier)
        recomputed = self.scheduler.num_recomputed_tokens  # a count across re-formations
        self.scheduler = Scheduler(formed.config, self.tier)
        self.scheduler.num_recomputed_tokens = recomputed
        imports: list[KVImportJob] = []
        for request in carried:
            try:
                job = self._admit(request, None)  # from the host tier when it holds its KV
            except ValueError as exc:  # the new group's cache is smaller than the old one's
                sink = self._streams.pop(request.request_id, None)
                if sink is not None:
                    sink.fail(request.request_id, f"cannot resume on the re-formed group: {exc}")
                continue
            if job is not None:
                imports.append(job)
        if imports and self.importer is not None:
            self.importer(imports)
        self.tracing.on_recovery(self._recovery_reason or "", time.monotonic() - started)
        self._recovery_reason = None
        self.num_recoveries += 1
        self._recoveries_without_progress += 1
        if self._recoveries_without_progress > MAX_RECOVERIES_WITHOUT_PROGRESS:
            logger.error(
                "%d recoveries without one good step: ending the requests in flight",
                self._recoveries_without_progress,
            )
            self.fail_all("the engine group fails every step of these requests")
            self._recoveries_without_progress = 0
        logger.warning(
            "engine group re-formed in %.1f s; %d requests resume from their tokens",
            time.monotonic() - started,
            len(carried),
        )
        await self.set_status(GroupStatus.READY)


def _fresh_copy(request: Request) -> Request:
    """The request as if just admitted with its outputs so far: the new workers hold
    nothing, so its KV is recomputed from prompt + outputs (prefix caching shares blocks).
    What the request is (prompt, sampling, adapter, images, ...) carries over, whatever
    fields it gains; only its progress on the old workers is reset."""
    return dataclasses.replace(
        request,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=list(request.output_token_ids),
        num_computed_tokens=0,
        block_ids=[],
        status=RequestStatus.WAITING,
        num_preemptions=0,
        fork_of=None,
        num_tokens_on_workers=0,
        num_pending_tokens=0,
        spec_token_ids=[],
    )
