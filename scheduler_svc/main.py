"""`python -m scheduler_svc.main`: one engine group's scheduler."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from dataclasses import asdict

from pagemesh.config import add_flag, add_registry_flags, add_server_flags, registry_config, server_config
from pagemesh.registry import Registry
from pagemesh.serving import GrpcServer, run_service
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc import convert
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.servicer import SchedulerServicer
from scheduler_svc.group_formation import form_group
from scheduler_svc.worker_client import WorkerGroupClient

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scheduler_svc", description=__doc__)
    add_server_flags(parser, default_port=0)
    add_registry_flags(parser)
    add_flag(parser, "--group", default="g0", help="engine group this scheduler drives")
    add_flag(parser, "--scheduler-id", default=None, help="id in the registry (default: group)")
    add_flag(parser, "--tp", type=int, default=1, help="tensor-parallel workers per stage")
    add_flag(parser, "--pp", type=int, default=1, help="pipeline stages")
    add_flag(parser, "--max-num-batched-tokens", type=int, default=2048,
             help="tokens computed per step, over all requests")
    add_flag(parser, "--max-num-seqs", type=int, default=128, help="running requests per step")
    add_flag(parser, "--enable-chunked-prefill", type=bool, default=True,
             help="split long prompts over several steps")
    add_flag(parser, "--long-prefill-token-threshold", type=int, default=0,
             help="largest prefill chunk of one request per step; 0 = no limit but the budget")
    add_flag(parser, "--enable-prefix-caching", type=bool, default=True,
             help="reuse the KV of prompt blocks computed before")
    add_flag(parser, "--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
             help="admission order and preemption victim: arrival, or request priority")
    add_flag(parser, "--preemption-mode", default="swap", choices=["recompute", "swap"],
             help="what a preempted request loses: its KV (recomputed later) or nothing "
                  "(its KV moves to the workers' CPU swap space, see the worker's --swap-space; "
                  "recompute when the workers have none). Swap measured 1.2x faster here")
    add_flag(parser, "--worker-wait-s", type=float, default=600.0,
             help="seconds to wait for the group's workers to register")
    add_flag(parser, "--step-timeout-s", type=float, default=300.0,
             help="seconds one step may take before it counts as failed")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    registry = Registry(registry_config(args))
    await registry.ping()
    endpoints = await form_group(registry, args.group, args.tp, args.pp, args.worker_wait_s)
    workers = WorkerGroupClient(endpoints, args.step_timeout_s, server_config(args).tls)
    infos = await workers.get_info()
    lead = infos[workers.driver_index]
    num_blocks = min(info.num_blocks for info in infos)
    num_swap_blocks = min(info.num_swap_blocks for info in infos)
    preemption_mode = args.preemption_mode
    if preemption_mode == "swap" and num_swap_blocks == 0:
        logger.warning("--preemption-mode swap but the workers have no swap space: recomputing")
        preemption_mode = "recompute"
    config = SchedulerConfig(
        num_blocks=num_blocks,
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
    )
    logger.info("workers %s; scheduler config %s", [e.address for e in endpoints], asdict(config))
    scheduler = Scheduler(config)
    loop = EngineLoop(scheduler, workers, max_steps_in_flight=args.pp)
    model_info = convert.model_info_to_pb(lead, num_blocks)
    servicer = SchedulerServicer(loop, model_info)
    server = GrpcServer(
        server_config(args),
        [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name],
        [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s)],
    )
    await server.start()
    server.install_signal_handlers()
    scheduler_id = args.scheduler_id or args.group

    def registry_info() -> dict[str, object]:
        stats = scheduler.stats()
        return {
            "address": server.address,
            "group": args.group,
            "model": model_info.model,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            **asdict(stats),
        }

    loop_task = asyncio.create_task(loop.run())
    loop_task.add_done_callback(lambda task: _on_loop_exit(task, server))
    await server.set_serving(True)
    await registry.start_heartbeat("scheduler", scheduler_id, registry_info)
    await server.wait_for_stop()
    await registry.close(deregister=[("scheduler", scheduler_id)])
    await server.stop()
    loop_task.cancel()
    await workers.close()


def _on_loop_exit(task: asyncio.Task[None], server: GrpcServer) -> None:
    """The step loop never ends on its own: if it does, stop serving rather than hang."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("step loop crashed", exc_info=task.exception())
        server.request_stop()


def main(argv: list[str] | None = None) -> None:
    run_service("scheduler", parse_args(argv), serve)


if __name__ == "__main__":
    main()
