"""`python -m worker_svc.main`: one worker (one device) of an engine group."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from kernels import cpu_native
from pagemesh.runtime.config import (
    add_flag,
    add_options,
    add_registry_flags,
    add_server_flags,
    metrics_config,
    registry_config,
    server_config,
)
from pagemesh.runtime.host_tier_files import tier_path
from pagemesh.runtime.internal_auth import InternalTokenInterceptor
from pagemesh.runtime.lora_modules import parse_lora_modules
from pagemesh.runtime.metrics import serve_metrics
from pagemesh.runtime.metrics_worker import WorkerMetrics, WorkerSnapshot
from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.registry import Registry
from pagemesh.runtime.registry_entries import WorkerEntry, WorkerStatus
from pagemesh.runtime.service_flags import WORKER_OPTIONS
from pagemesh.runtime.service_flags_worker import expert_parallel_error
from pagemesh.runtime.serving import GrpcServer, run_service
from pagemesh.runtime.speculative_config import SpeculativeConfig
from protos.pagemesh.worker.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.attention import needs_triton_interpreter
from worker_svc.cuda_graphs import parse_capture_sizes
from worker_svc.diagnostics import process_rss_bytes
from worker_svc.distributed import DistributedContext, init_distributed
from worker_svc.draft import draft_config
from worker_svc.encoder_runner import load_runner
from worker_svc.host_tier import HostTier, HostTierBusy
from worker_svc.kv_endpoint import KVEndpoint
from worker_svc.lora import LoraConfig
from worker_svc.membership import Membership, Plan, WorkerState
from worker_svc.model.moe import expert_load
from worker_svc.parallel import ParallelConfig
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig
from worker_svc.servicer import WorkerServicer

logger = logging.getLogger(__name__)

GIB = 1 << 30


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="worker_svc", description=__doc__)
    add_server_flags(parser, default_port=0)
    add_registry_flags(parser)
    add_flag(parser, "--device", default="cpu", help="cpu | cuda | cuda:N")
    add_flag(parser, "--group", default="g0", help="engine group this worker belongs to")
    add_flag(parser, "--worker-id", default=None, help="id in the registry (default: host-pid)")
    add_flag(parser, "--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    add_flag(parser, "--tp-rank", type=int, default=0, help="this worker's tensor-parallel rank")
    add_flag(parser, "--pp", type=int, default=1, help="pipeline stages")
    add_flag(parser, "--pp-rank", type=int, default=0, help="this worker's pipeline stage")
    add_flag(
        parser,
        "--standby",
        type=bool,
        default=False,
        help="start without a rank (ignores --tp-rank/--pp-rank): wait until a "
        "rendezvous plan gives this worker a dead one's place, then load that shard",
    )
    add_flag(
        parser,
        "--dist-port",
        type=int,
        default=0,
        help="torch.distributed port if this worker is rank 0 (0 = any free port)",
    )
    add_flag(
        parser,
        "--kv-transfer-port",
        type=int,
        default=0,
        help="port of this rank's KV transfer server, which other engine groups pull "
        "KV blocks from (0 = any free port)",
    )
    add_options(parser, WORKER_OPTIONS)  # declared in pagemesh.runtime.service_flags, like `up`'s
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("--model (or PAGEMESH_MODEL) is required")
    problem = expert_parallel_error(args.enable_expert_parallel, args.eplb_interval_steps)
    if problem:
        parser.error(problem)
    return args


def parallel_config(args: argparse.Namespace, rank: int | None = None) -> ParallelConfig:
    """This worker's place: from --tp-rank/--pp-rank, or from a global `rank` (a standby's,
    given by the rendezvous plan)."""
    split = tuple(int(n) for n in args.pp_layer_split.split(",")) if args.pp_layer_split else None
    tp_rank, pp_rank = (
        (args.tp_rank, args.pp_rank) if rank is None else (rank % args.tp, rank // args.tp)
    )
    return ParallelConfig(
        tp_size=args.tp,
        tp_rank=tp_rank,
        pp_size=args.pp,
        pp_rank=pp_rank,
        pp_layer_split=split,
        expert_parallel=args.enable_expert_parallel,
    )


def runner_config(args: argparse.Namespace, parallel: ParallelConfig) -> RunnerConfig:
    return RunnerConfig(
        parallel=parallel,
        model_path=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory_bytes=(
            None if args.kv_cache_memory_gib is None else int(args.kv_cache_memory_gib * GIB)
        ),
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_fraction=args.cpu_kv_cache_fraction,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        num_blocks=args.num_kv_blocks,
        swap_space_bytes=int(args.swap_space * GIB),
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        cpu_linear=args.cpu_linear,
        quantization=args.quantization,
        gguf_keep_quantized=args.gguf_keep_quantized,
        enforce_eager=args.enforce_eager,
        kv_prefault_steps=args.kv_prefault_steps,
        eplb_interval_steps=args.eplb_interval_steps,
        task=args.task,
        lora=(
            LoraConfig(
                args.max_loras,
                args.max_lora_rank,
                args.max_cpu_loras,
                tuple(parse_lora_modules(args.lora_modules).items()),
            )
            if args.enable_lora
            else None
        ),
        cuda_graph_sizes=(
            parse_capture_sizes(args.cuda_graph_sizes) if args.cuda_graph_sizes else None
        ),
        draft=draft_config(SpeculativeConfig.parse(args.speculative_config)),
    )


async def serve(args: argparse.Namespace) -> None:
    configure_kernels(args)  # first: before any kernel module is imported
    registry = Registry(registry_config(args))
    await registry.ping()
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    parallel = parallel_config(args)
    # A standby publishes rank -1 until a plan gives it one (changed in place then).
    layout = {
        "tp_rank": -1 if args.standby else parallel.tp_rank,
        "tp_size": parallel.tp_size,
        "pp_rank": -1 if args.standby else parallel.pp_rank,
        "pp_size": parallel.pp_size,
    }
    servicer = WorkerServicer(
        worker_id, layout, Path(args.profile_dir) if args.profile_dir else None, args.max_profile_s
    )
    # Only the mesh's own schedulers may call this worker (pagemesh/runtime/internal_auth.py).
    server = GrpcServer(
        server_config(args),
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
        [lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s)],
        interceptors=[InternalTokenInterceptor(args.internal_token)] if args.internal_token else [],
    )
    await server.start()
    try:
        server.install_signal_handlers()
        metrics = worker_metrics(args.group, layout, servicer, registry)
        metrics_server = await serve_metrics(metrics, metrics_config(args))
        state = WorkerState(WorkerStatus.STANDBY if args.standby else WorkerStatus.JOINING)
        dist_host = args.advertise_host or args.host
        dist_addr = f"{dist_host}:{args.dist_port or reserve_port(args.host)}"

        def registry_info() -> dict[str, object]:
            return WorkerEntry(
                address=server.address,
                group=args.group,
                dist_addr=dist_addr,
                model=args.served_model_name or args.model,
                pid=os.getpid(),
                host=socket.gethostname(),
                **layout,
                **dataclasses.asdict(state),
                **servicer.stats(),
                **metrics_server.registry_info(),
            ).to_json()

        membership = Membership(
            registry,
            args.group,
            worker_id,
            parallel.world_size,
            state,
            lambda: registry.put("worker", worker_id, registry_info()),
        )
        await membership.skip_current_plan()  # before registering: see there
        servicer.check_session = membership.check_session
        # Fenced (its scheduler gave up on it while it was frozen or cut off): leave, without
        # deregistering, for the id's entry may be a successor's by now.
        fenced: list[dict[str, object]] = []
        registry.on_fenced.append(lambda record: (fenced.append(record), server.request_stop()))
        await registry.start_heartbeat("worker", worker_id, registry_info)
        loading = asyncio.create_task(
            _join_and_load(args, membership, layout, servicer.run_on_model_thread)
        )
        stop = asyncio.create_task(server.wait_for_stop())
        following: asyncio.Task[None] | None = None
        try:
            done, _ = await asyncio.wait({loading, stop}, return_when=asyncio.FIRST_COMPLETED)
            if loading in done:
                runner = servicer.runner = loading.result()  # raises what failed the load
                servicer.kv = start_kv_endpoint(runner, args)
                runner.host_tier = open_host_tier(runner, args)
                info = runner.info()
                # Published with the registry entry (for `pagemesh top`) and as gauges.
                state.quantization, state.weight_bytes = info.quantization, info.weight_bytes
                metrics.set_weights(info.quantization, info.weight_bytes)
                await membership.set_status(WorkerStatus.READY)
                await server.set_serving(True)
                logger.info("ready: %s", info)
                if not runner.dist.is_single:
                    following = asyncio.create_task(
                        membership.follow(servicer, runner, args.dist_timeout_s)
                    )
                await stop
        finally:
            for task in (loading, stop, following):
                if task is not None:
                    task.cancel()
            await registry.close(deregister=[] if fenced else [("worker", worker_id)])
            await server.stop()
            servicer.close()
            await metrics_server.close()
    except BaseException:  # failed midway: no grpc.aio server may outlive the loop
        await server.stop_now()
        raise


def start_kv_endpoint(runner: object, args: argparse.Namespace) -> KVEndpoint | None:
    """This rank's KV transfer server; None for a model without a paged KV cache (an
    encoder), or when it cannot start (its KV then cannot move: other groups recompute)."""
    if not isinstance(runner, ModelRunner) or not runner.kv_caches:
        return None
    try:
        return KVEndpoint(
            runner,
            args.host,
            args.advertise_host,
            args.kv_transfer_port,
            args.internal_token or None,
        )
    except (OSError, ValueError) as exc:
        logger.error(
            "no KV transfer server (requests' KV cannot move to or from this group): %s", exc
        )
        return None


def open_host_tier(runner: object, args: argparse.Namespace) -> HostTier | None:
    """This rank's host tier (--host-tier-gib): the file a predecessor on this host left,
    or a new one. None when off, for a model without a paged KV cache, or when it cannot
    be opened (the group then recomputes as without one)."""
    if args.host_tier_gib <= 0 or not isinstance(runner, ModelRunner) or not runner.kv_caches:
        return None
    parallel = runner.parallel
    path = tier_path(
        args.host_tier_dir, args.cluster, args.group, parallel.pp_rank, parallel.tp_rank
    )
    num_slots = int(args.host_tier_gib * (1 << 30) // runner.kv_spec.bytes_per_block)
    try:
        tier = HostTier.open(
            path,
            runner.kv_spec,
            num_slots,
            identity=(
                f"{args.model}|{args.served_model_name}|{runner.metadata.dtype}|pp "
                f"{parallel.pp_rank}/{parallel.pp_size}|tp {parallel.tp_rank}/{parallel.tp_size}"
            ),
        )
    except (OSError, ValueError, HostTierBusy) as exc:
        logger.error("no host tier at %s: %s", path, exc)
        return None
    logger.info("host tier %s: %d slots, epoch %x", path, tier.num_slots, tier.epoch)
    return tier


def worker_metrics(
    group: str, layout: dict[str, int], servicer: WorkerServicer, registry: Registry
) -> WorkerMetrics:
    """This worker's Prometheus metrics: forward times as steps end, counters at scrape."""
    metrics = WorkerMetrics(group, layout)
    metrics.follow_heartbeat(lambda: registry.last_heartbeat_s)
    servicer.on_step.append(metrics.observe_forward)

    def snapshot() -> WorkerSnapshot:
        # The process group's timers are cumulative and survive a re-formation (same object).
        if servicer.runner is None:  # still loading
            return WorkerSnapshot(servicer.num_steps, 0.0, 0.0, 0.0, servicer.busy_time_s)
        runner = servicer.runner
        dist = runner.dist
        return WorkerSnapshot(
            servicer.num_steps,
            dist.tp_collective_time_s,
            dist.pp_send_time_s,
            dist.pp_recv_time_s,
            servicer.busy_time_s,
            kv_cache_bytes=runner.num_blocks * runner.kv_spec.bytes_per_block,
            rss_bytes=process_rss_bytes(),
            expert_tokens=expert_load(runner.model) or None,
            **image_counts(runner),
        )

    metrics.follow_worker(snapshot)
    return metrics


