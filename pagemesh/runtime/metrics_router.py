"""The router's metrics: requests as their clients see them, label `model`.

`RouterMetrics` holds the router's registry (request outcomes, tokens, latencies, embeddings,
and the requests in flight read at scrape time); `RequestTimer` times one `Generate` call per
sample. `ABORT` and `ERROR` are the finish reasons the router adds to the model's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import Counter, Histogram
from prometheus_client.core import Metric

from pagemesh.runtime.metrics import (
    E2E_REQUEST_LATENCY,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    ITL_BUCKETS_S,
    NUM_REQUESTS_IN_FLIGHT,
    PREFIX,
    PROMPT_TOKENS,
    REQUEST_LATENCY_BUCKETS_S,
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN,
    TTFT_BUCKETS_S,
    ServiceMetrics,
    counter,
    gauge,
)

# Finish reasons of `pagemesh:request_success_total` besides the model's own (stop, length):
ABORT = "abort"  # the client went away (or cancelled) before the sample finished
ERROR = "error"  # the stream failed after it started (e.g. no engine group took it back)


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
