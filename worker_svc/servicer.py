"""Worker gRPC servicer: converts, runs the step on the model thread, converts back.

Its admin RPCs (memory, step statistics, profiler traces) adapt worker_svc/diagnostics.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc

from pagemesh.runtime.serving import ServiceError
from protos.pagemesh.v1 import admin_pb2
from protos.pagemesh.worker.v1 import worker_pb2, worker_pb2_grpc
from protos.step import LoraRef
from worker_svc import convert, diagnostics
from worker_svc.diagnostics import (
    Profiler,
    ProfilerPathError,
    ProfilerStateError,
    StepStats,
    default_profile_dir,
)
from worker_svc.distributed import GroupStepError
from worker_svc.kv_endpoint import KVEndpoint
from worker_svc.lora.adapter import AdapterError
from worker_svc.lora.manager import LoraManager
from worker_svc.model.moe import expert_load
from worker_svc.runner import ModelRunner
from worker_svc.tracing import traced_step

logger = logging.getLogger(__name__)

STEP_ORDER_TIMEOUT_S = 60.0
REFORMING = "re-forming the engine group"

T = TypeVar("T")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        worker_id: str,
        layout: dict[str, int],
        profile_dir: Path | None = None,
        max_profile_s: float = 300.0,
    ) -> None:
        self.runner: ModelRunner | None = None  # set once the model is loaded
        self.kv: KVEndpoint | None = None  # KV moving between groups: set with the runner
        self.worker_id = worker_id
        self.layout = layout
        # One thread owns the model: steps run strictly one after another, and the event
        # loop stays free for health checks while a forward pass runs.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.step_stats = StepStats()  # every step that succeeded: time, communication
        self._profiler: Profiler | None = None  # made with the runner (it needs the device)
        self.profile_dir = profile_dir  # traces only under it (None: the default)
        self.max_profile_s = max_profile_s  # a trace stops itself after this long
        # Called with each step's forward time, seconds, once it succeeded (metrics).
        self.on_step: list[Callable[[float], None]] = []
        # Step order: (session, next sequence number) of the scheduler driving this worker.
        self._order = asyncio.Condition()
        self._session_id = ""
        self._next_sequence = 0
        # False while the engine group re-forms; each stop bumps the generation, so a step
        # that was waiting for its turn across a re-formation is refused, not run on the new
        # group with the old session's numbering.
        self._accepting = True
        self._generation = 0
        # Set by the worker's main: raises unless the group's current scheduler registered
        # this session (worker_svc/membership.py); None takes any (tests, no registry).
        self.check_session: Callable[[str], Awaitable[None]] | None = None

    def _ready_runner(self) -> ModelRunner:
        if self.runner is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.runner

    async def GetWorkerInfo(
        self, request: worker_pb2.GetWorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetWorkerInfoResponse:
        runner = self._ready_runner()
        return convert.worker_info_to_pb(
            runner.info(),
            self.worker_id,
            self.layout,
            self.kv.rank_slice if self.kv is not None else None,
            runner.host_tier,
        )

    async def LoadKv(
        self, request: worker_pb2.LoadKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadKvResponse:
        """Blocks from this rank's host tier into its cache, each slot checked; on a
        thread of its own, beside the steps (the blocks are the importing request's)."""
        runner = self._ready_runner()
        tier, dst = runner.host_tier, list(request.dst_block_ids)
        if tier is None or tier.epoch != request.epoch:
            return convert.load_failed_pb(
                dst,
                "this rank's host tier is not the one indexed (restarted without it, or re-made)",
            )
        executor = self.kv.executor if self.kv is not None else None
        failed = await asyncio.get_running_loop().run_in_executor(
            executor, tier.load, runner.kv_caches, list(zip(request.slots, dst, request.keys))
        )
        return convert.load_failed_pb(
            failed, f"{len(failed)} of {len(dst)} slots failed their check" if failed else ""
        )

    async def PullKv(
        self, request: worker_pb2.PullKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PullKvResponse:
        """Another group's blocks into this rank's cache, on a thread of its own (beside the
        steps); always the transfer's terminal result, never an error status."""
        kv = self.kv
        if kv is None:
            return convert.pull_failed_pb(
                "this worker serves no KV transfer (still loading, or it has none)"
            )
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                kv.executor,
                kv.pull,
                convert.rank_slices_from_pb(request.sources),
                list(request.src_block_ids),
                list(request.dst_block_ids),
                request.timeout_ms / 1000,
                request.transfer_token,
                request.transfer_id,
            )
        except ValueError as exc:  # the scheduler's mistake: block ids that do not fit here
            return convert.pull_failed_pb(f"bad pull: {exc}")
        return convert.pull_result_to_pb(result)

    @traced_step  # the step's span, worker_svc/tracing.py
    async def ExecuteStep(
        self, request: worker_pb2.ExecuteStepRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ExecuteStepResponse:
        runner = self._ready_runner()
        if not self._accepting:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, REFORMING)
        step = convert.scheduler_output_from_pb(request)
        if (
            self.check_session is not None
            and request.session_id != self._session_id
            and request.sequence == 0
        ):
            await self.check_session(request.session_id)
        new_session = await self._wait_for_turn(request.session_id, request.sequence)
        loop = asyncio.get_running_loop()
        if new_session:
            # A new scheduler re-sends every request in full; the old session's must not
            # linger. Queued ahead of the step, after any step of the old session.
            self._executor.submit(runner.reset_requests)
        # Queued on the one model thread in sequence order; the next step may queue behind
        # it at once, so a pipeline stage starts step k+1 as soon as it finishes step k.
        future = loop.run_in_executor(
            self._executor, diagnostics.run_step_recorded, runner, step, self.step_stats
        )
        async with self._order:
            self._next_sequence = request.sequence + 1
            self._order.notify_all()
        try:
            output = await future
        except ValueError as exc:  # an inconsistent step plan: the scheduler's bug, said plainly
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        except GroupStepError as exc:  # ranks disagreed, a stage failed, a peer was lost
            raise ServiceError(grpc.StatusCode.ABORTED, str(exc)) from exc
        for hook in self.on_step:
            hook(output.forward_time_ms / 1000)
        return convert.model_runner_output_to_pb(output)

    @property
    def num_steps(self) -> int:
        return self.step_stats.num_steps

    @property
    def busy_time_s(self) -> float:
        """Seconds in steps (wall time on the model thread), since the process started."""
        return self.step_stats.busy_s

    # ---- admin (pagemesh.v1.Admin, forwarded by the scheduler) ----------------------------

    async def GetMemory(
        self, request: worker_pb2.GetMemoryRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetMemoryResponse:
        memory = diagnostics.memory_stats(self._ready_runner())
        return convert.memory_to_pb(memory, self.worker_id, self.layout)

    async def GetStepStats(
        self, request: worker_pb2.GetStepStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetStepStatsResponse:
        snapshot = self.step_stats.snapshot(request.window_s)
        load = expert_load(self.runner.model) if self.runner is not None else {}
        return convert.step_stats_to_pb(snapshot, self.worker_id, self.layout, load)

    async def StartProfile(
        self, request: worker_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.StartProfileResponse:
        profiler = self._ready_profiler()
        layout = self.layout
        name = (
            f"{request.trace_name or 'pagemesh'}-pp{layout['pp_rank']}-tp{layout['tp_rank']}"
            f"-{self.worker_id}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        try:
            number = await self.run_on_model_thread(
                profiler.start, request.out_dir, name, request.record_shapes, request.with_stack
            )
        except ProfilerStateError as exc:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        except ProfilerPathError as exc:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        except OSError as exc:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cannot write traces to {request.out_dir!r}: {exc}",
            ) from exc
        logger.info(
            "profiler trace started (%s); it stops itself after %g s (--max-profile-s)",
            name,
            self.max_profile_s,
        )
        asyncio.get_running_loop().call_later(
            self.max_profile_s, lambda: asyncio.ensure_future(self._stop_profile(number))
        )
        return worker_pb2.StartProfileResponse()

    async def _stop_profile(self, number: int) -> None:
        """Ends trace `number` if it still runs: nobody may leave a trace running."""
        try:
            trace = await self.run_on_model_thread(self._ready_profiler().stop, number)
        except ProfilerStateError:  # stopped already (and maybe another one started)
            return
        logger.warning(
            "profiler trace stopped after --max-profile-s %g s; written to %s",
            self.max_profile_s,
            trace.path,
        )

    async def StopProfile(
        self, request: worker_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.StopProfileResponse:
        try:
            trace = await self.run_on_model_thread(self._ready_profiler().stop)
        except ProfilerStateError as exc:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        logger.info(
            "profiler trace written to %s (%.1f s, %d steps)",
            trace.path,
            trace.duration_s,
            trace.num_steps,
        )
        return convert.profile_trace_to_pb(trace, self.worker_id, self.layout)

    async def LoadLoraAdapter(
        self, request: admin_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.LoadLoraAdapterResponse:
        lora = self._lora()
        try:
            await self.run_on_model_thread(lora.load, LoraRef(request.lora_name, request.lora_path))
        except AdapterError as exc:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        logger.info("LoRA adapter %s loaded from %s", request.lora_name, request.lora_path)
        return admin_pb2.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(
        self, request: admin_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UnloadLoraAdapterResponse:
        await self.run_on_model_thread(self._lora().unload, request.lora_name)
        return admin_pb2.UnloadLoraAdapterResponse()

    def _lora(self) -> LoraManager:
        lora = getattr(self._ready_runner(), "lora", None)
        if lora is None:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "LoRA is off on this worker: start it with --enable-lora",
            )
        return lora

    def _ready_profiler(self) -> Profiler:
        if self._profiler is None:
            self._profiler = Profiler(
                self._ready_runner().device,
                self.step_stats,
                self.profile_dir or default_profile_dir(),
            )
        return self._profiler

    def stats(self) -> dict[str, float | int]:
        """Cumulative counters published with each heartbeat (seconds and steps), and the
        memory figures `pagemesh top` shows (bytes)."""
        stats: dict[str, float | int] = {
            "num_steps": self.num_steps,
            "busy_time_s": round(self.busy_time_s, 6),
        }
        if self.runner is not None:
            dist = self.runner.dist
            stats.update(
                tp_collective_time_s=round(dist.tp_collective_time_s, 6),
                tp_bytes_sent=dist.tp_bytes_sent,
                pp_send_time_s=round(dist.pp_send_time_s, 6),
                pp_recv_time_s=round(dist.pp_recv_time_s, 6),
                kv_cache_bytes=self.runner.num_blocks * self.runner.kv_spec.bytes_per_block,
                rss_bytes=diagnostics.process_rss_bytes(),
            )
        return stats

    async def stop_steps(self) -> None:
        """Refuse steps (UNAVAILABLE) until `resume_steps`, including those waiting for their
        turn. A step already on the model thread that waits on a peer (a collective, a
        stage's activations) gives up at once: the group re-forms, perhaps without that
        peer, which may be frozen or cut off and never answer."""
        async with self._order:
            self._accepting = False
            self._generation += 1
            self._order.notify_all()
        if self.runner is not None:
            self.runner.dist.abandon()

    async def resume_steps(self) -> None:
        """Accept steps again, from step 0 of a scheduler session, as a fresh worker does."""
        async with self._order:
            self._session_id = ""
            self._next_sequence = 0
            self._accepting = True

    async def run_on_model_thread(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the model thread, after every step handed to it before."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _wait_for_turn(self, session_id: str, sequence: int) -> bool:
        """Waits until every earlier step of this scheduler session was handed to the model
        thread. A new session (a restarted scheduler) starts at sequence 0; returns whether
        this step starts one."""
        generation = self._generation

        def my_turn() -> bool:
            if generation != self._generation:
                return True  # steps stopped meanwhile
            if session_id != self._session_id:
                return sequence == 0
            return sequence == self._next_sequence

        async with self._order:
            try:
                await asyncio.wait_for(self._order.wait_for(my_turn), timeout=STEP_ORDER_TIMEOUT_S)
            except TimeoutError as exc:
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"step {sequence} of session {session_id} never got its turn: expected "
                    f"step {self._next_sequence} of session {self._session_id or '(none)'}",
                ) from exc
            if generation != self._generation or not self._accepting:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, REFORMING)
            if session_id == self._session_id:
                return False
            logger.info("new scheduler session %s", session_id)
            self._session_id = session_id
            return True

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.kv is not None:
            self.kv.close()
