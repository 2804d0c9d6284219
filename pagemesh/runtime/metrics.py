"""Prometheus metrics of every service: the names in one place, and the `/metrics` endpoint.

Names follow vLLM's (`vllm:` becomes `pagemesh:`) where vLLM has one, and they are a contract:
`pagemesh top` and the Grafana dashboards in `compose/` read exactly these. Every process keeps
its own `CollectorRegistry` (never the global one), so that tests running several services in
one process stay apart.

Two kinds of values:
- events (a token reached the client, a step ended) are observed where they happen, into the
  counters and histograms each service's metrics declare;
- state that already lives in a service's objects (queue lengths, KV usage, cumulative counters
  kept by the scheduler core or the worker's process group) is read at scrape time by a
  collector. The endpoint is served on the service's event loop, not in a thread, so a scrape
  never sees half-updated state and nothing is counted twice.

Here: the names read outside, the buckets, `ServiceMetrics` (one process's registry, what every
service exports) and the endpoint. Each service's families extend `ServiceMetrics` in
pagemesh.runtime.metrics_router, metrics_scheduler and metrics_worker.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from pagemesh.runtime.version import VERSION

logger = logging.getLogger(__name__)

PREFIX = "pagemesh:"
# The names read outside (`pagemesh top`), which the services' metrics modules declare. Counters
# are named without `_total`, as prometheus_client declares them; `counter_sample` gives the
# name a scrape shows.
GENERATION_TOKENS = PREFIX + "generation_tokens"
PROMPT_TOKENS = PREFIX + "prompt_tokens"
REQUEST_SUCCESS = PREFIX + "request_success"
NUM_REQUESTS_IN_FLIGHT = PREFIX + "num_requests_in_flight"
TIME_TO_FIRST_TOKEN = PREFIX + "time_to_first_token_seconds"
INTER_TOKEN_LATENCY = PREFIX + "inter_token_latency_seconds"
E2E_REQUEST_LATENCY = PREFIX + "e2e_request_latency_seconds"
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_perc"
NUM_REQUESTS_SWAPPED = PREFIX + "num_requests_swapped"
HEARTBEAT_AGE = PREFIX + "heartbeat_age_seconds"
EXPERT_TOKENS = PREFIX + "worker_moe_expert_tokens"
# The classic text format, which every Prometheus reads (our names need no UTF-8 escaping).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards and SLOs carry over.
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# One engine step or one forward pass: from a millisecond (a GPU decode) to a minute (a long
# prefill on CPU).
STEP_TIME_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
TOKENS_PER_STEP_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _Callback(Collector):
    """A collector whose samples come from `collect()` at scrape time."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()

    def describe(self) -> Iterable[Metric]:
        return []  # names are not known before the first scrape; registering reads nothing


def counter_sample(name: str) -> str:
    """The sample name of counter `name` in the exposition text."""
    return name + "_total"


