"""What `pagemesh top` shows, computed from plain data: no Redis, no HTTP, no terminal.

The input is one `ServiceRecord` per registry entry (its typed entry from
pagemesh.runtime.registry_entries, how old its heartbeat is, the text its `/metrics` endpoint
returned). `build_snapshot` turns a list of them into a `Snapshot`; `compute_rates` turns two
snapshots into per-second rates and latency quantiles over the window between them, the way
Prometheus' `rate` and `histogram_quantile` would. The metric names it reads are those
pagemesh.runtime.metrics declares the metrics with.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pagemesh.runtime import metrics
from pagemesh.runtime.registry_entries import (
    KINDS,
    RouterEntry,
    SchedulerEntry,
    ServiceEntry,
    WorkerEntry,
    WorkerStatus,
)
from pagemesh.tools.top_experts import HotExpert, hot_experts

# Metric names this view reads, from where pagemesh.runtime.metrics declares them. Sample names, as
# they appear in the exposition text: counters with `_total` (histograms get `_bucket` below).
GENERATION_TOKENS = metrics.counter_sample(metrics.GENERATION_TOKENS)
PROMPT_TOKENS = metrics.counter_sample(metrics.PROMPT_TOKENS)
REQUEST_SUCCESS = metrics.counter_sample(metrics.REQUEST_SUCCESS)
REQUESTS_IN_FLIGHT = metrics.NUM_REQUESTS_IN_FLIGHT
TTFT = metrics.TIME_TO_FIRST_TOKEN
ITL = metrics.INTER_TOKEN_LATENCY
E2E = metrics.E2E_REQUEST_LATENCY
KV_CACHE_USAGE = metrics.KV_CACHE_USAGE
NUM_SWAPPED = metrics.NUM_REQUESTS_SWAPPED
HEARTBEAT_AGE = metrics.HEARTBEAT_AGE

# A sample name -> every (labels, value) of it in one scrape.
Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class ServiceRecord:
    """One registry entry and what top learnt about the service: the input of a snapshot."""

    kind: str  # router | scheduler | worker
    service_id: str
    entry: ServiceEntry  # what the service last published: a RouterEntry, SchedulerEntry, ...
    heartbeat_age_s: float | None = None  # None when unknown
    metrics_text: str | None = None  # the body of its /metrics, None when not scraped
    metrics_error: str | None = None  # why the scrape failed


@dataclass(frozen=True)
class GroupRow:
    """One engine group, seen through its scheduler's entry (and its workers')."""

    group: str
    scheduler_id: str  # "" when workers of the group are alive but no scheduler is
    status: str  # ready | degraded | draining | … | "no scheduler"
    workers_alive: int  # live worker entries of the group with status ready
    workers_expected: int  # tp_size x pp_size, 0 when unknown
    num_waiting: int
    num_running: int
    num_swapped: int
    kv_usage: float | None  # fraction of the device KV blocks in use, 0..1
    prefix_hit_rate: float | None  # lifetime hits / queries (tokens), 0..1
    num_recoveries: int
    num_preemptions: int
    num_steps: int
    heartbeat_age_s: float | None
    metrics: str  # "ok", "-" (no metrics_address published) or the scrape error
    # Speculative decoding: lifetime draft tokens kept / verified, 0..1; None: no drafts.
    spec_acceptance: float | None = None
    # Tokens a drafted step gives a request, on average: 1 + kept drafts / drafts verified.
    spec_mean_length: float | None = None


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    group: str
    tp_rank: int  # -1 for a standby that holds no rank yet
    pp_rank: int
    status: str  # joining | ready | standby | …
    epoch: str
    num_steps: int
    busy_time_s: float  # seconds spent executing steps since the worker started
    heartbeat_age_s: float | None
    metrics: str
    # Memory in bytes, None until the worker says (loaded, and new enough to publish it).
    weight_bytes: int | None = None
    kv_cache_bytes: int | None = None
    rss_bytes: int | None = None
    # Seconds in collectives and pipeline transfers since the worker started.
    communication_time_s: float = 0.0


@dataclass(frozen=True)
class RouterRow:
    router_id: str
    address: str
    serving: bool
    num_groups: int
    num_in_flight: int | None  # from its metrics; None without them
    heartbeat_age_s: float | None
    metrics: str


@dataclass(frozen=True)
class Snapshot:
    taken_at: float  # seconds (time.monotonic or wall clock: only differences are used)
    groups: list[GroupRow]
    workers: list[WorkerRow]
    routers: list[RouterRow]
    # "<kind>:<id>" -> its parsed metrics, for the rates between two snapshots.
    metrics: dict[str, Samples] = field(default_factory=dict)
    # "<kind>:<id>" -> the entry's cumulative counters (num_steps, busy_time_s, …) and instance.
    counters: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Rates:
    """Per-second rates and latency medians over the window between two snapshots.

    Without an earlier snapshot (`window_s` None) the rates are None and the quantiles are
    over every observation since the services started.
    """

    window_s: float | None
    output_tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    requests_per_s: float | None
    ttft_p50_s: float | None
    itl_p50_s: float | None
    e2e_p50_s: float | None
    # "<kind>:<id>" -> rate; only services seen in both snapshots (same instance).
    steps_per_s: dict[str, float] = field(default_factory=dict)
    busy_fraction: dict[str, float] = field(default_factory=dict)  # workers, 0..1
    # Workers: of the window's busy time, the fraction spent communicating, 0..1.
    communication_fraction: dict[str, float] = field(default_factory=dict)
    preemptions_per_s: dict[str, float] = field(default_factory=dict)  # schedulers
    # Mixture-of-experts groups: group -> its hottest experts (pagemesh/tools/top_experts.py).
    hot_experts: dict[str, list[HotExpert]] = field(default_factory=dict)


# --- metrics text ---------------------------------------------------------------------


def parse_metrics(text: str) -> Samples:
    """Prometheus exposition text -> sample name -> [(labels, value)].

    The parser names a counter family without `_total` and splits histograms into
    `_bucket`/`_sum`/`_count` samples; keying by sample name sidesteps both.
    """
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def metric_sum(samples: Samples, name: str, **labels: str) -> float | None:
    """Sum of a sample over the series whose labels match; None when there is none."""
    values = [
        value
        for series, value in samples.get(name, ())
        if all(series.get(key) == want for key, want in labels.items())
    ]
    return sum(values) if values else None


def histogram_buckets(samples: Samples, name: str, **labels: str) -> dict[float, float]:
    """Upper bound -> cumulative count of a histogram, summed over matching series."""
    buckets: dict[float, float] = {}
    for series, value in samples.get(name + "_bucket", ()):
        if all(series.get(key) == want for key, want in labels.items()):
            upper = float(series["le"])  # "+Inf" parses to inf
            buckets[upper] = buckets.get(upper, 0.0) + value
    return buckets


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Estimates the q-quantile from cumulative bucket counts as Prometheus does.

    Linear interpolation inside the bucket holding the rank, the lowest bucket starting at
    0; a rank in the +Inf bucket gives the highest finite bound. None without observations.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower if bounds[0] != upper else None
            if upper <= 0:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


# --- snapshot -------------------------------------------------------------------------


def heartbeat_age(
    entry: ServiceEntry, pttl_ms: int | None, ttl_s: float, now: float
) -> float | None:
    """Seconds since a service last refreshed its entry.

    From `heartbeat_at` (wall-clock seconds) when the entry carries it, else from the key's
    remaining TTL: every heartbeat resets it to the TTL (the entry's `heartbeat_ttl_s` when
    it says, else `ttl_s`), so no clocks of other hosts are involved.
    """
    if entry.heartbeat_at is not None:
        return max(0.0, now - entry.heartbeat_at)
    if pttl_ms is None or pttl_ms < 0:
        return None
    ttl = entry.heartbeat_ttl_s
    ttl_s = ttl if ttl is not None and ttl > 0 else ttl_s
    return max(0.0, ttl_s - pttl_ms / 1000.0)


def _heartbeat_age(record: ServiceRecord, parsed: dict[str, Samples]) -> float | None:
    """The age top measured, else the one the service reports about itself."""
    if record.heartbeat_age_s is not None:
        return record.heartbeat_age_s
    return metric_sum(parsed.get(_key(record), {}), HEARTBEAT_AGE)


def _metrics_state(record: ServiceRecord, parsed: dict[str, Samples]) -> str:
    if record.metrics_error:
        return record.metrics_error
    return "ok" if _key(record) in parsed else "-"


def _key(record: ServiceRecord) -> str:
    return f"{record.kind}:{record.service_id}"


def _kv_usage(entry: SchedulerEntry, samples: Samples | None) -> float | None:
    usage = entry.kv_cache_usage()
    if usage is not None:
        return usage
    # pagemesh:kv_cache_usage_perc is a fraction (1 = full), as vLLM's gauge of that name.
    return metric_sum(samples, KV_CACHE_USAGE) if samples else None


def _workers_ready(workers: list[ServiceRecord]) -> int:
    return sum(1 for w in workers if _worker(w).status == WorkerStatus.READY)


def _expected_workers(members: tuple[str, ...], workers: list[ServiceRecord]) -> int:
    """tp_size x pp_size as the group's workers publish it, else its scheduler's members."""
    if not workers:
        return len(members)
    layout = _worker(workers[0])
    return layout.tp_size * layout.pp_size


def _group_row(
    record: ServiceRecord, workers: list[ServiceRecord], parsed: dict[str, Samples]
) -> GroupRow:
    entry, samples = _scheduler(record), parsed.get(_key(record))
    swapped = entry.num_swapped
    if swapped is None and samples:
        swapped = metric_sum(samples, NUM_SWAPPED)
    return GroupRow(
        group=entry.group,
        scheduler_id=record.service_id,
        status=entry.status.value,
        workers_alive=_workers_ready(workers),
        workers_expected=_expected_workers(entry.members, workers),
        num_waiting=entry.num_waiting,
        num_running=entry.num_running,
        num_swapped=int(swapped or 0),
        kv_usage=_kv_usage(entry, samples),
        prefix_hit_rate=entry.prefix_cache_hit_rate,
        num_recoveries=entry.num_recoveries,
        num_preemptions=entry.num_preemptions,
        num_steps=entry.num_steps,
        heartbeat_age_s=_heartbeat_age(record, parsed),
        metrics=_metrics_state(record, parsed),
        spec_acceptance=(
            entry.num_accepted_tokens / entry.num_draft_tokens if entry.num_draft_tokens else None
        ),
        spec_mean_length=(
            1 + entry.num_accepted_tokens / entry.num_drafts if entry.num_drafts else None
        ),
    )


def _orphan_group_row(group: str, workers: list[ServiceRecord]) -> GroupRow:
    return GroupRow(
        group=group,
        scheduler_id="",
        status="no scheduler",
        workers_alive=_workers_ready(workers),
        workers_expected=_expected_workers((), workers),
        num_waiting=0,
        num_running=0,
        num_swapped=0,
        kv_usage=None,
        prefix_hit_rate=None,
        num_recoveries=0,
        num_preemptions=0,
        num_steps=0,
        heartbeat_age_s=None,
        metrics="-",
    )


def _worker_row(record: ServiceRecord, parsed: dict[str, Samples]) -> WorkerRow:
    entry = _worker(record)
    return WorkerRow(
        worker_id=record.service_id,
        group=entry.group,
        tp_rank=entry.tp_rank,
        pp_rank=entry.pp_rank,
        status=entry.status.value,
        epoch=entry.epoch,
        num_steps=entry.num_steps,
        busy_time_s=entry.busy_time_s,
        heartbeat_age_s=_heartbeat_age(record, parsed),
        metrics=_metrics_state(record, parsed),
        weight_bytes=entry.weight_bytes,
        kv_cache_bytes=entry.kv_cache_bytes,
        rss_bytes=entry.rss_bytes,
        communication_time_s=_communication_s(entry),
    )


def _communication_s(entry: WorkerEntry) -> float:
    return entry.tp_collective_time_s + entry.pp_send_time_s + entry.pp_recv_time_s


def _router_row(record: ServiceRecord, parsed: dict[str, Samples]) -> RouterRow:
    entry, samples = _router(record), parsed.get(_key(record))
    in_flight = metric_sum(samples, REQUESTS_IN_FLIGHT) if samples else None
    return RouterRow(
        router_id=record.service_id,
        address=entry.address,
        serving=entry.serving,
        num_groups=entry.num_groups,
        num_in_flight=int(in_flight) if in_flight is not None else None,
        heartbeat_age_s=_heartbeat_age(record, parsed),
        metrics=_metrics_state(record, parsed),
    )


# The entry of a record of that kind (a record's kind and entry type agree).
def _worker(record: ServiceRecord) -> WorkerEntry:
    assert isinstance(record.entry, WorkerEntry), record
    return record.entry


def _scheduler(record: ServiceRecord) -> SchedulerEntry:
    assert isinstance(record.entry, SchedulerEntry), record
    return record.entry


def _router(record: ServiceRecord) -> RouterEntry:
    assert isinstance(record.entry, RouterEntry), record
    return record.entry


def _counters(entry: ServiceEntry) -> dict[str, Any]:
    """The entry's cumulative counters that become rates, and the instance they belong to."""
    counters: dict[str, Any] = {"instance": entry.instance}
    if isinstance(entry, WorkerEntry):
        counters.update(
            num_steps=entry.num_steps,
            busy_time_s=entry.busy_time_s,
            communication_time_s=_communication_s(entry),
        )
    elif isinstance(entry, SchedulerEntry):
        counters.update(num_steps=entry.num_steps, num_preemptions=entry.num_preemptions)
    return counters


