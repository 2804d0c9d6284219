"""`pagemesh top`: a live view of a cluster from its Redis registry and metrics endpoints.

`ClusterReader` does the I/O (one SCAN per kind, GET + PTTL per entry, an HTTP GET of every
published `metrics_address`); `pagemesh.tools.top_snapshot` turns what it read into rows and rates;
`pagemesh.tools.top_render` draws them; `pagemesh.tools.top_app` refreshes them in a terminal UI.
With `--prometheus-targets FILE` it writes a Prometheus file_sd target list instead.
With no `--redis-url` it reads the local `pagemesh up`'s registry (pagemesh/tools/discovery.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import redis
from rich.console import Console

from pagemesh.runtime.config import add_flag, add_redis_password_flag, with_password
from pagemesh.runtime.redact import redact_url
from pagemesh.runtime.registry_entries import KINDS, ServiceEntry, entry_from_json
from pagemesh.tools import discovery
from pagemesh.tools.top_render import render
from pagemesh.tools.top_snapshot import (
    ServiceRecord,
    Snapshot,
    build_snapshot,
    compute_rates,
    heartbeat_age,
    prometheus_targets,
)

logger = logging.getLogger(__name__)


def scrape(address: str, timeout_s: float) -> tuple[str | None, str | None]:
    """GETs `http://<address>/metrics`: (text, None), or (None, a short reason)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as response:
            return response.read().decode("utf-8", "replace"), None
    except urllib.error.HTTPError as exc:
        return None, f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:  # refused, timed out, bad address
        return None, f"down: {_short_reason(exc)}"


def _short_reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc  # URLError wraps the socket's error
    if isinstance(reason, TimeoutError):
        return "timeout"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason)[:40]


class ClusterReader:
    """Reads one cluster's registry entries and scrapes their metrics endpoints."""

    def __init__(
        self, redis_url: str, cluster: str, ttl_s: float = 3.0, scrape_timeout_s: float = 1.0
    ) -> None:
        self.cluster = cluster
        self.ttl_s = ttl_s
        self.scrape_timeout_s = scrape_timeout_s
        self._redis = redis.Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=5.0, socket_connect_timeout=5.0
        )
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="top-scrape")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._redis.close()

    def read_registry(self) -> list[ServiceRecord]:
        """Every live router, scheduler and worker entry, with its heartbeat age."""
        records: list[ServiceRecord] = []
        for kind in KINDS:
            prefix = f"{self.cluster}:{kind}:"
            keys = sorted(self._redis.scan_iter(match=prefix + "*", count=1000))
            if not keys:
                continue
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
                pipe.pttl(key)
            replies = pipe.execute()
            now = time.time()
            for key, raw, pttl in zip(keys, replies[0::2], replies[1::2]):
                entry = _load_entry(kind, key, raw)
                if entry is not None:
                    age = heartbeat_age(entry, pttl, self.ttl_s, now)
                    records.append(ServiceRecord(kind, key[len(prefix) :], entry, age))
        return records

    def scrape_all(self, records: list[ServiceRecord]) -> list[ServiceRecord]:
        """The records with the metrics text of every service that publishes an address."""

        def one(record: ServiceRecord) -> ServiceRecord:
            address = record.entry.metrics_address
            if not address:
                return record
            text, error = scrape(address, self.scrape_timeout_s)
            return ServiceRecord(
                record.kind, record.service_id, record.entry, record.heartbeat_age_s, text, error
            )

        return list(self._pool.map(one, records))

    def read(self) -> Snapshot:
        return build_snapshot(self.scrape_all(self.read_registry()), time.monotonic())


def _load_entry(kind: str, key: str, raw: str | None) -> ServiceEntry | None:
    if raw is None:  # expired between SCAN and GET
        return None
    try:
        return entry_from_json(kind, json.loads(raw))
    except ValueError as exc:  # not JSON, or not an entry this version can read
        logger.warning("registry entry %s skipped: %s", key, exc)
        return None


# --- the command ----------------------------------------------------------------------


