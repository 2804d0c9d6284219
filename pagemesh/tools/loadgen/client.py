"""Streaming drivers: one request in, the arrival time of its tokens out, over gRPC or HTTP.

The client shares its machine with the server it measures, so per-token work is one clock
read and one list append; everything else (gaps, percentiles) happens after the run.

Token accounting differs by protocol, because the wire does:
- gRPC `Generate` chunks carry `token_ids`: a chunk of k tokens is k arrivals at one time.
- OpenAI `/v1/completions` events carry text, not ids. Each event with a choice counts as
  one token arrival, and the request's true count comes from the final usage event
  (`stream_options.include_usage`). A token whose text the router holds back (an
  incomplete UTF-8 character) reaches the client together with a later one; the
  difference is booked on the last event, as arrivals at the same time, which leaves the
  pooled inter-token gaps the same as booking it where it happened.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from pagemesh.runtime.tls import TlsConfig
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"  # `pagemesh up --port`'s default
# Arrivals of one request: (time.perf_counter() seconds, tokens that arrived then).
Arrivals = list[tuple[float, int]]


class RequestError(Exception):
    """A request the server refused or broke off; the runner counts it, the run goes on."""


@dataclass(frozen=True)
class Target:
    """Where the load goes: a router's gRPC address, or an OpenAI-compatible base URL
    (`http_url` set). `tls` dials gRPC over TLS and verifies HTTPS with its CA."""

    address: str = DEFAULT_ADDRESS
    http_url: str | None = None
    tls: TlsConfig = field(default_factory=TlsConfig)
    api_key: str | None = None

    @property
    def protocol(self) -> str:
        return "http" if self.http_url else "grpc"

    def describe(self) -> str:
        return f"HTTP {self.http_url}" if self.http_url else f"gRPC {self.address}"


@dataclass(frozen=True)
class ModelInfo:
    """What the server says about its model; None where the protocol does not tell."""

    name: str = ""
    vocab_size: int | None = None
    max_model_len: int | None = None
    dtype: str = ""


class Driver(Protocol):
    async def model_info(self) -> ModelInfo: ...

    async def stream(
        self, prompt_token_ids: Sequence[int], max_tokens: int, timeout_s: float | None
    ) -> tuple[float, Arrivals]:
        """(send time, arrivals) of one greedy, EOS-ignoring request; RequestError on failure."""
        ...

    async def close(self) -> None: ...


def open_driver(target: Target, max_connections: int | None = None) -> Driver:
    """A driver for `target`; call it from inside the event loop that will use it."""
    if target.http_url:
        return HttpDriver(target, max_connections)
    return GrpcDriver(target)


def _bearer(api_key: str | None) -> str | None:
    return f"Bearer {api_key}" if api_key else None


class GrpcDriver:
    """The router's public `pagemesh.v1.Generation` service over grpc.aio."""

    def __init__(self, target: Target) -> None:
        self._channel = target.tls.aio_channel(target.address)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        bearer = _bearer(target.api_key)
        self._metadata = (("authorization", bearer),) if bearer else None

    async def model_info(self) -> ModelInfo:
        try:
            info = await self._stub.GetModelInfo(
                generate_pb2.GetModelInfoRequest(), metadata=self._metadata, timeout=30
            )
        except grpc.aio.AioRpcError as exc:
            raise RequestError(f"GetModelInfo: {exc.code().name}: {exc.details()}") from exc
        return ModelInfo(
            info.model, info.vocab_size or None, info.max_model_len or None, info.dtype
        )

    async def stream(
        self, prompt_token_ids: Sequence[int], max_tokens: int, timeout_s: float | None
    ) -> tuple[float, Arrivals]:
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt_token_ids)
        )
        request.sampling.temperature = 0.0
        request.stopping.max_tokens = max_tokens
        request.stopping.ignore_eos = True
        arrivals: Arrivals = []
        append, clock = arrivals.append, time.perf_counter
        start = clock()
        call = self._stub.Generate(request, metadata=self._metadata, timeout=timeout_s)
        try:
            async for chunk in call:
                num_tokens = len(chunk.token_ids)
                if num_tokens:
                    append((clock(), num_tokens))
        except grpc.aio.AioRpcError as exc:
            raise RequestError(f"{exc.code().name}: {exc.details()}") from exc
        return start, arrivals

    async def close(self) -> None:
        await self._channel.close()