def _parse_all(records: Iterable[ServiceRecord]) -> tuple[dict[str, Samples], dict[str, str]]:
    parsed: dict[str, Samples] = {}
    errors: dict[str, str] = {}
    for record in records:
        if record.metrics_text is None:
            continue
        try:
            parsed[_key(record)] = parse_metrics(record.metrics_text)
        except Exception as exc:  # not Prometheus text (another server on that port?): say so
            # in its row rather than fail the whole view; the parser raises several types
            errors[_key(record)] = f"bad metrics: {exc}"[:60]
    return parsed, errors


def build_snapshot(records: Iterable[ServiceRecord], taken_at: float) -> Snapshot:
    """Registry entries and scraped metrics -> the rows top shows, sorted for display."""
    records = list(records)
    parsed, errors = _parse_all(records)
    records = [
        replace(r, metrics_text=None, metrics_error=errors[_key(r)]) if _key(r) in errors else r
        for r in records
    ]
    by_kind = {kind: [r for r in records if r.kind == kind] for kind in KINDS}
    workers_of: dict[str, list[ServiceRecord]] = {}
    for worker in by_kind["worker"]:
        workers_of.setdefault(_worker(worker).group, []).append(worker)
    groups = [
        _group_row(r, workers_of.get(_scheduler(r).group, []), parsed) for r in by_kind["scheduler"]
    ]
    scheduled = {row.group for row in groups}
    groups += [_orphan_group_row(g, ws) for g, ws in workers_of.items() if g not in scheduled]
    workers = [_worker_row(r, parsed) for r in by_kind["worker"]]
    return Snapshot(
        taken_at=taken_at,
        groups=sorted(groups, key=lambda g: (g.group, g.scheduler_id)),
        workers=sorted(workers, key=lambda w: (w.group, w.pp_rank, w.tp_rank, w.worker_id)),
        routers=sorted(
            (_router_row(r, parsed) for r in by_kind["router"]), key=lambda r: r.router_id
        ),
        metrics=parsed,
        counters={_key(r): _counters(r.entry) for r in records},
    )


