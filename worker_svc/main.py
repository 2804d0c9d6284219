"""`python -m worker_svc.main`: one worker (one device) of an engine group."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket

from pagemesh.config import add_flag, add_registry_flags, add_server_flags, registry_config, server_config
from pagemesh.registry import Registry
from pagemesh.serving import GrpcServer, run_service
from protos.pagemesh.worker.v1 import worker_pb2, worker_pb2_grpc
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
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("--model (or PAGEMESH_MODEL) is required")
    return args


def runner_config(args: argparse.Namespace) -> RunnerConfig:
    return RunnerConfig(
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
    runner = await asyncio.to_thread(ModelRunner.from_config, runner_config(args))
    info = runner.info()
    if args.served_model_name:
        runner.metadata = dataclasses.replace(runner.metadata, name=args.served_model_name)
    logger.info("model ready: %s", runner.info())
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    layout = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1}
    servicer = WorkerServicer(runner, worker_id, layout)
    server = GrpcServer(
        server_config(args),
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
        [lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s)],
    )
    await server.start()
    server.install_signal_handlers()
    await server.set_serving(True)
    await registry.start_heartbeat(
        "worker",
        worker_id,
        lambda: {
            "address": server.address,
            "group": args.group,
            "model": runner.metadata.name,
            "num_blocks": info.num_blocks,
            "num_steps": servicer.num_steps,
            "pid": os.getpid(),
            **layout,
        },
    )
    await server.wait_for_stop()
    await registry.close(deregister=[("worker", worker_id)])
    await server.stop()
    servicer.close()


def main(argv: list[str] | None = None) -> None:
    run_service("worker", parse_args(argv), serve)


if __name__ == "__main__":
    main()
