"""`python -m scheduler_svc.main`: one engine group's scheduler."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import asdict

from pagemesh.runtime.config import (
    add_flag,
    add_options,
    add_registry_flags,
    add_server_flags,
    metrics_config,
    registry_config,
    server_config,
)
from pagemesh.runtime.internal_auth import InternalTokenInterceptor
from pagemesh.runtime.lora_modules import parse_lora_modules
from pagemesh.runtime.metrics import serve_metrics
from pagemesh.runtime.metrics_scheduler import SchedulerMetrics
from pagemesh.runtime.registry import Registry
from pagemesh.runtime.registry_entries import GroupStatus, SchedulerEntry
from pagemesh.runtime.service_flags import SCHEDULER_OPTIONS
from pagemesh.runtime.serving import FatalStartupError, GrpcServer, run_service
from pagemesh.runtime.speculative_config import SpeculativeConfig
from protos.step import LoraRef
from scheduler_svc import convert
from scheduler_svc.adapters import GroupAdapters
from scheduler_svc.checkpoint import Checkpointer
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine_group import ConfigFor, EngineGroup, GroupSpec, host_tier_for
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.engine_metrics import observe_engine
from scheduler_svc.kv_moves import KVMoveConfig, KVMoves, kv_move_entry, kv_move_metrics
from scheduler_svc.messages import WorkerInfo
from scheduler_svc.servicer import SERVICE_NAMES, SchedulerServicer, add_to_server
from scheduler_svc.step_watchdog import WatchdogConfig
from scheduler_svc.worker_client import WorkerGroupClient

logger = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scheduler_svc", description=__doc__)
    add_server_flags(parser, default_port=0)
    add_registry_flags(parser)
    add_flag(parser, "--group", default="g0", help="engine group this scheduler drives")
    add_flag(parser, "--scheduler-id", default=None, help="id in the registry (default: group)")
    add_flag(parser, "--tp", type=int, default=1, help="tensor-parallel workers per stage")
    add_flag(parser, "--pp", type=int, default=1, help="pipeline stages")
    add_flag(
        parser,
        "--role",
        default="both",
        choices=ROLES,
        help="disaggregated serving: a prefill group stops each new request after its "
        "first token and hands its KV to a decode group; both = colocated",
    )
    add_options(
        parser, SCHEDULER_OPTIONS
    )  # declared in pagemesh.runtime.service_flags, like `up`'s
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def async_scheduling(args: argparse.Namespace) -> bool:
    """Only a group of one rank can fill in its own sampled tokens; and not while
    speculating (a step planned ahead assumes one token)."""
    return args.async_scheduling and args.tp * args.pp == 1 and not args.speculative_config


def config_for(args: argparse.Namespace) -> ConfigFor:
    """How the scheduler is sized from what its workers report (at start and after a
    re-formation, whose workers may have a different cache)."""

    def build(infos: list[WorkerInfo], driver_index: int) -> SchedulerConfig:
        lead = infos[driver_index]
        num_swap_blocks = min(info.num_swap_blocks for info in infos)
        preemption_mode = args.preemption_mode
        if preemption_mode == "swap" and num_swap_blocks == 0:
            logger.warning("--preemption-mode swap but the workers have no swap space: recomputing")
            preemption_mode = "recompute"
        return SchedulerConfig(
            num_blocks=min(info.num_blocks for info in infos),
            block_size=lead.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=lead.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            enable_prefix_caching=args.enable_prefix_caching,
            policy=args.scheduling_policy,
            preemption_mode=preemption_mode,
            num_swap_blocks=num_swap_blocks,
            num_microbatches=args.pp,
            async_scheduling=async_scheduling(args),
            pooling=lead.pooling,
            max_loras=args.max_loras if args.enable_lora else 0,
            speculative=SpeculativeConfig.parse(args.speculative_config),
        )

    return build


def _adapters(args: argparse.Namespace, loop: EngineLoop, registry: Registry) -> GroupAdapters:
    """The LoRA adapters the group holds: its --lora-modules at first, up to --max-cpu-loras
    (0 = --max-loras) with those it loads later; none held and none loaded without
    --enable-lora."""
    if not args.enable_lora:
        return GroupAdapters(args.group, 0, {}, lambda: None)
    pinned = {
        name: LoraRef(name, path) for name, path in parse_lora_modules(args.lora_modules).items()
    }
    return GroupAdapters(
        args.group,
        args.max_cpu_loras or args.max_loras,
        pinned,
        lambda: _worker_group(loop),
        registry.loras,
    )


def _worker_group(loop: EngineLoop) -> WorkerGroupClient | None:
    """The group's workers now (a re-formation replaces them)."""
    return loop.workers if isinstance(loop.workers, WorkerGroupClient) else None


