"""The mesh's internal token: who may call a scheduler or a worker.

Schedulers and workers are not for clients: only the mesh's own routers and schedulers call
them. With TLS, client certificates signed by the mesh's CA say so (mTLS). Without it (or
beside it), every service of one mesh shares a token (`--internal-token`, given in the
environment as PAGEMESH_INTERNAL_TOKEN; `pagemesh up` makes one per run): callers send it
as `x-pagemesh-internal-token`, and a scheduler or worker refuses a call without it
(UNAUTHENTICATED) before it runs. Health and reflection stay open, for probes. Compared in
constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from typing import Any

import grpc

METADATA_KEY = "x-pagemesh-internal-token"
ENV = "PAGEMESH_INTERNAL_TOKEN"
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an internal token must not be empty")
        self._token = token.encode()

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        given = b""
        for key, value in details.invocation_metadata or ():
            if key == METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                break
        if hmac.compare_digest(given, self._token):
            return handler
        return denying_handler(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            "this service answers only its own mesh: the caller sent no "
            "valid internal token (--internal-token / PAGEMESH_INTERNAL_TOKEN, the "
            "same on every service of the mesh)",
        )


def denying_handler(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler of `handler`'s shape that fails every call with `code` (used by this
    module's interceptor and by pagemesh.runtime.auth's)."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            deny, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            deny, handler.request_deserializer, handler.response_serializer
        )
    return grpc.stream_stream_rpc_method_handler(
        deny_stream, handler.request_deserializer, handler.response_serializer
    )


class _Attach:
    """Adds the token to every call's metadata (a client interceptor of each kind)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _with_token(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), (METADATA_KEY, self._token))
        return details._replace(metadata=metadata)


class _UnaryUnary(_Attach, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _UnaryStream(_Attach, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _StreamUnary(_Attach, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._with_token(details), request_iterator)


class _StreamStream(_Attach, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._with_token(details), request_iterator)


def token_metadata(token: str | None = None) -> list[tuple[str, str]] | None:
    """Call metadata carrying `token` (default: PAGEMESH_INTERNAL_TOKEN, or the file that
    PAGEMESH_INTERNAL_TOKEN_FILE names), for a tool that asks a scheduler or worker
    directly; None without one."""
    from pagemesh.runtime.config import env_value  # config imports the TLS code, which imports this

    token = token or env_value(ENV)
    return [(METADATA_KEY, token)] if token else None


def client_interceptors(token: str | None) -> list[Any]:
    """grpc.aio channel interceptors that send `token` on every call; none without one."""
    if not token:
        return []
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
