"""Scheduler gRPC servicer: converts (`convert/`), hands requests to the engine loop,
converts their events back.

Two ways in, one request life (`request_streams.py`): `Submit`, one call per request, and
`Connect`, a router's one stream for all its requests (`connection.py`), which the router
uses. Neither sees protobuf past this file.

The admin RPCs act on the core (`ResetPrefixCache`) or ask every worker of the group
(`WorkerGroupClient`'s admin calls) and add the group's figures."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from pagemesh.runtime.logs import request_id_var
from pagemesh.runtime.registry_entries import GroupStatus
from pagemesh.runtime.serving import ServiceError, invalid_argument
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import admin_pb2, generate_pb2
from scheduler_svc import convert
from scheduler_svc.adapters import AdapterLoadFailed, GroupAdapters
from scheduler_svc.checkpoint import Checkpointer
from scheduler_svc.connection import DEFAULT_MAX_BUFFERED_TOKENS, ConnectionCutOff, RouterConnection
from scheduler_svc.engine_loop import EngineLoop, QueueSink, StepFailed
from scheduler_svc.kv_moves import KVMoves
from scheduler_svc.messages import ConnectAction, ConnectBatch, InvalidSubmit, Submission
from scheduler_svc.request_streams import RequestStreams
from scheduler_svc.worker_client import WorkerGroupClient

logger = logging.getLogger(__name__)

# What a server registering this servicer names for health and reflection.
SERVICE_NAMES = [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name]


def add_to_server(servicer: SchedulerServicer, server: grpc.aio.Server) -> None:
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        loop: EngineLoop,
        model_info: generate_pb2.GetModelInfoResponse,
        checkpointer: Checkpointer | None = None,
        max_buffered_tokens: int = DEFAULT_MAX_BUFFERED_TOKENS,
        group: str = "",
        scheduler_id: str = "",
        adapters: GroupAdapters | None = None,
        kv_moves: KVMoves | None = None,
        prefill_only: bool = False,
    ) -> None:
        self.loop = loop
        self.kv_moves = kv_moves
        # The LoRA adapters held here (a request naming another the cluster serves loads it).
        self.adapters = adapters or GroupAdapters(group, 0, {}, lambda: None)
        self.group = group  # the engine group's name and this scheduler's id, for admin replies
        self.scheduler_id = scheduler_id or group
        self.model_info = model_info
        self.eos_token_ids = list(model_info.eos_token_ids)
        self.streams = RequestStreams(loop, checkpointer, kv_moves, prefill_only)
        self.checkpointer = self.streams.checkpointer
        self.max_buffered_tokens = max_buffered_tokens
        self.connections: set[RouterConnection] = set()

    async def GetModelInfo(
        self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GetModelInfoResponse:
        return self.model_info

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetStatsResponse:
        loop = self.loop
        return convert.stats_to_pb(
            loop.scheduler.stats(), loop.num_steps, loop.status, loop.num_recoveries
        )

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        request_id_var.set(request.request_id)
        sink = QueueSink()
        opened = self.streams.admit(await self._submission(request), sink)
        with_logprobs = opened.with_logprobs
        try:
            for index, event in opened.ended:
                yield convert.event_to_pb(event, index, with_logprobs)
            if opened.finished:
                await self.streams.finish([opened])
            while not opened.finished:
                events = await sink.queue.get()
                if isinstance(events, StepFailed):
                    self.streams.failed(opened, str(events))
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(events))
                for event in events:
                    index = self.streams.record(opened, event)
                    if opened.finished:  # the record is complete before the last message leaves
                        await self.streams.finish([opened])
                    yield convert.event_to_pb(event, index, with_logprobs)
        finally:
            self.streams.close(opened)

    async def Connect(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.ConnectResponse]:
        connection = RouterConnection(self.streams, self.max_buffered_tokens)
        self.connections.add(connection)
        reader = asyncio.get_running_loop().create_task(
            connection.read(self._actions(request_iterator))
        )
        try:
            while True:
                batch = await _next_or_reader_failure(connection, reader)
                if batch is None:
                    return
                yield convert.connect_batch_to_pb(batch)  # built as it leaves: once per message
        except ConnectionCutOff as exc:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        finally:
            reader.cancel()
            connection.close()
            self.connections.discard(connection)

    # ---- admin (pagemesh.v1.Admin, forwarded by the router) -------------------------------

    async def Drain(
        self, request: admin_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DrainResponse:
        """Admin: stop admitting and hand every request over (`EngineLoop.hand_off_all`),
        or, with `undo`, serve again."""
        if request.undo:
            await self.loop.set_status(GroupStatus.READY)
            return convert.drain_response_pb([self.group], 0, 0)
        await self.loop.set_status(GroupStatus.DRAINING)
        migrated, recomputed = await self.loop.hand_off_all()
        logger.warning(
            "drained: %d requests handed off with their KV, %d to recompute", migrated, recomputed
        )
        return convert.drain_response_pb([self.group], migrated, recomputed)

    async def ClaimKv(
        self, request: scheduler_pb2.ClaimKvRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ClaimKvResponse:
        claimed = (
            await self.kv_moves.claim(request.handoff_id, request.hold_ms)
            if self.kv_moves is not None
            else None
        )
        if claimed is None:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"no KV hold {request.handoff_id!r} here (released, expired, or "
                "lost with a re-formed group): recompute instead",
            )
        held, ranks = claimed
        return convert.claim_response_pb(held, ranks, self.kv_moves.token)

    async def ReleaseKv(
        self, request: scheduler_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReleaseKvResponse:
        if self.kv_moves is not None:
            self.kv_moves.release(request.handoff_id, request.pulled, request.reason)
        return scheduler_pb2.ReleaseKvResponse()

    async def ResetPrefixCache(
        self, request: scheduler_pb2.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ResetPrefixCacheResponse:
        # On the event loop, between two calls of the core: never inside a step's update.
        scheduler = self.loop.scheduler
        num_dropped = scheduler.reset_prefix_cache()
        logger.info(
            "prefix cache reset: %d cached blocks dropped, %d kept (in use)",
            num_dropped,
            scheduler.stats().num_cached_blocks,
        )
        return convert.prefix_cache_reset_to_pb(
            self.group, self.scheduler_id, num_dropped, scheduler.stats()
        )

    async def GetMemory(
        self, request: scheduler_pb2.GetMemoryRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetMemoryResponse:
        ranks = await self._workers().get_memory()
        scheduler = self.loop.scheduler  # after the await: the core of the same workers
        return convert.group_memory_to_pb(
            self.group,
            self.scheduler_id,
            scheduler.stats(),
            scheduler.config.num_swap_blocks,
            ranks,
        )

    async def GetStepStats(
        self, request: scheduler_pb2.GetStepStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetStepStatsResponse:
        ranks = await self._workers().get_step_stats(request.window_s)
        return convert.group_step_stats_to_pb(
            self.group, self.scheduler_id, self.loop.num_steps, ranks
        )

    async def LoadLoraAdapter(
        self, request: admin_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.LoadLoraAdapterResponse:
        """Every worker reads and checks the adapter; then requests may name it, here and
        (through the cluster's adapter table) on every group that serves LoRA."""
        if not self.adapters.enabled:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"engine group {self.group} serves no LoRA adapters: start it with --enable-lora",
            )
        if not request.lora_name or not request.lora_path:
            raise invalid_argument("give lora_name and lora_path (the adapter's PEFT folder)")
        self._workers()  # UNIMPLEMENTED for an in-process engine
        try:
            await self.adapters.load(request.lora_name, request.lora_path)
        except AdapterLoadFailed as exc:
            raise ServiceError(exc.code, exc.details) from exc
        return convert.lora_loaded_pb(
            self.group or self.scheduler_id, self.adapters.version, self.adapters.names()
        )

    async def UnloadLoraAdapter(
        self, request: admin_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UnloadLoraAdapterResponse:
        """New requests may no longer name it, here or (out of the cluster's table) on any
        other group; those running with it finish with it (a worker reads it again from its
        folder if one of them is sent to it again)."""
        if not await self.adapters.unload(request.lora_name):
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"LoRA adapter {request.lora_name!r} is not served by engine "
                f"group {self.group} (it holds "
                f"{', '.join(self.adapters.names()) or 'none'})",
            )
        return convert.lora_unloaded_pb(
            self.group or self.scheduler_id, self.adapters.version, self.adapters.names()
        )

    async def StartProfile(
        self, request: scheduler_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.StartProfileResponse:
        refusals = await self._workers().start_profile(
            request.out_dir,
            self.group or self.scheduler_id or "pagemesh",
            request.record_shapes,
            request.with_stack,
        )
        return scheduler_pb2.StartProfileResponse(
            group=convert.group_profile(self.group, self.scheduler_id, [], refusals)
        )

    async def StopProfile(
        self, request: scheduler_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.StopProfileResponse:
        traces, refusals = await self._workers().stop_profile()
        return scheduler_pb2.StopProfileResponse(
            group=convert.group_profile(self.group, self.scheduler_id, traces, refusals)
        )

    def _workers(self) -> WorkerGroupClient:
        """The group's workers now (a re-formation replaces them)."""
        workers = self.loop.workers
        if not isinstance(workers, WorkerGroupClient):
            raise ServiceError(
                grpc.StatusCode.UNIMPLEMENTED,
                "this engine runs its model in-process: ask the runner "
                "(worker_svc.diagnostics) directly",
            )
        return workers

    async def _submission(self, request: scheduler_pb2.SubmitRequest) -> Submission:
        """The message as admitted; one that cannot run is INVALID_ARGUMENT (checked before
        admission, so a draining group says so too: the request is invalid on any group)."""
        try:
            await self.adapters.resolve(request.lora_name)
            return convert.submission_from_pb(
                request, self.eos_token_ids, time.time(), self.adapters.held
            )
        except ValueError as exc:
            raise invalid_argument(str(exc)) from exc

    async def _actions(
        self, messages: AsyncIterator[scheduler_pb2.ConnectRequest]
    ) -> AsyncIterator[ConnectAction]:
        """Each message as an action. A submit naming an adapter this group does not hold
        waits for its load here (the stream's later messages with it: a first request for
        an adapter on a group is rare, and its order with an abort is kept)."""
        async for message in messages:
            if message.WhichOneof("action") == "submit" and message.submit.lora_name:
                try:
                    await self.adapters.resolve(message.submit.lora_name)
                except ValueError as exc:
                    yield InvalidSubmit(message.submit.request_id, str(exc))
                    continue
            yield convert.connect_action_from_pb(
                message, self.eos_token_ids, time.time(), self.adapters.held
            )


async def _next_or_reader_failure(
    connection: RouterConnection, reader: asyncio.Task[None]
) -> ConnectBatch | None:
    """The next message; a reader that failed (the stream broke) ends the call."""
    message = asyncio.ensure_future(connection.next_message())
    await asyncio.wait({message, reader}, return_when=asyncio.FIRST_COMPLETED)
    if message.done():
        return message.result()
    if reader.exception() is None:  # the router closed its side: what is left still goes
        return await message
    message.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await message
    raise reader.exception()
