"""The local process tree of `pagemesh up`: start services by module name, stop them all."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from pagemesh.runtime.redact import redacted_argv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceSpec:
    """One service process: `python -m <module> <args...>`."""

    name: str
    module: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None  # the logical CPUs it runs on; None: as its parent


class Supervisor:
    """Owns child processes; `restart_dead()` brings back those that died (as compose's
    `restart: unless-stopped` does), `stop()` ends every one (SIGTERM, then SIGKILL)."""

    def __init__(
        self, grace_s: float = 10.0, max_restarts: int = 5, restart_window_s: float = 60.0
    ) -> None:
        self.grace_s = grace_s
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.specs: dict[str, ServiceSpec] = {}
        # A child that dies more than `max_restarts` times within `restart_window_s` is
        # broken, not unlucky: it stays down.
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self._restarts: dict[str, list[float]] = {}
        self.given_up: set[str] = set()

    def start(self, spec: ServiceSpec) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        argv = [sys.executable, "-m", spec.module, *spec.args]
        logger.info("starting %s: %s", spec.name, " ".join(redacted_argv(argv)))
        cpus = spec.cpus
        # Set in the child before exec: the OpenMP runtime reads the affinity when it loads.
        bind = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        proc = subprocess.Popen(argv, env=env, preexec_fn=bind)
        self.children[spec.name] = proc
        self.specs[spec.name] = spec
        return proc

    def restart_dead(self) -> dict[str, int]:
        """Restarts every child that exited (unless it keeps dying); returns those restarted
        with their exit codes."""
        restarted = {}
        now = time.monotonic()
        for name, code in self.dead_children().items():
            if name in self.given_up:
                continue
            recent = [t for t in self._restarts.get(name, []) if now - t < self.restart_window_s]
            if len(recent) >= self.max_restarts:
                logger.error(
                    "%s died %d times in %.0f s; leaving it down",
                    name,
                    len(recent) + 1,
                    self.restart_window_s,
                )
                self.given_up.add(name)
                continue
            self._restarts[name] = [*recent, now]
            logger.warning("%s exited with status %s; restarting it", name, code)
            self.start(self.specs[name])
            restarted[name] = code
        return restarted

    def pids(self) -> dict[str, int]:
        """Children running now: name -> pid."""
        return {name: proc.pid for name, proc in self.children.items() if proc.poll() is None}

    def dead_children(self) -> dict[str, int]:
        """Children that exited, with their exit codes."""
        return {
            name: proc.returncode for name, proc in self.children.items() if proc.poll() is not None
        }

    def stop(self) -> None:
        alive = [p for p in self.children.values() if p.poll() is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait()
