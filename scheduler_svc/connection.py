"""A router's multiplexed stream (`Connect`): every request of that router on one call.

Up the stream come submits and aborts; down it goes, per step, one `ConnectResponse` with
every new token of the router's requests — the cost of this hop grows with steps, not with
tokens × requests. The connection is the engine loop's sink for all of them: `deliver`
puts a step's events in an outbox, and the writer (the servicer's generator) sends
whatever the outbox holds as one message, so a router that reads slowly gets several steps
merged into one message rather than a queue of them. Both ways it sees plain messages
(`messages.py`); the servicer converts.

Failures: a malformed or refused submit is an in-band `RequestError` for that request
alone. A router that stops reading stops the writer (gRPC flow control); once more than
`max_buffered_tokens` wait in the outbox, the connection is cut off: every request on it
is aborted (their checkpoints stay, for a resume), the outbox is dropped and later submits
are ignored, so the scheduler's memory stays bounded; once the router reads what gRPC
already holds for it, the stream ends RESOURCE_EXHAUSTED. The stream ending for any reason aborts
every
request still on it, as a cancelled Submit does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from pagemesh.runtime.serving import ServiceError
from protos.step import RequestId
from scheduler_svc.core.types import RequestEvent
from scheduler_svc.messages import (
    Abort,
    ConnectAction,
    ConnectBatch,
    InvalidSubmit,
    RequestError,
    SampleOutput,
    Submission,
)
from scheduler_svc.request_streams import OpenRequest, RequestStreams

logger = logging.getLogger(__name__)

DEFAULT_MAX_BUFFERED_TOKENS = 1 << 20


class ConnectionCutOff(Exception):
    """The router read nothing while `max_buffered_tokens` piled up for it."""


class RouterConnection:
    def __init__(
        self, streams: RequestStreams, max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS
    ) -> None:
        self.streams = streams
        self.max_buffered_tokens = max_buffered_tokens
        self._open: dict[str, OpenRequest] = {}  # router request id -> its stream
        self._by_core_id: dict[RequestId, OpenRequest] = {}
        self._outputs: list[SampleOutput] = []
        self._errors: list[RequestError] = []
        self._finishing: list[OpenRequest] = []  # checkpoints to finish before the next send
        self._num_buffered_tokens = 0
        self._ready = asyncio.Event()
        self._reading_done = False
        self.cut_off: str | None = None

    @property
    def num_open(self) -> int:
        return len(self._open)

    # ---- up the stream ------------------------------------------------------------------

    async def read(self, actions: AsyncIterator[ConnectAction]) -> None:
        """Applies the router's submits and aborts until it closes its side."""
        try:
            async for action in actions:
                if isinstance(action, Abort):
                    self.abort(action.request_id)
                elif action is not None:
                    self.submit(action)
                else:
                    logger.warning("a ConnectRequest with no action; ignored")
        finally:
            self._reading_done = True
            self._ready.set()

    def submit(self, submission: Submission | InvalidSubmit) -> None:
        if self.cut_off is not None:  # nothing more is buffered for a router that never reads
            return
        request_id = submission.request_id
        if request_id in self._open:
            self._error(
                request_id,
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {request_id!r} is already streaming on this "
                "connection; abort it first or use another id",
            )
            return
        if isinstance(submission, InvalidSubmit):
            self._error(request_id, grpc.StatusCode.INVALID_ARGUMENT, submission.message)
            return
        try:
            opened = self.streams.admit(submission, self, traced_from_message=True)
        except ServiceError as exc:
            self._error(request_id, exc.code, exc.message)
            return
        self._outputs.extend(
            (request_id, index, event, opened.with_logprobs) for index, event in opened.ended
        )
        if opened.finished:
            self._finishing.append(opened)
            self.streams.close(opened)
        else:
            self._open[opened.request_id] = opened
            for core_id in opened.unfinished:
                self._by_core_id[core_id] = opened
        self._ready.set()

    def abort(self, request_id: str) -> None:
        opened = self._open.pop(request_id, None)
        if opened is not None:
            self._forget(opened)
            self.streams.close(opened)

    # ---- the engine loop's sink ---------------------------------------------------------

    def deliver(self, events: list[RequestEvent]) -> None:
        record, outputs = self.streams.record, self._outputs
        num_tokens = 0
        for event in events:
            opened = self._by_core_id.get(event.request_id)
            if opened is None:
                continue
            outputs.append((opened.request_id, record(opened, event), event, opened.with_logprobs))
            num_tokens += len(event.new_tokens)
            if event.ends_stream:
                del self._by_core_id[event.request_id]
                if opened.finished:
                    del self._open[opened.request_id]
                    self._finishing.append(opened)
                    self.streams.close(opened)
        self._num_buffered_tokens += num_tokens
        if self._num_buffered_tokens > self.max_buffered_tokens and self.cut_off is None:
            self._cut_off()
        self._ready.set()

    def fail(self, request_id: RequestId, message: str) -> None:
        opened = self._by_core_id.get(request_id)
        if opened is None:
            return
        del self._open[opened.request_id]
        self._forget(opened)
        self.streams.failed(opened, message)
        self.streams.close(opened)
        self._error(opened.request_id, grpc.StatusCode.UNAVAILABLE, message)

    # ---- down the stream ----------------------------------------------------------------

    async def next_message(self) -> ConnectBatch | None:
        """Everything the outbox holds, as one message, once something is there (and the
        checkpoints of requests it ends are written); None once the router closed its side
        and nothing is left to send. Raises ConnectionCutOff when cut off."""
        while True:
            if self.cut_off is not None:
                raise ConnectionCutOff(self.cut_off)
            if self._outputs or self._errors:
                break
            if self._reading_done and not self._open:
                return None
            self._ready.clear()
            await self._ready.wait()
        if self._finishing:
            finishing, self._finishing = self._finishing, []
            await self.streams.finish(finishing)
        message = ConnectBatch(self._outputs, self._errors)
        self._outputs, self._errors = [], []
        self._num_buffered_tokens = 0
        return message

    def close(self) -> None:
        """The stream ended: every request still on it is aborted (checkpoints kept)."""
        for opened in list(self._open.values()):
            self.streams.close(opened)
        self._open.clear()
        self._by_core_id.clear()
        self._outputs, self._errors, self._finishing = [], [], []

    def _error(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self._errors.append(RequestError(request_id, code, message))
        self._ready.set()

    def _forget(self, opened: OpenRequest) -> None:
        for core_id in opened.unfinished:
            self._by_core_id.pop(core_id, None)

    def _cut_off(self) -> None:
        self.cut_off = (
            f"the router read none of the last {self._num_buffered_tokens} tokens "
            f"sent to it (over --max-buffered-tokens {self.max_buffered_tokens}); "
            "its stream is cut off and its requests aborted"
        )
        logger.error("%s", self.cut_off)
        self.close()
        self._ready.set()
