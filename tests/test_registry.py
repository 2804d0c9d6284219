"""The Redis registry against a real Valkey: claims, heartbeats, expiry."""

from __future__ import annotations

import asyncio

import pytest

from pagemesh.registry import Registry, RegistryConfig, RegistryConflict


def test_heartbeat_keeps_an_entry_alive_and_expiry_reports_death(redis_url: str) -> None:
    async def scenario() -> None:
        config = RegistryConfig(redis_url, cluster="t-registry", heartbeat_interval_s=0.1, ttl_s=0.3)
        alive, observer = Registry(config), Registry(config)
        load = {"n": 0}

        def info() -> dict:
            load["n"] += 1
            return {"address": "127.0.0.1:1", "n": load["n"]}

        await alive.start_heartbeat("worker", "w1", info)
        await asyncio.sleep(0.6)  # two TTLs: only the heartbeat keeps it there
        seen = await observer.list("worker")
        assert seen["w1"]["address"] == "127.0.0.1:1" and seen["w1"]["n"] > 2
        with pytest.raises(RegistryConflict, match="already registered"):
            await observer.start_heartbeat("worker", "w1", info)
        for task in alive._heartbeats:  # the process "dies": no more heartbeats, no goodbye
            task.cancel()
        await asyncio.sleep(0.5)
        assert "w1" not in await observer.list("worker")
        await observer.start_heartbeat("worker", "w1", info)  # the id is free again
        await observer.close(deregister=[("worker", "w1")])
        assert await alive.list("worker") == {}
        await alive.close()

    asyncio.run(scenario())


def test_config_rejects_a_ttl_shorter_than_the_heartbeat() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        RegistryConfig("redis://127.0.0.1:1", heartbeat_interval_s=2.0, ttl_s=1.0)
