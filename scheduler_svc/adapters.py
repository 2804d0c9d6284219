"""The LoRA adapters an engine group holds: those a request may name here without waiting.

A group holds its --lora-modules (pinned: never let go) and the adapters it loaded since:
by an admin's run-time load, or on demand, when a request names an adapter the cluster
serves (pagemesh/runtime/lora_table.py) that this group does not hold (the router sends it here
when no group holds it, or when every holder is much busier). Loading means every worker
of the group reads and checks the folder (Worker.LoadLoraAdapter); one load per adapter
runs at a time, however many requests wait for it. Past --max-cpu-loras, the adapter
named least recently (not pinned, not the one just loaded) is let go: requests running with
it finish with it (a worker reads it again from its folder when it must), the next request
naming it loads it again.

Each change bumps `version`, which the registry entry carries with the names and the
capacity: routers route by them (router/dispatcher.py)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import grpc
from redis.exceptions import RedisError

from pagemesh.runtime.lora_table import LoraTable
from protos.step import LoraRef

LOAD_TIMEOUT_S = 120.0  # reading a large adapter from a slow disk
TABLE_TIMEOUT_S = 5.0

logger = logging.getLogger(__name__)


class AdapterWorkers(Protocol):
    """The group's workers as this file asks them (scheduler_svc/worker_client.py's)."""

    async def load_lora(self, name: str, path: str, timeout_s: float) -> None: ...

    async def unload_lora(self, name: str, timeout_s: float) -> None: ...


class AdapterLoadFailed(Exception):
    """The workers refused an adapter (or could not be asked): their status and words."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class GroupAdapters:
    def __init__(
        self,
        group: str,
        capacity: int,
        pinned: Mapping[str, LoraRef],
        workers: Callable[[], AdapterWorkers | None],
        table: LoraTable | None = None,
    ) -> None:
        """`capacity` 0: LoRA is off here (no adapter is held or loaded)."""
        self.group = group
        self.capacity = capacity
        self.pinned = set(pinned) if capacity else set()
        self.held: OrderedDict[str, LoraRef] = OrderedDict(pinned if capacity else {})
        self.version = 0  # bumped by every change of `held`
        self.table = table
        self._workers = workers
        self._loading: dict[str, asyncio.Future[None]] = {}
        self.on_change: list[Callable[[], Awaitable[None]]] = []  # publishes the entry

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.held))

    async def publish_pinned(self) -> None:
        """Writes the --lora-modules into the cluster's table where their names are free
        (again after Redis restarted empty: then every held adapter)."""
        if self.table is None or not self.held:
            return
        taken = await self.table.put_absent({n: ref.path for n, ref in self.held.items()})
        for name, path in taken.items():
            logger.warning(
                "LoRA adapter %s is %s in the cluster's table, %s here: other "
                "groups load it from the table's folder",
                name,
                path,
                self.held[name].path,
            )

    async def resolve(self, name: str) -> None:
        """Holds `name` if the cluster serves it, loading it here first if need be. Raises
        ValueError, worded for the client, when the load fails; an adapter the cluster does
        not serve is left to the caller (the request's conversion names what is served)."""
        if not name or not self.enabled:
            return
        if name in self.held:
            self.held.move_to_end(name)
            return
        if self.table is None:
            return
        try:
            path = await asyncio.wait_for(self.table.get(name), TABLE_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            raise ValueError(
                f"LoRA adapter {name!r} is not held by engine group "
                f"{self.group}, and the cluster's adapter table in Redis is "
                f"unreachable ({exc}); retry shortly"
            ) from exc
        if path is None:
            return
        try:
            await self._load_once(name, path)
        except AdapterLoadFailed as exc:
            raise ValueError(
                f"LoRA adapter {name!r} (folder {path}) could not be loaded on "
                f"engine group {self.group}: {exc.details}"
            ) from exc

    async def load(self, name: str, path: str) -> None:
        """An admin's run-time load: held here, and in the cluster's table. Raises
        AdapterLoadFailed as the workers refused it."""
        await self._load_once(name, path, reload=True)
        if self.table is not None:
            await self.table.put(name, path)

    async def unload(self, name: str) -> bool:
        """Let go here and out of the cluster's table; whether either had it."""
        held = self.held.pop(name, None) is not None
        self.pinned.discard(name)
        in_table = await self.table.remove(name) if self.table is not None else False
        if held:
            self._changed()
            workers = self._workers()
            if workers is not None:
                await workers.unload_lora(name, LOAD_TIMEOUT_S)
            await self._notify()
        return held or in_table

    async def _load_once(self, name: str, path: str, reload: bool = False) -> None:
        """One load of `name` at a time; a caller arriving meanwhile waits for it."""
        running = self._loading.get(name)
        if running is None or reload:
            running = asyncio.ensure_future(self._load(name, path))
            self._loading[name] = running
            running.add_done_callback(lambda done: self._forget_load(name, done))
        await asyncio.shield(running)

    def _forget_load(self, name: str, done: asyncio.Future[None]) -> None:
        if self._loading.get(name) is done:
            del self._loading[name]

    async def _load(self, name: str, path: str) -> None:
        workers = self._workers()
        if workers is None:
            raise AdapterLoadFailed(
                grpc.StatusCode.UNIMPLEMENTED, "this engine runs its model in-process"
            )
        try:
            await workers.load_lora(name, path, LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise AdapterLoadFailed(exc.code(), exc.details() or str(exc.code())) from exc
        self.held[name] = LoraRef(name, path)
        self.held.move_to_end(name)
        self._evict(keep=name)
        self._changed()
        logger.info("LoRA adapter %s held by engine group %s (from %s)", name, self.group, path)
        await self._notify()

    def _evict(self, keep: str) -> None:
        """Down to `capacity`, letting go of the least recently named unpinned adapters."""
        spare = [n for n in self.held if n not in self.pinned and n != keep]
        for name in spare[: max(0, len(self.held) - self.capacity)]:
            del self.held[name]
            logger.info(
                "LoRA adapter %s let go by engine group %s (over --max-cpu-loras "
                "%d; loaded again when named)",
                name,
                self.group,
                self.capacity,
            )

    def _changed(self) -> None:
        self.version += 1

    async def _notify(self) -> None:
        for publish in self.on_change:
            try:
                await publish()
            except Exception as exc:  # the next heartbeat publishes it anyway
                logger.debug("publishing the adapters failed: %s", exc)
