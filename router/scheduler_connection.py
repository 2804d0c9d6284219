"""One channel to one scheduler process: its request stream, its gRPC health, its model.

This and router/scheduler_stream.py are the router's gRPC edge towards the schedulers: the
request path (router/dispatcher.py) hands a connection a `Submission` and a sink, and gets
`SampleOutput`s back; router/convert.py does every conversion on the way.

The scheduler's gRPC health (SERVING iff its registry status is ready) is checked every
0.2 s, so a group's readiness follows within that, not a heartbeat plus a poll: a scheduler
whose health says NOT_SERVING, or that does not answer (the process is gone), is not ready,
whatever its registry entry still says (router/group_directory.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime import keepalive
from pagemesh.runtime.tls import TlsConfig
from protos.pagemesh.scheduler.v1 import scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2
from router import convert
from router.resume import Progress
from router.scheduler_stream import RequestSink, SchedulerStream
from router.types import ModelInfo, Submission

logger = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_HEALTH_CHECK_INTERVAL_S = 0.2
# Health checks failing with these say nothing either way (other than UNAVAILABLE: no health).
_TRANSIENT_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# Re-dial a restarted scheduler within about a second (gRPC's default backoff reaches 120 s).
# A frozen or cut-off scheduler breaks the stream within 5 s (pagemesh/runtime/keepalive.py), and
# its requests resume elsewhere, as after its death.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *keepalive.CHANNEL_OPTIONS,
]
_MODEL_INFO_TIMEOUT_S = 10


class SchedulerConnection:
    """Dials `address` and follows its health until retired; closed once retired and no
    request uses it (closing a channel cancels its calls with a bare CancelledError, which
    would look like the client going away).

    `on_health_change()` is called when `healthy` changed. `poll_interval_s` (the registry
    poll's) bounds a health check's timeout and the backoff while the scheduler is unreachable.
    """

    def __init__(
        self,
        scheduler_id: str,
        address: str,
        tls: TlsConfig,
        on_health_change: Callable[[], object],
        poll_interval_s: float,
    ) -> None:
        self.scheduler_id = scheduler_id
        self.channel = tls.aio_channel(address, options=_CHANNEL_OPTIONS)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.stream = SchedulerStream(self.stub, scheduler_id)  # every request, on one call
        self.num_calls = 0  # requests on it now
        self.retired = False
        # The scheduler's gRPC health: True SERVING, False NOT_SERVING or unreachable,
        # None not known yet (or no health service): the registry status alone decides.
        self.healthy: bool | None = None
        self._on_health_change = on_health_change
        self._poll_interval_s = poll_interval_s
        self._health_task = asyncio.get_running_loop().create_task(self._follow_health())

    def retire(self) -> None:
        """No new request comes here (the scheduler restarted or left)."""
        self.retired = True
        self._health_task.cancel()
        if self.num_calls == 0:
            asyncio.get_running_loop().create_task(self.close())

    async def close(self) -> None:
        self._health_task.cancel()
        await self.stream.close()
        await self.channel.close()

    @contextlib.contextmanager
    def submitted(
        self,
        submission: Submission,
        progress: Progress | None,
        sink: RequestSink,
        metadata: tuple[tuple[str, str], ...] | None,
    ) -> Iterator[None]:
        """The request on this scheduler's stream while the block runs, continuing after
        `progress` when given (a resume); its outputs go to `sink`. Released after: aborted
        on the scheduler if it still runs there."""
        self.num_calls += 1
        opened = None
        try:
            opened = self.stream.submit(
                convert.submit_request(submission, progress), sink, metadata
            )
            yield
        finally:
            if opened is not None:
                self.stream.release(opened)
            self.num_calls -= 1
            if self.retired and self.num_calls == 0:
                asyncio.get_running_loop().create_task(self.close())

    async def model_info(self) -> ModelInfo:
        """The model this scheduler serves. Raises `grpc.aio.AioRpcError`."""
        reply = await self.stub.GetModelInfo(
            generate_pb2.GetModelInfoRequest(), timeout=_MODEL_INFO_TIMEOUT_S
        )
        return convert.model_info_from_pb(reply)

    async def _follow_health(self) -> None:
        """A Check every `_HEALTH_CHECK_INTERVAL_S` until retired. Two UNAVAILABLE answers in
        a row (one may be a connection being re-established) mark it unreachable; a slow
        answer proves nothing. (Not a Watch stream: pagemesh.runtime.serving's ErrorInterceptor
        wraps
        grpc_health's coroutine-style Watch as a generator, and it fails with INTERNAL.)"""
        stub = health_pb2_grpc.HealthStub(self.channel)
        backoff_s, num_unreachable = _HEALTH_CHECK_INTERVAL_S, 0
        while True:
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(), timeout=max(1.0, self._poll_interval_s)
                )
                self._set_health(reply.status == _SERVING)
                backoff_s, num_unreachable = _HEALTH_CHECK_INTERVAL_S, 0
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    num_unreachable += 1
                    if num_unreachable >= 2:
                        self._set_health(False)
                        backoff_s = min(
                            backoff_s * 2, max(self._poll_interval_s, _HEALTH_CHECK_INTERVAL_S)
                        )
                elif exc.code() not in _TRANSIENT_CODES:
                    self._set_health(None)  # no health: the registry decides
                    return
            await asyncio.sleep(backoff_s)

    def _set_health(self, healthy: bool | None) -> None:
        if healthy != self.healthy:
            logger.info(
                "engine group %s health: %s",
                self.scheduler_id,
                {True: "SERVING", False: "NOT_SERVING or unreachable", None: "unknown"}[healthy],
            )
            self.healthy = healthy
            self._on_health_change()
