"""The public gRPC `Admin` service: each call goes to every engine group (or the one named)
and their replies are listed, one per group.

The schedulers answer with the same `pagemesh.v1` messages this service returns (their
workers' reports with the group's figures added), so nothing is converted here: a reply
passes through, and a group that fails is listed with its `error` rather than failing the
call, so that one group down does not hide the others. Protected by the router's API key
(router/main.py installs the interceptor for this service too).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from pagemesh.runtime.registry_entries import GroupStatus
from pagemesh.runtime.serving import ServiceError, invalid_argument, unavailable
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import admin_pb2, admin_pb2_grpc
from router import lora_admin
from router.group_directory import EngineGroup, GroupDirectory

logger = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 15.0
STOP_PROFILE_TIMEOUT_S = 330.0  # the workers may take minutes to write long traces
MAX_WINDOW_S = 3600.0

M = TypeVar("M", bound=Message)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, directory: GroupDirectory) -> None:
        self.directory = directory

    async def LoadLoraAdapter(
        self, request: admin_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.LoadLoraAdapterResponse:
        groups = await lora_admin.load_adapter(self.directory, request.lora_name, request.lora_path)
        return admin_pb2.LoadLoraAdapterResponse(groups=groups)

    async def UnloadLoraAdapter(
        self, request: admin_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UnloadLoraAdapterResponse:
        groups = await lora_admin.unload_adapter(self.directory, request.lora_name)
        return admin_pb2.UnloadLoraAdapterResponse(groups=groups)

    async def Drain(
        self, request: admin_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DrainResponse:
        """The named group hands its requests over, with their KV, to the others (the
        router resumes each on another group); one group at a time, so a name is needed."""
        if not request.group:
            raise invalid_argument(
                "name the engine group to drain (`group`): draining "
                "every group would leave nowhere to go"
            )
        group = self._groups(request.group)[0]
        # Before its requests come back: they continue on the other groups, not this one
        # (the registry says so too, a heartbeat later, for the other routers).
        group.status = GroupStatus.READY if request.undo else GroupStatus.DRAINING
        try:
            return await group.conn.stub.Drain(request, timeout=ADMIN_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise ServiceError(exc.code(), f"engine group {group.name}: {exc.details()}") from exc

    async def ResetPrefixCache(
        self, request: admin_pb2.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ResetPrefixCacheResponse:
        async def reset(group: EngineGroup) -> admin_pb2.GroupPrefixCacheReset:
            reply = await group.conn.stub.ResetPrefixCache(
                scheduler_pb2.ResetPrefixCacheRequest(), timeout=ADMIN_TIMEOUT_S
            )
            # Where this router sent each prefix is void there now: route by load again.
            for forget in self.directory.on_group_reset:
                forget(group.scheduler_id)
            return reply.group

        groups = await self._each_group(request.group, reset, admin_pb2.GroupPrefixCacheReset)
        return admin_pb2.ResetPrefixCacheResponse(groups=groups)

    async def GetMemory(
        self, request: admin_pb2.GetMemoryRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetMemoryResponse:
        async def memory(group: EngineGroup) -> admin_pb2.GroupMemory:
            reply = await group.conn.stub.GetMemory(
                scheduler_pb2.GetMemoryRequest(), timeout=ADMIN_TIMEOUT_S
            )
            return reply.group

        groups = await self._each_group(request.group, memory, admin_pb2.GroupMemory)
        return admin_pb2.GetMemoryResponse(groups=groups)

    async def GetStepStats(
        self, request: admin_pb2.GetStepStatsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetStepStatsResponse:
        if not 0 <= request.window_s <= MAX_WINDOW_S:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"window_s must be in [0, {MAX_WINDOW_S:g}] seconds, got {request.window_s:g}",
            )

        async def stats(group: EngineGroup) -> admin_pb2.GroupStepStats:
            reply = await group.conn.stub.GetStepStats(
                scheduler_pb2.GetStepStatsRequest(window_s=request.window_s),
                timeout=ADMIN_TIMEOUT_S,
            )
            return reply.group

        groups = await self._each_group(request.group, stats, admin_pb2.GroupStepStats)
        return admin_pb2.GetStepStatsResponse(groups=groups)

    async def StartProfile(
        self, request: admin_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StartProfileResponse:
        if not request.out_dir:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "out_dir is required: the folder each worker writes its trace to",
            )
        forwarded = scheduler_pb2.StartProfileRequest(
            out_dir=request.out_dir,
            record_shapes=request.record_shapes,
            with_stack=request.with_stack,
        )

        async def start(group: EngineGroup) -> admin_pb2.GroupProfile:
            reply = await group.conn.stub.StartProfile(forwarded, timeout=ADMIN_TIMEOUT_S)
            return reply.group

        groups = await self._each_group(request.group, start, admin_pb2.GroupProfile)
        return admin_pb2.StartProfileResponse(groups=groups)

    async def StopProfile(
        self, request: admin_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StopProfileResponse:
        async def stop(group: EngineGroup) -> admin_pb2.GroupProfile:
            reply = await group.conn.stub.StopProfile(
                scheduler_pb2.StopProfileRequest(), timeout=STOP_PROFILE_TIMEOUT_S
            )
            return reply.group

        groups = await self._each_group(request.group, stop, admin_pb2.GroupProfile)
        return admin_pb2.StopProfileResponse(groups=groups)

    async def _each_group(
        self, name: str, call: Callable[[EngineGroup], Awaitable[M]], reply_type: type[M]
    ) -> list[M]:
        """`call` on every group (or the one `name`s, by group name or scheduler id), at
        once; a group whose call fails gets a `reply_type` naming it, with `error` set."""
        groups = self._groups(name)

        async def one(group: EngineGroup) -> M:
            try:
                return await call(group)
            except grpc.aio.AioRpcError as exc:
                logger.warning(
                    "admin call to engine group %s failed: %s", group.scheduler_id, exc.details()
                )
                return reply_type(
                    group=group.name,
                    scheduler_id=group.scheduler_id,
                    error=f"{exc.code().name}: {exc.details()}",
                )

        return list(await asyncio.gather(*(one(group) for group in groups)))

    def _groups(self, name: str) -> list[EngineGroup]:
        groups = sorted(
            (g for g in self.directory.groups if not g.conn.retired),
            key=lambda g: (g.name, g.scheduler_id),
        )
        if not groups:
            raise unavailable("no engine group is known yet; retry shortly")
        if not name:
            return groups
        chosen = [g for g in groups if name in (g.name, g.scheduler_id)]
        if not chosen:
            known = ", ".join(g.name for g in groups)
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND, f"no engine group {name!r}; known: {known}"
            )
        return chosen
