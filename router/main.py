"""`python -m router.main`: the public front of the mesh."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket

from pagemesh.config import add_flag, add_registry_flags, add_server_flags, registry_config, server_config
from pagemesh.registry import Registry
from pagemesh.serving import GrpcServer, run_service
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc
from router.scheduler_client import SchedulerPool
from router.servicer import GenerationServicer
from router.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="router", description=__doc__)
    add_server_flags(parser, default_port=50051)
    add_registry_flags(parser)
    add_flag(parser, "--model", required=False, default=None,
             help="model folder or .gguf file whose tokenizer the router uses")
    add_flag(parser, "--router-id", default=None, help="id in the registry (default: host-pid)")
    add_flag(parser, "--discovery-interval-s", type=float, default=1.0,
             help="seconds between registry polls for engine groups")
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("--model (or PAGEMESH_MODEL) is required")
    return args


async def serve(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(args.model)
    registry = Registry(registry_config(args))
    await registry.ping()
    server: GrpcServer | None = None

    def on_groups_changed(num_groups: int) -> None:
        # Health tells the truth: no engine group, no serving.
        if server is not None:
            asyncio.get_running_loop().create_task(server.set_serving(num_groups > 0))

    pool = SchedulerPool(registry, args.discovery_interval_s, on_groups_changed)
    servicer = GenerationServicer(tokenizer, pool)
    server = GrpcServer(
        server_config(args),
        [SERVICE_NAME],
        [lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(servicer, s)],
        reflection_enabled=True,
    )
    await server.start()
    server.install_signal_handlers()
    await pool.refresh()
    await server.set_serving(pool.num_groups > 0)
    pool_task = asyncio.create_task(pool.run())
    router_id = args.router_id or f"{socket.gethostname()}-{os.getpid()}"
    await registry.start_heartbeat(
        "router", router_id, lambda: {"address": server.address, "num_groups": pool.num_groups}
    )
    logger.info("router %s serving %s on %s", router_id, args.model, server.address)
    await server.wait_for_stop()
    await registry.close(deregister=[("router", router_id)])
    await server.stop()
    pool_task.cancel()
    await pool.close()


def main(argv: list[str] | None = None) -> None:
    run_service("router", parse_args(argv), serve)


if __name__ == "__main__":
    main()
