"""The scheduler's metrics: one engine group's, label `group`.

`SchedulerMetrics` holds the histograms observed as steps run (queue time, step time, tokens
per step); everything else is read at scrape time from an `EngineSnapshot`, the group's state
as its scheduler sees it (scheduler_svc/engine_metrics.py takes it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Histogram
from prometheus_client.core import Metric

from pagemesh.runtime.metrics import (
    KV_CACHE_USAGE,
    NUM_REQUESTS_SWAPPED,
    PREFIX,
    REQUEST_LATENCY_BUCKETS_S,
    STEP_TIME_BUCKETS_S,
    TOKENS_PER_STEP_BUCKETS,
    ServiceMetrics,
    counter,
    gauge,
)


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
                *_batch_families(s, labels),
                *_cache_families(s, labels),
                *_spec_decode_families(s, labels),
                *_group_families(s, labels),
            ]

        self.add_collector(collect)


# What one scrape reads from the snapshot, in exposition order.


def _batch_families(s: EngineSnapshot, labels: dict[str, str]) -> list[Metric]:
    """The running batch, the queues and the KV cache, now."""
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
    ]


def _cache_families(s: EngineSnapshot, labels: dict[str, str]) -> list[Metric]:
    """Cumulative: prefix cache lookups, preemptions and swaps."""
    return [
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
    ]


def _spec_decode_families(s: EngineSnapshot, labels: dict[str, str]) -> list[Metric]:
    """Cumulative: drafts verified and their tokens (speculative decoding)."""
    return [
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
    ]


def _group_families(s: EngineSnapshot, labels: dict[str, str]) -> list[Metric]:
    """The engine group's own: recoveries, readiness, checkpoint writes."""
    return [
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