class HttpDriver:
    """An OpenAI-compatible `/v1/completions` server (pagemesh's router, or any other that
    takes token-id prompts and `ignore_eos`, as vLLM's does), over aiohttp: its C HTTP
    parser costs the client a fraction of what httpx's pure-Python stream reading did (as
    measured with 256 SSE streams), CPU the measured server then has to itself. vLLM's
    serving benchmark uses aiohttp too."""

    def __init__(self, target: Target, max_connections: int | None = None) -> None:
        import aiohttp  # only HTTP runs need it

        assert target.http_url is not None
        self._base = target.http_url.rstrip("/").removesuffix("/v1")
        self._headers = {"Authorization": bearer} if (bearer := _bearer(target.api_key)) else {}
        # No pool limit below the run's concurrency: requests queued inside the client
        # would show up as server TTFT.
        connector = aiohttp.TCPConnector(limit=max_connections or 0, ssl=_ssl_context(target.tls))
        self._session = aiohttp.ClientSession(
            connector=connector, headers=self._headers, timeout=aiohttp.ClientTimeout(total=None)
        )
        self._model: str | None = None

    async def model_info(self) -> ModelInfo:
        import aiohttp

        try:
            async with self._session.get(
                f"{self._base}/v1/models", timeout=aiohttp.ClientTimeout(total=30)
            ) as response:
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RequestError(f"GET /v1/models: {exc!r}") from exc
        if response.status != 200:
            raise RequestError(f"GET /v1/models: HTTP {response.status}: {text[:300]}")
        models = json.loads(text).get("data") or [{}]
        self._model = models[0].get("id")
        return ModelInfo(self._model or "", None, models[0].get("max_model_len"), "")

    async def stream(
        self, prompt_token_ids: Sequence[int], max_tokens: int, timeout_s: float | None
    ) -> tuple[float, Arrivals]:
        import aiohttp

        body: dict[str, Any] = {
            "prompt": list(prompt_token_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self._model:
            body["model"] = self._model
        arrivals: Arrivals = []
        append, clock = arrivals.append, time.perf_counter
        num_tokens = None
        start = clock()
        try:
            async with self._session.post(
                f"{self._base}/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                if response.status != 200:
                    raise RequestError(
                        f"HTTP {response.status}: {_error_message(await response.read())}"
                    )
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("choices"):
                        append((clock(), 1))
                    elif "error" in event:
                        raise RequestError(f"in-stream error: {_error_message(event)}")
                    elif event.get("usage"):
                        num_tokens = event["usage"]["completion_tokens"]
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RequestError(f"{type(exc).__name__}: {exc}") from exc
        return start, reconcile(arrivals, num_tokens)

    async def close(self) -> None:
        await self._session.close()


def reconcile(arrivals: Arrivals, num_tokens: int | None) -> Arrivals:
    """`arrivals` holding exactly `num_tokens` tokens (None: as they are): missing tokens join
    the last arrival; surplus ones (events without a token) are dropped from the end."""
    if num_tokens is None or not arrivals:
        return arrivals
    surplus = sum(n for _, n in arrivals) - num_tokens
    if surplus < 0:
        at, n = arrivals[-1]
        return [*arrivals[:-1], (at, n - surplus)]
    while surplus > 0 and arrivals:
        at, n = arrivals.pop()
        if n > surplus:
            arrivals.append((at, n - surplus))
        surplus -= n
    return arrivals


def _error_message(payload: bytes | dict[str, Any]) -> str:
    if isinstance(payload, bytes):
        try:
            payload = json.loads(payload)
        except ValueError:
            return payload[:300].decode(errors="replace")
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))[:300]
    return str(payload)[:300]


def _ssl_context(tls: TlsConfig) -> ssl.SSLContext | bool:
    """HTTPS verified against --tls-ca (presenting --tls-cert when set); else the system CAs."""
    if not tls.ca_path:
        return True
    context = ssl.create_default_context(cafile=tls.ca_path)
    if tls.cert_path and tls.key_path:
        context.load_cert_chain(tls.cert_path, tls.key_path)
    return context