# --- rates between two snapshots ------------------------------------------------------


def counter_delta(prev: Snapshot, cur: Snapshot, name: str) -> float:
    """Increase of a counter summed over services, as Prometheus' `increase`.

    A service whose counter went down restarted: its whole current value is the increase.
    A service absent from `prev` contributes nothing (its past is not in this window).
    """
    total = 0.0
    for source, samples in cur.metrics.items():
        now = metric_sum(samples, name)
        before = metric_sum(prev.metrics.get(source, {}), name)
        if now is None or before is None:
            continue
        total += now - before if now >= before else now
    return total


def histogram_delta(prev: Snapshot | None, cur: Snapshot, name: str) -> dict[float, float]:
    """Bucket counts observed in the window (over all time without `prev`), summed."""
    total: dict[float, float] = {}
    for source, samples in cur.metrics.items():
        now = histogram_buckets(samples, name)
        if prev is not None:
            if source not in prev.metrics:
                continue
            before = histogram_buckets(prev.metrics[source], name)
            if all(now.get(le, 0.0) >= count for le, count in before.items()):
                now = {le: count - before.get(le, 0.0) for le, count in now.items()}
        for le, count in now.items():
            total[le] = total.get(le, 0.0) + count
    return total


def _entry_rates(prev: Snapshot, cur: Snapshot, name: str, window_s: float) -> dict[str, float]:
    rates: dict[str, float] = {}
    for source, counters in cur.counters.items():
        before = prev.counters.get(source)
        now_value, before_value = counters.get(name), (before or {}).get(name)
        if (
            before is None
            or before.get("instance") != counters.get("instance")
            or not isinstance(now_value, (int, float))
            or not isinstance(before_value, (int, float))
            or now_value < before_value
        ):
            continue
        rates[source] = (now_value - before_value) / window_s
    return rates


