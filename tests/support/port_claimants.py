"""A process that claims reserved ports as a service would (tests/pagemesh/test_ports.py):
kept apart from the test module so that each spawned process imports only pagemesh.runtime.ports."""

from __future__ import annotations

import multiprocessing
import socket

from pagemesh.runtime.ports import reserve_port


def serve_on_reserved_ports(
    count: int, barrier: multiprocessing.Barrier, results: multiprocessing.Queue
) -> None:
    """Waits for every other process, then reserves `count` ports and listens on each (as
    a service handed the port would), holding them until all processes have reported.
    Between two, binds port 0 as the kernel hands it out. Reports (ports, failures): the
    reserved ports, and the kernel's as negative numbers."""
    barrier.wait()
    held, bound, failures = [], [], []
    for _ in range(count):
        port = reserve_port()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
            held.append(sock)
            bound.append(port)
        except OSError as exc:
            failures.append(f"{port}: {exc}")
            sock.close()
        with socket.socket() as anonymous:
            anonymous.bind(("127.0.0.1", 0))
            bound.append(-anonymous.getsockname()[1])
    results.put((bound, failures))
    barrier.wait()  # everyone holds their ports until all have reported
    for sock in held:
        sock.close()
