"""Test certificates made with the `openssl` command: a CA, a server certificate for
127.0.0.1 and localhost, and a client certificate, all signed by the CA."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagemesh.runtime.tls import TlsConfig


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_tls(self) -> TlsConfig:
        """What every service runs with: serve mTLS, dial with the same certificate."""
        return TlsConfig(str(self.server_cert), str(self.server_key), str(self.ca))

    def client_tls(self) -> TlsConfig:
        return TlsConfig(str(self.client_cert), str(self.client_key), str(self.ca))


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(folder: Path) -> CertFiles:
    if shutil.which("openssl") is None:
        pytest.skip("the `openssl` command is needed to make test certificates")
    folder.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=pagemesh-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=folder,
    )
    (folder / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN=pagemesh-test-{name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=folder,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.pem",
            cwd=folder,
        )
    return CertFiles(
        folder / "ca.pem",
        folder / "server.pem",
        folder / "server.key",
        folder / "client.pem",
        folder / "client.key",
    )
