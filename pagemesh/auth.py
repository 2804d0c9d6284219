"""API keys on the router: who may call `pagemesh.v1.Generation` (gRPC) and `/v1/*` (HTTP).

Clients send `authorization: Bearer <key>`. Health checks and reflection stay open so that
load balancers and tooling work without a key. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import grpc

GRPC_HOW_TO = "send metadata `authorization: Bearer <api key>`"
HTTP_HOW_TO = "send the header `Authorization: Bearer <api key>`"


def parse_api_keys_file(text: str) -> list[str]:
    """One key a line; blank lines and `#` comments (whole-line or trailing) are skipped."""
    keys = []
    for line in text.splitlines():
        key = line.split("#", 1)[0].strip()
        if key:
            keys.append(key)
    return keys


class ApiKeys:
    """The set of accepted keys; empty = authentication off."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode() for k in dict.fromkeys(keys)]
        for key in self._keys:
            if not key or any(c in key for c in b" \t\r\n"):
                raise ValueError("an API key must be non-empty and contain no whitespace")

    @classmethod
    def load(cls, keys: Iterable[str] | None, keys_file: str | None) -> ApiKeys:
        """`keys` as given (--api-key, or PAGEMESH_API_KEY: several separated by spaces)
        and the file's."""
        all_keys = [key for item in keys or [] for key in item.split()]
        if keys_file:
            all_keys += parse_api_keys_file(Path(keys_file).read_text())
        return cls(all_keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check_authorization(self, value: str | None) -> bool:
        """Whether an `authorization` value carries an accepted bearer key."""
        if not self.enabled:
            return True
        given = bearer_token(value).encode()
        if not given:
            return False
        # Compare with every key, without stopping early, so timing tells nothing.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        return matched


def bearer_token(value: str | None) -> str:
    """The key of an `authorization: Bearer <key>` value; "" for none or another scheme."""
    scheme, _, token = (value or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def missing_key_message(value: str | None, how_to: str) -> str:
    """Why `value` (the `authorization` sent, if any) was refused, and how to send a key."""
    if not value:
        return f"this router requires an API key: {how_to}"
    return f"the API key is not valid: {how_to}"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls to methods under `protected_prefix` without a valid key: UNAUTHENTICATED."""

    def __init__(self, keys: ApiKeys, protected_prefix: str = "/pagemesh.v1.Generation/") -> None:
        self.keys = keys
        self.protected_prefix = protected_prefix

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.protected_prefix):
            return handler
        value = None
        for key, item in details.invocation_metadata or ():
            if key == "authorization":
                value = item if isinstance(item, str) else item.decode(errors="replace")
                break
        if self.keys.check_authorization(value):
            return handler
        message = missing_key_message(value, GRPC_HOW_TO)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                deny_stream, handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                deny, handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                deny, handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            deny_stream, handler.request_deserializer, handler.response_serializer)
