"""The shared gRPC bootstrap: standard health, including its streaming Watch."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.serving import GrpcServer, ServerConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_watch_streams_every_change() -> None:
    """Watch is how load balancers follow health; the error interceptor must let it be."""
    async def body() -> None:
        server = GrpcServer(ServerConfig(), ["pagemesh.test.Nothing"], [])
        await server.start()
        try:
            await server.set_serving(True)
            async with grpc.aio.insecure_channel(server.address) as channel:
                call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                assert (await call.read()).status == SERVING
                await server.set_serving(False)
                assert (await call.read()).status == NOT_SERVING
                call.cancel()
        finally:
            await server.server.stop(0)

    asyncio.run(body())
