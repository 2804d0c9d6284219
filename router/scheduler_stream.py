"""This router's one multiplexed stream to one scheduler process (`Scheduler.Connect`).

Every request the router sends that scheduler travels on it: a submit up the stream, then
its outputs come down inside the scheduler's per-step messages, and leaving early sends an
abort. The reader hands each message to its requests in one pass, without awaiting: every
output of a request goes, converted to a `SampleOutput` (its one conversion), to that
request's `RequestSink.add`, then each sink the message touched gets one `flush` — so a
request's own task wakes once per step, not per token.
A request failing in-band gets `fail` with the `grpc.aio.AioRpcError` a `Submit` call would
have raised; a broken stream fails every request on it the same way (the caller resumes them
all, router/resume.py). The next submit after a break opens a new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from router import convert
from router.types import SampleOutput

logger = logging.getLogger(__name__)

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a `Submit` call would have raised with this status."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class RequestSink(Protocol):
    """Where one request's outputs go. Called from the stream's reader: never awaits."""

    def add(self, output: SampleOutput) -> None:
        """One output of one of the request's samples, in the order the scheduler sent them."""

    def flush(self) -> None:
        """The end of a step's message that carried outputs of this request."""

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        """The request failed on this stream; nothing more comes for it here."""

    def hand_over(self) -> None:
        """Every sample that did not finish here was handed off with its KV (a prefill
        group's, or a draining one's): nothing more comes for it here."""


@dataclass(eq=False)
class OpenRequest:
    """One request submitted on one stream (a resume on the same scheduler is a new one)."""

    request_id: str
    sink: RequestSink
    session: _Session
    num_unfinished: int  # samples the scheduler has still to finish (or hand off)
    handed_off: bool = False  # a sample ended here with its KV handed off


@dataclass
class _Session:
    """One Connect call: its queue of messages up, and the requests streaming on it."""

    up: asyncio.Queue[scheduler_pb2.ConnectRequest | None] = field(default_factory=asyncio.Queue)
    requests: dict[str, OpenRequest] = field(default_factory=dict)
    call: grpc.aio.StreamStreamCall | None = None
    reader: asyncio.Task[None] | None = None
    broken: bool = False


class SchedulerStream:
    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, name: str = "") -> None:
        self._stub = stub
        self._name = name
        self._session: _Session | None = None

    @property
    def num_requests(self) -> int:
        return len(self._session.requests) if self._session is not None else 0

    def submit(
        self,
        request: scheduler_pb2.SubmitRequest,
        sink: RequestSink,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> OpenRequest:
        """Sends `request` (its trace context from `metadata`, as a Submit call's); its outputs
        go to `sink` until every sample finished or it failed. Raises ALREADY_EXISTS when the
        id is streaming on this stream already. `release` the result once done with it."""
        session = self._open()
        request_id = request.request_id
        if request_id in session.requests:
            raise rpc_error(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {request_id!r} is already streaming from this scheduler",
            )
        if metadata:
            request.trace_context.update(dict(metadata))
        num_unfinished = max(request.n, 1) - sum(p.finished for p in request.progress)
        opened = OpenRequest(request_id, sink, session, num_unfinished)
        session.requests[request_id] = opened
        session.up.put_nowait(scheduler_pb2.ConnectRequest(submit=request))
        return opened

    def release(self, opened: OpenRequest) -> None:
        """The caller is done with the request: aborted when its scheduler still runs it."""
        session = opened.session
        if session.requests.get(opened.request_id) is opened:
            del session.requests[opened.request_id]
            if not session.broken:
                session.up.put_nowait(
                    scheduler_pb2.ConnectRequest(
                        abort=scheduler_pb2.AbortRequest(request_id=opened.request_id)
                    )
                )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.up.put_nowait(None)
            if session.call is not None:
                session.call.cancel()
            if session.reader is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await session.reader

    def _open(self) -> _Session:
        session = self._session
        if session is None or session.broken:
            session = _Session()
            session.call = self._stub.Connect(_messages_up(session.up))
            session.reader = asyncio.get_running_loop().create_task(self._read(session))
            self._session = session
        return session

    async def _read(self, session: _Session) -> None:
        """Hands each step's message to its requests; a broken stream fails them all."""
        assert session.call is not None
        requests = session.requests
        try:
            async for message in session.call:
                _dispatch(message, requests)
            failure = rpc_error(
                grpc.StatusCode.UNAVAILABLE,
                f"the scheduler {self._name} ended this router's stream",
            )
        except grpc.aio.AioRpcError as exc:
            failure = exc
        except asyncio.CancelledError:
            failure = rpc_error(grpc.StatusCode.CANCELLED, "the router closed its stream")
            raise
        except Exception as exc:  # a channel closed under it, a malformed message
            logger.exception("stream to scheduler %s failed", self._name)
            failure = rpc_error(grpc.StatusCode.UNKNOWN, f"stream to {self._name} failed: {exc}")
        finally:
            session.broken = True
            session.up.put_nowait(None)
            if requests:
                logger.warning(
                    "stream to scheduler %s ended (%s); %d requests on it fail over",
                    self._name,
                    failure.details(),
                    len(requests),
                )
            failed = list(requests.values())
            requests.clear()
            for opened in failed:
                opened.sink.fail(failure)


def _dispatch(message: scheduler_pb2.ConnectResponse, requests: dict[str, OpenRequest]) -> None:
    """One step's message, in one pass: outputs to their sinks (each converted once, here, as
    it enters the router), one flush per sink touched, then the in-band errors. A request
    whose samples all ended (finished, or handed off with their KV) leaves `requests` here;
    one that handed a sample off is handed over (its sink resumes it on another group)."""
    touched: dict[str, RequestSink] = {}
    handed_over: list[RequestSink] = []
    for message_output in message.outputs:
        request_id = message_output.request_id
        opened = requests.get(request_id)
        if opened is None:
            continue  # aborted by the router meanwhile
        output = convert.sample_output(message_output)
        if output.finish_reason is not None or output.kv_handoff is not None:
            opened.num_unfinished -= 1
            opened.handed_off = opened.handed_off or output.kv_handoff is not None
            if opened.num_unfinished <= 0:
                del requests[request_id]
                if opened.handed_off:
                    handed_over.append(opened.sink)
        touched[request_id] = opened.sink
        opened.sink.add(output)
    for sink in touched.values():
        sink.flush()
    for sink in handed_over:
        sink.hand_over()
    for error in message.errors:
        opened = requests.pop(error.request_id, None)
        if opened is not None:
            code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
            opened.sink.fail(rpc_error(code, error.message))


async def _messages_up(
    queue: asyncio.Queue[scheduler_pb2.ConnectRequest | None],
) -> AsyncIterator[scheduler_pb2.ConnectRequest]:
    while (message := await queue.get()) is not None:
        yield message
