"""How each answer the mesh gives is classed: a success, a clear refusal, or a failure.

A clear refusal is a gRPC status that names the caller's mistake or a limit, with a message;
an HTTP 4xx with OpenAI's error object (`{"error": {"message": ...}}`). A client that gives up
on purpose (a disconnect storm, a slow client that goes silent) is `cancelled`, and a server
that closes a connection carrying no valid request is `closed`: both are fine. Everything
else is a failure: a 5xx or gRPC INTERNAL / UNKNOWN (`server error`), UNAVAILABLE from a mesh
that was serving, a refusal without a message or OpenAI's shape, an answer cut short or
malformed, and a request that never ended (`hung`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc

OK = "ok"
REFUSED = "refused"
CANCELLED = "cancelled"
CLOSED = "closed"
UNCLEAR = "unclear refusal"
SERVER_ERROR = "server error"
UNAVAILABLE = "unavailable"
MALFORMED = "malformed answer"
HUNG = "hung"
FUZZER_ERROR = "fuzzer error"

FINE = (OK, REFUSED, CANCELLED, CLOSED)
FAILURES = (SERVER_ERROR, HUNG, UNAVAILABLE, UNCLEAR, MALFORMED, FUZZER_ERROR)
CLASSES = FINE + FAILURES

# Statuses that tell the caller what was wrong with its request (or that a limit was hit).
CLEAR_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ABORTED,
    }
)
DETAIL_CHARS = 240


@dataclass(frozen=True)
class Outcome:
    kind: str  # what was sent (the plan's kind)
    index: int  # the request's index in the run: (seed, index) draws it again
    result: str  # one of CLASSES
    detail: str  # the status and message, or what was wrong
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.result in FAILURES


def short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS] + "…"


def grpc_status(code: grpc.StatusCode | None, details: str | None) -> tuple[str, str]:
    """(class, detail) of a call that ended with a status other than OK."""
    details = details or ""
    detail = short(f"{code.name if code else 'no status'}: {details}")
    if code in CLEAR_CODES:
        return (REFUSED if details.strip() else UNCLEAR), detail
    if code == grpc.StatusCode.UNAVAILABLE:
        return UNAVAILABLE, detail
    return SERVER_ERROR, detail


def http_error_body(status: int, body: bytes) -> tuple[str, str]:
    """(class, detail) of an HTTP answer that is not a 200."""
    text = body.decode("utf-8", "replace")
    detail = short(f"HTTP {status}: {text}")
    if status >= 500:
        return (UNAVAILABLE if status == 503 else SERVER_ERROR), detail
    if 400 <= status < 500:
        return (REFUSED if openai_error_message(text) else UNCLEAR), detail
    return UNCLEAR, detail


def openai_error_message(text: str) -> str | None:
    """The message of OpenAI's error object `{"error": {"message": ..., "type": ...}}`."""
    try:
        error = json.loads(text)["error"]
        message = error["message"]
    except (ValueError, TypeError, KeyError):
        return None
    return (
        message
        if isinstance(message, str) and message.strip() and isinstance(error.get("type"), str)
        else None
    )


def in_stream_error(event: dict) -> tuple[str, str]:
    """(class, detail) of an error event inside a 200 event stream."""
    error = event.get("error") if isinstance(event, dict) else None
    kind = error.get("type", "") if isinstance(error, dict) else ""
    detail = short(f"error event: {json.dumps(event)}")
    if not openai_error_message(json.dumps(event)):
        return UNCLEAR, detail
    if kind == "service_unavailable":
        return UNAVAILABLE, detail
    return (SERVER_ERROR if kind in ("internal_error", "server_error") else REFUSED), detail
