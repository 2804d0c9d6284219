"""Service registry and heartbeats in Redis.

Each service writes `<prefix>:<kind>:<id>` = JSON of where it is and what it serves, with
a TTL of a few heartbeats, and refreshes it every heartbeat. A key that expired is a
service that died: membership is read from Redis, never from a hard-coded address.
What an entry holds is typed in pagemesh.runtime.registry_entries: writers publish
`entry.to_json()`,
readers call `entries(WorkerEntry)` and the like.

Fencing: a scheduler that declares a worker failed (it stopped answering: frozen, or cut off
by the network) writes `<prefix>:fenced:<instance>` for that process. Such a process may
wake up or be reached again later, still thinking it holds its rank: before each heartbeat
every service looks for its own fence, and a fenced one stops beating (so it cannot
overwrite the entry of whoever took its place) and tells its `on_fenced` hooks, which end
the process; its supervisor then starts a fresh one. `pagemesh up` also kills fenced
children it sees (pagemesh/tools/liveness.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis

from pagemesh.runtime.checkpoints import CheckpointStore
from pagemesh.runtime.lora_table import LoraTable
from pagemesh.runtime.registry_entries import ServiceEntry
from pagemesh.runtime.serving import FatalStartupError

logger = logging.getLogger(__name__)

E = TypeVar("E", bound=ServiceEntry)
FENCE_TTL_S = 3600.0  # a fence outlives any process that could still wake up and act on it


@dataclass(frozen=True)
class RegistryConfig:
    redis_url: str
    cluster: str = "pagemesh"
    heartbeat_interval_s: float = 1.0
    ttl_s: float = 3.0
    call_timeout_s: float = 2.0  # the longest any Redis call may take

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        if self.call_timeout_s <= 0:
            raise ValueError("call_timeout_s must be > 0")
        if self.ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"ttl_s ({self.ttl_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}) or live services would expire"
            )


def raise_if_cancelled() -> None:
    """A cancel that lands in a Redis call with a socket timeout can come out of redis-py as
    a connection error, or be retried away (its default retry) so that the call returns:
    the task is still being cancelled, and must stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class RegistryConflict(FatalStartupError):
    """Another live service already holds this id."""


class ClaimLost(RuntimeError):
    """This process's registry entry is held by another instance now (split brain averted)."""


# KEYS[1] = the entry; ARGV = its new value, this instance, the TTL in ms. Writes unless the
# entry there names another instance; returns "" when written, else the holder's instance.
_PUT_IF_MINE = """
local current = redis.call('GET', KEYS[1])
if current then
  local ok, entry = pcall(cjson.decode, current)
  if ok and type(entry) == 'table' and entry['instance'] and entry['instance'] ~= ARGV[2] then
    return entry['instance']
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return ''
"""


