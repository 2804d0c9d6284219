"""TLS between services and towards clients: the one place that makes credentials and channels.

A server with a certificate and key serves TLS; with a CA as well it requires client
certificates signed by that CA (mutual TLS). A client dials with TLS when it has a CA, and
presents its own certificate and key when it has them; without a CA it dials in plaintext.
gRPC checks the server name against the certificate's SANs, so a certificate must name every
host (or IP address) that others dial.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

ChannelOptions = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class TlsConfig:
    cert_path: str | None = None  # PEM certificate chain this process presents
    key_path: str | None = None  # PEM private key of cert_path
    ca_path: str | None = None  # PEM CA that peers' certificates must chain to

    def __post_init__(self) -> None:
        if (self.cert_path is None) != (self.key_path is None):
            raise ValueError("--tls-cert and --tls-key go together: set both or neither")
        for flag, path in (("--tls-cert", self.cert_path), ("--tls-key", self.key_path),
                           ("--tls-ca", self.ca_path)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")

    @property
    def serves_tls(self) -> bool:
        return self.cert_path is not None

    @property
    def dials_tls(self) -> bool:
        return self.ca_path is not None

    @property
    def requires_client_cert(self) -> bool:
        return self.serves_tls and self.ca_path is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None = serve plaintext."""
        if not self.serves_tls:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.key_path), _read(self.cert_path))],
            root_certificates=_read(self.ca_path) if self.ca_path else None,
            require_client_auth=self.requires_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None = dial plaintext."""
        if not self.dials_tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_path),
            private_key=_read(self.key_path) if self.key_path else None,
            certificate_chain=_read(self.cert_path) if self.cert_path else None,
        )

    def channel(self, address: str, options: ChannelOptions | None = None) -> grpc.Channel:
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, credentials, options=options)

    def aio_channel(self, address: str, options: ChannelOptions | None = None) -> grpc.aio.Channel:
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, credentials, options=options)

    def flags(self) -> list[str]:
        """The command-line flags that give a child process this config."""
        pairs = (("--tls-cert", self.cert_path), ("--tls-key", self.key_path),
                 ("--tls-ca", self.ca_path))
        return [arg for flag, path in pairs if path is not None for arg in (flag, path)]


def _read(path: str | None) -> bytes:
    assert path is not None
    return Path(path).read_bytes()
