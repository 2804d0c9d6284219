"""The LoRA adapters a cluster serves, in Redis: `<cluster>:loras`, a hash of adapter name ->
its PEFT folder (a path on the workers' hosts, the same on every host).

An engine group holds (has loaded and checked) some adapters: those of its --lora-modules,
and those it loaded since, up to --max-cpu-loras (the least recently used of the others is
let go). The table is every adapter a request may name anywhere: a group asked for one it
does not hold reads its folder from here and loads it then (scheduler_svc/adapters.py), so
an adapter loaded at run time outlives a scheduler's restart, reaches a group that joins
later, and follows a request resumed on another group. A run-time load writes the name, an
unload removes it, and a group's --lora-modules are written where the name is free (one
folder per name: the first writer's).
"""

from __future__ import annotations

from collections.abc import Mapping

import redis.asyncio as aioredis


class LoraTable:
    def __init__(self, redis: aioredis.Redis, cluster: str) -> None:
        self._redis = redis
        self.key = f"{cluster}:loras"

    async def put(self, name: str, path: str) -> None:
        await self._redis.hset(self.key, name, path)

    async def put_absent(self, adapters: Mapping[str, str]) -> dict[str, str]:
        """Writes each name not in the table yet; returns the names already there under
        another folder, with that folder."""
        if not adapters:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for name, path in adapters.items():
            pipe.hsetnx(self.key, name, path)
        await pipe.execute()
        present = await self._redis.hmget(self.key, list(adapters))
        return {
            name: path
            for name, path in zip(adapters, present)
            if path is not None and _text(path) != adapters[name]
        }

    async def get(self, name: str) -> str | None:
        path = await self._redis.hget(self.key, name)
        return _text(path) if path is not None else None

    async def remove(self, name: str) -> bool:
        """Whether it was there."""
        return bool(await self._redis.hdel(self.key, name))

    async def all(self) -> dict[str, str]:
        return {
            _text(name): _text(path) for name, path in (await self._redis.hgetall(self.key)).items()
        }


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
