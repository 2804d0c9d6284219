"""An engine group's LoRA adapters (scheduler_svc/adapters.py) over a real Redis table: what
it holds, what it loads on demand from the cluster's table (once, however many requests
wait), what it lets go past --max-cpu-loras, and what the workers' refusal becomes.

The workers are stand-ins here that count the loads they are asked for (the real workers'
reading and checking is tests/e2e/test_lora_mesh.py's and test_lora_placement.py's)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis.asyncio as aioredis

from pagemesh.runtime.lora_table import LoraTable
from protos.step import LoraRef
from scheduler_svc.adapters import AdapterLoadFailed, GroupAdapters


class Refused(grpc.aio.AioRpcError):
    def __init__(self, details: str) -> None:
        super().__init__(
            grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), details
        )


class CountingWorkers:
    """A group's workers as scheduler_svc/worker_client.py's client asks them."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.unloads: list[str] = []

    async def load_lora(self, name: str, path: str, timeout_s: float) -> None:
        await asyncio.sleep(0.05)  # reading the folder
        if path.endswith("broken"):
            raise Refused("no adapter_config.json in broken")
        self.loads.append(name)

    async def unload_lora(self, name: str, timeout_s: float) -> None:
        self.unloads.append(name)


def scenario(redis_url: str, cluster: str, test) -> None:
    async def run() -> None:
        client = aioredis.from_url(redis_url, decode_responses=True)
        try:
            await test(LoraTable(client, cluster))
        finally:
            await client.aclose()

    asyncio.run(run())


def test_an_adapter_of_the_table_is_loaded_once_and_held_up_to_capacity(redis_url: str) -> None:
    async def test(table: LoraTable) -> None:
        workers = CountingWorkers()
        adapters = GroupAdapters(
            "g0", 2, {"pinned": LoraRef("pinned", "/a/pinned")}, lambda: workers, table
        )
        await adapters.publish_pinned()
        assert await table.all() == {"pinned": "/a/pinned"}
        await table.put("sql", "/a/sql")
        await table.put("chat", "/a/chat")
        # Three requests naming sql at once: one load.
        await asyncio.gather(*(adapters.resolve("sql") for _ in range(3)))
        assert workers.loads == ["sql"]
        assert adapters.names() == ("pinned", "sql") and adapters.version == 1
        # Past the capacity, the least recently named unpinned adapter goes.
        await adapters.resolve("chat")
        assert adapters.names() == ("chat", "pinned") and adapters.version == 2
        await adapters.resolve("pinned")
        await adapters.resolve("nowhere")  # not served: left to the request's conversion
        assert adapters.names() == ("chat", "pinned")

    scenario(redis_url, "adapters-capacity", test)


def test_loads_refusals_and_unloads(redis_url: str) -> None:
    async def test(table: LoraTable) -> None:
        workers = CountingWorkers()
        adapters = GroupAdapters("g1", 4, {}, lambda: workers, table)
        with pytest.raises(AdapterLoadFailed) as refused:
            await adapters.load("bad", "/a/broken")
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert await table.all() == {} and adapters.names() == ()
        # A folder in the table that this group's workers refuse: the request is told why.
        await table.put("elsewhere", "/b/broken")
        with pytest.raises(
            ValueError, match="could not be loaded on engine group g1: no adapter_config.json"
        ):
            await adapters.resolve("elsewhere")
        await adapters.load("late", "/a/late")
        assert await table.get("late") == "/a/late" and adapters.names() == ("late",)
        published: list[int] = []

        async def publish() -> None:
            published.append(adapters.version)

        adapters.on_change.append(publish)
        assert await adapters.unload("late") and workers.unloads == ["late"]
        assert published == [adapters.version] and await table.get("late") is None
        # Held nowhere but in the table: the unload takes it out of the table.
        assert await adapters.unload("elsewhere") and await table.all() == {}
        assert not await adapters.unload("late")

    scenario(redis_url, "adapters-loads", test)


def test_pinned_adapters_keep_the_first_writers_folder(redis_url: str) -> None:
    async def test(table: LoraTable) -> None:
        first = GroupAdapters("g0", 1, {"sql": LoraRef("sql", "/host-a/sql")}, lambda: None, table)
        second = GroupAdapters("g1", 1, {"sql": LoraRef("sql", "/host-b/sql")}, lambda: None, table)
        await first.publish_pinned()
        assert await table.put_absent({"sql": "/host-b/sql", "new": "/x"}) == {"sql": "/host-a/sql"}
        await second.publish_pinned()  # a warning; the table keeps the first folder
        assert await table.all() == {"sql": "/host-a/sql", "new": "/x"}
        # Off (capacity 0): nothing held, nothing loaded.
        off = GroupAdapters("g2", 0, {"sql": LoraRef("sql", "/x")}, lambda: None, table)
        await off.resolve("new")
        assert off.names() == () and not off.enabled

    scenario(redis_url, "adapters-pinned", test)
