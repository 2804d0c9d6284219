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
from typing import Any

from pagemesh.registry import Registry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    address: str
    tp_rank: int
    pp_rank: int


def choose_members(entries: dict[str, dict[str, Any]], group: str, tp_size: int,
                   pp_size: int) -> dict[tuple[int, int], str] | None:
    """One live worker per (pp_rank, tp_rank) slot of the layout, or None while a slot is
    empty. Workers of another layout are ignored; among several candidates for a slot the
    smallest id wins, so every scheduler picks the same ones."""
    slots: dict[tuple[int, int], str] = {}
    for worker_id in sorted(entries):
        info = entries[worker_id]
        if info.get("group") != group or info.get("status") not in ("joining", "loading", "ready"):
            continue
        if (info.get("tp_size", 1), info.get("pp_size", 1)) != (tp_size, pp_size):
            logger.warning("worker %s has layout tp=%s pp=%s, group wants tp=%d pp=%d",
                           worker_id, info.get("tp_size"), info.get("pp_size"), tp_size, pp_size)
            continue
        slots.setdefault((info.get("pp_rank", 0), info.get("tp_rank", 0)), worker_id)
    if len(slots) < tp_size * pp_size:
        return None
    return slots


async def form_group(registry: Registry, group: str, tp_size: int, pp_size: int,
                     timeout_s: float) -> list[WorkerEndpoint]:
    """Returns the group's workers sorted by (pp_rank, tp_rank) once every one is ready."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    members = None
    while members is None:
        entries = await registry.list("worker")
        members = choose_members(entries, group, tp_size, pp_size)
        if members is None:
            if loop.time() > deadline:
                raise TimeoutError(
                    f"engine group {group!r} needs {tp_size * pp_size} workers "
                    f"(tp={tp_size} x pp={pp_size}); found only "
                    f"{sum(1 for e in entries.values() if e.get('group') == group)} "
                    f"after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)
    epoch = ""
    if tp_size * pp_size > 1:
        epoch = uuid.uuid4().hex
        master = entries[members[(0, 0)]]["dist_addr"]
        host, port = master.rsplit(":", 1)
        plan = {"epoch": epoch, "world_size": tp_size * pp_size, "master_addr": host,
                "master_port": int(port),
                "members": {wid: pp * tp_size + tp for (pp, tp), wid in members.items()}}
        await registry.publish_rendezvous(group, plan)
        logger.info("published rendezvous of group %s: %s", group, plan)
    while True:
        entries = await registry.list("worker")
        ready = [wid for wid in members.values()
                 if entries.get(wid, {}).get("status") == "ready"
                 and entries[wid].get("epoch", "") == epoch]
        if len(ready) == len(members):
            break
        if loop.time() > deadline:
            raise TimeoutError(f"workers of group {group!r} not ready after {timeout_s:.0f} s: "
                               f"{sorted(set(members.values()) - set(ready))}")
        await asyncio.sleep(0.2)
    return sorted(
        (WorkerEndpoint(wid, entries[wid]["address"], tp, pp) for (pp, tp), wid in members.items()),
        key=lambda e: (e.pp_rank, e.tp_rank),
    )