class Registry:
    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        # Every call is bounded: a frozen Redis (SIGSTOPped, partitioned away) must fail
        # a call within seconds, not hold it (and the heartbeat, the request behind it) forever.
        self._redis = aioredis.from_url(
            config.redis_url,
            decode_responses=True,
            socket_timeout=config.call_timeout_s,
            socket_connect_timeout=config.call_timeout_s,
        )
        self._heartbeats: list[asyncio.Task[None]] = []
        self.checkpoints = CheckpointStore(self._redis, config.cluster)
        self.loras = LoraTable(self._redis, config.cluster)  # the adapters the cluster serves
        # Called (no arguments) after Redis came back empty-handed: a restarted server, whose
        # keys are gone. Services re-publish what they own (checkpoints) there.
        self.on_redis_restart: list[Any] = []
        # Called with the fence record once this process finds itself fenced (see above).
        self.on_fenced: list[Any] = []
        self._run_id: str | None = None
        # Told apart from a dead predecessor that had the same id (a restarted container).
        self.instance = uuid.uuid4().hex
        # time.monotonic() of the last successful write of a service key (claim, heartbeat):
        # the heartbeat age each service exports (pagemesh/runtime/metrics.py). None before the
        # first.
        self.last_heartbeat_s: float | None = None

    def key(self, kind: str, service_id: str) -> str:
        return f"{self.config.cluster}:{kind}:{service_id}"

    async def ping(self) -> None:
        await self._redis.ping()

    async def put(self, kind: str, service_id: str, info: dict[str, Any]) -> None:
        """Refreshes this process's entry: compare-and-set on the instance, in one Lua
        script. An entry another instance holds (this one was cut off longer than the TTL
        and was replaced) is left alone: ClaimLost."""
        ttl_ms = int(self.config.ttl_s * 1000)
        key = self.key(kind, service_id)
        holder = await self._redis.eval(
            _PUT_IF_MINE, 1, key, self._dumps(info), self.instance, ttl_ms
        )
        if holder:
            raise ClaimLost(
                f"{kind} {service_id!r} is held by another instance ({holder}) "
                f"since this one ({self.instance}) was cut off longer than the "
                "registry TTL"
            )
        self.last_heartbeat_s = time.monotonic()

    def _dumps(self, info: dict[str, Any]) -> str:
        # The instance is this process's, whatever the info says (an entry read back and
        # published again carries its reader's idea of it).
        return json.dumps({**info, "instance": self.instance})

    async def remove(self, kind: str, service_id: str) -> None:
        await self._redis.delete(self.key(kind, service_id))

    async def list(self, kind: str) -> dict[str, dict[str, Any]]:
        """Live services of one kind: id -> the info they last published."""
        prefix = f"{self.config.cluster}:{kind}:"
        keys = [key async for key in self._redis.scan_iter(match=prefix + "*", count=1000)]
        if not keys:
            return {}
        values = await self._redis.mget(keys)
        return {
            key[len(prefix) :]: json.loads(value)
            for key, value in zip(keys, values)
            if value is not None
        }

    async def entries(self, entry_type: type[E]) -> dict[str, E]:
        """Live services of one kind as typed entries: id -> entry. An entry this version
        cannot read (a wrong type, an unknown status) is left out, with a warning."""
        entries: dict[str, E] = {}
        for service_id, raw in (await self.list(entry_type.KIND)).items():
            try:
                entries[service_id] = entry_type.from_json(raw)
            except ValueError as exc:
                logger.warning("ignoring the %s entry of %s: %s", entry_type.KIND, service_id, exc)
        return entries

    async def claim(self, kind: str, service_id: str, info: dict[str, Any]) -> None:
        """Registers a service id that no live service holds, or raises RegistryConflict.

        Two live services under one id would overwrite each other's entry and receive
        each other's traffic; the second one must not start. A key left by a dead process
        (a restarted container keeps its id) expires within one TTL, so the claim waits
        that long before it gives up.
        """
        ttl_ms = int(self.config.ttl_s * 1000)
        key = self.key(kind, service_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.ttl_s + self.config.heartbeat_interval_s
        value = self._dumps(info)
        # Free, or this instance's own already (a scheduler publishes its entry before the
        # first step of a session, which may precede this claim).
        while holder := await self._redis.eval(_PUT_IF_MINE, 1, key, value, self.instance, ttl_ms):
            if loop.time() < deadline:
                await asyncio.sleep(min(0.2, self.config.heartbeat_interval_s))
                continue
            raise RegistryConflict(
                f"{kind} id {service_id!r} is already registered in cluster "
                f"{self.config.cluster!r} by a live service ({holder}); pick another id "
                "or cluster, or wait for its heartbeat to expire"
            )
        self.last_heartbeat_s = time.monotonic()

    async def start_heartbeat(self, kind: str, service_id: str, info_fn: Any) -> None:
        """Claims the id, then publishes `info_fn()` every heartbeat until `close()`.

        `info_fn` is called each time so that load figures stay current.
        """
        await self.claim(kind, service_id, info_fn())
        self._heartbeats.append(asyncio.create_task(self._beat(kind, service_id, info_fn)))

    async def _beat(self, kind: str, service_id: str, info_fn: Any) -> None:
        """Refreshes the key every interval. While Redis is away, retries with a backoff
        (0.1 s doubling up to the interval) and re-registers as soon as it answers. A
        fenced process stops here, before writing anything."""
        backoff = 0.1
        failing = False
        while True:
            try:
                fence = await self._redis.get(self.key("fenced", self.instance))
                if fence is not None:
                    await self._fenced(kind, service_id, json.loads(fence))
                    return
                try:
                    await self.put(kind, service_id, info_fn())
                except ClaimLost as exc:
                    await self._lost_claim(kind, service_id, str(exc))
                    return
                if len(self._heartbeats) and self._heartbeats[0] is asyncio.current_task():
                    await self._check_restart()
                raise_if_cancelled()
                if failing:
                    logger.warning("Redis is back: %s %s registered again", kind, service_id)
                failing, backoff = False, 0.1
                await asyncio.sleep(self.config.heartbeat_interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away for a moment: keep trying, loudly
                raise_if_cancelled()
                if not failing:
                    logger.warning(
                        "heartbeat of %s %s failed (%s); retrying with backoff",
                        kind,
                        service_id,
                        exc,
                    )
                failing = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.heartbeat_interval_s)

    async def _lost_claim(self, kind: str, service_id: str, reason: str) -> None:
        """Another instance holds our id: this one fences itself (so that `pagemesh up` and
        anyone else see it must go) and stops as a fenced one does, never writing again."""
        record = {
            "reason": f"lost its registry claim: {reason}",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "kind": kind,
            "id": service_id,
        }
        try:
            await self.fence(self.instance, record)
        except Exception as exc:  # Redis away again: stopping is what matters
            logger.warning("could not write this process's own fence: %s", exc)
        await self._fenced(kind, service_id, record)

    async def _fenced(self, kind: str, service_id: str, record: dict[str, Any]) -> None:
        logger.error(
            "%s %s (instance %s) was fenced out of its group: %s; it stops beating "
            "and exits so that a fresh process can take its place",
            kind,
            service_id,
            self.instance,
            record.get("reason", "no reason given"),
        )
        for hook in self.on_fenced:
            result = hook(record)
            if asyncio.iscoroutine(result):
                await result

    async def fence(self, instance: str, record: dict[str, Any]) -> None:
        """Marks process `instance` as cut out of its group (see the module docstring);
        `record` says why and where it runs (reason, pid, host, address)."""
        await self._redis.set(
            self.key("fenced", instance),
            json.dumps({**record, "at": time.time()}),
            ex=int(FENCE_TTL_S),
        )

    async def fences(self) -> dict[str, dict[str, Any]]:
        """Every fence in the cluster: instance -> record."""
        return await self.list("fenced")

    async def _check_restart(self) -> None:
        """Notices a restarted Redis by its run id and tells the `on_redis_restart` hooks."""
        run_id = (await self._redis.info("server")).get("run_id")
        restarted = self._run_id is not None and run_id != self._run_id
        self._run_id = run_id
        if restarted:
            logger.warning("Redis restarted (run id %s): re-publishing state", run_id)
            for hook in self.on_redis_restart:
                await hook()

    async def shared_secret(self, name: str) -> bytes:
        """A secret every service of the cluster shares (`<cluster>:secret:<name>`, 32 random
        bytes): the first caller creates it, everyone reads the same one."""
        key = self.key("secret", name)
        await self._redis.set(key, secrets.token_hex(32), nx=True)
        return bytes.fromhex(await self._redis.get(key))

    async def keep_secret(self, name: str, secret: bytes) -> None:
        """Writes `secret` back unless one is there (a restarted Redis lost it): services
        already running keep agreeing on it."""
        await self._redis.set(self.key("secret", name), secret.hex(), nx=True)

    async def publish_rendezvous(self, group: str, plan: dict[str, Any]) -> None:
        """Publishes how an engine group's workers form their torch.distributed group."""
        await self._redis.set(self.key("rendezvous", group), json.dumps(plan))

    async def get_rendezvous(self, group: str) -> dict[str, Any] | None:
        raw = await self._redis.get(self.key("rendezvous", group))
        return json.loads(raw) if raw is not None else None

    async def close(self, deregister: list[tuple[str, str]] = ()) -> None:
        for task in self._heartbeats:
            task.cancel()
        for kind, service_id in deregister:
            try:
                await self.remove(kind, service_id)
            except Exception as exc:
                logger.warning("could not deregister %s %s: %s", kind, service_id, exc)
        await self.checkpoints.images.close()
        await self._redis.aclose()
