"""The engine groups this router can send requests to: discovered in Redis, dialled over gRPC.

Groups' health comes from the `status` each scheduler publishes in its registry entry
(pagemesh.runtime.registry_entries.GroupStatus): ready (or none, from older schedulers) is a
complete
group; degraded (a worker is missing, the group is being re-formed; requests queue there) is
a fallback used only when no ready group exists; draining is never picked. The router is
SERVING iff at least one ready group exists.

Each scheduler's own gRPC health counts too (router/scheduler_connection.py): a group whose
health says NOT_SERVING, or that does not answer, is not ready and only a fallback, whatever
its registry entry still says.

A group missing from one registry poll is kept, with its last status, until it has been missing
for longer than the registry TTL: a restarted Redis is empty for up to a heartbeat, and
dropping every group then would break every stream. A dead group's entry expires after one TTL,
so it is dropped after two; meanwhile (unreachable, so not ready) it is tried only after every
other group, and a request it fails is resumed elsewhere (router/dispatcher.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pagemesh.runtime.registry import Registry, raise_if_cancelled
from pagemesh.runtime.registry_entries import GroupStatus, SchedulerEntry
from pagemesh.runtime.serving import unavailable
from pagemesh.runtime.tls import TlsConfig
from router.routing import GroupLoad
from router.scheduler_connection import SchedulerConnection
from router.types import ModelInfo

logger = logging.getLogger(__name__)


@dataclass
class EngineGroup:
    """One engine group as its scheduler's registry entry and connection show it."""

    scheduler_id: str
    name: str  # the engine group (registry "group"): checkpoints are listed under it
    address: str
    instance: str  # the scheduler process (registry "instance"); a new one = a restart
    conn: SchedulerConnection
    load: GroupLoad  # as its scheduler last reported (outstanding_tokens: the dispatcher's)
    status: GroupStatus = GroupStatus.READY
    missing_since: float | None = None  # loop time of the first poll it was missing from
    suspect_until: float = 0.0  # a request failed here: others first until then (loop time)
    loras: tuple[str, ...] = ()  # the LoRA adapters its scheduler serves
    # The version of `loras` (the scheduler's): a registry entry read before a run-time
    # load or unload this router made carries an older one, and does not undo it.
    lora_version: int = 0
    lora_capacity: int = 0  # the adapters it may hold at once; 0: it serves no LoRA
    # Disaggregated serving: "prefill" groups take new requests and hand each off after
    # its first token; "decode" groups continue them; "both" do either.
    role: str = "both"

    def set_loras(self, loras: tuple[str, ...], version: int) -> None:
        if version >= self.lora_version:
            self.loras, self.lora_version = loras, version

    def may_serve(self, adapter: str) -> bool:
        """It holds `adapter`, or serves LoRA and would load it (from the cluster's table)."""
        return adapter in self.loras or self.lora_capacity > 0

    def has_room(self) -> bool:
        """It would load another adapter without letting one go."""
        return len(self.loras) < self.lora_capacity

    @property
    def ready(self) -> bool:
        return self.status == GroupStatus.READY and self.conn.healthy is not False

    def not_suspect(self) -> None:
        """A request made progress here."""
        self.suspect_until = 0.0