async def serve(args: argparse.Namespace) -> None:
    try:
        SpeculativeConfig.parse(args.speculative_config)  # a bad one stops the start, named
    except ValueError as exc:
        raise FatalStartupError(f"--speculative-config: {exc}") from exc
    registry = Registry(registry_config(args))
    await registry.ping()
    spec = GroupSpec(
        args.group,
        args.tp,
        args.pp,
        args.worker_wait_s,
        args.step_timeout_s,
        server_config(args).tls,
        args.standby_grace_s,
    )
    group = EngineGroup(registry, spec, config_for(args))
    formed = await group.form()
    logger.info("scheduler config %s", asdict(formed.config))
    watchdog = WatchdogConfig(min_s=min(1.0, args.step_watchdog_s), max_s=args.step_watchdog_s)
    loop = EngineLoop(
        Scheduler(formed.config, host_tier_for(formed.infos, None)),
        formed.workers,
        max_steps_in_flight=args.pp,
        group=group,
        recovery_timeout_s=args.recovery_timeout_s,
        watchdog=watchdog,
    )
    checkpointer = Checkpointer(
        registry.checkpoints,
        args.group,
        args.checkpoint_interval,
        args.resume_window_s,
        int(args.image_store_mib * 1024 * 1024),
    )
    loop.on_step.append(checkpointer.on_step)
    registry.on_redis_restart.append(checkpointer.rewrite_all)
    await checkpointer.adopt_orphans()
    model_info = convert.model_info_to_pb(
        formed.lead, formed.config.num_blocks, formed.weight_bytes, formed.kv_cache_bytes
    )
    scheduler_id = args.scheduler_id or args.group
    adapters = _adapters(args, loop, registry)
    kv_moves = KVMoves(
        loop,
        args.internal_token or "",
        server_config(args).tls,
        KVMoveConfig(hold_s=args.kv_hold_s, pull_timeout_s=args.kv_pull_timeout_s),
    )
    loop.importer = kv_moves.pull
    servicer = SchedulerServicer(
        loop,
        model_info,
        checkpointer,
        group=args.group,
        scheduler_id=scheduler_id,
        adapters=adapters,
        kv_moves=kv_moves,
        prefill_only=args.role == "prefill",
    )
    server = GrpcServer(
        server_config(args),
        SERVICE_NAMES,
        [lambda s: add_to_server(servicer, s)],
        interceptors=internal_auth(args),
    )
    await server.start()
    try:
        server.install_signal_handlers()
        metrics = SchedulerMetrics(args.group)
        observe_engine(metrics, loop, checkpointer, registry)
        metrics.add_collector(lambda: kv_move_metrics(kv_moves, args.group))
        metrics_server = await serve_metrics(metrics, metrics_config(args))

        def registry_info() -> dict[str, object]:
            return SchedulerEntry(
                address=server.address,
                group=args.group,
                model=formed.lead.model,
                pid=os.getpid(),
                host=socket.gethostname(),
                status=loop.status,
                num_recoveries=loop.num_recoveries,
                num_steps=loop.num_steps,
                num_watchdog_probes=loop.watchdog.num_probes,
                num_slow_steps=loop.watchdog.num_slow_steps,
                members=tuple(e.worker_id for e in loop.workers.endpoints),
                role=args.role,
                **kv_move_entry(kv_moves.counts),
                session=group.session,
                epoch=group.epoch,
                checkpoint_writes=checkpointer.num_writes,
                checkpoint_write_s=round(checkpointer.write_time_s, 6),
                loras=adapters.names(),
                lora_version=adapters.version,
                lora_capacity=adapters.capacity,
                **asdict(loop.scheduler.stats()),
                **metrics_server.registry_info(),
            ).to_json()

        async def on_status(status: GroupStatus) -> None:
            await server.set_serving(status == GroupStatus.READY)
            with contextlib.suppress(Exception):  # the next heartbeat publishes it anyway
                await registry.put("scheduler", scheduler_id, registry_info())

        loop.on_status.append(on_status)
        adapters.on_change.append(lambda: registry.put("scheduler", scheduler_id, registry_info()))
        registry.on_redis_restart.append(adapters.publish_pinned)
        await adapters.publish_pinned()
        # Before a formation's first step the workers check its session against this entry,
        # written once the id is claimed (a killed predecessor's entry may hold it until its
        # TTL runs out: steps of requests that reach this one early wait for that).
        claimed = asyncio.Event()

        async def announce_session() -> None:
            await claimed.wait()
            await registry.put("scheduler", scheduler_id, registry_info())

        group.on_new_session.append(announce_session)
        loop_task = asyncio.create_task(loop.run())
        loop_task.add_done_callback(lambda task: _on_loop_exit(task, server))
        # Another instance holds this group now (this one was cut off longer than the TTL,
        # and was replaced), or this one was fenced: stop driving the workers at once, no
        # drain, and leave the registry entry to its holder. No split brain.
        fenced: list[dict[str, object]] = []
        registry.on_fenced.append(
            lambda record: (fenced.append(record), loop_task.cancel(), server.request_stop())
        )
        await server.set_serving(True)
        await registry.start_heartbeat("scheduler", scheduler_id, registry_info)
        claimed.set()
        watch = asyncio.create_task(
            _watch_members(loop, group, registry.config.heartbeat_interval_s)
        )
        expiry = asyncio.create_task(kv_moves.run())
        await server.wait_for_stop()
        watch.cancel()
        if not fenced:
            migrate = args.drain_migrate and await _other_group_ready(
                registry, scheduler_id, formed.lead.model
            )
            await _drain(loop, checkpointer, args.drain_timeout_s, migrate)
        expiry.cancel()
        await kv_moves.close()
        await registry.close(deregister=[] if fenced else [("scheduler", scheduler_id)])
        await server.stop()
        loop_task.cancel()
        await checkpointer.close()
        await loop.workers.close()
    except BaseException:  # failed midway: no grpc.aio server may outlive the loop
        await server.stop_now()
        raise
    await metrics_server.close()


