"""Service registry and heartbeats in Redis.

Each service writes `<prefix>:<kind>:<id>` = JSON of where it is and what it serves, with
a TTL of a few heartbeats, and refreshes it every heartbeat. A key that expired is a
service that died: membership is read from Redis, never from a hard-coded address.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from pagemesh.serving import FatalStartupError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistryConfig:
    redis_url: str
    cluster: str = "pagemesh"
    heartbeat_interval_s: float = 1.0
    ttl_s: float = 3.0

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        if self.ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"ttl_s ({self.ttl_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s}) or live services would expire"
            )


class RegistryConflict(FatalStartupError):
    """Another live service already holds this id."""


class Registry:
    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self._redis = aioredis.from_url(config.redis_url, decode_responses=True)
        self._heartbeats: list[asyncio.Task[None]] = []

    def key(self, kind: str, service_id: str) -> str:
        return f"{self.config.cluster}:{kind}:{service_id}"

    async def ping(self) -> None:
        await self._redis.ping()

    async def put(self, kind: str, service_id: str, info: dict[str, Any]) -> None:
        ttl_ms = int(self.config.ttl_s * 1000)
        await self._redis.set(self.key(kind, service_id), json.dumps(info), px=ttl_ms)

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
            key[len(prefix):]: json.loads(value)
            for key, value in zip(keys, values)
            if value is not None
        }

    async def claim(self, kind: str, service_id: str, info: dict[str, Any]) -> None:
        """Registers a service id that no live service holds, or raises RegistryConflict.

        Two live services under one id would overwrite each other's entry and receive
        each other's traffic; the second one must not start.
        """
        ttl_ms = int(self.config.ttl_s * 1000)
        key = self.key(kind, service_id)
        if not await self._redis.set(key, json.dumps(info), px=ttl_ms, nx=True):
            holder = await self._redis.get(key)
            raise RegistryConflict(
                f"{kind} id {service_id!r} is already registered in cluster "
                f"{self.config.cluster!r} by a live service ({holder}); pick another id "
                "or cluster, or wait for its heartbeat to expire"
            )

    async def start_heartbeat(self, kind: str, service_id: str, info_fn: Any) -> None:
        """Claims the id, then publishes `info_fn()` every heartbeat until `close()`.

        `info_fn` is called each time so that load figures stay current.
        """
        await self.claim(kind, service_id, info_fn())
        self._heartbeats.append(asyncio.create_task(self._beat(kind, service_id, info_fn)))

    async def _beat(self, kind: str, service_id: str, info_fn: Any) -> None:
        while True:
            try:
                await self.put(kind, service_id, info_fn())
            except Exception as exc:  # Redis away for a moment: keep trying, loudly
                logger.warning("heartbeat of %s %s failed: %s", kind, service_id, exc)
            await asyncio.sleep(self.config.heartbeat_interval_s)

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
        await self._redis.aclose()
