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

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceSpec:
    """One service process: `python -m <module> <args...>`."""

    name: str
    module: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


class Supervisor:
    """Owns child processes; `stop()` ends every one of them (SIGTERM, then SIGKILL)."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, spec: ServiceSpec) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        argv = [sys.executable, "-m", spec.module, *spec.args]
        logger.info("starting %s: %s", spec.name, " ".join(argv))
        proc = subprocess.Popen(argv, env=env)
        self.children[spec.name] = proc
        return proc

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

