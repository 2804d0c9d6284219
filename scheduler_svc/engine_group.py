"""The workers one scheduler drives: formed from the registry at start, re-formed after one
of them dies, watched in between."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from pagemesh.runtime.registry import Registry
from pagemesh.runtime.registry_entries import WorkerEntry
from pagemesh.runtime.tls import TlsConfig
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.host_tier import HostTierIndex
from scheduler_svc.group_formation import WorkerEndpoint, form_group
from scheduler_svc.messages import WorkerInfo
from scheduler_svc.worker_client import WorkerGroupClient

logger = logging.getLogger(__name__)

ConfigFor = Callable[[list[WorkerInfo], int], SchedulerConfig]


@dataclass(frozen=True)
class GroupSpec:
    group: str
    tp: int
    pp: int
    worker_wait_s: float
    step_timeout_s: float
    tls: TlsConfig
    # At the first formation, seconds before a standby may take a slot whose worker has
    # not registered yet (re-formations use standbys at once).
    standby_grace_s: float = 60.0


@dataclass
class FormedGroup:
    workers: WorkerGroupClient
    config: SchedulerConfig
    lead: WorkerInfo  # the driver's: model, vocabulary, block size
    infos: list[WorkerInfo]  # every member's, in endpoint order

    @property
    def weight_bytes(self) -> int:
        """The group's weights in memory, summed over its ranks."""
        return sum(info.weight_bytes for info in self.infos)

    @property
    def kv_cache_bytes(self) -> int:
        """The group's KV caches as used: each rank's bytes per block times the group's
        block count (the smallest rank's), summed over its ranks."""
        return sum(
            info.kv_cache_bytes * self.config.num_blocks // max(1, info.num_blocks)
            for info in self.infos
        )


class EngineGroup:
    def __init__(self, registry: Registry, spec: GroupSpec, config_for: ConfigFor) -> None:
        self.registry = registry
        self.spec = spec
        self.config_for = config_for
        # Instances found dead: never chosen again (a restarted worker is a new instance).
        self.dead_instances: set[str] = set()
        # The step session and rendezvous epoch of the last formation: the scheduler
        # publishes them in its registry entry, where each worker checks a new session.
        self.session = ""
        self.epoch = ""
        # Awaited before the first step of each formation's session: the scheduler publishes
        # its entry (compare-and-set on its claim), so that the workers accept the session.
        self.on_new_session: list[Callable[[], Awaitable[None]]] = []

    async def form(
        self, previous: WorkerGroupClient | None = None, timeout_s: float | None = None
    ) -> FormedGroup:
        """Chooses live workers (keeping the previous members that still answer), waits until
        they are ready, and sizes the scheduler from what they report."""
        prefer: frozenset[str] = frozenset()
        if previous is not None:
            dead = await previous.find_dead()
            self.dead_instances.update(e.instance for e in dead if e.instance)
            for endpoint in dead:
                logger.warning("worker %s (%s) is dead", endpoint.worker_id, endpoint.address)
                await self._fence(endpoint)
            prefer = frozenset(e.worker_id for e in previous.endpoints if e not in dead)
            await previous.close()
        spec = self.spec
        endpoints, epoch = await form_group(
            self.registry,
            spec.group,
            spec.tp,
            spec.pp,
            timeout_s or spec.worker_wait_s,
            frozenset(self.dead_instances),
            prefer,
            standby_after_s=0.0 if previous else spec.standby_grace_s,
        )
        workers = WorkerGroupClient(
            endpoints, spec.step_timeout_s, spec.tls, announce=self._announce
        )
        try:
            infos = await workers.get_info()
        except Exception:
            await workers.close()
            raise
        config = self.config_for(infos, workers.driver_index)
        self.session, self.epoch = workers.session_id, epoch
        logger.info(
            "engine group %s formed: %s",
            spec.group,
            [f"{e.worker_id}@{e.address}" for e in endpoints],
        )
        return FormedGroup(workers, config, infos[workers.driver_index], infos)

    async def _announce(self) -> None:
        for hook in self.on_new_session:
            await hook()

    async def _fence(self, endpoint: WorkerEndpoint) -> None:
        """A member that does not answer may only be frozen or cut off: fence it, so that
        if it comes back it leaves instead of acting on its old rank
        (pagemesh/runtime/registry.py)."""
        if not endpoint.instance:
            return
        try:
            await self.registry.fence(
                endpoint.instance,
                {
                    "reason": f"did not answer the scheduler of group {self.spec.group}",
                    "kind": "worker",
                    "worker_id": endpoint.worker_id,
                    "address": endpoint.address,
                    "pid": endpoint.pid,
                    "host": endpoint.host,
                },
            )
        except Exception as exc:  # Redis away: it is still never chosen again by this scheduler
            logger.warning("could not fence worker %s: %s", endpoint.worker_id, exc)

    async def members_alive(self, workers: WorkerGroupClient) -> bool:
        """False when a member refuses connections (its process is gone), or does not answer
        and its registry entry expired or belongs to another process. Redis being away, or
        emptied by a restart, is not a death; neither is a member merely slow to answer."""
        codes = await workers.probe(timeout_s=2.0)
        if all(code is None for code in codes):
            return True
        if any(code == grpc.StatusCode.UNAVAILABLE for code in codes):
            return False
        try:
            entries = await self.registry.entries(WorkerEntry)
        except Exception as exc:
            logger.debug("registry unreadable, not judging slow workers: %s", exc)
            return True
        return all(
            code is None or (e.worker_id in entries and entries[e.worker_id].instance == e.instance)
            for e, code in zip(workers.endpoints, codes)
        )


def host_tier_for(infos: list[WorkerInfo], current: HostTierIndex | None) -> HostTierIndex | None:
    """The group's host tier index (core/host_tier.py): kept across a re-formation while
    every rank reports the same tier (its epoch), so requests carried over reload their
    blocks from it; cleared when a tier is another one now; None when a rank has none."""
    num_slots = min((info.host_tier_slots for info in infos), default=0)
    if num_slots == 0:
        return None
    epochs = tuple(info.host_tier_epoch for info in infos)
    if current is None or current.num_slots != num_slots:
        return HostTierIndex(num_slots, epochs)
    if current.epochs != epochs:
        logger.warning(
            "the host tier of a rank is another one now (epochs %s -> %s): "
            "its blocks are forgotten",
            current.epochs,
            epochs,
        )
        current.reset(epochs)
    return current
