"""The offline `LLM`'s engine core: the scheduler service's own `EngineLoop`, over an
`Executor`, on an asyncio loop in one background thread.

The loop is the one the scheduler service, bench/inprocess.py and the tests run; only its
executor differs: `InprocExecutor` (a model runner in this process) for one rank,
`LocalWorkersExecutor` (offline/local_workers.py) for tensor or pipeline
parallelism. The calling thread submits requests and waits for its sink
(offline/batch.py); the sink's `deliver` runs on the engine thread, between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.types import Request
from scheduler_svc.engine_loop import EngineLoop, RequestSink
from scheduler_svc.executor import Executor

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineClosed(RuntimeError):
    """The engine was closed, or its loop stopped after an error."""


class EngineCore:
    """`EngineLoop(scheduler, executor)` running in a daemon thread until `close()`.

    `max_steps_in_flight`: 1, or the pipeline stages (each has a step then). Closing closes
    the executor (its worker processes, if any)."""

    def __init__(
        self, scheduler: Scheduler, executor: Executor, max_steps_in_flight: int = 1
    ) -> None:
        self._executor = executor
        self._loop = asyncio.new_event_loop()
        self._stopped: asyncio.Event | None = None
        self._failure: str | None = None
        self.engine_loop: EngineLoop | None = None
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(scheduler, max_steps_in_flight, started),
            name="pagemesh-engine",
            daemon=True,
        )
        self._thread.start()
        started.wait()

    def _run(
        self, scheduler: Scheduler, max_steps_in_flight: int, started: threading.Event
    ) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main(scheduler, max_steps_in_flight, started))
        finally:
            self._loop.close()

    async def _main(
        self, scheduler: Scheduler, max_steps_in_flight: int, started: threading.Event
    ) -> None:
        # Built on this loop: its events belong to it.
        self.engine_loop = EngineLoop(scheduler, self._executor, max_steps_in_flight)
        self._stopped = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self.engine_loop.run())
        task.add_done_callback(self._on_loop_end)
        started.set()
        await self._stopped.wait()
        # The loop's task, and the steps it had in flight: nothing is left pending.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for pending in tasks:
            pending.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._executor.close()

    def _on_loop_end(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self._failure = f"the engine loop stopped: {exc!r}"
        logger.error("%s", self._failure, exc_info=exc)
        assert self.engine_loop is not None
        self.engine_loop.fail_all(self._failure)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the engine thread, between steps; its result or its exception."""
        if self._failure is not None or not self._thread.is_alive():
            raise EngineClosed(self._failure or "the LLM was closed")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller's thread
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future.result()

    def submit(self, prompts: list[list[Request]], sink: RequestSink) -> None:
        """Admits every prompt's core requests (each prompt's samples) at once, between two
        steps, so that the first step can batch them all. Raises ValueError, having admitted
        none, when one can never run here (the KV cache cannot hold it)."""

        def submit_all() -> None:
            loop = self.engine_loop
            assert loop is not None
            admitted: list[Request] = []
            try:
                for requests in prompts:
                    loop.submit(requests, sink)
                    admitted += requests
            except ValueError:
                for request in admitted:
                    loop.abort(request.request_id)
                raise

        self.call(submit_all)

    def abort(self, request_ids: list[str]) -> None:
        def abort_all() -> None:
            assert self.engine_loop is not None
            for request_id in request_ids:
                self.engine_loop.abort(request_id)

        with contextlib.suppress(EngineClosed):
            self.call(abort_all)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops the loop and closes the executor; idempotent."""
        if self._thread.is_alive() and self._stopped is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout_s)
