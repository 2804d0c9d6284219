"""The worker's metrics: one worker's, labels `group`, `tp_rank`, `pp_rank`.

`WorkerMetrics` holds the forward-time histogram observed at each step and the loaded weights;
everything else is read at scrape time from a `WorkerSnapshot`, the worker's cumulative
counters (steps, communication time, memory, images encoded, tokens per expert).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from pagemesh.runtime.metrics import (
    EXPERT_TOKENS,
    PREFIX,
    STEP_TIME_BUCKETS_S,
    ServiceMetrics,
    counter,
    gauge,
)


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
            return [
                *_step_families(s, labels),
                *_memory_families(s, labels),
                *_image_families(s, labels),
                *_expert_families(s, labels),
            ]

        self.add_collector(collect)


# What one scrape reads from the snapshot, in exposition order.


def _step_families(s: WorkerSnapshot, labels: dict[str, str]) -> list[Metric]:
    """Cumulative: steps, and where their time went."""
    return [
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


def _memory_families(s: WorkerSnapshot, labels: dict[str, str]) -> list[Metric]:
    """The KV cache's and the process's bytes, once the model is loaded."""
    found: list[Metric] = []
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
    return found


def _image_families(s: WorkerSnapshot, labels: dict[str, str]) -> list[Metric]:
    """Vision-language models' image encoder (none without one)."""
    found: list[Metric] = []
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
    return found


def _expert_families(s: WorkerSnapshot, labels: dict[str, str]) -> list[Metric]:
    """Mixture-of-experts models: tokens routed to each expert of each layer."""
    found: list[Metric] = []
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
