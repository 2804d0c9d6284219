"""`pagemesh up`'s liveness probe: what a container runtime's does for containers.

A child that dies is restarted by the supervisor. A child that is alive but does not run —
frozen (SIGSTOP), wedged — never exits, so nothing restarts it; its peers notice it (the
scheduler's step watchdog, keepalive) and carry on without it, but its place stays empty
until it is replaced. So, once a second, this probe asks each child's gRPC health
(the address it publishes in the registry, remembered after its entry expires) and kills
(SIGKILL) a child that has not answered at all for `silent_s`; the supervisor then restarts
it. An answer of any kind (SERVING, NOT_SERVING) is alive; a refused connection is a child
starting or ending, which the supervisor sees by itself. A child its scheduler fenced
(pagemesh/runtime/registry.py) is killed at once: it was declared failed, and a fresh process
takes its place sooner than a frozen one wakes up.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime.tls import TlsConfig

logger = logging.getLogger(__name__)

KINDS = ("worker", "scheduler", "router")


@dataclass(frozen=True)
class LivenessConfig:
    interval_s: float = 1.0  # between rounds of probes
    probe_timeout_s: float = 1.0  # one health check
    silent_s: float = 5.0  # no answer for this long: killed

    def __post_init__(self) -> None:
        if not 0 < self.probe_timeout_s <= self.interval_s < self.silent_s:
            raise ValueError("liveness needs 0 < probe_timeout_s <= interval_s < silent_s")


@dataclass
class _Child:
    address: str | None = None  # its gRPC address, from the registry
    silent_since: float | None = None  # monotonic time of the first unanswered probe


@dataclass
class LivenessProbe:
    """Probes the children `pids()` names (name -> pid) from a daemon thread; `kill` is how
    a child is ended (os.kill by default). `num_kills` counts what it did."""

    redis_url: str
    cluster: str
    pids: Callable[[], dict[str, int]]
    tls: TlsConfig = field(default_factory=TlsConfig)
    config: LivenessConfig = field(default_factory=LivenessConfig)
    kill: Callable[[int], None] = lambda pid: os.kill(pid, signal.SIGKILL)
    num_kills: int = field(default=0, init=False)
    _children: dict[int, _Child] = field(default_factory=dict, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)

    def start(self) -> LivenessProbe:
        threading.Thread(target=self._run, name="liveness", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        client = redis.Redis.from_url(
            self.redis_url, decode_responses=True, socket_timeout=self.config.probe_timeout_s
        )
        while not self._stop.wait(self.config.interval_s):
            try:
                self.check(client)
            except Exception:  # the probe must outlive anything it meets
                logger.exception("liveness probe round failed")

    def check(self, client: redis.Redis) -> None:
        """One round: learn addresses, kill fenced children, probe the others."""
        names = {pid: name for name, pid in self.pids().items()}
        self._children = {pid: self._children.get(pid, _Child()) for pid in names}
        try:
            entries, fences = self._read_registry(client)
        except redis.RedisError as exc:  # Redis away: probe the addresses known so far
            logger.debug("liveness: registry unreadable: %s", exc)
            entries, fences = {}, []
        for pid, address in entries.items():
            if pid in self._children:
                self._children[pid].address = address
        host = socket.gethostname()
        for record in fences:
            pid = record.get("pid")
            if pid in self._children and record.get("host") in (host, ""):
                self._end(pid, names[pid], f"fenced: {record.get('reason')}")
        now = time.monotonic()
        for pid, child in list(self._children.items()):
            if child.address is None:
                continue
            if self._answers(child.address):
                child.silent_since = None
                continue
            child.silent_since = child.silent_since or now
            if now - child.silent_since >= self.config.silent_s:
                self._end(
                    pid,
                    names[pid],
                    f"its health has not answered for {now - child.silent_since:.1f} s",
                )

    def _read_registry(self, client: redis.Redis) -> tuple[dict[int, str], list[dict]]:
        addresses: dict[int, str] = {}
        for kind in KINDS:
            for key in client.scan_iter(f"{self.cluster}:{kind}:*", count=1000):
                raw = client.get(key)
                if raw is not None:
                    entry = json.loads(raw)
                    if isinstance(entry.get("pid"), int) and entry.get("address"):
                        addresses[entry["pid"]] = entry["address"]
        fences = [
            json.loads(raw)
            for key in client.scan_iter(f"{self.cluster}:fenced:*", count=1000)
            if (raw := client.get(key)) is not None
        ]
        return addresses, fences

    def _answers(self, address: str) -> bool:
        """False only when the child does not answer at all within the probe's timeout."""
        try:
            with self.tls.channel(address) as channel:
                health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=self.config.probe_timeout_s
                )
        except grpc.RpcError as exc:
            return exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
        return True

    def _end(self, pid: int, name: str, why: str) -> None:
        logger.error(
            "%s (pid %d) is alive but not running: %s; killing it so that it is restarted",
            name,
            pid,
            why,
        )
        try:
            self.kill(pid)
            self.num_kills += 1
        except ProcessLookupError:
            pass
        self._children.pop(pid, None)
