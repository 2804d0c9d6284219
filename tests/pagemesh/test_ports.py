"""pagemesh.runtime.ports: ports chosen in advance are never handed out twice, by any process of the
machine, and never collide with what the kernel hands out for port 0; a service that cannot
bind says why in one line and exits without a traceback."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagemesh.runtime import ports
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.testing.tiny_models import write_tiny_model
from tests.support.paths import REPO_ROOT
from tests.support.port_claimants import serve_on_reserved_ports

NUM_PROCESSES = 6
NUM_ROUNDS = 5
SERVICES_PER_PROCESS = 8


def test_concurrent_services_never_share_a_reserved_port() -> None:
    """NUM_PROCESSES processes start SERVICES_PER_PROCESS listeners each, at once, over
    NUM_ROUNDS rounds: every bind succeeds and no port is handed out twice in a run."""
    context = multiprocessing.get_context("spawn")
    first, last = ports.port_range()
    low, high = ports.ephemeral_range()
    assert last < low or first > high, "reserved ports must lie outside the ephemeral range"
    seen: set[int] = set()
    for _ in range(NUM_ROUNDS):
        barrier, results = context.Barrier(NUM_PROCESSES), context.Queue()
        workers = [
            context.Process(
                target=serve_on_reserved_ports, args=(SERVICES_PER_PROCESS, barrier, results)
            )
            for _ in range(NUM_PROCESSES)
        ]
        for worker in workers:
            worker.start()
        reports = [results.get(timeout=60) for _ in workers]
        for worker in workers:
            worker.join(timeout=60)
            assert worker.exitcode == 0
        reserved = [port for bound, _ in reports for port in bound if port > 0]
        anonymous = {-port for bound, _ in reports for port in bound if port < 0}
        assert not anonymous & set(reserved), "bind(0) was handed a reserved port"
        failures = [failure for _, failed in reports for failure in failed]
        assert failures == []
        assert len(reserved) == NUM_PROCESSES * SERVICES_PER_PROCESS
        assert all(first <= port <= last for port in reserved)
        assert not seen & set(reserved), "a port was handed out again within the run"
        assert len(set(reserved)) == len(reserved), "two services were given one port"
        seen |= set(reserved)


def test_a_held_port_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port something already listens on is never handed out, and the sequence wraps
    round its range."""
    held, base = _three_free_ports()  # `base` held; base + 1 and base + 2 free just now
    monkeypatch.setenv(ports.PORT_RANGE_ENV, f"{base}-{base + 2}")
    monkeypatch.setenv(ports.PORT_STATE_ENV, str(tmp_path / "counter"))
    (tmp_path / "counter").write_text("0")
    with held:
        assert [reserve_port() for _ in range(4)] == [base + 1, base + 2, base + 1, base + 2]


def _three_free_ports() -> tuple[socket.socket, int]:
    """A listening socket on port `base`, and `base`; base + 1 and base + 2 were bound too
    and released just now, so that they are free (an ephemeral port found by bind(0) says
    nothing of its neighbours, which other processes' connections may hold)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        sockets = []
        try:
            for port in (base, base + 1, base + 2):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            for sock in sockets:
                sock.close()
            continue
        sockets[0].listen()
        for sock in sockets[1:]:
            sock.close()
        return sockets[0], base
    raise AssertionError("no three consecutive free ports found")


def test_port_range_setting_is_checked() -> None:
    assert ports.port_range({ports.PORT_RANGE_ENV: "20000-20009"}) == (20000, 20009)
    for bad in ("20000", "x-y", "80-90", "30000-20000", "60000-70000"):
        with pytest.raises(ValueError, match=ports.PORT_RANGE_ENV):
            ports.port_range({ports.PORT_RANGE_ENV: bad})


def test_a_service_that_cannot_bind_says_why_in_one_line(tmp_path: Path, redis_url: str) -> None:
    """The router with its metrics port taken: exit status 1, one `fatal:` line naming the
    address, and nothing after it (no traceback from a grpc.aio server left running when
    its event loop closed)."""
    model = write_tiny_model(tmp_path / "tiny", "llama", seed=1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "router.main",
                "--model",
                str(model),
                "--port",
                "0",
                "--http-port",
                "0",
                "--metrics-port",
                str(port),
                "--redis-url",
                redis_url,
                "--cluster",
                "ports-test",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
        )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr[-3000:]
    assert "fatal:" in lines[-1] and f"'127.0.0.1', {port}" in lines[-1], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr
