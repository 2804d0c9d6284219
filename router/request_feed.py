"""One request's outputs on their way from the stream's reader to the request's own task.

`RequestFeed` is the `RequestSink` of a request for all its attempts (router/resume.py): in
the reader's pass over a step's message it records each output in `Progress`, clears the
retry state on progress, and runs the caller's `process` on it (detokenizing, stop strings,
building the client's message); what `process` returns is batched and handed over once per
step. The request's task awaits `next_batch`: a list of results, or the attempt's failure
raised, or None once every sample finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Generic, TypeVar

import grpc

from router.resume import Attempts, Progress
from router.types import SampleOutput

T = TypeVar("T")
_END = object()
_HANDED_OVER = object()


class HandedOver(Exception):
    """The attempt's group handed every unfinished sample off with its KV: continue the
    request on another group (not a failure)."""


class _Failed(Exception):
    """Stands in for a processing error already handed over."""


_FAILED = _Failed()


class RequestFeed(Generic[T]):
    """`process(output)` returns what to hand over for that output, or None for nothing.
    It runs inside the reader's pass: it must not await, and an exception it raises fails
    this request alone (raised from `next_batch`), never the stream."""

    def __init__(
        self, progress: Progress, attempts: Attempts, process: Callable[[SampleOutput], T | None]
    ) -> None:
        self.progress = progress
        self.attempts = attempts
        self.process = process
        self.on_progress: Callable[[], None] | None = None  # the attempt's group: not suspect
        self.source_address = ""  # the attempt's group's scheduler: where a handoff waits
        self._batch: list[T] = []
        self._queue: asyncio.Queue[list[T] | BaseException | object] = asyncio.Queue()
        self._error: BaseException | None = None

    def add(self, output: SampleOutput) -> None:
        if self._error is not None:
            return
        finished = output.finish_reason is not None
        self.progress.record(output.index, output.token_ids, finished, output.logprobs)
        if output.token_ids or finished:
            self.attempts.progressed()
            if self.on_progress is not None:
                self.on_progress()
        if output.kv_handoff is not None:
            self.progress.samples[output.index].kv_handoff = dataclasses.replace(
                output.kv_handoff, scheduler_address=self.source_address
            )
            if not output.token_ids:
                return  # nothing for the client in it
        try:
            result = self.process(output)
        except Exception as exc:  # a bug in this request's processing: it fails alone
            self._error = exc
            return
        if result is not None:
            self._batch.append(result)

    def flush(self) -> None:
        if self._batch:
            self._queue.put_nowait(self._batch)
            self._batch = []
        if self._error is not None and self._error is not _FAILED:
            self._queue.put_nowait(self._error)
            self._error = _FAILED  # raised once; later outputs are dropped
        elif self._error is None and self.progress.all_finished:
            self._queue.put_nowait(_END)

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        self.flush()
        self._queue.put_nowait(error)

    def hand_over(self) -> None:
        self._queue.put_nowait(_HANDED_OVER)

    async def next_batch(self) -> list[T] | None:
        """The next step's results; None once every sample finished. Raises the current
        attempt's failure (an `AioRpcError`), or the exception `process` raised."""
        item = await self._queue.get()
        if item is _END:
            return None
        if item is _HANDED_OVER:
            raise HandedOver()
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[return-value]