class GroupDirectory:
    """One connection per live scheduler, refreshed from the registry every
    `poll_interval_s` (`run`), and the model they serve.

    `on_change(serving)` is called when whether a ready group exists changed (after a
    registry poll or a health check). `on_group_reset` callbacks get the scheduler id of a
    group whose process restarted or that left: what the router learnt about it is void.
    """

    def __init__(
        self,
        registry: Registry,
        poll_interval_s: float,
        on_change: Callable[[bool], object] | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.registry = registry
        self.tls = tls or TlsConfig()
        self.poll_interval_s = poll_interval_s
        self.on_group_reset: list[Callable[[str], object]] = []
        self._on_change = on_change
        self._groups: dict[str, EngineGroup] = {}
        self._table: set[str] = (
            set()
        )  # the cluster's adapter table (pagemesh/runtime/lora_table.py)
        self._model_info: ModelInfo | None = None
        self._serving = False

    @property
    def groups(self) -> list[EngineGroup]:
        """Every group known, ready or not, missing from the registry or not."""
        return list(self._groups.values())

    def get(self, scheduler_id: str) -> EngineGroup:
        return self._groups[scheduler_id]

    @property
    def num_groups(self) -> int:
        """Ready groups: the replicas serving now (not degraded, draining, unreachable or
        dead ones kept while missing from the registry)."""
        return sum(g.ready and g.missing_since is None for g in self._groups.values())

    @property
    def serving(self) -> bool:
        """At least one complete (ready) engine group: the router's health."""
        return any(g.ready for g in self._groups.values())

    @property
    def ttl_s(self) -> float:
        """How long a registry entry outlives its last heartbeat, seconds."""
        return self.registry.config.ttl_s

    @property
    def adapters(self) -> set[str]:
        """The LoRA adapters a request may name as its model: those some group holds, and
        those of the cluster's table while some group serves LoRA (it loads them)."""
        held = {name for group in self._groups.values() for name in group.loras}
        if any(group.lora_capacity for group in self._groups.values()):
            held |= self._table
        return held

    def table_changed(self, name: str, present: bool) -> None:
        """This router loaded or unloaded `name`: known at once, before the next poll."""
        if present:
            self._table.add(name)
        else:
            self._table.discard(name)

    @property
    def model_name(self) -> str:
        """The served model's name once a group was asked (`model_info`), else ""."""
        return self._model_info.model if self._model_info is not None else ""

    async def model_info(self) -> ModelInfo:
        """The served model, asked once of any group (all groups serve the same model), with
        `num_replicas` the ready groups now. UNAVAILABLE while no group answers."""
        info = self._model_info or await self._ask_model_info()
        if info.num_replicas != self.num_groups:
            info = dataclasses.replace(info, num_replicas=self.num_groups)
        self._model_info = info
        return info

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:
                logger.warning("registry poll failed: %s", exc)
            raise_if_cancelled()  # a cancel redis-py turned into an error, or retried away
            await asyncio.sleep(self.poll_interval_s)

    async def refresh(self) -> None:
        """One registry poll: groups joined, restarted, changed status or left."""
        # An entry without an address cannot be dialled: as good as absent.
        entries = {
            scheduler_id: entry
            for scheduler_id, entry in (await self.registry.entries(SchedulerEntry)).items()
            if entry.address
        }
        now = asyncio.get_running_loop().time()
        for scheduler_id, entry in entries.items():
            self._update(scheduler_id, entry)
        for scheduler_id in set(self._groups) - set(entries):
            group = self._groups[scheduler_id]
            if group.missing_since is None:
                group.missing_since = now
                logger.info(
                    "engine group %s is missing from the registry; kept for %.1f s",
                    scheduler_id,
                    self.ttl_s,
                )
            elif now - group.missing_since > self.ttl_s:
                self._drop(scheduler_id)
        self._notify()
        if any(entry.lora_capacity for entry in entries.values()):
            self._table = set(await self.registry.loras.all())

    async def close(self) -> None:
        for group in self._groups.values():
            await group.conn.close()

    def _update(self, scheduler_id: str, entry: SchedulerEntry) -> None:
        # Free blocks not said: routed as if full, the least attractive.
        load = GroupLoad(
            scheduler_id, entry.num_running, entry.num_waiting, entry.num_free_blocks or 0
        )
        group = self._groups.get(scheduler_id)
        if group is None or group.address != entry.address or group.instance != entry.instance:
            group = self._join(scheduler_id, entry, load, group)
        if group.status != entry.status:
            logger.warning("engine group %s is %s", scheduler_id, entry.status)
        group.load, group.status, group.missing_since = load, entry.status, None
        group.set_loras(entry.loras, entry.lora_version)
        group.lora_capacity = entry.lora_capacity
        group.role = entry.role

    def _join(
        self,
        scheduler_id: str,
        entry: SchedulerEntry,
        load: GroupLoad,
        previous: EngineGroup | None,
    ) -> EngineGroup:
        """A new scheduler process: a new connection (the previous one retired)."""
        conn = SchedulerConnection(
            scheduler_id, entry.address, self.tls, self._notify, self.poll_interval_s
        )
        if previous is not None:
            previous.conn.retire()
            self._reset(scheduler_id)  # a new process: an empty cache
            logger.warning("engine group %s restarted at %s", scheduler_id, entry.address)
        else:
            logger.info("engine group %s at %s joined", scheduler_id, entry.address)
        group = EngineGroup(
            scheduler_id, entry.group or scheduler_id, entry.address, entry.instance, conn, load
        )
        self._groups[scheduler_id] = group
        return group

    def _drop(self, scheduler_id: str) -> None:
        logger.warning(
            "engine group %s left (missing from the registry for over %.1f s)",
            scheduler_id,
            self.ttl_s,
        )
        self._groups.pop(scheduler_id).conn.retire()
        self._reset(scheduler_id)

    def _reset(self, scheduler_id: str) -> None:
        for callback in self.on_group_reset:
            callback(scheduler_id)

    def _notify(self) -> None:
        """Tells `on_change` when whether a ready group exists changed."""
        serving = self.serving
        if serving == self._serving:
            return
        self._serving = serving
        logger.info(
            "router %s: %d engine groups, %d ready",
            "SERVING" if serving else "NOT_SERVING",
            len(self._groups),
            sum(g.ready for g in self._groups.values()),
        )
        if self._on_change is not None:
            self._on_change(serving)

    async def _ask_model_info(self) -> ModelInfo:
        for group in list(self._groups.values()):
            try:
                return await group.conn.model_info()
            except grpc.aio.AioRpcError as exc:
                logger.warning("GetModelInfo on %s failed: %s", group.scheduler_id, exc.details())
        raise unavailable("no engine group is available yet; retry shortly")
