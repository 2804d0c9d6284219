"""The mesh's id of a client's request (router/tenancy.py), for tests that look at what the
mesh stores or traces under it: the router's secret read from the registry, as a router does."""

from __future__ import annotations

import redis

from pagemesh.runtime.auth import ApiKeys
from pagemesh.runtime.checkpoints import Checkpoint
from router.tenancy import SECRET_NAME, Tenancy


def mesh_request_id(
    redis_url: str, cluster: str, client_id: str, api_key: str | None = None
) -> str:
    client = redis.Redis.from_url(redis_url)
    try:
        secret = client.get(f"{cluster}:secret:{SECRET_NAME}")
    finally:
        client.close()
    assert secret is not None, f"no router of cluster {cluster!r} has created the secret yet"
    tenancy = Tenancy(bytes.fromhex(secret.decode()), ApiKeys([api_key] if api_key else []))
    return tenancy.mesh_request_id(
        tenancy.owner(f"Bearer {api_key}" if api_key else None), client_id
    )


def redis_checkpoint(redis_url: str, cluster: str, mesh_id: str) -> Checkpoint | None:
    """The checkpoint the mesh keeps of a request, by the mesh's id; None when there is none."""
    client = redis.Redis.from_url(redis_url)
    try:
        raw = client.get(f"{cluster}:ckpt:{mesh_id}")
    finally:
        client.close()
    return Checkpoint.from_json(raw) if raw is not None else None
