"""KV moving between engine groups: this scheduler's side, both ways.

The scheduler decides what moves; workers only move bytes (worker_svc/kv_transfer/).

*Holding* (this group computed the KV): a sample that leaves unfinished — a prefill group's
after its first token (`--role prefill`), a draining group's running requests — keeps its
blocks in the core's `held` table and its last message carries a `KvHandoff`, which the
router passes on to the group that continues it. That group claims the hold (`claim`: the
block ids, the tokens they hold, where the ranks' transfer servers listen), pulls, and
releases it (`release`). A hold ends in one of two ways, each counted: released by its
claimant (pulled, or given up with a reason), or expired (`hold_s` unclaimed, or the
claim's own deadline passed), when the blocks are freed all the same. A re-formed group
(a worker died) has a new core: its holds are gone and claims of them are NOT_FOUND.

*Importing* (another group holds the KV): a sample that arrives with a handoff is admitted
holding fresh blocks for that KV (`Scheduler.add_importing`); a task claims the hold, has
every worker pull its share (its layers, its KV heads) with one deadline, and queues the
sample with the KV computed — or, on any failure (claim refused, tokens that differ, a
worker's pull failing or timing out), with nothing computed: it recomputes, and the
stream is the same either way. The task always ends, by `pull_timeout_s` at the latest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from pagemesh.runtime import keepalive
from pagemesh.runtime.internal_auth import METADATA_KEY
from pagemesh.runtime.metrics import PREFIX, counter
from pagemesh.runtime.tls import TlsConfig
from protos.pagemesh.scheduler.v1 import scheduler_pb2_grpc
from protos.step import RequestId
from scheduler_svc import convert
from scheduler_svc.core.kv_moves import num_usable_tokens
from scheduler_svc.core.types import HeldKV, KVImport, Request
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.messages import KVClaim, KVHandoffRef, KVImportJob, KVRank, TierSource
from scheduler_svc.worker_client import WorkerGroupClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVMoveConfig:
    # An unclaimed hold is freed after this long, seconds (its sample recomputes elsewhere).
    hold_s: float = 30.0
    # One import's whole budget (claim, every rank's pull), seconds.
    pull_timeout_s: float = 10.0
    # A claim keeps the hold this much past the claimant's own deadline, seconds.
    claim_margin_s: float = 2.0


@dataclass
class KVMoveCounts:
    """Since start. Source side: holds made, released after a pull, released unused,
    expired. Destination side: imports tried, pulled, failed; blocks and bytes pulled."""

    holds: int = 0
    holds_pulled: int = 0
    holds_unused: int = 0
    holds_expired: int = 0
    imports: int = 0
    imports_pulled: int = 0
    imports_failed: int = 0
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    pull_seconds: float = 0.0
    tier_loads: int = 0  # of the imports pulled, those from this group's host tier


def _source_name(job: KVImportJob) -> str:
    source = job.source
    return source.scheduler_address if isinstance(source, KVHandoffRef) else "the host tier"


def kv_move_entry(counts: KVMoveCounts) -> dict[str, int]:
    """The counts as the registry entry's `kv_*` fields (pagemesh/runtime/registry_entries.py)."""
    return {
        f"kv_{name}": int(value) for name, value in vars(counts).items() if name != "pull_seconds"
    }


def kv_move_metrics(moves: KVMoves, group: str) -> Iterable[Metric]:
    """The counts as Prometheus counters (scrape time; they outlive a re-formation)."""
    counts, labels = moves.counts, {"group": group}
    yield counter(
        PREFIX + "kv_recomputed_tokens",
        "Tokens of resumed requests computed again "
        "(not pulled from another group, loaded from the host tier or cached)",
        labels,
        moves.loop.scheduler.num_recomputed_tokens,
    )
    yield counter(
        PREFIX + "kv_transferred_blocks",
        "KV blocks pulled into this group (from another group or the host tier)",
        labels,
        counts.blocks_pulled,
    )
    yield counter(
        PREFIX + "kv_transferred_bytes",
        "Bytes of KV pulled from other groups",
        labels,
        counts.bytes_pulled,
    )
    imports = CounterMetricFamily(
        PREFIX + "kv_imports",
        "Requests admitted with KV held elsewhere, by how the import ended",
        labels=["group", "result"],
    )
    imports.add_metric([group, "pulled"], counts.imports_pulled - counts.tier_loads)
    imports.add_metric([group, "tier"], counts.tier_loads)
    imports.add_metric([group, "failed"], counts.imports_failed)
    yield imports
    holds = CounterMetricFamily(
        PREFIX + "kv_holds",
        "KV holds this group made for another, by how they ended",
        labels=["group", "result"],
    )
    holds.add_metric([group, "pulled"], counts.holds_pulled)
    holds.add_metric([group, "unused"], counts.holds_unused)
    holds.add_metric([group, "expired"], counts.holds_expired)
    yield holds


