"""The shared gRPC bootstrap: standard health, including its streaming Watch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime.serving import GrpcServer, ServerConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@contextlib.asynccontextmanager
async def serving_server() -> AsyncIterator[tuple[GrpcServer, grpc.aio.Channel]]:
    """A server with nothing but health, SERVING, and a channel to it."""
    server = GrpcServer(ServerConfig(), ["pagemesh.test.Nothing"], [])
    await server.start()
    try:
        await server.set_serving(True)
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield server, channel
    finally:
        await server.server.stop(0)


def test_health_watch_streams_every_change() -> None:
    """Watch is how load balancers follow health; the error interceptor must let it be."""

    async def body() -> None:
        async with serving_server() as (server, channel):
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await call.read()).status == SERVING
            await server.set_serving(False)
            assert (await call.read()).status == NOT_SERVING
            call.cancel()

    asyncio.run(body())


def test_a_request_message_that_does_not_parse_is_invalid_argument() -> None:
    """Bytes no serializer writes (cut, wrongly typed, invalid UTF-8) are the caller's
    mistake: INVALID_ARGUMENT naming the method, not gRPC's UNKNOWN "Unexpected
    DecodeError" (found by bench/fuzz)."""

    async def body() -> None:
        async with serving_server() as (_, channel):
            check = channel.unary_unary("/grpc.health.v1.Health/Check")  # bytes in, bytes out
            for raw in (b"\x0a\x7f" + b"a" * 5, b"\x0a\x02\xff\xfe", b"\xff"):
                try:
                    await check(raw)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (raw, exc)
                    assert "/grpc.health.v1.Health/Check does not parse" in exc.details()
                else:
                    raise AssertionError(f"{raw!r} was accepted")
            answer = health_pb2.HealthCheckResponse.FromString(
                await check(health_pb2.HealthCheckRequest().SerializeToString())
            )
            assert answer.status == SERVING  # what parses is served as before

    asyncio.run(body())


def test_health_of_an_unknown_service_is_not_found_with_a_message() -> None:
    """gRPC's health servicer answers NOT_FOUND with no message; ours names the service
    and those it reports (found by bench/fuzz: GenerateRequest bytes sent to Check)."""

    async def body() -> None:
        async with serving_server() as (_, channel):
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND
                assert (
                    "'no.such.Service'" in exc.details()
                    and "'pagemesh.test.Nothing'" in exc.details()
                )
            else:
                raise AssertionError("an unknown service had a health status")
            for known in ("", "pagemesh.test.Nothing"):
                assert (
                    await stub.Check(health_pb2.HealthCheckRequest(service=known))
                ).status == SERVING

    asyncio.run(body())