async def _watch_members(loop: EngineLoop, group: EngineGroup, interval_s: float) -> None:
    """Notices a dead worker between steps too (an idle group has no step to fail), so
    health turns NOT_SERVING within one heartbeat TTL of the death."""
    while True:
        await asyncio.sleep(interval_s)
        if loop.status == GroupStatus.READY and not await group.members_alive(loop.workers):
            loop.request_recovery("a worker's heartbeat expired and it does not answer")


async def _drain(
    loop: EngineLoop, checkpointer: Checkpointer, timeout_s: float, migrate: bool = False
) -> None:
    """SIGTERM: NOT_SERVING, no admissions. With `migrate`, every request is handed over at
    once with its KV, and the group stays up (for `timeout_s` at most) until the groups
    continuing them have pulled it. Else the requests in flight may finish for up to
    `timeout_s`; then the rest are handed over: their streams end UNAVAILABLE with their
    checkpoints written, and the routers resume them on another group."""
    await loop.set_status(GroupStatus.DRAINING)
    deadline = time.monotonic() + timeout_s
    if migrate:
        migrated, recomputed = await loop.hand_off_all()
        logger.warning(
            "drain: %d requests handed over with their KV, %d to recompute", migrated, recomputed
        )
        # Until the groups continuing them pulled what this drain handed over (a prefill
        # group's ordinary holds expire on their own).
        while loop.handed_off & set(loop.scheduler.held) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return
    while loop.num_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if loop.num_streams:
        logger.warning("drain: handing %d requests over to other groups", loop.num_streams)
        loop.fail_all("this scheduler is shutting down; resume on another group")
        await asyncio.sleep(0.2)  # let the streams end (and orphan their checkpoints)


async def _other_group_ready(registry: Registry, scheduler_id: str, model: str) -> bool:
    """Whether another group of the model serves now: somewhere to hand requests over to."""
    try:
        entries = await registry.entries(SchedulerEntry)
    except Exception:  # Redis away: let them finish here
        return False
    return any(
        sid != scheduler_id
        and entry.model == model
        and entry.status == GroupStatus.READY
        and entry.role != "prefill"
        for sid, entry in entries.items()
    )


def internal_auth(args: argparse.Namespace) -> list[InternalTokenInterceptor]:
    """Only the mesh's own routers may call this scheduler (pagemesh/runtime/internal_auth.py)."""
    return [InternalTokenInterceptor(args.internal_token)] if args.internal_token else []


def _on_loop_exit(task: asyncio.Task[None], server: GrpcServer) -> None:
    """The step loop never ends on its own: if it does, stop serving rather than hang."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("step loop crashed", exc_info=task.exception())
        server.request_stop()


def main(argv: list[str] | None = None) -> None:
    run_service("scheduler", parse_args(argv), serve)


if __name__ == "__main__":
    main()
