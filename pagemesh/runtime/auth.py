"""API keys on the router: who may call `pagemesh.v1.Generation` (gRPC) and `/v1/*` (HTTP),
and who `pagemesh.v1.Admin`.

Clients send `authorization: Bearer <key>`. A key has a scope: `inference` (generate,
tokenize, model info) or `admin` (the Admin service: profiles, prefix cache resets, memory
and step statistics; and inference too). Health checks and reflection stay open so that
load balancers and tooling work without a key. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

from pagemesh.runtime.internal_auth import denying_handler

GRPC_HOW_TO = "send metadata `authorization: Bearer <api key>`"
HTTP_HOW_TO = "send the header `Authorization: Bearer <api key>`"


INFERENCE = "inference"  # Generation: generate, tokenize, model info
ADMIN = "admin"  # the Admin service (and inference too)
SCOPES = (INFERENCE, ADMIN)


def parse_api_keys_file(text: str) -> list[tuple[str, str]]:
    """(key, scope) pairs: one key a line, optionally followed by its scope (`inference`,
    the default, or `admin`); blank lines and `#` comments (whole-line or trailing) are
    skipped."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2 or (len(words) == 2 and words[1] not in SCOPES):
            raise ValueError(
                f"API keys file, line {number}: expected `<key> [{' | '.join(SCOPES)}]`"
                f" (the key itself is not shown)"
            )
        entries.append((words[0], words[1] if len(words) == 2 else INFERENCE))
    return entries


class ApiKeys:
    """The accepted keys, each with its scope; none = authentication off (all open)."""

    def __init__(self, keys: Iterable[str], admin_keys: Iterable[str] = ()) -> None:
        scopes: dict[str, str] = {key: INFERENCE for key in keys}
        scopes |= {key: ADMIN for key in admin_keys}
        for key in scopes:
            if not key or any(c in key for c in " \t\r\n"):
                raise ValueError("an API key must be non-empty and contain no whitespace")
        self._keys = [(key.encode(), scope) for key, scope in scopes.items()]

    @classmethod
    def load(
        cls,
        keys: Iterable[str] | None,
        keys_file: str | None,
        admin_keys: Iterable[str] | None = None,
    ) -> ApiKeys:
        """`keys` and `admin_keys` as given (--api-key / --admin-api-key, or their
        PAGEMESH_ variables: several separated by spaces) and the file's."""
        inference = [key for item in keys or [] for key in item.split()]
        admin = [key for item in admin_keys or [] for key in item.split()]
        if keys_file:
            for key, scope in parse_api_keys_file(Path(keys_file).read_text()):
                (admin if scope == ADMIN else inference).append(key)
        return cls(inference, admin)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def count(self, scope: str) -> int:
        return sum(s == scope for _, s in self._keys)

    def scope_of(self, value: str | None) -> str | None:
        """The scope of the bearer key an `authorization` value carries; None when it
        carries none that is accepted. With keys off, every caller is an admin."""
        if not self.enabled:
            return ADMIN
        given = bearer_token(value).encode()
        if not given:
            return None
        # Compare with every key, without stopping early, so timing tells nothing.
        found = None
        for key, scope in self._keys:
            if hmac.compare_digest(given, key):
                found = scope
        return found

    def check_authorization(self, value: str | None, scope: str = INFERENCE) -> bool:
        """Whether an `authorization` value carries a key allowed `scope`."""
        return allows(self.scope_of(value), scope)


def allows(held: str | None, wanted: str) -> bool:
    """Whether a key of scope `held` may do what `wanted` needs (admin includes inference)."""
    return held == ADMIN or (held == INFERENCE and wanted == INFERENCE)


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
    """Guards the methods under `protected_prefix`: no valid key is UNAUTHENTICATED, a
    valid key without `scope` (an inference key calling Admin) PERMISSION_DENIED."""

    def __init__(
        self,
        keys: ApiKeys,
        protected_prefix: str = "/pagemesh.v1.Generation/",
        scope: str = INFERENCE,
    ) -> None:
        self.keys = keys
        self.protected_prefix = protected_prefix
        self.scope = scope

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.protected_prefix):
            return handler
        value = None
        for key, item in details.invocation_metadata or ():
            if key == "authorization":
                value = item if isinstance(item, str) else item.decode(errors="replace")
                break
        held = self.keys.scope_of(value)
        if allows(held, self.scope):
            return handler
        if held is None:
            code, message = grpc.StatusCode.UNAUTHENTICATED, missing_key_message(value, GRPC_HOW_TO)
        else:
            code = grpc.StatusCode.PERMISSION_DENIED
            message = (
                f"this key may not call {self.protected_prefix.strip('/')}: it needs an "
                f"{self.scope} key (--admin-api-key, or `<key> {self.scope}` in "
                "--api-keys-file)"
            )
        return denying_handler(handler, code, message)
