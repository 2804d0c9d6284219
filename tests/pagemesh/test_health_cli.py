"""`pagemesh health` against a real GrpcServer: the exit status a container health check
reads (0 = SERVING, 1 = anything else) and the one line it prints on stderr."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.serving import GrpcServer, ServerConfig
from pagemesh.runtime.tls import TlsConfig
from pagemesh.tools.cli import main
from tests.support.paths import REPO_ROOT
from tests.support.tls_certs import CertFiles, make_certs

SERVICE = "pagemesh.test.Thing"
ROOT = REPO_ROOT


class ServerThread:
    """A GrpcServer on its own event loop in a thread, so the blocking CLI can dial it."""

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = ServerConfig(tls=tls or TlsConfig())
        self.server = self._call(self._make(config))
        self._call(self.server.start())

    async def _make(self, config: ServerConfig) -> GrpcServer:
        return GrpcServer(config, [SERVICE], [])

    def _call(self, coroutine):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def set_serving(self, serving: bool) -> None:
        self._call(self.server.set_serving(serving))

    def close(self) -> None:
        self._call(self.server.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(autouse=True)
def _no_pagemesh_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags read PAGEMESH_* variables; the tests set the ones they mean."""
    for name in (
        "ADDRESS",
        "SERVICE",
        "TIMEOUT_S",
        "TLS_CERT",
        "TLS_KEY",
        "TLS_CA",
        "TLS_SERVER_NAME",
    ):
        monkeypatch.delenv(f"PAGEMESH_{name}", raising=False)


@pytest.fixture
def server() -> Iterator[ServerThread]:
    thread = ServerThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(tmp_path_factory.mktemp("certs"))


def health(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["health", *args])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line, whatever happened
    return code, err.strip()


def test_serving_exits_0(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    server.set_serving(True)
    code, line = health(capsys, "--address", server.address)
    assert code == 0
    assert line == f"pagemesh health: {server.address} (server, plaintext): SERVING"
    code, line = health(capsys, "--address", server.address, "--service", SERVICE)
    assert (code, line.endswith(f"({SERVICE}, plaintext): SERVING")) == (0, True)


def test_not_serving_exits_1(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    """A GrpcServer starts NOT_SERVING and returns to it when it drains."""
    code, line = health(capsys, "--address", server.address)
    assert (code, line.endswith(": NOT_SERVING")) == (1, True)
    server.set_serving(True)
    assert health(capsys, "--address", server.address)[0] == 0
    server.set_serving(False)
    code, line = health(capsys, "--address", server.address, "--service", SERVICE)
    assert (code, line.endswith(": NOT_SERVING")) == (1, True)


def test_unknown_service_exits_1(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    server.set_serving(True)
    code, line = health(capsys, "--address", server.address, "--service", "no.Such")
    assert code == 1
    assert "unknown service name" in line


def test_nothing_listening_exits_1_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{reserve_port()}"
    code, line = health(capsys, "--address", address, "--timeout-s", "2")
    assert code == 1
    assert line.startswith(f"pagemesh health: {address} (server, plaintext): unreachable:")
    assert "refused" in line.lower()


def test_the_command_line_entry_point(server: ServerThread) -> None:
    """What Docker's HEALTHCHECK runs: a process whose exit status is the verdict."""

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pagemesh.tools.cli", "health", "--address", server.address],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    result = run()
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == [
        f"pagemesh health: {server.address} (server, plaintext): NOT_SERVING"
    ]
    server.set_serving(True)
    result = run()
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stderr


def test_mtls(
    certs: CertFiles, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = ServerThread(certs.server_tls())
    try:
        server.set_serving(True)
        tls = [
            "--tls-ca",
            str(certs.ca),
            "--tls-cert",
            str(certs.client_cert),
            "--tls-key",
            str(certs.client_key),
        ]
        code, line = health(capsys, "--address", server.address, *tls)
        assert (code, line.endswith("(server, TLS): SERVING")) == (0, True)
        # Plaintext against a TLS port: refused by the handshake, with a hint.
        code, line = health(capsys, "--address", server.address)
        assert code == 1 and "--tls-ca" in line
        # The name checked is --tls-server-name's, not the dialed host's.
        assert (
            health(capsys, "--address", server.address, *tls, "--tls-server-name", "localhost")[0]
            == 0
        )
        assert (
            health(capsys, "--address", server.address, *tls, "--tls-server-name", "router")[0] == 1
        )
        # In a container, the service's own PAGEMESH_TLS_* variables are what the check uses.
        monkeypatch.setenv("PAGEMESH_TLS_CA", str(certs.ca))
        monkeypatch.setenv("PAGEMESH_TLS_CERT", str(certs.server_cert))
        monkeypatch.setenv("PAGEMESH_TLS_KEY", str(certs.server_key))
        assert health(capsys, "--address", server.address)[0] == 0
        # A missing certificate file is a failed check, not a traceback.
        code, line = health(capsys, "--address", server.address, "--tls-ca", "/nonexistent.pem")
        assert code == 1 and "bad TLS flags" in line
    finally:
        server.close()
