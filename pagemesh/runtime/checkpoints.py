"""Request checkpoints in Redis: what a request needs to resume after any process dies.

One key per request, `<cluster>:ckpt:<request_id>` = JSON of a `Checkpoint`: the original
`SubmitRequest` (prompt ids, sampling with its seed, stopping, n; a vision-language
prompt's images as their SHA-256s, the bytes in the image store, pagemesh/runtime/image_store.py)
and each sample's output ids so far. Sampling draws are keyed by (seed, token position), so prompt
+ outputs + seed
is the whole state: recomputing the KV and sampling on gives the tokens the undisturbed run
would have given. A set `<cluster>:ckpts:<group>` lists the requests of one engine group, so
a replacement scheduler finds its predecessor's.

When the request asks for logprobs, each sample also keeps its tokens' logprobs (the chosen
token's and the top alternatives, float32 as the wire carries them, packed): a router
resuming the stream replays them exactly as the live stream sent them. Without logprobs the
record holds no logprob data at all; a record without the field (an older one) has none.

Lifetime: the scheduler writes a checkpoint on admission, every `--checkpoint-interval`
steps and when the request finishes or loses its router; every record expires a resume
window after it was last written, and the scheduler renews the records of the requests it
runs (so one whose scheduler is gone for good does not stay). The router deletes the
checkpoint once its client has received everything; expired ids are pruned from the group
sets.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from pagemesh.runtime.image_store import ImageStore

RUNNING = "running"  # a scheduler is computing it
FINISHED = "finished"  # every sample ended; the client may not have the last tokens yet
ORPHANED = "orphaned"  # its router or scheduler went away before the end


# One token's logprobs: (the chosen token's, [(alternative id, its logprob), ...] best first).
TokenLogprobs = tuple[float, Sequence[tuple[int, float]]]


@dataclass
class SampleState:
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: int = 0  # pagemesh.v1.FinishReason of a finished sample
    # One per token of `token_ids`, or None: the request asked for no logprobs, or they are
    # not known for every token (an older record, or a resume that came without them).
    logprobs: list[TokenLogprobs] | None = None

    def to_dict(self) -> dict[str, object]:
        data: dict[str, object] = {
            "token_ids": self.token_ids,
            "finished": self.finished,
            "finish_reason": self.finish_reason,
        }
        if self.logprobs is not None:
            data["logprobs"] = pack_logprobs(self.logprobs)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> SampleState:
        token_ids = list(data["token_ids"])
        logprobs = unpack_logprobs(data["logprobs"]) if "logprobs" in data else None
        if logprobs is not None and len(logprobs) != len(token_ids):
            logprobs = None  # not one per token: not trusted
        return cls(token_ids, bool(data["finished"]), int(data.get("finish_reason", 0)), logprobs)


@dataclass
class Checkpoint:
    request_id: str
    group: str
    submit: bytes  # the scheduler's SubmitRequest as first received, serialized
    samples: list[SampleState]
    state: str = RUNNING
    updated_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(
            {
                "request_id": self.request_id,
                "group": self.group,
                "submit": base64.b64encode(self.submit).decode(),
                "samples": [s.to_dict() for s in self.samples],
                "state": self.state,
                "updated_at": self.updated_at or time.time(),
            }
        )

    @classmethod
    def from_json(cls, raw: str) -> Checkpoint:
        data = json.loads(raw)
        return cls(
            request_id=data["request_id"],
            group=data["group"],
            submit=base64.b64decode(data["submit"]),
            samples=[SampleState.from_dict(s) for s in data["samples"]],
            state=data["state"],
            updated_at=float(data["updated_at"]),
        )


def pack_logprobs(logprobs: Sequence[TokenLogprobs]) -> dict[str, object]:
    """A sample's logprobs as little-endian float32 / uint32 arrays in base64 (a quarter of
    the size of JSON numbers, and exact: the values crossed the wire as float32)."""
    top = [pair for _, alternatives in logprobs for pair in alternatives]
    return {
        "chosen": _pack("f", [chosen for chosen, _ in logprobs]),
        "num_top": [len(alternatives) for _, alternatives in logprobs],
        "top_ids": _pack("I", [token_id for token_id, _ in top]),
        "top": _pack("f", [logprob for _, logprob in top]),
    }


def unpack_logprobs(data: dict) -> list[TokenLogprobs]:
    chosen = _unpack("f", data["chosen"])
    top_ids = _unpack("I", data["top_ids"])
    top = _unpack("f", data["top"])
    logprobs: list[TokenLogprobs] = []
    start = 0
    for logprob, num_top in zip(chosen, data["num_top"]):
        end = start + int(num_top)
        logprobs.append((logprob, list(zip(top_ids[start:end], top[start:end]))))
        start = end
    return logprobs


def _pack(kind: str, values: list) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}{kind}", *values)).decode()


def _unpack(kind: str, encoded: str) -> list:
    raw = base64.b64decode(encoded)
    return list(struct.unpack(f"<{len(raw) // 4}{kind}", raw))


class CheckpointStore:
    def __init__(self, redis: aioredis.Redis, cluster: str) -> None:
        self._redis = redis
        self.cluster = cluster
        self.images = ImageStore(redis, cluster)  # the bytes of the records' images

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

    async def prune_group(self, group: str) -> int:
        """Drops the ids of expired records from the group's set; returns how many."""
        ids = list(await self._redis.smembers(self.group_key(group)))
        if not ids:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for request_id in ids:
            pipe.exists(self.key(request_id))
        gone = [i for i, exists in zip(ids, await pipe.execute()) if not exists]
        if gone:
            await self._redis.srem(self.group_key(group), *gone)
        return len(gone)

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
