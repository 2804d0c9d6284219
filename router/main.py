"""`python -m router.main`: the public front of the mesh."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn

from pagemesh.runtime.auth import ADMIN, INFERENCE, ApiKeyInterceptor, ApiKeys
from pagemesh.runtime.config import (
    add_flag,
    add_options,
    add_registry_flags,
    add_server_flags,
    metrics_config,
    registry_config,
    server_config,
    tls_config,
)
from pagemesh.runtime.images import MIB, ImageLimits
from pagemesh.runtime.media import MediaFetcher
from pagemesh.runtime.metrics import serve_metrics
from pagemesh.runtime.metrics_router import RouterMetrics
from pagemesh.runtime.registry import Registry
from pagemesh.runtime.registry_entries import RouterEntry
from pagemesh.runtime.service_flags import ROUTER_OPTIONS
from pagemesh.runtime.serving import GrpcServer, run_service
from pagemesh.runtime.tokenizer import Tokenizer, load_tokenizer
from protos.pagemesh.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
)
from router.admin import AdminServicer
from router.dispatcher import Dispatcher
from router.generation import AdmissionLimits, Generation
from router.group_directory import GroupDirectory
from router.http_api import build_http_app
from router.resume import ResumeConfig
from router.routing import RoutingConfig
from router.servicer import GenerationServicer
from router.tenancy import SECRET_NAME, Tenancy
from router.tool_calls import CallFormat, choose_format

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="router", description=__doc__)
    add_server_flags(parser, default_port=50051)
    add_registry_flags(parser)
    add_flag(parser, "--router-id", default=None, help="id in the registry (default: host-pid)")
    add_flag(
        parser,
        "--http-port",
        type=int,
        default=8000,
        help="port of the OpenAI-compatible HTTP API on --host (0 = disabled)",
    )
    add_options(parser, ROUTER_OPTIONS)  # declared in pagemesh.runtime.service_flags, like `up`'s
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("--model (or PAGEMESH_MODEL) is required")
    return args


async def serve(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(args.model)
    registry = Registry(registry_config(args))
    await registry.ping()
    server: GrpcServer | None = None

    def on_serving_changed(serving: bool) -> None:
        # Health tells the truth: no ready engine group, no serving.
        if server is not None:
            asyncio.get_running_loop().create_task(server.set_serving(serving))

    routing = RoutingConfig(
        args.routing, args.balance_abs_threshold_tokens, args.balance_rel_threshold
    )
    # One connection may not open more streams than the router admits requests (plus room
    # for health checks and the Admin service).
    config = dataclasses.replace(
        server_config(args),
        max_receive_message_bytes=args.max_message_bytes,
        max_concurrent_streams=args.max_queued_requests + SPARE_STREAMS,
    )
    api_keys = ApiKeys.load(args.api_key, args.api_keys_file, args.admin_api_key)
    if any(word.split("=", 1)[0] in ("--api-key", "--admin-api-key") for word in sys.argv):
        logger.warning(
            "an API key was given on the command line, which every user of this "
            "host can read (/proc/<pid>/cmdline): use --api-keys-file or "
            "PAGEMESH_API_KEY instead"
        )
    logger.info(
        "API keys: %s",
        f"{api_keys.count(INFERENCE)} for inference, {api_keys.count(ADMIN)} admin"
        if api_keys.enabled
        else "off (open access)",
    )
    resume = ResumeConfig(timeout_s=args.resume_timeout_s)
    directory = GroupDirectory(registry, args.discovery_interval_s, on_serving_changed, config.tls)
    dispatcher = Dispatcher(directory, routing, resume)
    image_limits = ImageLimits(
        int(args.max_image_mib * MIB), args.max_image_pixels, args.max_images_per_request
    )
    limits = AdmissionLimits(
        args.max_queued_requests,
        args.max_prompt_tokens,
        args.stream_interval,
        args.max_requests_per_key,
        image_limits,
    )
    media = MediaFetcher(
        args.allowed_media_domains or (), image_limits.max_bytes, args.media_fetch_timeout_s
    )
    if media.enabled:
        logger.info("image URLs are fetched from: %s", ", ".join(sorted(media.allowed_domains)))
    metrics = RouterMetrics()
    secret = await registry.shared_secret(SECRET_NAME)  # request ids scoped per key
    registry.on_redis_restart.append(lambda: registry.keep_secret(SECRET_NAME, secret))
    tenancy = Tenancy(secret, api_keys)
    generation = Generation(
        tokenizer, dispatcher, limits, metrics, tenancy, media
    )  # both APIs adapt it
    servicer = GenerationServicer(generation)
    metrics.follow_router(
        lambda: directory.model_name,
        lambda: generation.num_in_flight,
        lambda: directory.num_groups,
        lambda: dispatcher.num_resumes,
    )
    metrics.follow_heartbeat(lambda: registry.last_heartbeat_s)
    admin = AdminServicer(directory)
    # Inference keys open Generation, admin keys Admin too; health and reflection stay open.
    interceptors = (
        [
            ApiKeyInterceptor(api_keys, f"/{SERVICE_NAME}/", INFERENCE),
            ApiKeyInterceptor(api_keys, f"/{ADMIN_SERVICE_NAME}/", ADMIN),
        ]
        if api_keys.enabled
        else []
    )
    server = GrpcServer(
        config,
        [SERVICE_NAME, ADMIN_SERVICE_NAME],
        [
            lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
            lambda s: admin_pb2_grpc.add_AdminServicer_to_server(admin, s),
        ],
        reflection_enabled=True,
        interceptors=interceptors,
    )
    await server.start()
    try:
        server.install_signal_handlers()
        metrics_server = await serve_metrics(metrics, metrics_config(args))
        await directory.refresh()
        await server.set_serving(directory.serving)
        directory_task = asyncio.create_task(directory.run())
        http = _start_http(args, generation, lambda: directory.serving, api_keys)
        router_id = args.router_id or f"{socket.gethostname()}-{os.getpid()}"
        await registry.start_heartbeat(
            "router",
            router_id,
            lambda: RouterEntry(
                address=server.address,
                num_groups=directory.num_groups,
                serving=directory.serving,
                pid=os.getpid(),
                host=socket.gethostname(),
                **metrics_server.registry_info(),
            ).to_json(),
        )
        logger.info("router %s serving %s on %s", router_id, args.model, server.address)
        await server.wait_for_stop()
        await _stop_http(http)
        await registry.close(deregister=[("router", router_id)])
        await server.stop()
        directory_task.cancel()
        await directory.close()
        await metrics_server.close()
        await media.close()
    except BaseException:  # failed midway: no grpc.aio server may outlive the loop
        await server.stop_now()
        raise


# --- OpenAI-compatible HTTP API (router/http_api.py), served by uvicorn in this event loop.


SPARE_STREAMS = 64  # beyond --max-queued-requests: health checks, model info, Admin


def _start_http(
    args: argparse.Namespace,
    generation: Generation,
    is_serving: Callable[[], bool],
    api_keys: ApiKeys,
) -> tuple[uvicorn.Server, asyncio.Task[None]] | None:
    if not args.http_port:
        return None
    # The same certificate as the gRPC port, and the same rule for client certificates.
    tls = {}
    config = tls_config(args)
    if config.serves_tls:
        tls = {"ssl_certfile": config.cert_path, "ssl_keyfile": config.key_path}
        if config.verifying_ca:
            tls |= {"ssl_ca_certs": config.verifying_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    tool_format = tool_call_format(args.tool_call_parser, args.model, generation.tokenizer)
    logger.info(
        "tool calls parsed as %s (--tool-call-parser %s)", tool_format.name, args.tool_call_parser
    )
    app = build_http_app(
        generation,
        is_serving,
        api_keys,
        max_body_bytes=args.max_message_bytes,
        tool_format=tool_format,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.http_port,
        log_level="warning",
        log_config=None,
        # Connections and requests served at once: past it uvicorn
        # answers 503 before reading a body.
        limit_concurrency=args.max_queued_requests + SPARE_STREAMS,
        timeout_graceful_shutdown=5,
        **tls,
    )
    http_server = _HttpServer(config)
    scheme = "https" if tls else "http"
    logger.info("OpenAI HTTP API on %s://%s:%d/v1", scheme, args.host, args.http_port)
    return http_server, asyncio.create_task(_serve_http(http_server))


def tool_call_format(flag: str, model: str, tokenizer: Tokenizer) -> CallFormat:
    """The tool call format for `--tool-call-parser`: `auto` looks at the model folder's
    config.json `model_type` (a .gguf file has none) and the chat template."""
    config = Path(model) / "config.json"
    model_type = ""
    if config.is_file():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            model_type = str(json.loads(config.read_text()).get("model_type") or "")
    template = tokenizer.hf.chat_template
    return choose_format(flag, model_type, template if isinstance(template, str) else "")


async def _serve_http(http_server: uvicorn.Server) -> None:
    try:
        await http_server.serve()
    except SystemExit:  # uvicorn exits when it cannot bind; the gRPC API keeps serving
        logger.error(
            "the HTTP API could not start on port %d; serving gRPC only", http_server.config.port
        )


async def _stop_http(http: tuple[uvicorn.Server, asyncio.Task[None]] | None) -> None:
    if http is not None:
        http[0].should_exit = True
        await http[1]


class _HttpServer(uvicorn.Server):
    """Leaves SIGINT/SIGTERM to the gRPC server's handlers, which stop both servers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def main(argv: list[str] | None = None) -> None:
    run_service("router", parse_args(argv), serve)


if __name__ == "__main__":
    main()
