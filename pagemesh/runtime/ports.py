"""Ports that must be chosen before the process that binds them runs.

A service binds port 0 when it can, and reports the port it got (its registry entry, the
state file of `pagemesh up`). Some ports cannot wait for that: the torch.distributed
master's (published before rank 0 binds it), the embedded Valkey's, the ports a harness
gives to compose services run as processes. Asking the kernel for a free port and closing
the socket is a guess: the next `bind(0)` or outgoing connection may be handed the same
port, and two guesses in a row may return the same port twice.

`reserve_port()` hands out ports so that no two callers on this machine ever get the same
one while it may still be in use:

- from a range **outside the kernel's ephemeral range** (`ip_local_port_range`), so that no
  `bind(0)` and no outgoing connection's local port can land on one;
- **in turn**, from a counter kept in a file under the temp folder and advanced under an
  exclusive lock, so every process of the machine (pytest workers, meshes, their workers)
  shares one sequence: a port comes round again only after every other port of the range;
- **checked**: a port that something still holds is skipped.

`PAGEMESH_PORT_RANGE=FIRST-LAST` sets the range (read at each call, never at import).
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

PORT_RANGE_ENV = "PAGEMESH_PORT_RANGE"
PORT_STATE_ENV = "PAGEMESH_PORT_STATE"
# The size of the range taken from below (or above) the ephemeral range.
DEFAULT_RANGE_SIZE = 10_000
_LOWEST_PORT = 1024  # below this a port is privileged
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


class PortsExhausted(OSError):
    """Every port of the range is held by something."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for `bind(0)` and outgoing connections, inclusive (Linux's
    default where it cannot be read)."""
    try:
        first, last = (int(n) for n in _EPHEMERAL_RANGE_FILE.read_text().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


def port_range(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """The inclusive range reserved ports come from: `$PAGEMESH_PORT_RANGE`, else the
    `DEFAULT_RANGE_SIZE` ports just below the ephemeral range (or just above it when
    there is no room below)."""
    env = os.environ if environ is None else environ
    if env.get(PORT_RANGE_ENV):
        try:
            first, last = (int(n) for n in env[PORT_RANGE_ENV].split("-"))
        except ValueError as exc:
            raise ValueError(
                f"{PORT_RANGE_ENV} must be FIRST-LAST, got {env[PORT_RANGE_ENV]!r}"
            ) from exc
        if not _LOWEST_PORT <= first <= last <= 65535:
            raise ValueError(
                f"{PORT_RANGE_ENV}={env[PORT_RANGE_ENV]} is not within {_LOWEST_PORT}-65535"
            )
        return first, last
    low, high = ephemeral_range()
    if low - DEFAULT_RANGE_SIZE >= _LOWEST_PORT:
        return low - DEFAULT_RANGE_SIZE, low - 1
    if high + DEFAULT_RANGE_SIZE <= 65535:
        return high + 1, high + DEFAULT_RANGE_SIZE
    return _LOWEST_PORT, max(_LOWEST_PORT, low - 1)  # a kernel that left little room


def state_file(environ: Mapping[str, str] | None = None) -> Path:
    """The counter every process of this machine (and user) advances."""
    env = os.environ if environ is None else environ
    if env.get(PORT_STATE_ENV):
        return Path(env[PORT_STATE_ENV])
    return Path(tempfile.gettempdir()) / f"pagemesh-ports-{os.getuid()}"


def bindable(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now: as servers do, with SO_REUSEADDR (a
    port whose connections linger in TIME_WAIT is free), on `host` and the wildcard."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
    for address in dict.fromkeys((host, wildcard)):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((address, port))
            except OSError:
                return False
    return True


def reserve_port(host: str = "127.0.0.1") -> int:
    """A port no other caller of this function on this machine has been given since the
    range last came round, and that nothing holds now on `host` (see the module's
    docstring). Raises PortsExhausted when every port of the range is held."""
    first, last = port_range()
    size = last - first + 1
    path = state_file()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.read(fd, 32).decode(errors="replace").strip()
        start = int(raw) if raw.isdigit() else int.from_bytes(os.urandom(2), "big")
        for step in range(size):
            port = first + (start + step) % size
            if bindable(host, port):
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                os.write(fd, str((start + step + 1) % size).encode())
                return port
        raise PortsExhausted(f"every port of {first}-{last} is in use on {host}")
    finally:
        os.close(fd)  # releases the lock


def reserve_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports, each as `reserve_port` gives them."""
    return [reserve_port(host) for _ in range(count)]
