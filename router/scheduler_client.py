"""The router's view of the engine groups: discovered in Redis, dialled over gRPC.

Groups' health comes from the `status` each scheduler publishes in its registry entry
(pagemesh.registry_entries.GroupStatus): ready (or none, from older schedulers) is a complete
group; degraded (a worker is missing, the group is being re-formed; requests queue there) is
a fallback used only when no ready group exists; draining is never picked. The router is
SERVING iff at least one ready group exists.

Each scheduler's gRPC health (SERVING iff its status is ready) is checked as well, every
0.2 s, so a group's readiness follows within that, not a heartbeat plus a poll: a group whose
health says NOT_SERVING, or that does not answer (the process is gone), is not ready and
only a fallback, whatever its registry entry still says.

A group missing from one registry poll is kept, with its last status, until it has been missing
for longer than the registry TTL: a restarted Redis is empty for up to a heartbeat, and
dropping every group then would break every stream. A dead group's entry expires after one TTL,
so it is dropped after two; meanwhile (unreachable, so not ready) it is tried only after every
other group, and a request it fails is resumed elsewhere (router/resume.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from pagemesh.checkpoints import CheckpointStore
from pagemesh.registry import Registry
from pagemesh.registry_entries import GroupStatus, SchedulerEntry
from pagemesh.serving import ServiceError, unavailable
from pagemesh.telemetry import grpc_metadata
from pagemesh.tls import TlsConfig
from protos.block_hash import hash_request_blocks
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2
from router import convert
from router.request_feed import RequestFeed
from router.resume import Attempts, Progress, ResumeConfig, retry_kind
from router.routing import GroupLoad, RoutingConfig, RoutingPolicy
from router.scheduler_stream import SchedulerStream
from router.tracing import group_failed_event, resume_event

logger = logging.getLogger(__name__)

T = TypeVar("T")
_SERVING = health_pb2.HealthCheckResponse.SERVING
_HEALTH_CHECK_INTERVAL_S = 0.2
# Health checks failing with these say nothing either way (other than UNAVAILABLE: no health).
_TRANSIENT_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# Re-dial a restarted scheduler within about a second (gRPC's default backoff reaches 120 s).
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass
class _Connection:
    """One channel to one scheduler process, and the task checking its gRPC health. Closed once
    retired and no call uses it (closing a channel cancels its calls with a bare
    CancelledError, which would look like the client going away)."""

    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    stream: SchedulerStream  # every request to this scheduler, multiplexed on one call
    num_calls: int = 0
    retired: bool = False
    # The scheduler's gRPC health: True SERVING, False NOT_SERVING or unreachable,
    # None not known yet (or no health service): the registry status alone decides.
    healthy: bool | None = None
    health_task: asyncio.Task[None] | None = None

    def retire(self) -> None:
        self.retired = True
        if self.health_task is not None:
            self.health_task.cancel()
        if self.num_calls == 0:
            asyncio.get_running_loop().create_task(self.close())

    async def close(self) -> None:
        await self.stream.close()
        await self.channel.close()


@dataclass
class _Group:
    scheduler_id: str
    name: str  # the engine group (registry "group"): checkpoints are listed under it
    address: str
    instance: str  # the scheduler process (registry "instance"); a new one = a restart
    conn: _Connection
    load: GroupLoad
    status: GroupStatus = GroupStatus.READY
    missing_since: float | None = None  # loop time of the first poll it was missing from
    suspect_until: float = 0.0  # a Submit there failed: others first until then (loop time)

    @property
    def ready(self) -> bool:
        return self.status == GroupStatus.READY and self.conn.healthy is not False

    def not_suspect(self) -> None:
        """A request made progress here."""
        self.suspect_until = 0.0


class SchedulerPool:
    """Keeps one channel per live scheduler, refreshed from the registry every poll, and
    streams requests from them, resuming a stream on another group when its group fails.

    `on_change(serving)` is called when whether a ready group exists changed (after a
    registry poll or a health check).
    """

    def __init__(self, registry: Registry, poll_interval_s: float,
                 on_change: Callable[[bool], object] | None = None,
                 routing: RoutingConfig | None = None, tls: TlsConfig | None = None,
                 resume: ResumeConfig | None = None) -> None:
        self.registry = registry
        self.tls = tls or TlsConfig()
        self.poll_interval_s = poll_interval_s
        self.resume = resume or ResumeConfig()
        self._on_change = on_change
        self._groups: dict[str, _Group] = {}
        self._policy = RoutingPolicy(routing or RoutingConfig())
        # Tokens (prompt + still to generate) of this router's requests in flight per group.
        self._outstanding: dict[str, int] = {}
        self._model_info: generate_pb2.GetModelInfoResponse | None = None
        self._serving = False
        # Streams resumed on a group after the one serving them failed (router metrics).
        self.num_resumes = 0

    @property
    def num_groups(self) -> int:
        """Ready groups: the replicas serving now (not degraded, draining, unreachable or
        dead ones kept while missing from the registry)."""
        return sum(g.ready and g.missing_since is None for g in self._groups.values())

    @property
    def model_name(self) -> str:
        """The served model's name once a group was asked (`model_info`), else ""."""
        return self._model_info.model if self._model_info is not None else ""

    @property
    def serving(self) -> bool:
        """At least one complete (ready) engine group: the router's health."""
        return any(g.ready for g in self._groups.values())

    @property
    def checkpoints(self) -> CheckpointStore:
        return self.registry.checkpoints

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:
                logger.warning("registry poll failed: %s", exc)
            await asyncio.sleep(self.poll_interval_s)

    async def refresh(self) -> None:
        # An entry without an address cannot be dialled: as good as absent.
        entries = {scheduler_id: entry for scheduler_id, entry
                   in (await self.registry.entries(SchedulerEntry)).items() if entry.address}
        now = asyncio.get_running_loop().time()
        for scheduler_id, entry in entries.items():
            self._update(scheduler_id, entry)
        for scheduler_id in set(self._groups) - set(entries):
            group = self._groups[scheduler_id]
            if group.missing_since is None:
                group.missing_since = now
                logger.info("engine group %s is missing from the registry; kept for %.1f s",
                            scheduler_id, self.registry.config.ttl_s)
            elif now - group.missing_since > self.registry.config.ttl_s:
                self._drop(scheduler_id)
        self._notify()

    def _notify(self) -> None:
        """Tells `on_change` when whether a ready group exists changed."""
        if self.serving == self._serving:
            return
        self._serving = self.serving
        logger.info("router %s: %d engine groups, %d ready", "SERVING" if self._serving
                    else "NOT_SERVING", len(self._groups), self._num_ready())
        if self._on_change is not None:
            self._on_change(self._serving)

    def _update(self, scheduler_id: str, entry: SchedulerEntry) -> None:
        # Free blocks not said: routed as if full, the least attractive.
        load = GroupLoad(scheduler_id, entry.num_running, entry.num_waiting,
                         entry.num_free_blocks or 0)
        self._outstanding.setdefault(scheduler_id, 0)
        status = entry.status
        group = self._groups.get(scheduler_id)
        address, instance = entry.address, entry.instance
        if group is None or group.address != address or group.instance != instance:
            channel = self.tls.aio_channel(address, options=_CHANNEL_OPTIONS)
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            conn = _Connection(channel, stub, SchedulerStream(stub, scheduler_id))
            conn.health_task = asyncio.get_running_loop().create_task(self._follow_health(scheduler_id, conn))
            name = entry.group or scheduler_id
            if group is not None:
                group.conn.retire()
                self._policy.index.forget_group(scheduler_id)  # a new process: an empty cache
                logger.warning("engine group %s restarted at %s", scheduler_id, address)
            else:
                logger.info("engine group %s at %s joined", scheduler_id, address)
            group = _Group(scheduler_id, name, address, instance, conn, load)
            self._groups[scheduler_id] = group
        if group.status != status:
            logger.warning("engine group %s is %s", scheduler_id, status)
        group.load, group.status, group.missing_since = load, status, None

    def _drop(self, scheduler_id: str) -> None:
        logger.warning("engine group %s left (missing from the registry for over %.1f s)",
                       scheduler_id, self.registry.config.ttl_s)
        self._groups.pop(scheduler_id).conn.retire()
        self._policy.index.forget_group(scheduler_id)
        if self._outstanding.get(scheduler_id) == 0:
            del self._outstanding[scheduler_id]

    def _num_ready(self) -> int:
        return sum(g.ready for g in self._groups.values())

    async def _follow_health(self, scheduler_id: str, conn: _Connection) -> None:
        """Follows one scheduler's gRPC health, a Check every `_HEALTH_CHECK_INTERVAL_S`, until
        its connection is retired. Two UNAVAILABLE answers in a row (one may be a connection
        being re-established) mark it unreachable; a slow answer proves nothing. (Not a Watch
        stream: pagemesh.serving's ErrorInterceptor wraps grpc_health's coroutine-style Watch
        as a generator, and it fails with INTERNAL.)"""
        stub = health_pb2_grpc.HealthStub(conn.channel)
        backoff_s, num_unreachable = _HEALTH_CHECK_INTERVAL_S, 0
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(),
                                         timeout=max(1.0, self.poll_interval_s))
                self._set_health(scheduler_id, conn, reply.status == _SERVING)
                backoff_s, num_unreachable = _HEALTH_CHECK_INTERVAL_S, 0
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    num_unreachable += 1
                    if num_unreachable >= 2:
                        self._set_health(scheduler_id, conn, False)
                        backoff_s = min(backoff_s * 2, max(self.poll_interval_s, _HEALTH_CHECK_INTERVAL_S))
                elif exc.code() not in _TRANSIENT_CODES:
                    self._set_health(scheduler_id, conn, None)  # no health: the registry decides
                    return
            await asyncio.sleep(backoff_s)

    def _set_health(self, scheduler_id: str, conn: _Connection, healthy: bool | None) -> None:
        if healthy != conn.healthy:
            logger.info("engine group %s health: %s", scheduler_id,
                        {True: "SERVING", False: "NOT_SERVING or unreachable", None: "unknown"}[healthy])
            conn.healthy = healthy
            self._notify()

    async def model_info(self) -> generate_pb2.GetModelInfoResponse:
        """The served model, asked once of any group (all groups serve the same model)."""
        if self._model_info is not None:
            return self._model_info
        for group in list(self._groups.values()):
            try:
                self._model_info = await group.conn.stub.GetModelInfo(
                    generate_pb2.GetModelInfoRequest(), timeout=10
                )
                return self._model_info
            except grpc.aio.AioRpcError as exc:
                logger.warning("GetModelInfo on %s failed: %s", group.scheduler_id, exc.details())
        raise unavailable("no engine group is available yet; retry shortly")

    def _pick(self, block_hashes: list, exclude: frozenset[str]) -> _Group | None:
        """The routing policy's choice within the best non-empty tier: ready groups present in
        the registry and not just failed, then ready ones missing or just failed, then the
        rest (degraded, NOT_SERVING, unreachable). Draining groups and `exclude` are never
        picked."""
        now = asyncio.get_running_loop().time()
        tiers: list[list[GroupLoad]] = [[], [], []]
        for group in self._groups.values():
            if group.scheduler_id in exclude or group.status == GroupStatus.DRAINING:
                continue
            load = dataclasses.replace(
                group.load, outstanding_tokens=self._outstanding.get(group.scheduler_id, 0))
            if not group.ready:
                tiers[2].append(load)
            elif group.missing_since is not None or group.suspect_until > now:
                tiers[1].append(load)
            else:
                tiers[0].append(load)
        for loads in tiers:
            if loads:
                scheduler_id = self._policy.pick(loads, block_hashes)
                return self._groups[scheduler_id] if scheduler_id is not None else None
        return None

    async def _choose(self, block_hashes: list, attempts: Attempts) -> _Group:
        """A group for the next attempt: another one at once when there is one; else, once the
        request was accepted somewhere, any (the failed group's replacement too) after a
        backoff, until the resume timeout."""
        exclude = attempts.excluded
        while True:
            group = self._pick(block_hashes, exclude)
            if group is not None:
                return group
            if not attempts.may_wait:
                raise unavailable("no engine group could take the request; retry shortly")
            if attempts.remaining_s() <= 0:
                raise unavailable(f"the engine group serving the request failed and no engine "
                                  f"group took it back within --resume-timeout-s "
                                  f"{self.resume.timeout_s:g}")
            await asyncio.sleep(attempts.next_backoff_s())
            exclude = frozenset()

    async def stream(self, request: scheduler_pb2.SubmitRequest,
                     process: Callable[[scheduler_pb2.SubmitResponse], T | None],
                     progress: Progress | None = None, span: trace.Span | None = None
                     ) -> AsyncIterator[list[T]]:
        """Streams a request as one continuous stream, whatever fails underneath: for each
        step, the list of what `process` returned for the request's outputs in it (Nones
        left out). `process` runs in the stream reader's pass over the step
        (router/request_feed.py): it must not await, and it marks samples a stop string
        ended with `progress.finish(i)`. The stream ends once every sample finished.

        `progress` (updated in place as tokens arrive) is what each sample already produced:
        empty for a fresh request, a checkpoint's for a resume on a new router. When a group
        fails the stream with a retryable status (router/resume.py), the same request plus
        `progress` goes to another group (or the failed one's replacement) and the stream goes
        on after the last token received. A group that fails before the first token is
        replaced the same way. `span` (the request's Generate span) goes to every attempt as
        its parent; failures and resumes are its events.
        """
        progress = progress or Progress.fresh(request.n)
        metadata = grpc_metadata(span)
        info = await self.model_info()
        block_hashes = hash_request_blocks(list(request.prompt_token_ids), info.block_size)
        attempts = Attempts(self.resume, asyncio.get_running_loop().time, progress.started)
        feed: RequestFeed[T] = RequestFeed(progress, attempts, process)
        while not progress.all_finished:
            group = await self._choose(block_hashes, attempts)
            if attempts.num_failures:
                self.num_resumes += 1
                logger.warning("request %s resumed on engine group %s with %s output tokens "
                               "already received (per sample)", request.request_id,
                               group.scheduler_id, progress.num_tokens())
                resume_event(span, group.scheduler_id, progress.num_tokens())
            try:
                with self._attempt(group, request, progress, feed, block_hashes, metadata):
                    while (batch := await feed.next_batch()) is not None:
                        yield batch
                return
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or str(exc.code())
            except grpc.aio.UsageError as exc:  # its channel was closed under it
                code, details = grpc.StatusCode.CANCELLED, str(exc)
            group_failed_event(span, group.scheduler_id, code, details)
            self._failed(group, request, progress, attempts, code, details)

    def _failed(self, group: _Group, request: scheduler_pb2.SubmitRequest, progress: Progress,
                attempts: Attempts, code: grpc.StatusCode | None, details: str) -> None:
        """Logs a failed attempt; raises the error the client sees when it is not retried."""
        kind = retry_kind(code)
        if kind is None:
            assert code is not None
            raise ServiceError(code, details)
        give_up = attempts.failed(group.scheduler_id, code)
        if give_up is not None:
            logger.warning("request %s: engine group %s failed (%s: %s); giving up: %s",
                           request.request_id, group.scheduler_id,
                           code.name if code else "early end", details, give_up)
            final = grpc.StatusCode.UNAVAILABLE if kind == "peer_gone" else (code or grpc.StatusCode.INTERNAL)
            raise ServiceError(final, f"{details} ({give_up})")
        group.suspect_until = asyncio.get_running_loop().time() + self.registry.config.ttl_s
        logger.warning("request %s: engine group %s failed (%s: %s) after %s output tokens "
                       "(per sample); resuming", request.request_id, group.scheduler_id,
                       code.name if code else "early end", details, progress.num_tokens())

    @contextlib.contextmanager
    def _attempt(self, group: _Group, request: scheduler_pb2.SubmitRequest, progress: Progress,
                 feed: RequestFeed[T], block_hashes: list,
                 metadata: tuple[tuple[str, str], ...] | None) -> Iterator[None]:
        """One attempt on one group: the request on its stream, its outputs into `feed`.
        `_outstanding` counts prompt + max_tokens of each unfinished sample while it lasts
        (recomputed outputs are bounded by max_tokens too)."""
        submit = convert.with_progress(request, progress) if progress.started else request
        num_tokens = len(request.prompt_token_ids) + request.stopping.max_tokens * progress.num_unfinished
        scheduler_id, conn = group.scheduler_id, group.conn
        self._policy.record(block_hashes, scheduler_id)
        self._outstanding[scheduler_id] = self._outstanding.get(scheduler_id, 0) + num_tokens
        progress.served_by(group.name)
        feed.on_progress = group.not_suspect
        conn.num_calls += 1
        opened = None
        try:
            opened = conn.stream.submit(submit, feed, metadata)
            yield
        finally:
            if opened is not None:
                conn.stream.release(opened)
            conn.num_calls -= 1
            if conn.retired and conn.num_calls == 0:
                asyncio.get_running_loop().create_task(conn.close())
            if scheduler_id in self._outstanding:
                self._outstanding[scheduler_id] -= num_tokens

    async def close(self) -> None:
        for group in self._groups.values():
            if group.conn.health_task is not None:
                group.conn.health_task.cancel()
            await group.conn.close()
