"""Forming an engine group: pick one worker per (pipeline stage, tensor rank) from the
registry, publish the torch.distributed rendezvous through Redis, wait until all are ready.

Workers announce themselves with their ranks, the group layout and, for the process-group
master, an address and port they reserved (`dist_addr`). The scheduler chooses the members
and publishes `{epoch, world_size, master_addr, master_port, members: {worker_id: rank}}`;
no address or port is hard-coded anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from pagemesh.runtime.registry import Registry
from pagemesh.runtime.registry_entries import WorkerEntry, WorkerStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    address: str
    tp_rank: int
    pp_rank: int
    instance: str = ""  # the process behind the id (a restarted one keeps the id)
    pid: int = -1  # that process, on `host`
    host: str = ""


# Workers that hold a rank of their own and can take their slot (a standby holds none).
_CANDIDATE = (WorkerStatus.JOINING, WorkerStatus.LOADING, WorkerStatus.READY)


def choose_members(
    entries: dict[str, WorkerEntry],
    group: str,
    tp_size: int,
    pp_size: int,
    exclude: frozenset[str] = frozenset(),
    prefer: frozenset[str] = frozenset(),
    use_standby: bool = True,
) -> dict[tuple[int, int], str] | None:
    """One live worker per (pp_rank, tp_rank) slot of the layout, or None while a slot is
    empty. Workers of another layout, and those whose `instance` is in `exclude` (found
    dead), are ignored. For a slot, a worker in `prefer` (the last members: they keep their
    state) wins, then a ready one, then the smallest id, so every scheduler picks the same.
    With `use_standby`, slots still empty take `standby` workers (no rank of their own),
    smallest id first."""
    slots: dict[tuple[int, int], str] = {}
    standbys: list[str] = []

    def rank(worker_id: str) -> tuple[int, int, str]:
        return (worker_id not in prefer, entries[worker_id].status != WorkerStatus.READY, worker_id)

    for worker_id in sorted(entries, key=rank):
        entry = entries[worker_id]
        if entry.group != group or entry.instance in exclude:
            continue
        if (entry.tp_size, entry.pp_size) != (tp_size, pp_size):
            logger.warning(
                "worker %s has layout tp=%s pp=%s, group wants tp=%d pp=%d",
                worker_id,
                entry.tp_size,
                entry.pp_size,
                tp_size,
                pp_size,
            )
            continue
        if entry.status == WorkerStatus.STANDBY:
            standbys.append(worker_id)
        elif entry.status in _CANDIDATE:
            slots.setdefault((entry.pp_rank, entry.tp_rank), worker_id)
    empty = [(pp, tp) for pp in range(pp_size) for tp in range(tp_size) if (pp, tp) not in slots]
    for slot, worker_id in zip(empty, sorted(standbys) if use_standby else []):
        slots[slot] = worker_id
    if len(slots) < tp_size * pp_size:
        return None
    return slots


async def form_group(
    registry: Registry,
    group: str,
    tp_size: int,
    pp_size: int,
    timeout_s: float,
    exclude: frozenset[str] = frozenset(),
    prefer: frozenset[str] = frozenset(),
    standby_after_s: float = 0.0,
) -> tuple[list[WorkerEndpoint], str]:
    """Returns the group's workers sorted by (pp_rank, tp_rank) once every one is ready, and
    the epoch of the rendezvous they are in ("" for a single worker).

    Standbys fill empty slots only after `standby_after_s`: at a first formation, workers
    still starting must not lose their rank to a standby that happened to register first.

    A multi-worker group gets a new rendezvous plan (epoch) unless the chosen members are
    exactly those of the current plan and all still ready in it (a restarted scheduler
    finds its workers intact). Raises TimeoutError after `timeout_s`.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    standby_from = loop.time() + standby_after_s
    members = None
    while members is None:
        entries = await registry.entries(WorkerEntry)
        members = choose_members(
            entries,
            group,
            tp_size,
            pp_size,
            exclude,
            prefer,
            use_standby=loop.time() >= standby_from,
        )
        if members is None:
            if loop.time() > deadline:
                raise TimeoutError(
                    f"engine group {group!r} needs {tp_size * pp_size} workers "
                    f"(tp={tp_size} x pp={pp_size}); found only "
                    f"{sum(1 for e in entries.values() if e.group == group)} "
                    f"after {timeout_s:.0f} s"
                )
            await asyncio.sleep(0.2)
    epoch = await _publish_plan(registry, group, tp_size, members, entries)
    while True:
        entries = await registry.entries(WorkerEntry)
        ready = [
            wid
            for wid in members.values()
            if wid in entries
            and entries[wid].status == WorkerStatus.READY
            and (not epoch or entries[wid].epoch == epoch)
        ]
        if len(ready) == len(members):
            break
        if loop.time() > deadline:
            raise TimeoutError(
                f"workers of group {group!r} not ready after {timeout_s:.0f} s: "
                f"{sorted(set(members.values()) - set(ready))}"
            )
        await asyncio.sleep(0.1)
    endpoints = sorted(
        (
            WorkerEndpoint(
                wid,
                entries[wid].address,
                tp,
                pp,
                entries[wid].instance,
                entries[wid].pid,
                entries[wid].host,
            )
            for (pp, tp), wid in members.items()
        ),
        key=lambda e: (e.pp_rank, e.tp_rank),
    )
    return endpoints, epoch


async def _publish_plan(
    registry: Registry,
    group: str,
    tp_size: int,
    members: dict[tuple[int, int], str],
    entries: dict[str, WorkerEntry],
) -> str:
    """The epoch the members must reach: the current plan's when it still holds, a new
    one published otherwise; "" for a single worker that needs no process group."""
    ranks = {wid: pp * tp_size + tp for (pp, tp), wid in members.items()}
    standby = any(entries[wid].status == WorkerStatus.STANDBY for wid in ranks)
    if len(ranks) == 1 and not standby:
        return ""
    current = await registry.get_rendezvous(group)
    if (
        current is not None
        and current.get("members") == ranks
        and all(
            entries[wid].status == WorkerStatus.READY and entries[wid].epoch == current["epoch"]
            for wid in ranks
        )
    ):
        logger.info("group %s: members unchanged, keeping epoch %s", group, current["epoch"])
        return "" if len(ranks) == 1 else current["epoch"]
    master = entries[members[(0, 0)]].dist_addr
    host, port = master.rsplit(":", 1)
    plan = {
        "epoch": uuid.uuid4().hex,
        "world_size": len(ranks),
        "master_addr": host,
        "master_port": int(port),
        "members": ranks,
    }
    await registry.publish_rendezvous(group, plan)
    logger.info("published rendezvous of group %s: %s", group, plan)
    return "" if len(ranks) == 1 else plan["epoch"]
