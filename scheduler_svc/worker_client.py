"""The scheduler's side of its engine group: find the workers in Redis, drive their steps."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence

import grpc

from pagemesh.runtime import keepalive
from pagemesh.runtime.tls import TlsConfig
from protos.pagemesh.worker.v1 import worker_pb2_grpc
from protos.step import ModelRunnerOutput, SchedulerOutput
from scheduler_svc import convert
from scheduler_svc.convert import ProfileTraceReport, RankMemoryReport, RankStepStatsReport
from scheduler_svc.group_formation import WorkerEndpoint
from scheduler_svc.messages import KVClaim, PullResult, WorkerInfo

logger = logging.getLogger(__name__)

_ADMIN_TIMEOUT_S = 10.0
_STOP_PROFILE_TIMEOUT_S = 300.0  # writing a long trace takes a while


class WorkerGroupClient:
    """Sends each step to every worker of the group and returns the sampling rank's answer:
    the engine loop's gRPC executor (scheduler_svc/executor.py)."""

    def __init__(
        self,
        endpoints: list[WorkerEndpoint],
        step_timeout_s: float,
        tls: TlsConfig | None = None,
        announce: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.step_timeout_s = step_timeout_s
        tls = tls or TlsConfig()
        self._channels = [
            tls.aio_channel(
                e.address,
                options=[
                    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.max_send_message_length", 64 * 1024 * 1024),
                    # A frozen or cut-off worker fails its step within 5 s, not at the
                    # step timeout (pagemesh/runtime/keepalive.py).
                    *keepalive.CHANNEL_OPTIONS,
                ],
            )
            for e in endpoints
        ]
        self._stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]
        last_stage = max(e.pp_rank for e in endpoints)
        self.driver_index = next(
            i for i, e in enumerate(endpoints) if e.pp_rank == last_stage and e.tp_rank == 0
        )
        # Workers run steps in this session's order, and accept a new session only from
        # the scheduler whose registry entry names it: `announce` publishes it, once,
        # before the first step goes out (a failure fails the steps: the group re-forms).
        self.session_id = uuid.uuid4().hex
        self._next_sequence = 0
        self._announce = announce
        self._announced: asyncio.Future[None] | None = None

    @property
    def stubs(self) -> list[worker_pb2_grpc.WorkerStub]:
        """One per member, in endpoint order (calls every member answers alike)."""
        return list(self._stubs)

    async def get_info(self) -> list[WorkerInfo]:
        request = convert.worker_info_request_pb()
        responses = await asyncio.gather(
            *(stub.GetWorkerInfo(request, timeout=30, wait_for_ready=True) for stub in self._stubs)
        )
        return [convert.worker_info_from_pb(response) for response in responses]

    async def execute(
        self, output: SchedulerOutput, traceparents: dict[str, str]
    ) -> ModelRunnerOutput:
        """Runs one step on every worker. Calls may overlap (pipeline parallelism): the
        sequence number stamped here, in call order, is the order workers run them in."""
        sequence = self._next_sequence
        self._next_sequence += 1
        if self._announce is not None:
            if self._announced is None:
                self._announced = asyncio.ensure_future(self._announce())
            await asyncio.shield(self._announced)  # one step's cancel leaves it to the others
        request = convert.scheduler_output_to_pb(output, traceparents, self.session_id, sequence)
        responses = await asyncio.gather(
            *(stub.ExecuteStep(request, timeout=self.step_timeout_s) for stub in self._stubs)
        )
        # The last pipeline stage samples; its first tensor-parallel rank answers for the group.
        return convert.model_runner_output_from_pb(responses[self.driver_index])

    async def probe(self, timeout_s: float = 2.0) -> list[grpc.StatusCode | None]:
        """Each member's answer to GetWorkerInfo: None when it answered, else the status."""

        async def ask(stub: worker_pb2_grpc.WorkerStub) -> grpc.StatusCode | None:
            try:
                await stub.GetWorkerInfo(convert.worker_info_request_pb(), timeout=timeout_s)
                return None
            except grpc.aio.AioRpcError as exc:
                return exc.code()

        return list(await asyncio.gather(*(ask(stub) for stub in self._stubs)))

    async def find_dead(self, timeout_s: float = 2.0) -> list[WorkerEndpoint]:
        """Members that do not answer within `timeout_s` (after a failed step: the dead one,
        not its peers whose step failed because of it)."""
        codes = await self.probe(timeout_s)
        return [e for e, code in zip(self.endpoints, codes) if code is not None]

    async def unresponsive(self, timeout_s: float) -> list[str]:
        """Members that do not answer within `timeout_s`, as `worker <id> (<address>)`."""
        return [f"worker {e.worker_id} ({e.address})" for e in await self.find_dead(timeout_s)]

    async def pull_kv(
        self,
        claim: KVClaim,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        timeout_ms: int,
    ) -> list[PullResult]:
        """Every member pulls its share of another group's KV blocks (`claim`'s) into
        `dst_block_ids`; each answers with its transfer's terminal result by the timeout.
        A member that does not answer fails its share."""
        request = convert.pull_request_pb(
            uuid.uuid4().hex[:16], claim, src_block_ids, dst_block_ids, timeout_ms
        )
        timeout_s = timeout_ms / 1000 + 1.0

        async def pull(stub: worker_pb2_grpc.WorkerStub) -> PullResult:
            try:
                return convert.pull_result_from_pb(await stub.PullKv(request, timeout=timeout_s))
            except grpc.aio.AioRpcError as exc:
                return PullResult(False, f"PullKv: {exc.code().name}: {exc.details()}", 0, 0.0, "")

        return list(await asyncio.gather(*(pull(stub) for stub in self._stubs)))

    async def load_kv(
        self,
        slots: Sequence[int],
        dst_block_ids: Sequence[int],
        keys: Sequence[bytes],
        epochs: Sequence[int],
        timeout_s: float,
    ) -> tuple[set[int], str]:
        """Every member loads its share of the blocks from its host tier (`epochs`: each
        member's tier as indexed). Returns the blocks that failed their check anywhere and
        the first failure's reason ("" when every member loaded every block)."""

        async def load(stub: worker_pb2_grpc.WorkerStub, epoch: int) -> tuple[list[int], str]:
            try:
                reply = await stub.LoadKv(
                    convert.load_request_pb(slots, dst_block_ids, keys, epoch), timeout=timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                return list(dst_block_ids), f"LoadKv: {exc.code().name}: {exc.details()}"
            return list(reply.failed_block_ids), reply.reason

        results = await asyncio.gather(
            *(load(stub, epoch) for stub, epoch in zip(self._stubs, epochs))
        )
        failed = {block for blocks, _ in results for block in blocks}
        reasons = [reason for _, reason in results if reason]
        return failed, reasons[0] if reasons else ""

    # ---- admin: each member's report, passed through (pagemesh.v1.Admin's messages) -------

    async def get_memory(self) -> list[RankMemoryReport]:
        """Every member's memory, in endpoint ((pp_rank, tp_rank)) order. Raises
        grpc.aio.AioRpcError when one does not answer."""
        request = convert.memory_request_pb()
        responses = await asyncio.gather(
            *(stub.GetMemory(request, timeout=_ADMIN_TIMEOUT_S) for stub in self._stubs)
        )
        return [response.memory for response in responses]

    async def load_lora(self, name: str, path: str, timeout_s: float) -> None:
        """Every member reads and checks the adapter's folder. Raises the first refusal
        (grpc.aio.AioRpcError, as the worker worded it)."""
        request = convert.lora_load_request_pb(name, path)
        await asyncio.gather(
            *(stub.LoadLoraAdapter(request, timeout=timeout_s) for stub in self._stubs)
        )

    async def unload_lora(self, name: str, timeout_s: float) -> None:
        """Every member lets the adapter go (one that does not answer keeps it until its
        own least-recently-used order lets it go)."""
        request = convert.lora_unload_request_pb(name)
        await asyncio.gather(
            *(stub.UnloadLoraAdapter(request, timeout=timeout_s) for stub in self._stubs),
            return_exceptions=True,
        )

    async def get_step_stats(self, window_s: float) -> list[RankStepStatsReport]:
        """Every member's step statistics over the last `window_s` seconds, in endpoint order."""
        request = convert.step_stats_request_pb(window_s)
        responses = await asyncio.gather(
            *(stub.GetStepStats(request, timeout=_ADMIN_TIMEOUT_S) for stub in self._stubs)
        )
        return [response.stats for response in responses]

    async def start_profile(
        self, out_dir: str, trace_name: str, record_shapes: bool, with_stack: bool
    ) -> list[str]:
        """Starts a trace on every member; returns why each member that refused did."""
        request = convert.start_profile_request_pb(out_dir, trace_name, record_shapes, with_stack)
        results = await asyncio.gather(
            *(stub.StartProfile(request, timeout=_ADMIN_TIMEOUT_S) for stub in self._stubs),
            return_exceptions=True,
        )
        return self._refusals(results)

    async def stop_profile(self) -> tuple[list[ProfileTraceReport], list[str]]:
        """Stops every member's trace: the traces written, and why each other member failed."""
        request = convert.stop_profile_request_pb()
        results = await asyncio.gather(
            *(stub.StopProfile(request, timeout=_STOP_PROFILE_TIMEOUT_S) for stub in self._stubs),
            return_exceptions=True,
        )
        traces = [r.trace for r in results if not isinstance(r, BaseException)]
        return traces, self._refusals(results)

    def _refusals(self, results: list[object]) -> list[str]:
        refusals = []
        for endpoint, result in zip(self.endpoints, results):
            if isinstance(result, grpc.aio.AioRpcError):
                refusals.append(
                    f"worker {endpoint.worker_id}: {result.code().name}: {result.details()}"
                )
            elif isinstance(result, BaseException):
                raise result
        return refusals

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