def compute_rates(prev: Snapshot | None, cur: Snapshot) -> Rates:
    """Rates over the window from `prev` to `cur`; see `Rates` for the case without `prev`."""
    ttft = histogram_quantile(0.5, histogram_delta(prev, cur, TTFT))
    itl = histogram_quantile(0.5, histogram_delta(prev, cur, ITL))
    e2e = histogram_quantile(0.5, histogram_delta(prev, cur, E2E))
    window_s = cur.taken_at - prev.taken_at if prev is not None else 0.0
    if prev is None or window_s <= 0:
        return Rates(
            None, None, None, None, ttft, itl, e2e, hot_experts=hot_experts(None, cur.metrics)
        )
    busy = _entry_rates(prev, cur, "busy_time_s", window_s)
    communication = _entry_rates(prev, cur, "communication_time_s", window_s)
    return Rates(
        window_s=window_s,
        output_tokens_per_s=counter_delta(prev, cur, GENERATION_TOKENS) / window_s,
        prompt_tokens_per_s=counter_delta(prev, cur, PROMPT_TOKENS) / window_s,
        requests_per_s=counter_delta(prev, cur, REQUEST_SUCCESS) / window_s,
        ttft_p50_s=ttft,
        itl_p50_s=itl,
        e2e_p50_s=e2e,
        steps_per_s=_entry_rates(prev, cur, "num_steps", window_s),
        busy_fraction={source: min(1.0, value) for source, value in busy.items()},
        communication_fraction={
            source: min(1.0, communication[source] / value)
            for source, value in busy.items()
            if value > 0 and source in communication
        },
        preemptions_per_s=_entry_rates(prev, cur, "num_preemptions", window_s),
        hot_experts=hot_experts(prev.metrics, cur.metrics),
    )


# --- Prometheus service discovery -----------------------------------------------------


def prometheus_targets(records: Iterable[ServiceRecord]) -> list[dict[str, Any]]:
    """Registry entries -> a Prometheus `file_sd_configs` target list.

    One target group per service that publishes `metrics_address`. The labels avoid the
    names the metrics carry themselves (`group`, `service`) so Prometheus need not rename
    them to `exported_*`.
    """
    targets = [
        {
            "targets": [r.entry.metrics_address],
            "labels": {"pagemesh_kind": r.kind, "pagemesh_id": r.service_id},
        }
        for r in records
        if r.entry.metrics_address
    ]
    return sorted(targets, key=lambda t: (t["labels"]["pagemesh_kind"], t["labels"]["pagemesh_id"]))
