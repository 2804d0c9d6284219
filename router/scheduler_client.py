"""The router's view of the engine groups: discovered in Redis, dialled over gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from pagemesh.registry import Registry
from pagemesh.serving import ServiceError, unavailable
from pagemesh.tls import TlsConfig
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2
from protos.block_hash import hash_request_blocks
from router.routing import GroupLoad, Router, RoutingConfig

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    scheduler_id: str
    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    load: GroupLoad


class SchedulerPool:
    """Keeps one channel per live scheduler, refreshed from the registry every poll."""

    def __init__(self, registry: Registry, poll_interval_s: float,
                 on_change: Callable[[int], object] | None = None,
                 routing: RoutingConfig | None = None, tls: TlsConfig | None = None) -> None:
        self.registry = registry
        self.tls = tls or TlsConfig()
        self.poll_interval_s = poll_interval_s
        self._on_change = on_change
        self._groups: dict[str, _Group] = {}
        self._router = Router(routing or RoutingConfig())
        # Tokens (prompt + still to generate) of this router's requests in flight per group.
        self._outstanding: dict[str, int] = {}
        self._model_info: generate_pb2.GetModelInfoResponse | None = None

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:
                logger.warning("registry poll failed: %s", exc)
            await asyncio.sleep(self.poll_interval_s)

    async def refresh(self) -> None:
        entries = await self.registry.list("scheduler")
        before = set(self._groups)
        for scheduler_id, info in entries.items():
            load = GroupLoad(scheduler_id, info.get("num_running", 0), info.get("num_waiting", 0),
                             info.get("num_free_blocks", 0))
            self._outstanding.setdefault(scheduler_id, 0)
            group = self._groups.get(scheduler_id)
            if group is None or group.address != info["address"]:
                if group is not None:
                    await group.channel.close()
                channel = self.tls.aio_channel(info["address"])
                group = _Group(scheduler_id, info["address"], channel,
                               scheduler_pb2_grpc.SchedulerStub(channel), load)
                self._groups[scheduler_id] = group
                logger.info("engine group %s at %s joined", scheduler_id, info["address"])
            group.load = load
        for scheduler_id in set(self._groups) - set(entries):
            logger.warning("engine group %s left (heartbeat expired)", scheduler_id)
            await self._groups.pop(scheduler_id).channel.close()
            self._router.index.forget_group(scheduler_id)
        if set(self._groups) != before and self._on_change is not None:
            self._on_change(len(self._groups))

    async def model_info(self) -> generate_pb2.GetModelInfoResponse:
        """The served model, asked once of any group (all groups serve the same model)."""
        if self._model_info is not None:
            return self._model_info
        for group in list(self._groups.values()):
            try:
                self._model_info = await group.stub.GetModelInfo(
                    generate_pb2.GetModelInfoRequest(), timeout=10
                )
                return self._model_info
            except grpc.aio.AioRpcError as exc:
                logger.warning("GetModelInfo on %s failed: %s", group.scheduler_id, exc.details())
        raise unavailable("no engine group is available yet; retry shortly")

    def _loads(self) -> list[GroupLoad]:
        return [dataclasses.replace(g.load, outstanding_tokens=self._outstanding.get(g.scheduler_id, 0))
                for g in self._groups.values()]

    async def submit(self, request: scheduler_pb2.SubmitRequest,
                     max_attempts: int = 3) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        """Streams a request's tokens from one group, chosen by the routing policy.

        A group that fails before the first token is replaced by another, transparently;
        after the first token a failure reaches the caller (resume comes with fault tolerance).
        """
        info = await self.model_info()
        block_hashes = hash_request_blocks(list(request.prompt_token_ids), info.block_size)
        num_tokens = len(request.prompt_token_ids) + request.stopping.max_tokens * max(request.n, 1)
        tried: set[str] = set()
        for _ in range(max_attempts):
            scheduler_id = self._router.pick(self._loads(), block_hashes, frozenset(tried))
            if scheduler_id is None:
                break
            tried.add(scheduler_id)
            group = self._groups.get(scheduler_id)
            if group is None:  # left while we were choosing
                continue
            self._router.record(block_hashes, scheduler_id)
            self._outstanding[scheduler_id] = self._outstanding.get(scheduler_id, 0) + num_tokens
            call = group.stub.Submit(request)
            received_any = False
            try:
                async for response in call:
                    received_any = True
                    yield response
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and not received_any:
                    logger.warning("group %s unavailable before the first token: %s",
                                   scheduler_id, exc.details())
                    continue
                raise ServiceError(exc.code(), exc.details() or str(exc.code())) from exc
            finally:
                call.cancel()
                if scheduler_id in self._outstanding:
                    self._outstanding[scheduler_id] -= num_tokens
        raise unavailable("no engine group could take the request; retry shortly")

    async def close(self) -> None:
        for group in self._groups.values():
            await group.channel.close()