class KVMoves:
    def __init__(
        self,
        loop: EngineLoop,
        token: str = "",
        tls: TlsConfig | None = None,
        config: KVMoveConfig | None = None,
    ) -> None:
        self.loop = loop
        self.token = token
        self.tls = tls or TlsConfig()
        self.config = config or KVMoveConfig()
        self.counts = KVMoveCounts()
        # Hold (core request id) -> monotonic deadline; a hold seen first gets hold_s.
        self._deadlines: dict[RequestId, float] = {}
        self._ranks: tuple[object, list[KVRank]] | None = None  # (workers, their ranks)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- holding: this group's KV for another -------------------------------------------

    async def claim(self, handoff_id: str, hold_ms: int) -> tuple[HeldKV, list[KVRank]] | None:
        """The hold and where this group's ranks serve it, kept for `hold_ms` more; None
        when it is not here (released, expired, or lost with a re-formed group)."""
        held = self.loop.scheduler.held.get(RequestId(handoff_id))
        if held is None:
            return None
        ranks = await self._kv_ranks()
        if ranks is None:
            return None
        self._deadlines[held.request_id] = (
            time.monotonic() + hold_ms / 1000 + self.config.claim_margin_s
        )
        return held, ranks

    def release(self, handoff_id: str, pulled: bool, reason: str) -> None:
        request_id = RequestId(handoff_id)
        self._deadlines.pop(request_id, None)
        if not self.loop.scheduler.release_held(request_id):
            return
        if pulled:
            self.counts.holds_pulled += 1
        else:
            self.counts.holds_unused += 1
            logger.info("KV hold %s released unused by its claimant: %s", handoff_id, reason)

    def expire(self) -> None:
        """Frees holds past their deadline; a hold seen for the first time gets `hold_s`."""
        now = time.monotonic()
        held = self.loop.scheduler.held
        for request_id in list(self._deadlines):
            if request_id not in held:
                del self._deadlines[request_id]
        for request_id in held:
            if request_id not in self._deadlines:
                self._deadlines[request_id] = now + self.config.hold_s
        for request_id, deadline in list(self._deadlines.items()):
            if deadline <= now:
                del self._deadlines[request_id]
                self.loop.scheduler.release_held(request_id)
                self.counts.holds_expired += 1
                logger.warning("KV hold %s expired unpulled; its blocks are freed", request_id)

    async def run(self, interval_s: float = 0.5) -> None:
        while True:
            self.expire()
            await asyncio.sleep(interval_s)

    async def _kv_ranks(self) -> list[KVRank] | None:
        """This group's ranks' transfer servers, asked once per formation; None when a rank
        has none (its KV cannot move)."""
        workers = self.loop.workers
        if self._ranks is None or self._ranks[0] is not workers:
            if not isinstance(workers, WorkerGroupClient):
                return None
            infos = await workers.get_info()
            self._ranks = (
                workers,
                [i.kv_rank for i in infos if i.kv_rank is not None]
                if all(i.kv_rank is not None for i in infos)
                else [],
            )
        return self._ranks[1] or None

    # ---- importing: another group's KV for this one -------------------------------------

    def pull(self, imports: Sequence[KVImportJob]) -> None:
        """Starts one import task per importing sample (`EngineLoop.submit`'s result)."""
        for job in imports:
            importer = (
                self._import_remote if isinstance(job.source, KVHandoffRef) else self._import_tier
            )
            task = asyncio.create_task(self._import(job, importer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def dismiss(self, handoffs: Sequence[KVHandoffRef]) -> None:
        """Holds this group does not need (their blocks are in its prefix cache, or there
        was no room to import): released at once rather than left to expire."""
        for handoff in handoffs:
            self._spawn_release(handoff, False, "not needed: cached here, or no room")

    async def _import(
        self, job: KVImportJob, importer: Callable[[KVImportJob, float], Awaitable[str]]
    ) -> None:
        """Runs one import to its terminal result and queues the request either way."""
        core, request = self.loop.scheduler, job.request
        self.counts.imports += 1
        started = time.monotonic()
        try:
            reason = await importer(job, started + self.config.pull_timeout_s)
        except Exception as exc:  # whatever failed, the sample recomputes
            reason = f"{type(exc).__name__}: {exc}"
        pulled = not reason
        if pulled:
            self.counts.imports_pulled += 1
            self.counts.blocks_pulled += len(job.kv.block_ids)
        else:
            self.counts.imports_failed += 1
            logger.warning(
                "request %s: KV not imported from %s (%s); recomputing %d tokens",
                request.request_id,
                _source_name(job),
                reason,
                job.kv.num_tokens,
            )
        self.counts.pull_seconds += time.monotonic() - started
        if self.loop.scheduler is core and core.finish_import(request.request_id, pulled):
            self.loop.wake()

    async def _import_remote(self, job: KVImportJob, deadline: float) -> str:
        """Claim, pull, release: "" when every rank pulled its share, else why not."""
        handoff = job.source
        assert isinstance(handoff, KVHandoffRef)
        claim, reason = None, ""
        try:
            claim = await self._claim(handoff, deadline)
            reason = self._check(job.request, job.kv, claim)
            if not reason:
                assert claim is not None
                reason = await self._pull_blocks(job.kv, claim, deadline)
        finally:
            if claim is not None:
                self._spawn_release(handoff, not reason, reason)
        return reason

    async def _import_tier(self, job: KVImportJob, deadline: float) -> str:
        """Every rank loads its share from its host tier; a slot that fails its check
        there is forgotten (and the request recomputes)."""
        source, workers, tier = job.source, self.loop.workers, self.loop.tier
        assert isinstance(source, TierSource)
        if not isinstance(workers, WorkerGroupClient) or tier is None:
            return "no host tier on this group now"
        failed, reason = await workers.load_kv(
            source.slots,
            job.kv.block_ids,
            source.keys,
            tier.epochs,
            max(deadline - time.monotonic(), 0.1),
        )
        for key in {
            source.keys[job.kv.block_ids.index(b)] for b in failed if b in job.kv.block_ids
        }:
            tier.forget(key)
        if not reason:
            self.counts.tier_loads += 1
        return reason

    async def _claim(self, handoff: KVHandoffRef, deadline: float) -> KVClaim | None:
        stub = scheduler_pb2_grpc.SchedulerStub(self._channel(handoff.scheduler_address))
        hold_ms = int(max(deadline - time.monotonic(), 0) * 1000)
        try:
            response = await stub.ClaimKv(
                convert.claim_request_pb(handoff.handoff_id, hold_ms),
                timeout=max(deadline - time.monotonic(), 0.1),
                metadata=self._metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            logger.info(
                "claim of KV hold %s at %s: %s",
                handoff.handoff_id,
                handoff.scheduler_address,
                exc.details(),
            )
            return None
        return convert.claim_from_pb(response)

    @staticmethod
    def _check(request: Request, imported: KVImport, claim: KVClaim | None) -> str:
        """Why the claimed blocks cannot serve the import ("" when they can)."""
        if claim is None:
            return "the hold could not be claimed (released, expired, or its group re-formed)"
        if num_usable_tokens(request.all_token_ids, claim.token_ids) < imported.num_tokens:
            return "the held KV is of other tokens than the request's"
        if len(claim.block_ids) < imported.first_index + len(imported.block_ids):
            return "the hold has fewer blocks than its tokens need"
        if not claim.ranks:
            return "the holding group's ranks serve no KV transfer"
        return ""

    async def _pull_blocks(self, imported: KVImport, claim: KVClaim, deadline: float) -> str:
        """Every worker pulls its share; "" when all did, else the first failure's reason."""
        workers = self.loop.workers
        if not isinstance(workers, WorkerGroupClient):
            return "this group's workers cannot pull KV (in-process executor)"
        first = imported.first_index
        src = claim.block_ids[first : first + len(imported.block_ids)]
        timeout_ms = int(max(deadline - time.monotonic(), 0) * 1000)
        results = await workers.pull_kv(claim, src, imported.block_ids, timeout_ms)
        failed = [r.reason for r in results if not r.ok]
        if failed:
            return failed[0]
        self.counts.bytes_pulled += sum(r.num_bytes for r in results)
        return ""

    def _spawn_release(self, handoff: KVHandoffRef, pulled: bool, reason: str) -> None:
        async def release() -> None:
            stub = scheduler_pb2_grpc.SchedulerStub(self._channel(handoff.scheduler_address))
            with contextlib.suppress(grpc.aio.AioRpcError):  # it expires there anyway
                await stub.ReleaseKv(
                    convert.release_request_pb(handoff.handoff_id, pulled, reason),
                    timeout=5.0,
                    metadata=self._metadata(),
                )

        task = asyncio.create_task(release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.tls.aio_channel(
                address, options=list(keepalive.CHANNEL_OPTIONS)
            )
        return channel

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, self.token),) if self.token else ()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for channel in self._channels.values():
            await channel.close()
