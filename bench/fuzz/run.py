"""One fuzz run against a mesh: the probes, a bounded number in flight, while the good
clients are served; then the mesh must settle with every KV block free, no service process
may have died, and each way of leaving mid-stream must free its request."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import aiohttp
import grpc

from bench.fuzz import mesh as mesh_checks
from bench.fuzz import outcomes as oc
from bench.fuzz.good_client import (
    AuditRow,
    GoodStats,
    calibrate,
    disconnect_audit,
    good_client,
)
from bench.fuzz.plan import Plan, Probe
from bench.fuzz.probes import Targets, send
from bench.fuzz.specs import ModelFacts
from pagemesh.tools.mesh_process import Mesh

NUM_CHANNELS = 4
PROGRESS_EVERY = 1000  # requests between progress lines


@dataclass(frozen=True)
class FuzzConfig:
    num_requests: int = 10_000
    seed: int = 0
    concurrency: int = 32  # probes in flight (a storm is one probe of many clients)
    deadline_s: float = 120.0  # a probe not done by then is hung
    settle_s: float = 60.0  # for the mesh to be quiet after the last probe
    good_deadline_s: float = 60.0  # a good client's request not answered by then failed
    weights: dict[str, float] | None = None  # kinds and their weights; None: plan.KIND_WEIGHTS
    only: tuple[int, ...] = ()  # just these request indices (a finding sent again)
    audit: bool = True  # the disconnect audit after the run
    quiet: bool = False  # no progress lines


@dataclass
class FuzzResult:
    config: FuzzConfig
    facts: ModelFacts
    outcomes: list[oc.Outcome] = field(default_factory=list)
    good: list[GoodStats] = field(default_factory=list)
    died: list[tuple[mesh_checks.ServiceProcess, float]] = field(default_factory=list)
    num_processes: int = 0
    settled_after_s: float | None = None  # None: not quiet within settle_s
    final_stats: list[mesh_checks.GroupStats] = field(default_factory=list)
    audit: list[AuditRow] = field(default_factory=list)
    wall_s: float = 0.0  # the probes' phase

    @property
    def blocks_leaked(self) -> int:
        return sum(s.num_blocks - s.num_free_blocks for s in self.final_stats)

    @property
    def failures(self) -> list[oc.Outcome]:
        return [o for o in self.outcomes if o.failed]

    @property
    def passed(self) -> bool:
        return (
            not self.failures
            and not self.died
            and self.settled_after_s is not None
            and not self.blocks_leaked
            and all(not g.num_failures for g in self.good)
            and (bool(self.audit) or not self.config.audit)
            and all(row.passed for row in self.audit)
        )


async def fuzz(
    endpoints: mesh_checks.Endpoints, config: FuzzConfig, mesh: Mesh | None = None
) -> FuzzResult:
    info = await asyncio.to_thread(mesh_checks.model_info, endpoints)
    facts = ModelFacts(info.model, info.vocab_size, info.max_model_len)
    watch = await asyncio.to_thread(mesh_checks.ProcessWatch, endpoints, mesh)
    result = FuzzResult(config, facts, num_processes=len(watch.started))
    plan = Plan(facts, endpoints.grpc_limit_bytes, config.seed, config.weights)
    async with _targets(endpoints, NUM_CHANNELS) as targets, _targets(endpoints, 1) as good_targets:
        cases, seconds_per_token = await calibrate(good_targets.channels[0], facts)
        stop = asyncio.Event()
        good = [
            asyncio.create_task(
                good_client(transport, good_targets, facts, cases, stop, config.good_deadline_s)
            )
            for transport in ("gRPC", "HTTP")
        ]
        watching = asyncio.create_task(_watch(watch))
        start = time.monotonic()
        probes = (
            [plan.probe(i) for i in config.only]
            if config.only
            else plan.probes(config.num_requests)
        )
        result.outcomes = await _run_probes(probes, targets, config)
        result.wall_s = time.monotonic() - start
        stop.set()
        result.good = list(await asyncio.gather(*good))
        result.settled_after_s, result.final_stats = await _settle(endpoints, config.settle_s)
        serving = await _router_serving(endpoints, config.settle_s)
        if config.audit and result.settled_after_s is not None and serving:
            async with _targets(endpoints, 1) as fresh:  # the probes' channels may be backing off
                result.audit = await disconnect_audit(fresh, endpoints, facts, seconds_per_token)
            result.final_stats = await asyncio.to_thread(mesh_checks.group_stats, endpoints)
        watching.cancel()
        await asyncio.to_thread(watch.check)
        result.died = list(watch.died)
    return result


@contextlib.asynccontextmanager
async def _targets(endpoints: mesh_checks.Endpoints, num_channels: int) -> AsyncIterator[Targets]:
    # A local subchannel pool: each channel its own connection, and a fresh one does not
    # inherit another's reconnect backoff (after a router restart) from gRPC's shared pool.
    options = [
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    channels = [
        grpc.aio.insecure_channel(endpoints.grpc_address, options=options)
        for _ in range(num_channels)
    ]
    # A connection per request: a kept-alive one the server closes as idle just when it is
    # reused breaks the request on the client's side, which is no finding of the server's.
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=None),
    )
    try:
        yield Targets(endpoints.grpc_address, endpoints.http_url, channels, session)
    finally:
        await session.close()
        for channel in channels:
            await channel.close()


async def _run_probes(
    probes: Iterable[Probe], targets: Targets, config: FuzzConfig
) -> list[oc.Outcome]:
    slots = asyncio.Semaphore(config.concurrency)
    outcomes: list[oc.Outcome] = []
    running: set[asyncio.Task[None]] = set()
    next_report = PROGRESS_EVERY

    async def one(probe: Probe) -> None:
        try:
            outcomes.extend(await _probe(probe, targets, config.deadline_s))
        finally:
            slots.release()

    for probe in probes:
        await slots.acquire()
        task = asyncio.create_task(one(probe))
        running.add(task)
        task.add_done_callback(running.discard)
        if not config.quiet and len(outcomes) >= next_report:
            failed = sum(o.failed for o in outcomes)
            print(f"  {len(outcomes):,} requests answered, {failed} failed", flush=True)
            next_report += PROGRESS_EVERY
    await asyncio.gather(*running)
    return sorted(outcomes, key=lambda o: o.index)


async def _probe(probe: Probe, targets: Targets, deadline_s: float) -> list[oc.Outcome]:
    start = time.monotonic()
    try:
        async with asyncio.timeout(deadline_s):
            results = await send(probe.spec, targets)
    except TimeoutError:
        results = [(oc.HUNG, f"no end within {deadline_s:g} s")] * probe.num_requests
    except ConnectionRefusedError as exc:
        results = [(oc.UNAVAILABLE, f"connection refused: {exc}")] * probe.num_requests
    except Exception as exc:  # noqa: BLE001 - a bug of the fuzzer's own, reported as one
        results = [(oc.FUZZER_ERROR, oc.short(repr(exc)))] * probe.num_requests
    seconds = time.monotonic() - start
    return [
        oc.Outcome(probe.kind, probe.index, result, detail, seconds) for result, detail in results
    ]


async def _watch(watch: mesh_checks.ProcessWatch) -> None:
    while True:
        await asyncio.to_thread(watch.check)
        await asyncio.sleep(1.0)


async def _router_serving(
    endpoints: mesh_checks.Endpoints, timeout_s: float, steady_s: float = 3.0
) -> bool:
    """Waits for the router to serve for `steady_s` on end (a restarted one takes seconds, and
    one about to be killed may still answer once); False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    since = None
    while time.monotonic() < deadline:
        if await asyncio.to_thread(mesh_checks.router_serving, endpoints):
            since = since or time.monotonic()
            if time.monotonic() - since >= steady_s:
                return True
        else:
            since = None
        await asyncio.sleep(0.5)
    return False


async def _settle(
    endpoints: mesh_checks.Endpoints, timeout_s: float
) -> tuple[float | None, list[mesh_checks.GroupStats]]:
    """(seconds until every group was quiet, or None after `timeout_s`; the last stats)."""
    start = time.monotonic()
    while True:
        stats = await asyncio.to_thread(mesh_checks.group_stats, endpoints)
        if all(s.quiet for s in stats):
            return time.monotonic() - start, stats
        if time.monotonic() - start > timeout_s:
            return None, stats
        await asyncio.sleep(0.2)
