"""The step loop: schedule, run the step on the workers, update, stream tokens out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from protos.pagemesh.worker.v1 import worker_pb2
from scheduler_svc import convert
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.types import Request, RequestEvent, RequestId, SchedulerOutput, StepResult
from scheduler_svc.worker_client import WorkerGroupClient

logger = logging.getLogger(__name__)


class StepFailed(Exception):
    """The engine group could not run a step; the request cannot continue here."""


class EngineLoop:
    """Owns the scheduler core on the event loop; one step at a time.

    Each submitted request gets a queue that receives its `RequestEvent`s, or a
    `StepFailed` when the workers fail.
    """

    def __init__(self, scheduler: Scheduler, workers: WorkerGroupClient,
                 max_steps_in_flight: int = 1) -> None:
        self.scheduler = scheduler
        self.workers = workers
        self.max_steps_in_flight = max_steps_in_flight
        self._streams: dict[RequestId, asyncio.Queue[RequestEvent | StepFailed]] = {}
        self._wakeup = asyncio.Event()
        self.num_steps = 0
        self.last_step_time_ms = 0.0

    def submit(self, requests: list[Request]) -> asyncio.Queue[RequestEvent | StepFailed]:
        """Admits one request, or n > 1 samples of one prompt (the first one leads, the
        others fork from its computed prompt). Every sample's events arrive on the one
        queue returned. Raises ValueError when they can never be served here."""
        if len(requests) == 1:
            self.scheduler.add_request(requests[0])
        else:
            self.scheduler.add_request_group(requests)
        queue: asyncio.Queue[RequestEvent | StepFailed] = asyncio.Queue()
        for request in requests:
            self._streams[request.request_id] = queue
        self._wakeup.set()
        return queue

    def abort(self, request_id: RequestId) -> None:
        """Aborts a request whose client went away; its blocks are freed before the next step."""
        self._streams.pop(request_id, None)
        self.scheduler.abort(request_id)
        self._wakeup.set()

    async def run(self) -> None:
        """Schedules up to `max_steps_in_flight` steps ahead (pipeline parallelism keeps one
        per stage in flight so no stage idles), then updates with the oldest as it returns."""
        pending: deque[tuple[SchedulerOutput, asyncio.Task[worker_pb2.ExecuteStepResponse]]] = deque()
        while True:
            while len(pending) < self.max_steps_in_flight and self.scheduler.has_work():
                output = self.scheduler.schedule()
                if output.is_empty:  # e.g. everything runnable is already in flight
                    break
                task = asyncio.create_task(self.workers.execute_step(convert.step_to_pb(output)))
                pending.append((output, task))
            if not pending:
                if self.scheduler.has_work():
                    await asyncio.sleep(0.001)  # nothing fits right now (just preempted)
                else:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                continue
            output, task = pending.popleft()
            started = time.perf_counter()
            try:
                response = await task
            except Exception as exc:
                self._fail_all([output, *(o for o, _ in pending)], [t for _, t in pending], exc)
                pending.clear()
                continue
            self.last_step_time_ms = (time.perf_counter() - started) * 1000
            self.num_steps += 1
            self._deliver(self.scheduler.update(output, convert.step_result_from_pb(response)))

    def _deliver(self, events: list[RequestEvent]) -> None:
        for event in events:
            queue = self._streams.get(event.request_id)
            if queue is None:
                continue
            queue.put_nowait(event)
            if event.finish_reason is not None:
                del self._streams[event.request_id]

    def _fail_all(self, outputs: list[SchedulerOutput], later: list[asyncio.Task[object]],
                  exc: Exception) -> None:
        """A failed step leaves the workers' state unknown: end every request with an error."""
        logger.error("step failed, ending %d requests: %s", len(self._streams), exc)
        for task in later:
            task.cancel()
        for output in outputs:
            self.scheduler.update(output, StepResult(step_id=output.step_id))
        # update() cached the failed step's blocks, whose KV may never have been written.
        self.scheduler.reset_prefix_cache()
        for request_id, queue in list(self._streams.items()):
            self.scheduler.abort(request_id)
            queue.put_nowait(StepFailed(f"engine group step failed: {exc}"))
        self._streams.clear()

