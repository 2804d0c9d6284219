"""The Redis registry against a real Valkey: claims, heartbeats, expiry."""

from __future__ import annotations

import asyncio

import pytest

from pagemesh.runtime.registry import Registry, RegistryConfig, RegistryConflict
from pagemesh.runtime.registry_entries import GroupStatus, SchedulerEntry
from tests.support.eventually import eventually_async


def test_heartbeat_keeps_an_entry_alive_and_expiry_reports_death(redis_url: str) -> None:
    async def scenario() -> None:
        config = RegistryConfig(
            redis_url, cluster="t-registry", heartbeat_interval_s=0.1, ttl_s=0.3
        )
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

        async def expired() -> bool:
            return "w1" not in await observer.list("worker")

        await eventually_async(expired, 5, "w1 outlived its TTL without heartbeats")
        await observer.start_heartbeat("worker", "w1", info)  # the id is free again
        await observer.close(deregister=[("worker", "w1")])
        assert await alive.list("worker") == {}
        await alive.close()

    asyncio.run(scenario())


def test_a_cancelled_heartbeat_stops_whenever_it_is_cancelled(redis_url: str) -> None:
    # A heartbeat cancelled mid-command must stop: a dead-looking process that still beats
    # keeps its id (its replacement cannot claim it), and a shutdown awaiting it hangs.
    # redis-py 8.0-8.1 swallowed the cancellation of a command in flight in ~half the runs.
    async def scenario() -> None:
        config = RegistryConfig(
            redis_url, cluster="t-cancel", heartbeat_interval_s=0.001, ttl_s=0.4
        )
        survivors = 0
        for i in range(40):
            registry = Registry(config)
            await registry.start_heartbeat("worker", f"w{i}", lambda: {"address": "x"})
            await asyncio.sleep(0.0002 * i)  # land the cancel at many points of a beat
            for task in registry._heartbeats:
                task.cancel()
            await asyncio.wait(registry._heartbeats, timeout=0.5)
            survivors += sum(not task.done() for task in registry._heartbeats)
            await registry.close()
        return survivors

    # Not asyncio.run: its teardown would wait forever on a heartbeat that ignores cancel.
    loop = asyncio.new_event_loop()
    try:
        survivors = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert survivors == 0, f"{survivors} of 40 heartbeats went on after cancel()"


def test_config_rejects_a_ttl_shorter_than_the_heartbeat() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        RegistryConfig("redis://127.0.0.1:1", heartbeat_interval_s=2.0, ttl_s=1.0)


def test_typed_entries_carry_the_writers_instance_and_skip_unreadable_ones(redis_url: str) -> None:
    async def scenario() -> None:
        config = RegistryConfig(redis_url, cluster="t-typed", heartbeat_interval_s=1.0, ttl_s=5.0)
        writer, reader = Registry(config), Registry(config)
        # An entry read back and published again names its reader's idea of the instance:
        # the registry stamps the writer's own.
        entry = SchedulerEntry(
            address="127.0.0.1:1", group="g0", status=GroupStatus.DEGRADED, instance="someone-else"
        )
        await writer.put("scheduler", "s1", entry.to_json())
        await writer.put("scheduler", "s2", {"address": "127.0.0.1:2", "status": "paused"})
        entries = await reader.entries(SchedulerEntry)
        assert list(entries) == ["s1"]  # s2's status is unknown to this version: left out
        assert entries["s1"] == SchedulerEntry(
            address="127.0.0.1:1", group="g0", status=GroupStatus.DEGRADED, instance=writer.instance
        )
        await writer.close(deregister=[("scheduler", "s1"), ("scheduler", "s2")])
        await reader.close()

    asyncio.run(scenario())
