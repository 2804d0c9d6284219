"""This router's one multiplexed stream to one scheduler process (`Scheduler.Connect`).

Every request the router sends that scheduler travels on it: a submit up the stream, then
its outputs come down inside the scheduler's per-step messages, and leaving early sends an
abort. To its caller `submit` looks exactly like a `Submit` call: an async iterator of the
request's `SubmitResponse`s that ends once every sample finished, or raises the
`grpc.aio.AioRpcError` the request failed with — in-band for that request alone, or the
stream's own error for every request on it when the stream breaks (the caller resumes them
all, router/resume.py). The next submit after a break opens a new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
_UNSPECIFIED = 0  # FINISH_REASON_UNSPECIFIED


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a `Submit` call would have raised with this status."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@dataclass
class _Session:
    """One Connect call: its queue of messages up, and the requests streaming on it."""

    up: asyncio.Queue[scheduler_pb2.ConnectRequest | None] = field(default_factory=asyncio.Queue)
    requests: dict[str, asyncio.Queue[scheduler_pb2.SubmitResponse | BaseException]] = \
        field(default_factory=dict)
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

    async def submit(self, request: scheduler_pb2.SubmitRequest,
                     metadata: tuple[tuple[str, str], ...] | None = None
                     ) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        """The request's responses, as a Submit call with `metadata` would stream them."""
        session = self._open()
        request_id = request.request_id
        if request_id in session.requests:
            raise rpc_error(grpc.StatusCode.ALREADY_EXISTS,
                            f"request {request_id!r} is already streaming from this scheduler")
        if metadata:
            request.trace_context.update(dict(metadata))
        num_samples = max(request.n, 1) - sum(p.finished for p in request.progress)
        queue: asyncio.Queue[scheduler_pb2.SubmitResponse | BaseException] = asyncio.Queue()
        session.requests[request_id] = queue
        session.up.put_nowait(scheduler_pb2.ConnectRequest(submit=request))
        finished: set[int] = set()
        try:
            while len(finished) < num_samples:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason != _UNSPECIFIED:
                    finished.add(item.index)
                yield item
        finally:
            if session.requests.pop(request_id, None) is not None and len(finished) < num_samples \
                    and not session.broken:
                session.up.put_nowait(scheduler_pb2.ConnectRequest(
                    abort=scheduler_pb2.AbortRequest(request_id=request_id)))

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
        """Fans each step's message out to its requests; a broken stream fails them all."""
        assert session.call is not None
        requests = session.requests
        try:
            async for message in session.call:
                for output in message.outputs:
                    queue = requests.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                for error in message.errors:
                    queue = requests.pop(error.request_id, None)
                    if queue is not None:
                        code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
                        queue.put_nowait(rpc_error(code, error.message))
            failure = rpc_error(grpc.StatusCode.UNAVAILABLE,
                                f"the scheduler {self._name} ended this router's stream")
        except grpc.aio.AioRpcError as exc:
            failure = exc
        except asyncio.CancelledError:
            failure = rpc_error(grpc.StatusCode.CANCELLED, "the router closed its stream")
            raise
        except Exception as exc:  # a channel closed under it, a malformed message
            failure = rpc_error(grpc.StatusCode.UNKNOWN, f"stream to {self._name} failed: {exc}")
        finally:
            session.broken = True
            session.up.put_nowait(None)
            if requests:
                logger.warning("stream to scheduler %s ended (%s); %d requests on it fail over",
                               self._name, failure.details(), len(requests))
            for queue in requests.values():
                queue.put_nowait(failure)
            requests.clear()


async def _messages_up(queue: asyncio.Queue[scheduler_pb2.ConnectRequest | None]
                       ) -> AsyncIterator[scheduler_pb2.ConnectRequest]:
    while (message := await queue.get()) is not None:
        yield message
