"""The gRPC bootstrap every service shares: error mapping, health, reflection, shutdown.

Shutdown follows one order: SIGTERM or SIGINT -> health NOT_SERVING -> stop admitting ->
`server.stop(grace_s)` lets in-flight calls finish, then cancels what is left.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagemesh.runtime import keepalive
from pagemesh.runtime.logs import setup_logging
from pagemesh.runtime.redact import redacted_config
from pagemesh.runtime.telemetry import server_interceptors, setup_tracing, shutdown_tracing
from pagemesh.runtime.tls import TlsConfig

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ServiceError(Exception):
    """An error with the gRPC status code a caller should see."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason  # a finer cause an HTTP adapter may map apart ("id_conflict")


def invalid_argument(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, ServiceError):
        await context.abort(exc.code, exc.message)
    logger.exception("%s failed", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def _aborting_stream(inner: Any, method: str) -> Any:
    """A response-streaming handler (its request one message or a stream of them) whose
    exceptions become the call's status."""

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in inner(request, context):
                yield response
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _abort_for(exc, context, method)

    return handler


def _decoding(inner: Any, deserializer: Callable[[bytes], Any] | None, method: str) -> Any:
    """A handler of one request message that takes its bytes and parses them itself: a
    message that does not parse is the caller's INVALID_ARGUMENT (gRPC would answer
    UNKNOWN for a deserializer's exception)."""

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw) if deserializer is not None else raw
        except Exception as exc:
            raise invalid_argument(
                f"the request message of {method} does not parse: {exc}"
            ) from exc

    if inspect.isasyncgenfunction(inner):

        async def streaming(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in inner(decode(raw), context):
                yield response

        return streaming

    async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await inner(decode(raw), context)

    return unary


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions raised by servicers into gRPC status codes.

    `ServiceError` carries its own code; anything else is a bug and becomes INTERNAL
    with the exception's text, logged with its traceback. A request message that does not
    parse (one request, not a stream of them) is INVALID_ARGUMENT.
    """

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary is not None:
            inner_uu = _decoding(handler.unary_unary, handler.request_deserializer, method)

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner_uu(request, context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await _abort_for(exc, context, method)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, None, handler.response_serializer
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                _aborting_stream(
                    _decoding(handler.unary_stream, handler.request_deserializer, method), method
                ),
                None,
                handler.response_serializer,
            )
        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(
                _aborting_stream(handler.stream_stream, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        # Anything else passes untouched: e.g. Health/Watch streams by `context.write()` from
        # a coroutine, which a generator wrapper would break.
        return handler


class _HealthServicer(health.aio.HealthServicer):
    """gRPC's health service, whose NOT_FOUND for a service it has no status of says so
    (the library's has no message)."""

    def __init__(self, service_names: Sequence[str]) -> None:
        super().__init__()
        self.service_names = list(service_names)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.service_names:
            known = ", ".join(repr(name) for name in self.service_names)
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no health status for service {request.service!r}; this server reports {known}",
            )
        return await super().Check(request, context)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port; the bound one is published in the registry
    advertise_host: str | None = None  # what others dial; defaults to host
    grace_s: float = 5.0
    tls: TlsConfig = field(default_factory=TlsConfig)
    max_receive_message_bytes: int = MAX_MESSAGE_BYTES  # largest request message accepted
    max_concurrent_streams: int = 0  # per client connection; 0 = gRPC's default (no limit)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        if self.max_receive_message_bytes < 1:
            raise ValueError("max_receive_message_bytes must be >= 1")


class GrpcServer:
    """A grpc.aio server with standard health (and optional reflection) wired in."""

    def __init__(
        self,
        config: ServerConfig,
        service_names: Sequence[str],
        add_servicers: Sequence[Callable[[grpc.aio.Server], None]],
        reflection_enabled: bool = False,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        """`interceptors` run before the error mapping, in order (e.g. authentication)."""
        self.config = config
        self.service_names = list(service_names)
        self.server = grpc.aio.server(
            interceptors=[*server_interceptors(), *interceptors, ErrorInterceptor()],
            options=[
                ("grpc.max_receive_message_length", config.max_receive_message_bytes),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                *keepalive.SERVER_OPTIONS,  # a frozen or cut-off client is noticed (5 s)
                *(
                    [("grpc.max_concurrent_streams", config.max_concurrent_streams)]
                    if config.max_concurrent_streams
                    else []
                ),
            ],
        )
        for add in add_servicers:
            add(self.server)
        self.health = _HealthServicer(["", *self.service_names])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection_enabled:
            names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
            reflection.enable_server_reflection(names, self.server)
        self.port: int | None = None
        self._stop_requested = asyncio.Event()

    @property
    def address(self) -> str:
        """host:port that other services dial."""
        host = self.config.advertise_host or self.config.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        bind = f"{self.config.host}:{self.config.port}"
        credentials = self.config.tls.server_credentials()
        if credentials is None:
            self.port = self.server.add_insecure_port(bind)
        else:
            self.port = self.server.add_secure_port(bind, credentials)
        if self.port == 0:
            raise OSError(f"could not bind {bind}")
        await self.set_serving(False)
        await self.server.start()
        mode = (
            ("mTLS" if self.config.tls.requires_client_cert else "TLS")
            if credentials
            else "plaintext"
        )
        logger.info("gRPC listening on %s (%s)", self.address, mode)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self.health.service_names:
            await self.health.set(name, status)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_requested.set)

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def wait_for_stop(self) -> None:
        await self._stop_requested.wait()

    async def stop(self) -> None:
        logger.info("shutting down: NOT_SERVING, draining for up to %.1f s", self.config.grace_s)
        await self.set_serving(False)
        await self.server.stop(self.config.grace_s)

    async def stop_now(self) -> None:
        """Stops at once, without draining (a no-op once stopped): for a service's error
        path, so that its grpc.aio server never outlives the event loop (its `__del__`
        would then fail with 'Event loop is closed' after the service's own reason)."""
        await self.server.stop(None)


class FatalStartupError(RuntimeError):
    """A service cannot start as configured; the message says why."""


def run_service(service: str, args: Any, serve: Callable[[Any], Any]) -> None:
    """A service's `main` after flag parsing: log set-up, the effective config, then
    `serve(args)` on a fresh event loop. A fatal error ends the process with status 1 and
    one clear log line instead of a traceback through asyncio."""
    setup_logging(service, args.log_level)
    logger.info("%s config %s", service, redacted_config(vars(args)))
    tracer_provider = setup_tracing(
        f"pagemesh-{service}", getattr(args, "otlp_traces_endpoint", None)
    )
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    except (FatalStartupError, TimeoutError, OSError, ValueError) as exc:
        logger.error("fatal: %s", exc)
        sys.exit(1)
    finally:
        shutdown_tracing(tracer_provider)
