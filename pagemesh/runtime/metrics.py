"""Prometheus metrics of every service: the names in one place, and the `/metrics` endpoint.

Names follow vLLM's (`vllm:` becomes `pagemesh:`) where vLLM has one, and they are a contract:
`pagemesh top` and the Grafana dashboards in `compose/` read exactly these. Every process keeps
its own `CollectorRegistry` (never the global one), so that tests running several services in
one process stay apart.

Two kinds of values:
- events (a token reached the client, a step ended) are observed where they happen, into the
  counters and histograms defined here;
- state that already lives in a service's objects (queue lengths, KV usage, cumulative counters
  kept by the scheduler core or the worker's process group) is read at scrape time by a
  collector. The endpoint is served on the service's event loop, not in a thread, so a scrape
  never sees half-updated state and nothing is counted twice.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from pagemesh.runtime.version import VERSION

logger = logging.getLogger(__name__)

PREFIX = "pagemesh:"
# The names read outside this module (`pagemesh top`), used below to declare them. Counters
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

# Finish reasons of `pagemesh:request_success_total` besides the model's own (stop, length):
ABORT = "abort"  # the client went away (or cancelled) before the sample finished
ERROR = "error"  # the stream failed after it started (e.g. no engine group took it back)


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


# --- router ------------------------------------------------------------------------------


class RouterMetrics(ServiceMetrics):
    """Requests as their clients see them (measured around `Generate`), label `model`."""

    def __init__(self) -> None:
        super().__init__("router")
        registry = self.registry
        self.request_success = Counter(
            REQUEST_SUCCESS,
            "Requests finished, by finish reason (each of n samples "
            "counts as one request, as in vLLM)",
            ["model", "finished_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            PROMPT_TOKENS, "Prompt tokens of finished requests", ["model"], registry=registry
        )
        self.generation_tokens = Counter(
            GENERATION_TOKENS, "Generated tokens streamed to clients", ["model"], registry=registry
        )
        self.time_to_first_token = Histogram(
            TIME_TO_FIRST_TOKEN,
            "Seconds from a request's arrival to its first token leaving the router",
            ["model"],
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            INTER_TOKEN_LATENCY,
            "Seconds between consecutive token messages of one sample",
            ["model"],
            buckets=ITL_BUCKETS_S,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            E2E_REQUEST_LATENCY,
            "Seconds from a request's arrival to its last message",
            ["model"],
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=registry,
        )
        # Embedding requests (router/embedding.py): each input is one engine request.
        self.embedding_inputs = Counter(
            PREFIX + "router_embedding_inputs",
            "Inputs of embedding requests admitted, by outcome (ok, error)",
            ["model", "outcome"],
            registry=registry,
        )
        self.embedding_tokens = Counter(
            PREFIX + "router_embedding_prompt_tokens",
            "Tokens of embedded inputs",
            ["model"],
            registry=registry,
        )
        self.embedding_latency = Histogram(
            PREFIX + "router_embedding_request_latency_seconds",
            "Seconds from an embedding request's arrival to its answer",
            ["model"],
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=registry,
        )

    def follow_router(
        self,
        model: Callable[[], str],
        num_in_flight: Callable[[], int],
        num_groups_ready: Callable[[], int],
        num_resumes: Callable[[], int],
    ) -> None:
        """Reads, at each scrape, the requests in flight, the ready engine groups and the
        streams resumed after a group failed (a cumulative count)."""

        def collect() -> Iterable[Metric]:
            labels = {"model": model()}
            return [
                gauge(
                    NUM_REQUESTS_IN_FLIGHT,
                    "Generate calls in flight through this router",
                    labels,
                    num_in_flight(),
                ),
                gauge(
                    PREFIX + "engine_groups_ready",
                    "Engine groups this router can send requests to",
                    labels,
                    num_groups_ready(),
                ),
                counter(
                    PREFIX + "request_resumes",
                    "Streams resumed on an engine group after the one serving them failed",
                    labels,
                    num_resumes(),
                ),
            ]

        self.add_collector(collect)

    def request(
        self,
        model: Callable[[], str],
        num_samples: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> RequestTimer:
        return RequestTimer(self, model, num_samples, clock)


class RequestTimer:
    """Times one `Generate` call as its client sees it, from its arrival.

    Per sample (vLLM counts each of n samples as a request): time to first token, the gap
    between consecutive messages carrying its tokens (one per token when streaming), the
    end-to-end latency and the finish reason. The `model` label is read at the first message,
    once the router knows the model (a validated request fetched it).
    """

    def __init__(
        self,
        metrics: RouterMetrics,
        model: Callable[[], str],
        num_samples: int,
        clock: Callable[[], float],
    ) -> None:
        self.metrics = metrics
        self._model = model
        self._label: str | None = None
        self._clock = clock
        self._start_s = clock()
        num_samples = max(num_samples, 1)
        self._last_token_s: list[float | None] = [None] * num_samples
        self._finished = [False] * num_samples

    @property
    def started(self) -> bool:
        return self._label is not None

    def _model_label(self) -> str:
        if self._label is None:
            self._label = label = self._model()
            # Bound once per call, not per message: `labels()` is a locked dict lookup.
            metrics = self.metrics
            self._ttft = metrics.time_to_first_token.labels(label)
            self._itl = metrics.inter_token_latency.labels(label)
            self._tokens = metrics.generation_tokens.labels(label)
        return self._label

    def observe(
        self, index: int, num_tokens: int, finish_reason: str | None, num_prompt_tokens: int = 0
    ) -> None:
        """One message to the client: `num_tokens` new tokens of sample `index`, its finish
        reason when it is the sample's last, and the request's prompt tokens on its last."""
        model, now = self._model_label(), self._clock()
        if index >= len(self._finished):  # more samples than announced: grow, never fail
            extra = index + 1 - len(self._finished)
            self._last_token_s += [None] * extra
            self._finished += [False] * extra
        if num_tokens:
            last_s = self._last_token_s[index]
            if last_s is None:
                self._ttft.observe(now - self._start_s)
            else:
                self._itl.observe(now - last_s)
            self._last_token_s[index] = now
            self._tokens.inc(num_tokens)
        if num_prompt_tokens:
            self.metrics.prompt_tokens.labels(model).inc(num_prompt_tokens)
        if finish_reason is not None and not self._finished[index]:
            self._finish(index, finish_reason, now)

    def end(self, reason: str) -> None:
        """The call ended early: its unfinished samples finish with `reason` (ABORT or ERROR).
        An ERROR before the first message (an invalid request, refused) counts nothing."""
        if reason != ABORT and not self.started:
            return
        now = self._clock()
        for index, finished in enumerate(self._finished):
            if not finished:
                self._finish(index, reason, now)

    def _finish(self, index: int, reason: str, now: float) -> None:
        model = self._model_label()
        self._finished[index] = True
        self.metrics.request_success.labels(model, reason).inc()
        self.metrics.e2e_request_latency.labels(model).observe(now - self._start_s)


# --- scheduler ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSnapshot:
    """One engine group's state as its scheduler sees it now; counters are cumulative over
    the life of the process (across the cores a recovery replaces)."""

    num_running: int
    num_waiting: int  # not counting swapped ones
    num_swapped: int
    kv_cache_usage: float  # used device blocks / all, 0..1
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_swap_outs: int  # preemptions that swapped the KV out (the others recomputed)
    num_swap_ins: int  # swapped requests whose KV came back
    num_recoveries: int
    ready: bool  # the group serves (not degraded, not draining)
    num_checkpoint_writes: int
    num_drafts: int = 0  # speculative decoding: drafts verified (a request's, in one step)
    num_draft_tokens: int = 0  # their tokens
    num_accepted_tokens: int = 0  # of those, the ones kept


class SchedulerMetrics(ServiceMetrics):
    """One engine group's scheduler, label `group`."""

    def __init__(self, group: str) -> None:
        super().__init__("scheduler")
        self.group = group
        registry = self.registry
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Seconds from a request's admission to its first step",
            ["group"],
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=registry,
        ).labels(group)
        self.step_time = Histogram(
            PREFIX + "step_time_seconds",
            "Seconds one engine step took, as the scheduler waits for it",
            ["group"],
            buckets=STEP_TIME_BUCKETS_S,
            registry=registry,
        ).labels(group)
        self.scheduled_tokens_per_step = Histogram(
            PREFIX + "scheduled_tokens_per_step",
            "Tokens computed by one engine step",
            ["group"],
            buckets=TOKENS_PER_STEP_BUCKETS,
            registry=registry,
        ).labels(group)

    def follow_engine(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        def collect() -> Iterable[Metric]:
            s, labels = snapshot(), {"group": self.group}
            return [
                gauge(
                    PREFIX + "num_requests_running",
                    "Requests in the running batch",
                    labels,
                    s.num_running,
                ),
                gauge(
                    PREFIX + "num_requests_waiting",
                    "Requests queued (preempted ones too, not swapped)",
                    labels,
                    s.num_waiting,
                ),
                gauge(
                    NUM_REQUESTS_SWAPPED,
                    "Preempted requests whose KV is in CPU swap space",
                    labels,
                    s.num_swapped,
                ),
                gauge(
                    KV_CACHE_USAGE,
                    "Fraction of KV cache blocks in use, 0..1",
                    labels,
                    s.kv_cache_usage,
                ),
                counter(
                    PREFIX + "prefix_cache_queries",
                    "Tokens looked up in the prefix cache",
                    labels,
                    s.prefix_cache_queries,
                ),
                counter(
                    PREFIX + "prefix_cache_hits",
                    "Tokens whose KV came from the prefix cache",
                    labels,
                    s.prefix_cache_hits,
                ),
                counter(
                    PREFIX + "num_preemptions",
                    "Requests preempted (swapped out or recomputed)",
                    labels,
                    s.num_preemptions,
                ),
                counter(
                    PREFIX + "num_swap_outs",
                    "Preemptions whose KV was copied to CPU swap space (the rest were recomputed)",
                    labels,
                    s.num_swap_outs,
                ),
                counter(
                    PREFIX + "num_swap_ins",
                    "Swapped requests whose KV was copied back from CPU swap space",
                    labels,
                    s.num_swap_ins,
                ),
                counter(
                    PREFIX + "spec_decode_num_drafts",
                    "Drafts verified, a request's in one "
                    "step (speculative decoding; mean accepted length = 1 + accepted "
                    "tokens / drafts)",
                    labels,
                    s.num_drafts,
                ),
                counter(
                    PREFIX + "spec_decode_num_draft_tokens",
                    "Draft tokens verified (speculative decoding)",
                    labels,
                    s.num_draft_tokens,
                ),
                counter(
                    PREFIX + "spec_decode_num_accepted_tokens",
                    "Draft tokens kept (speculative decoding; acceptance = kept / verified)",
                    labels,
                    s.num_accepted_tokens,
                ),
                counter(
                    PREFIX + "engine_recoveries",
                    "Times the engine group was re-formed after a failure",
                    labels,
                    s.num_recoveries,
                ),
                gauge(
                    PREFIX + "engine_group_ready",
                    "1 when the engine group serves, 0 when degraded or draining",
                    labels,
                    1.0 if s.ready else 0.0,
                ),
                counter(
                    PREFIX + "checkpoint_writes",
                    "Request checkpoints written to Redis",
                    labels,
                    s.num_checkpoint_writes,
                ),
            ]

        self.add_collector(collect)


# --- worker ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSnapshot:
    """One worker's cumulative counters."""

    num_steps: int
    tp_collective_s: float  # all-reduce, all-gather, step agreement
    pp_send_s: float
    pp_recv_s: float  # includes waiting for the previous stage
    busy_s: float = 0.0  # wall time in steps, communication included
    # Memory, once the model is loaded (None before: no sample): the KV cache allocated
    # and the process's resident set, bytes.
    kv_cache_bytes: int | None = None
    rss_bytes: int | None = None
    # Mixture-of-experts models: {layer: tokens routed to each expert} this rank counted.
    expert_tokens: dict[int, list[int]] | None = None
    # Vision-language models' first stage: images run through the image encoder, and
    # images found in its content-keyed cache (None: no image encoder).
    images_encoded: int | None = None
    image_cache_hits: int | None = None
    image_encode_seconds: float = 0.0  # wall time in the image encoder


EXPERT_TOKENS = PREFIX + "worker_moe_expert_tokens"


class WorkerMetrics(ServiceMetrics):
    """One worker, labels `group`, `tp_rank`, `pp_rank` (a standby's ranks are -1 until it
    takes a place; they are read at each observation and scrape)."""

    def __init__(self, group: str, layout: dict[str, int]) -> None:
        super().__init__("worker")
        self.group = group
        self.layout = layout
        self._forward_time = Histogram(
            PREFIX + "worker_forward_time_seconds",
            "Seconds one step's forward pass (and sampling) took on this worker",
            ["group", "tp_rank", "pp_rank"],
            buckets=STEP_TIME_BUCKETS_S,
            registry=self.registry,
        )
        self._weights: tuple[str, int] | None = None  # (quantization, bytes) once loaded
        self.add_collector(self._collect_weights)

    def set_weights(self, quantization: str, weight_bytes: int) -> None:
        """The loaded model's weights: how its linear layers hold them ("none", "fp8",
        "awq") and this worker's bytes of them in memory."""
        self._weights = (quantization, weight_bytes)

    def _collect_weights(self) -> Iterable[Metric]:
        if self._weights is None:
            return []  # still loading
        quantization, weight_bytes = self._weights
        return [
            gauge(
                PREFIX + "worker_weight_bytes",
                "Bytes of this worker's model weights in "
                "memory, as they are held (quantized or packed)",
                self.labels(),
                weight_bytes,
            ),
            gauge(
                PREFIX + "model_quantization_info",
                "How the linear layers hold their weights (always 1)",
                {"group": self.group, "quantization": quantization},
                1,
            ),
        ]

    def labels(self) -> dict[str, str]:
        return {
            "group": self.group,
            "tp_rank": str(self.layout["tp_rank"]),
            "pp_rank": str(self.layout["pp_rank"]),
        }

    def observe_forward(self, forward_time_s: float) -> None:
        self._forward_time.labels(**self.labels()).observe(forward_time_s)

    def follow_worker(self, snapshot: Callable[[], WorkerSnapshot]) -> None:
        def collect() -> Iterable[Metric]:
            s, labels = snapshot(), self.labels()
            found: list[Metric] = [
                counter(PREFIX + "worker_steps", "Steps this worker executed", labels, s.num_steps),
                counter(
                    PREFIX + "worker_tp_collective_seconds",
                    "Seconds in tensor-parallel collectives",
                    labels,
                    s.tp_collective_s,
                ),
                counter(
                    PREFIX + "worker_pp_send_seconds",
                    "Seconds sending to the next pipeline stage",
                    labels,
                    s.pp_send_s,
                ),
                counter(
                    PREFIX + "worker_pp_recv_seconds",
                    "Seconds receiving from (and waiting for) the previous pipeline stage",
                    labels,
                    s.pp_recv_s,
                ),
                counter(
                    PREFIX + "worker_busy_seconds",
                    "Seconds this worker spent executing steps (wall time, communication included)",
                    labels,
                    s.busy_s,
                ),
            ]
            if s.kv_cache_bytes is not None:
                found.append(
                    gauge(
                        PREFIX + "worker_kv_cache_bytes",
                        "Bytes of the KV cache this worker allocated",
                        labels,
                        s.kv_cache_bytes,
                    )
                )
            if s.rss_bytes is not None:
                found.append(
                    gauge(
                        PREFIX + "worker_resident_memory_bytes",
                        "Resident set size of the worker process, bytes",
                        labels,
                        s.rss_bytes,
                    )
                )
            if s.images_encoded is not None:
                found.append(
                    counter(
                        PREFIX + "worker_images_encoded",
                        "Images run through "
                        "the image encoder (each distinct image once while it "
                        "stays in the encoder cache)",
                        labels,
                        s.images_encoded,
                    )
                )
                found.append(
                    counter(
                        PREFIX + "worker_image_cache_hits",
                        "Images whose embeddings the encoder cache already held",
                        labels,
                        s.image_cache_hits or 0,
                    )
                )
                found.append(
                    counter(
                        PREFIX + "worker_image_encode_seconds",
                        "Seconds the "
                        "image encoder took (decoding, preprocessing, the "
                        "vision tower and projector)",
                        labels,
                        s.image_encode_seconds,
                    )
                )
            if s.expert_tokens:
                family = CounterMetricFamily(
                    EXPERT_TOKENS,
                    "Tokens routed to each expert of a mixture-of-experts "
                    "layer (once per chosen expert; a stage's ranks together count each "
                    "token once)",
                    labels=[*labels, "layer", "expert"],
                )
                for layer, tokens in sorted(s.expert_tokens.items()):
                    for expert, count in enumerate(tokens):
                        family.add_metric([*labels.values(), str(layer), str(expert)], count)
                found.append(family)
            return found

        self.add_collector(collect)


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
