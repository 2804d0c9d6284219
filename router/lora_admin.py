"""Loading and unloading LoRA adapters at run time: the Admin service's LoadLoraAdapter /
UnloadLoraAdapter and vLLM's HTTP endpoints (`POST /v1/load_lora_adapter`,
`/v1/unload_lora_adapter`) both come here.

A load goes to the groups serving LoRA that have room for another adapter (or hold this
one already; when none has room, the least busy one): their workers read and check it, and
the scheduler writes it in the cluster's adapter table (pagemesh/runtime/lora_table.py), from which
every other group loads it when a request for it is sent there. A refusal (the adapter is
not a PEFT folder, its rank is above --max-lora-rank, it is another base model's) is the
caller's error, as the workers worded it. Where the adapter loaded, this router routes to it
at once, and every router from the groups' next heartbeat on; the entries carry a version
of each group's adapter list, so an entry read before the change cannot undo it here.

An unload goes to every group: out of the table, and let go where it is held.
"""

from __future__ import annotations

import asyncio

import grpc

from pagemesh.runtime.serving import ServiceError, invalid_argument
from protos.pagemesh.v1 import admin_pb2
from router.group_directory import EngineGroup, GroupDirectory

TIMEOUT_S = 150.0  # the scheduler's own wait on its workers, and some


async def load_adapter(directory: GroupDirectory, name: str, path: str) -> list[str]:
    """The engine groups serving `name` now."""
    if not name or not path:
        raise invalid_argument(
            "give lora_name and lora_path (the adapter's PEFT folder, on the workers' hosts)"
        )
    groups = _load_targets(directory, name)
    request = admin_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
    replies = await asyncio.gather(
        *(g.conn.stub.LoadLoraAdapter(request, timeout=TIMEOUT_S) for g in groups),
        return_exceptions=True,
    )
    loaded = []
    for group, reply in zip(groups, replies):
        if isinstance(reply, grpc.aio.AioRpcError):
            if reply.code() == grpc.StatusCode.FAILED_PRECONDITION:
                continue  # LoRA is off there
            raise ServiceError(reply.code(), reply.details() or str(reply.code()))
        if isinstance(reply, BaseException):
            raise reply
        group.set_loras(tuple(reply.loras), reply.lora_version)
        loaded.append(group.name)
    if not loaded:
        raise _no_lora_group()
    directory.table_changed(name, True)
    return loaded


def _load_targets(directory: GroupDirectory, name: str) -> list[EngineGroup]:
    live = [g for g in directory.groups if not g.conn.retired]
    if not live:
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no engine group is known yet; retry")
    lora = [g for g in live if g.lora_capacity > 0]
    if not lora:
        raise _no_lora_group()
    targets = [g for g in lora if g.has_room() or name in g.loras]
    return targets or [
        min(lora, key=lambda g: (not g.ready, g.load.num_running + g.load.num_waiting))
    ]


def _no_lora_group() -> ServiceError:
    return ServiceError(
        grpc.StatusCode.FAILED_PRECONDITION,
        "no engine group serves LoRA adapters: start them with --enable-lora",
    )


async def unload_adapter(directory: GroupDirectory, name: str) -> list[str]:
    """The engine groups that served `name`; NOT_FOUND when none did."""
    groups = [g for g in directory.groups if not g.conn.retired]
    request = admin_pb2.UnloadLoraAdapterRequest(lora_name=name)
    replies = await asyncio.gather(
        *(g.conn.stub.UnloadLoraAdapter(request, timeout=TIMEOUT_S) for g in groups),
        return_exceptions=True,
    )
    unloaded = []
    for group, reply in zip(groups, replies):
        if isinstance(reply, grpc.aio.AioRpcError):
            if reply.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
                continue
            raise ServiceError(reply.code(), reply.details() or str(reply.code()))
        if isinstance(reply, BaseException):
            raise reply
        group.set_loras(tuple(reply.loras), reply.lora_version)
        unloaded.append(group.name)
    directory.table_changed(name, False)
    if not unloaded:
        raise ServiceError(
            grpc.StatusCode.NOT_FOUND,
            f"LoRA adapter {name!r} is not served here (adapters: "
            f"{', '.join(sorted(directory.adapters)) or 'none'})",
            reason="model_not_found",
        )
    return unloaded
