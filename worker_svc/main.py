"""`python -m worker_svc.main`: one worker (one device) of an engine group."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket

import torch

from pagemesh.config import add_flag, add_registry_flags, add_server_flags, registry_config, server_config
from pagemesh.registry import Registry
from pagemesh.serving import FatalStartupError, GrpcServer, run_service
from protos.pagemesh.worker.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.parallel import ParallelConfig
from worker_svc.runner import ModelRunner, RunnerConfig
from worker_svc.servicer import WorkerServicer

logger = logging.getLogger(__name__)

GIB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="worker_svc", description=__doc__)
    add_server_flags(parser, default_port=0)
    add_registry_flags(parser)
    add_flag(parser, "--model", default=None, help="HF model folder or .gguf file")
    add_flag(parser, "--served-model-name", default=None, help="name clients use")
    add_flag(parser, "--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    add_flag(parser, "--device", default="cpu", help="cpu | cuda | cuda:N")
    add_flag(parser, "--block-size", type=int, default=16, help="tokens per KV block")
    add_flag(parser, "--kv-cache-memory-gib", type=float, default=1.0,
             help="memory for the KV cache, GiB")
    add_flag(parser, "--num-kv-blocks", type=int, default=None,
             help="exact number of KV blocks (overrides --kv-cache-memory-gib)")
    add_flag(parser, "--swap-space", type=float, default=4.0,
             help="CPU memory, GiB, for the KV of requests preempted by swapping; 0 = none")
    add_flag(parser, "--max-model-len", type=int, default=None,
             help="cap on prompt + output tokens (default: the model's)")
    add_flag(parser, "--attention-backend", default="auto", help="auto | torch | triton")
    add_flag(parser, "--group", default="g0", help="engine group this worker belongs to")
    add_flag(parser, "--worker-id", default=None, help="id in the registry (default: host-pid)")
    add_flag(parser, "--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    add_flag(parser, "--tp-rank", type=int, default=0, help="this worker's tensor-parallel rank")
    add_flag(parser, "--pp", type=int, default=1, help="pipeline stages")
    add_flag(parser, "--pp-rank", type=int, default=0, help="this worker's pipeline stage")
    add_flag(parser, "--pp-layer-split", default=None,
             help="layers per stage, e.g. 12,10 (default: as even as possible)")
    add_flag(parser, "--torch-threads", type=int, default=0,
             help="CPU threads of this worker's torch ops (0 = torch's default, all cores)")
    add_flag(parser, "--dist-port", type=int, default=0,
             help="torch.distributed port if this worker is rank 0 (0 = any free port)")
    add_flag(parser, "--dist-timeout-s", type=float, default=300.0,
             help="seconds to wait for the group's process group to form")
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("--model (or PAGEMESH_MODEL) is required")
    return args


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    split = tuple(int(n) for n in args.pp_layer_split.split(",")) if args.pp_layer_split else None
    return ParallelConfig(tp_size=args.tp, tp_rank=args.tp_rank, pp_size=args.pp,
                          pp_rank=args.pp_rank, pp_layer_split=split)


def runner_config(args: argparse.Namespace, parallel: ParallelConfig) -> RunnerConfig:
    return RunnerConfig(
        parallel=parallel,
        model_path=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory_bytes=int(args.kv_cache_memory_gib * GIB),
        num_blocks=args.num_kv_blocks,
        swap_space_bytes=int(args.swap_space * GIB),
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
    )


async def serve(args: argparse.Namespace) -> None:
    registry = Registry(registry_config(args))
    await registry.ping()
    parallel = parallel_config(args)
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    layout = {"tp_rank": parallel.tp_rank, "tp_size": parallel.tp_size,
              "pp_rank": parallel.pp_rank, "pp_size": parallel.pp_size}
    servicer = WorkerServicer(worker_id, layout)
    server = GrpcServer(
        server_config(args),
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
        [lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s)],
    )
    await server.start()
    server.install_signal_handlers()
    state: dict[str, object] = {"status": "joining", "epoch": ""}
    dist_host = args.advertise_host or args.host
    dist_addr = f"{dist_host}:{args.dist_port or free_port(args.host)}"

    def registry_info() -> dict[str, object]:
        return {"address": server.address, "group": args.group, "dist_addr": dist_addr,
                "model": args.served_model_name or args.model, "pid": os.getpid(),
                **layout, **state, **servicer.stats()}

    await registry.start_heartbeat("worker", worker_id, registry_info)
    loading = asyncio.create_task(_join_and_load(args, registry, worker_id, parallel, state))
    stop = asyncio.create_task(server.wait_for_stop())
    try:
        done, _ = await asyncio.wait({loading, stop}, return_when=asyncio.FIRST_COMPLETED)
        if loading in done:
            servicer.runner = loading.result()  # raises what failed the load
            state["status"] = "ready"
            await registry.put("worker", worker_id, registry_info())
            await server.set_serving(True)
            logger.info("ready: %s", servicer.runner.info())
            await stop
    finally:
        loading.cancel()
        stop.cancel()
        await registry.close(deregister=[("worker", worker_id)])
        await server.stop()
        servicer.close()


async def _join_and_load(args: argparse.Namespace, registry: Registry, worker_id: str,
                         parallel: ParallelConfig, state: dict[str, object]) -> ModelRunner:
    """Joins the group's torch.distributed rendezvous (when it has several workers), then
    loads this rank's shard of the model."""
    dist = None
    if parallel.world_size > 1:
        from worker_svc.distributed import init_distributed  # only multi-worker groups need it

        plan = await _wait_for_rendezvous(registry, args.group, worker_id)
        if plan["members"][worker_id] != parallel.rank:
            raise FatalStartupError(f"rendezvous gives rank {plan['members'][worker_id]}, "
                                    f"this worker is rank {parallel.rank}")
        logger.info("joining group %s epoch %s via %s:%s", args.group, plan["epoch"],
                    plan["master_addr"], plan["master_port"])
        dist = await asyncio.to_thread(init_distributed, parallel, plan["master_addr"],
                                       plan["master_port"], None, args.dist_timeout_s,
                                       device=args.device)
        state["epoch"] = plan["epoch"]
    state["status"] = "loading"
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    runner = await asyncio.to_thread(ModelRunner.from_config, runner_config(args, parallel), dist)
    if args.served_model_name:
        runner.metadata = dataclasses.replace(runner.metadata, name=args.served_model_name)
    return runner


async def _wait_for_rendezvous(registry: Registry, group: str, worker_id: str) -> dict:
    """The scheduler's plan that names this worker (it publishes one once all ranks are up)."""
    while True:
        plan = await registry.get_rendezvous(group)
        if plan is not None and worker_id in plan.get("members", {}):
            return plan
        await asyncio.sleep(0.2)


def free_port(host: str) -> int:
    """A port free right now on `host`, for the torch.distributed master (rank 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    run_service("worker", parse_args(argv), serve)


if __name__ == "__main__":
    main()
