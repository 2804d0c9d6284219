"""A process that holds one registry id, as a scheduler does (pagemesh.runtime.registry: claim,
then a
heartbeat every interval), for tests that cut it off the network. Prints "claimed <instance>"
once it holds the id; exits with status 3 once it finds itself fenced (its claim lost).

    python -m tests.support.claim_holder REDIS_URL CLUSTER KIND ID TTL_S
"""

from __future__ import annotations

import asyncio
import sys

from pagemesh.runtime.registry import Registry, RegistryConfig

FENCED_EXIT = 3


async def hold(redis_url: str, cluster: str, kind: str, service_id: str, ttl_s: float) -> int:
    registry = Registry(
        RegistryConfig(
            redis_url,
            cluster,
            heartbeat_interval_s=ttl_s / 4,
            ttl_s=ttl_s,
            call_timeout_s=ttl_s / 4,
        )
    )
    fenced = asyncio.Event()
    registry.on_fenced.append(lambda record: fenced.set())
    await registry.start_heartbeat(kind, service_id, lambda: {"address": "-"})
    print(f"claimed {registry.instance}", flush=True)
    await fenced.wait()
    print("fenced", flush=True)
    return FENCED_EXIT


if __name__ == "__main__":
    url, cluster, kind, service_id, ttl = sys.argv[1:6]
    sys.exit(asyncio.run(hold(url, cluster, kind, service_id, float(ttl))))