def image_counts(runner: object) -> dict[str, float]:
    """A vision-language model's image-encoder counters, for its metrics; {} otherwise."""
    embedder = getattr(runner, "image_embedder", None)
    if embedder is None:
        return {}
    return {
        "images_encoded": embedder.num_encoded,
        "image_cache_hits": embedder.num_cache_hits,
        "image_encode_seconds": embedder.encode_time_s,
    }


async def _join_and_load(
    args: argparse.Namespace,
    membership: Membership,
    layout: dict[str, int],
    on_model_thread: Callable[..., Awaitable[Any]],
) -> ModelRunner:
    """Joins the group's torch.distributed rendezvous (when it has several workers, or this
    worker is a standby waiting for its rank), then loads this rank's shard of the model.
    Both on the model thread, where its steps run (scheduler_svc/executor.py `model_thread`
    says why one thread)."""
    parallel = parallel_config(args)
    dist = None
    if parallel.world_size > 1 or args.standby:

        async def join(plan: Plan, should_abort: Callable[[], bool]) -> DistributedContext:
            place = parallel_config(args, plan.members[membership.worker_id])
            if args.standby:
                layout.update(tp_rank=place.tp_rank, pp_rank=place.pp_rank)
                await membership.set_status(WorkerStatus.JOINING)
            try:
                return await on_model_thread(
                    functools.partial(
                        init_distributed,
                        place,
                        plan.master_addr,
                        plan.master_port,
                        None,
                        args.dist_timeout_s,
                        device=args.device,
                        tag=plan.epoch,
                        should_abort=should_abort,
                    )
                )
            except Exception:
                if args.standby:  # in no group yet: free again to take any rank
                    layout.update(tp_rank=-1, pp_rank=-1)
                    await membership.set_status(WorkerStatus.STANDBY)
                raise

        plan, dist = await membership.join(None if args.standby else parallel.rank, join)
        parallel = parallel_config(args, plan.members[membership.worker_id])
        membership.state.epoch = plan.epoch
    await membership.set_status(WorkerStatus.LOADING)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    runner = await on_model_thread(load_runner, runner_config(args, parallel), dist)
    if args.served_model_name:
        runner.metadata = dataclasses.replace(runner.metadata, name=args.served_model_name)
    return runner


def configure_kernels(args: argparse.Namespace) -> None:
    """The process-wide kernel settings, decided once at startup and logged: the C kernels'
    config from `CC`, `PAGEMESH_KERNEL_CACHE` and `PAGEMESH_NATIVE_KERNELS`, and Triton's
    interpreter where the attention backend needs it. Called by `serve` (logging is set up
    by then) before the model loads: Triton reads TRITON_INTERPRET when its kernel modules
    are imported, which the attention backend does while the runner is built."""
    cpu_native.configure(cpu_native.native_kernel_config_from_env(os.environ))
    if needs_triton_interpreter(args.attention_backend, args.device):
        os.environ["TRITON_INTERPRET"] = "1"
        logger.info(
            "TRITON_INTERPRET=1: --attention-backend triton on %s runs Triton's "
            "kernels in its interpreter",
            args.device,
        )


def main(argv: list[str] | None = None) -> None:
    run_service("worker", parse_args(argv), serve)


if __name__ == "__main__":
    main()