def add_top_parser(sub: argparse._SubParsersAction) -> None:
    top = sub.add_parser("top", help="live view of a cluster: groups, workers, routers, tokens/s")
    add_flag(
        top,
        "--redis-url",
        default=None,
        help="Redis holding the cluster's registry (default: the local `pagemesh up`'s, "
        f"else {discovery.DEFAULT_REDIS_URL})",
    )
    add_redis_password_flag(top)
    add_flag(
        top,
        "--cluster",
        default=None,
        help="key prefix of the mesh in Redis (default: the local `pagemesh up`'s, else "
        f"{discovery.DEFAULT_CLUSTER})",
    )
    add_flag(
        top,
        "--interval",
        type=float,
        default=1.0,
        help="seconds between refreshes; with --once, the window rates are measured over "
        "(0 = one read: no rates, latency medians since the services started)",
    )
    add_flag(
        top,
        "--once",
        type=bool,
        default=False,
        help="print one view as plain tables (or JSON, --format) and exit",
    )
    add_flag(top, "--format", default="table", choices=["table", "json"], help="what --once prints")
    add_flag(
        top,
        "--heartbeat-ttl-s",
        type=float,
        default=3.0,
        help="the services' heartbeat TTL, to tell heartbeat ages from key TTLs",
    )
    add_flag(
        top,
        "--scrape-timeout-s",
        type=float,
        default=1.0,
        help="seconds to wait for one /metrics endpoint",
    )
    add_flag(
        top,
        "--prometheus-targets",
        default=None,
        help="write the services' metrics addresses to this Prometheus file_sd JSON file "
        "(every --interval, or once with --once) instead of showing the view",
    )
    top.set_defaults(func=run_top)


def run_top(args: argparse.Namespace) -> int:
    if args.interval < 0:
        raise SystemExit("--interval must be >= 0")
    url = with_password(args.redis_url, args.redis_password) if args.redis_url else None
    where = discovery.resolve_registry(url, args.cluster)
    reader = ClusterReader(
        where.redis_url, where.cluster, args.heartbeat_ttl_s, args.scrape_timeout_s
    )
    try:
        if args.prometheus_targets:
            return write_targets_loop(reader, args.prometheus_targets, args.interval, args.once)
        if args.once:
            return print_once(reader, args.interval, args.format)
        from pagemesh.tools.top_app import TopApp  # textual loads only for the live view

        TopApp(reader.read, max(args.interval, 0.1), where.cluster).run()
        return 0
    except redis.RedisError as exc:
        print(
            f"pagemesh top: cannot read the registry at {redact_url(where.redis_url)} "
            f"({where.source}): "
            f"{exc}; start a mesh with `pagemesh up`, or pass --redis-url",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:  # Ctrl-C of the targets writer or of --once
        return 130
    finally:
        reader.close()


def print_once(reader: ClusterReader, interval_s: float, output: str) -> int:
    first = reader.read()
    prev, cur = None, first
    if interval_s > 0:
        time.sleep(interval_s)
        prev, cur = first, reader.read()
    rates = compute_rates(prev, cur)
    if output == "json":
        rows = {
            name: [asdict(row) for row in getattr(cur, name)]
            for name in ("groups", "workers", "routers")
        }
        body = {"snapshot": {"taken_at": cur.taken_at, **rows}, "rates": asdict(rates)}
        print(json.dumps(body, indent=2))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)
    console.print(render(cur, rates, reader.cluster))
    return 0


def write_targets(path: str, targets: list[dict[str, Any]]) -> None:
    """Replaces the file in one rename, so Prometheus never reads half of it."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".targets-", suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(targets, out, indent=2)
        out.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def write_targets_loop(reader: ClusterReader, path: str, interval_s: float, once: bool) -> int:
    written: list[dict[str, Any]] | None = None
    while True:
        try:
            targets = prometheus_targets(reader.read_registry())
        except redis.RedisError as exc:  # keep the last list while Redis is away
            if once:
                raise
            logger.warning("cannot read the registry: %s", exc)
            targets = written
        if targets is not None and targets != written:
            write_targets(path, targets)
            written = targets
        if once:
            return 0
        time.sleep(max(interval_s, 0.1))