def gauge(name: str, documentation: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def counter(
    name: str, documentation: str, labels: dict[str, str], value: float
) -> CounterMetricFamily:
    """`name` without `_total` (the exposition appends it)."""
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class ServiceMetrics:
    """One process's registry, holding what every service exports:
    `pagemesh:build_info{service,version}` = 1 and `pagemesh:heartbeat_age_seconds{service}`."""

    def __init__(self, service: str) -> None:
        # No `*_created` series (as vLLM): they double the output and no dashboard reads them.
        # A process-wide switch of prometheus_client, set here rather than at import time.
        disable_created_metrics()
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        self._last_heartbeat_s: Callable[[], float | None] = lambda: None
        build_info = Gauge(
            PREFIX + "build_info",
            "pagemesh version this process runs (always 1)",
            ["service", "version"],
            registry=self.registry,
        )
        build_info.labels(service, VERSION).set(1)
        self.add_collector(self._heartbeat)

    def add_collector(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Registers `collect`, called at every scrape for metrics read from live objects."""
        self.registry.register(_Callback(collect))

    def follow_heartbeat(self, last_heartbeat_s: Callable[[], float | None]) -> None:
        """`last_heartbeat_s()`: `time.monotonic()` of the last successful refresh of this
        process's registry key (pagemesh.runtime.registry.Registry.last_heartbeat_s), None before
        one."""
        self._last_heartbeat_s = last_heartbeat_s

    def _heartbeat(self) -> Iterable[Metric]:
        last_s = self._last_heartbeat_s()
        if last_s is None:
            return []  # no heartbeat yet: no age rather than a made-up one
        return [
            gauge(
                HEARTBEAT_AGE,
                "Seconds since this process last refreshed its registry key in Redis",
                {"service": self.service},
                max(0.0, time.monotonic() - last_s),
            )
        ]

    def exposition(self) -> bytes:
        """The Prometheus text format of everything registered."""
        return generate_latest(self.registry)


# --- the /metrics endpoint ---------------------------------------------------------------

_REQUEST_TIMEOUT_S = 10.0
_MAX_HEADER_LINES = 100


@dataclass(frozen=True)
class MetricsConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port; -1 = no endpoint
    advertise_host: str | None = None  # what Prometheus and `pagemesh top` dial; default: host

    def __post_init__(self) -> None:
        if not -1 <= self.port <= 65535:
            raise ValueError(f"metrics port must be in [-1, 65535], got {self.port}")

    @property
    def enabled(self) -> bool:
        return self.port >= 0


class MetricsServer:
    """Serves `GET /metrics` (Prometheus text format) over plain HTTP on the event loop."""

    def __init__(self, metrics: ServiceMetrics, config: MetricsConfig) -> None:
        self.metrics = metrics
        self.config = config
        self.port: int | None = None
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str | None:
        """host:port to scrape, None while not serving."""
        if self.port is None:
            return None
        host = self.config.advertise_host or self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def registry_info(self) -> dict[str, str]:
        """What the service publishes in its registry entry: `metrics_address` when serving."""
        address = self.address
        return {"metrics_address": address} if address is not None else {}

    async def start(self) -> None:
        """Binds (one socket, so port 0 means one port) and serves; nothing when disabled."""
        if not self.config.enabled:
            return
        host, port = self.config.host, self.config.port
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.create_server(address[:2], family=family)
        self._server = await asyncio.start_server(self._handle, sock=sock)
        self.port = sock.getsockname()[1]
        logger.info("Prometheus metrics on http://%s/metrics", self.address)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
            self.port = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path = await asyncio.wait_for(_read_request(reader), _REQUEST_TIMEOUT_S)
            if method not in ("GET", "HEAD"):
                status, body, content_type = (
                    "405 Method Not Allowed",
                    b"GET /metrics\n",
                    "text/plain",
                )
            elif path.split("?", 1)[0].rstrip("/") == "/metrics":
                status, body, content_type = "200 OK", self.metrics.exposition(), CONTENT_TYPE
            else:
                status, body, content_type = "404 Not Found", b"see /metrics\n", "text/plain"
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            writer.write(head if method == "HEAD" else head + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, ValueError) as exc:
            logger.debug("metrics request dropped: %s", exc)
        finally:
            writer.close()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """(method, path) of an HTTP/1.x request; its headers are read and ignored."""
    request_line = (await reader.readline()).decode("latin-1").split()
    if len(request_line) < 2:
        raise ValueError("not an HTTP request")
    for _ in range(_MAX_HEADER_LINES):
        if (await reader.readline()) in (b"\r\n", b"\n", b""):
            break
    return request_line[0].upper(), request_line[1]


async def serve_metrics(metrics: ServiceMetrics, config: MetricsConfig) -> MetricsServer:
    """Starts the `/metrics` endpoint (nothing when `config.port` is -1)."""
    server = MetricsServer(metrics, config)
    await server.start()
    return server
