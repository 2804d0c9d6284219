"""Request checkpoints in Redis: what a request needs to resume after any process dies.

One key per request, `<cluster>:ckpt:<request_id>` = JSON of a `Checkpoint`: the original
`SubmitRequest` (prompt ids, sampling with its seed, stopping, n) and each sample's output
ids so far. Sampling draws are keyed by (seed, token position), so prompt + outputs + seed
is the whole state: recomputing the KV and sampling on gives the tokens the undisturbed run
would have given. A set `<cluster>:ckpts:<group>` lists the requests of one engine group, so
a replacement scheduler finds its predecessor's.

Lifetime: the scheduler writes a checkpoint on admission, every `--checkpoint-interval`
steps and when the request finishes or loses its router; a request in flight has no TTL, a
finished or orphaned one expires after the resume window. The router deletes the checkpoint
once its client has received everything.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

RUNNING = "running"  # a scheduler is computing it
FINISHED = "finished"  # every sample ended; the client may not have the last tokens yet
ORPHANED = "orphaned"  # its router or scheduler went away before the end


@dataclass
class SampleState:
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: int = 0  # pagemesh.v1.FinishReason of a finished sample


@dataclass
class Checkpoint:
    request_id: str
    group: str
    submit: bytes  # the scheduler's SubmitRequest as first received, serialized
    samples: list[SampleState]
    state: str = RUNNING
    updated_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps({
            "request_id": self.request_id, "group": self.group,
            "submit": base64.b64encode(self.submit).decode(),
            "samples": [{"token_ids": s.token_ids, "finished": s.finished,
                         "finish_reason": s.finish_reason} for s in self.samples],
            "state": self.state, "updated_at": self.updated_at or time.time(),
        })

    @classmethod
    def from_json(cls, raw: str) -> Checkpoint:
        data = json.loads(raw)
        return cls(
            request_id=data["request_id"], group=data["group"],
            submit=base64.b64decode(data["submit"]),
            samples=[SampleState(list(s["token_ids"]), bool(s["finished"]), int(s.get("finish_reason", 0)))
                     for s in data["samples"]],
            state=data["state"], updated_at=float(data["updated_at"]),
        )


class CheckpointStore:
    def __init__(self, redis: aioredis.Redis, cluster: str) -> None:
        self._redis = redis
        self.cluster = cluster

    def key(self, request_id: str) -> str:
        return f"{self.cluster}:ckpt:{request_id}"

    def group_key(self, group: str) -> str:
        return f"{self.cluster}:ckpts:{group}"

    async def save(self, checkpoints: Iterable[Checkpoint], ttl_s: float | None = None) -> int:
        """Writes checkpoints in one round trip; `ttl_s` None = no expiry. Returns how many."""
        pipe = self._redis.pipeline(transaction=False)
        count = 0
        for ckpt in checkpoints:
            px = int(ttl_s * 1000) if ttl_s is not None else None
            pipe.set(self.key(ckpt.request_id), ckpt.to_json(), px=px)
            pipe.sadd(self.group_key(ckpt.group), ckpt.request_id)
            count += 1
        if count:
            await pipe.execute()
        return count

    async def load(self, request_id: str) -> Checkpoint | None:
        raw = await self._redis.get(self.key(request_id))
        return Checkpoint.from_json(raw) if raw is not None else None

    async def load_group(self, group: str) -> list[Checkpoint]:
        """Every live checkpoint of one engine group; ids whose key expired are dropped."""
        ids = sorted(await self._redis.smembers(self.group_key(group)))
        if not ids:
            return []
        values = await self._redis.mget([self.key(i) for i in ids])
        gone = [i for i, v in zip(ids, values) if v is None]
        if gone:
            await self._redis.srem(self.group_key(group), *gone)
        return [Checkpoint.from_json(v) for v in values if v is not None]

    async def expire(self, checkpoints: Iterable[Checkpoint], ttl_s: float) -> None:
        """Gives checkpoints nobody is computing any more a deadline (the resume window)."""
        pipe = self._redis.pipeline(transaction=False)
        for ckpt in checkpoints:
            pipe.pexpire(self.key(ckpt.request_id), int(ttl_s * 1000))
        await pipe.execute()

    async def delete(self, request_id: str, group: str | None = None) -> None:
        await self.delete_many([(request_id, group)])

    async def delete_many(self, entries: Iterable[tuple[str, str | None]]) -> None:
        """Deletes (request id, its group or None) checkpoints in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        for request_id, group in entries:
            pipe.delete(self.key(request_id))
            if group is not None:
                pipe.srem(self.group_key(group), request_id)
        if len(pipe):
            await pipe.execute()
