"""What one fuzz probe sends, as plain data: drawn by `strategies.py`, sent by `probes.py`,
quoted in the report so that a finding can be sent again by hand."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelFacts:
    """What the strategies aim at: the served model's name and limits (`GetModelInfo`)."""

    name: str
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class Cancel:
    """When a client gives up on purpose: after `after_chunks` response chunks (SSE events
    over HTTP) or `after_s` seconds, whichever comes first (None: not on that count). An
    HTTP answer that is not streamed has no chunks: its client closes after `after_s`, or
    0.2 s per chunk it would have waited for."""

    after_chunks: int | None = None
    after_s: float | None = None


@dataclass(frozen=True)
class GrpcGenerate:
    """`Generation.Generate` with these GenerateRequest fields (prompt and the nested
    messages as `strategies.grpc_request` draws them; None: left unset)."""

    fields: dict[str, Any]
    cancel: Cancel | None = None


@dataclass(frozen=True)
class GrpcRaw:
    """Bytes sent as the request message of `method` (a generic call, no serializer)."""

    method: str
    payload: bytes
    what: str  # how the bytes were made, for the report


@dataclass(frozen=True)
class HttpJson:
    """A JSON body POSTed to an OpenAI endpoint (`json.dumps`, so NaN and Infinity may
    appear, as Python clients send them)."""

    path: str
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    cancel: Cancel | None = None


@dataclass(frozen=True)
class HttpRaw:
    """Any method, content type and body bytes on any path (aiohttp, a well-formed HTTP
    request carrying a malformed payload)."""

    method: str
    path: str
    content_type: str | None
    body: bytes
    what: str


@dataclass(frozen=True)
class RawSocket:
    """Bytes written on a plain TCP connection to the `port` ("http" or "grpc") in `chunks`,
    `delay_s` apart (a slow client when small chunks and delays), then `hold_s` more with the
    connection open; `complete`: the bytes are a whole, valid HTTP request, so an answer is
    owed (else the server may answer or close, both fine)."""

    port: str
    chunks: list[bytes]
    delay_s: float
    hold_s: float
    complete: bool
    what: str


@dataclass(frozen=True)
class Oversized:
    """A message past the size limits: `transport` "grpc" (a GenerateRequest of
    `num_bytes`) or "http" (a JSON body of `num_bytes`); `shape` says what fills it."""

    transport: str
    shape: str
    num_bytes: int


@dataclass(frozen=True)
class Storm:
    """`clients` started at once, each cancelling or closing its connection mid-stream."""

    clients: list[GrpcGenerate | HttpJson]


Spec = GrpcGenerate | GrpcRaw | HttpJson | HttpRaw | RawSocket | Oversized | Storm
