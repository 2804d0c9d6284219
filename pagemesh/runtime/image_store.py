"""The images of checkpointed requests, in Redis, once per image, by content.

A vision-language request's checkpoint (pagemesh/runtime/checkpoints.py) must let any router resume
it, so its images must outlive the router that received them. The checkpoint's
`SubmitRequest` keeps each image's SHA-256 and placement, not its bytes (a record is
rewritten every few steps; megabytes of image each time would cost Redis more than the
tokens do), and the bytes live under `<cluster>:img:<sha256 hex>`: once per image,
however many requests show it.

Bounds:
- Time: an image expires a resume window after the last checkpoint write that named it.
  Every write of a record renews its images (`renew`), so the images of a running or
  resumable request stay, and those of requests nobody can resume any more go.
- Size: at most `max_bytes` of images in all (the scheduler's --image-store-mib). One Lua
  script does the accounting atomically: a sorted set of image -> expiry (ms, the server's
  clock) and a hash of image -> size, pruned of the expired before each `put`. An image
  that would go over is not stored: its request is served as usual, and the death of a
  worker or scheduler is still recovered (its router holds the images), but a resume
  through another router finds the image missing and is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import redis.asyncio as aioredis

# KEYS: the accounting set, the size hash, then one key per image.
# ARGV: ttl ms, budget bytes, then (member, data) per image. Returns 1 (kept) / 0 per image.
_PUT = """
local now_s, now_us = unpack(redis.call('TIME'))
local now = tonumber(now_s) * 1000 + math.floor(tonumber(now_us) / 1000)
local ttl, budget = tonumber(ARGV[1]), tonumber(ARGV[2])
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('HDEL', KEYS[2], member)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local total = 0
for _, size in ipairs(redis.call('HVALS', KEYS[2])) do total = total + tonumber(size) end
local kept = {}
for i = 3, #KEYS do
  local member, data = ARGV[2 * i - 3], ARGV[2 * i - 2]
  if redis.call('PEXPIRE', KEYS[i], ttl) == 1 then
    redis.call('ZADD', KEYS[1], now + ttl, member)
    kept[#kept + 1] = 1
  elseif total + #data <= budget then
    redis.call('SET', KEYS[i], data, 'PX', ttl)
    redis.call('ZADD', KEYS[1], now + ttl, member)
    redis.call('HSET', KEYS[2], member, #data)
    total = total + #data
    kept[#kept + 1] = 1
  else
    kept[#kept + 1] = 0
  end
end
return kept
"""

# KEYS: the accounting set, then one key per image. ARGV: ttl ms, then the members.
# Returns 1 (renewed) / 0 (not stored: expired, never kept) per image.
_RENEW = """
local now_s, now_us = unpack(redis.call('TIME'))
local now = tonumber(now_s) * 1000 + math.floor(tonumber(now_us) / 1000)
local ttl = tonumber(ARGV[1])
local found = {}
for i = 2, #KEYS do
  if redis.call('PEXPIRE', KEYS[i], ttl) == 1 then
    redis.call('ZADD', KEYS[1], now + ttl, ARGV[i])
    found[#found + 1] = 1
  else
    found[#found + 1] = 0
  end
end
return found
"""


class ImageStore:
    def __init__(self, redis: aioredis.Redis, cluster: str) -> None:
        """`redis`: the server's client; the store talks bytes over a pool of its own (the
        services' clients decode replies as text)."""
        self._redis = _binary_client(redis)
        self._owns_client = self._redis is not redis
        self.cluster = cluster
        self._put = redis.register_script(_PUT)
        self._renew = redis.register_script(_RENEW)

    def key(self, digest: bytes) -> str:
        return f"{self.cluster}:img:{digest.hex()}"

    @property
    def _accounts(self) -> list[str]:
        return [f"{self.cluster}:imgs:expiry", f"{self.cluster}:imgs:size"]

    async def put(self, images: Mapping[bytes, bytes], ttl_s: float, max_bytes: int) -> set[bytes]:
        """Stores the images (SHA-256 -> bytes) not stored yet and renews the rest, within
        `max_bytes` in all; returns the SHA-256s now stored (the others did not fit)."""
        if not images:
            return set()
        digests = list(images)
        args: list[object] = [int(ttl_s * 1000), max_bytes]
        for digest in digests:
            args += [digest.hex(), images[digest]]
        kept = await self._put(keys=self._accounts + [self.key(d) for d in digests], args=args)
        return {digest for digest, ok in zip(digests, kept) if ok}

    async def renew(self, digests: Iterable[bytes], ttl_s: float) -> set[bytes]:
        """Pushes the images' expiry to `ttl_s` from now; returns those not stored (the
        caller puts them again if it has their bytes)."""
        digests = list(dict.fromkeys(digests))
        if not digests:
            return set()
        found = await self._renew(
            keys=self._accounts[:1] + [self.key(d) for d in digests],
            args=[int(ttl_s * 1000), *(d.hex() for d in digests)],
        )
        return {digest for digest, ok in zip(digests, found) if not ok}

    async def get_many(self, digests: Iterable[bytes]) -> dict[bytes, bytes]:
        """The stored images among `digests` (SHA-256 -> bytes); missing ones are absent."""
        digests = list(dict.fromkeys(digests))
        if not digests:
            return {}
        values = await self._redis.mget([self.key(d) for d in digests])
        return {digest: value for digest, value in zip(digests, values) if value is not None}

    async def stored_bytes(self) -> int:
        """Bytes of images the accounting holds (expired ones until the next `put`)."""
        return sum(int(size) for size in await self._redis.hvals(self._accounts[1]))

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()


def _binary_client(redis: aioredis.Redis) -> aioredis.Redis:
    """A client of the same server, with the same timeouts, whose replies stay bytes."""
    pool = redis.connection_pool
    if not pool.connection_kwargs.get("decode_responses"):
        return redis
    kwargs = {**pool.connection_kwargs, "decode_responses": False}
    return aioredis.Redis(
        connection_pool=aioredis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    )
