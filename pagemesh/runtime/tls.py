"""TLS between services and towards clients: the one place that makes credentials and channels.

A server with a certificate and key serves TLS; with a CA as well it requires client
certificates signed by that CA (mutual TLS). The CA that verifies clients can be another one
(--tls-client-ca), or none (`--tls-client-ca none`: a router serving public TLS to clients
without certificates while it dials its schedulers with mTLS). A client dials with TLS when
it has a CA (--tls-ca), and presents its own certificate and key when it has them; without
a CA it dials in plaintext.
gRPC checks the server name against the certificate's SANs, so a certificate must name every
host (or IP address) that others dial.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pagemesh.runtime.internal_auth import client_interceptors

ChannelOptions = Sequence[tuple[str, Any]]


NO_CLIENT_CERTS = "none"  # --tls-client-ca none: serve TLS without asking for client certificates


@dataclass(frozen=True)
class TlsConfig:
    cert_path: str | None = None  # PEM certificate chain this process presents
    key_path: str | None = None  # PEM private key of cert_path
    ca_path: str | None = None  # PEM CA the servers this process dials must chain to
    # PEM CA that clients' certificates must chain to (mTLS); None = ca_path (one CA for
    # both ways), NO_CLIENT_CERTS = none asked for (public TLS, while dialing with mTLS).
    client_ca_path: str | None = None
    # The mesh's internal token (pagemesh/runtime/internal_auth.py), sent on every call this
    # process makes to a scheduler or worker; None = none. Never in repr (logs).
    internal_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_path is None) != (self.key_path is None):
            raise ValueError("--tls-cert and --tls-key go together: set both or neither")
        client_ca = None if self.client_ca_path == NO_CLIENT_CERTS else self.client_ca_path
        for flag, path in (
            ("--tls-cert", self.cert_path),
            ("--tls-key", self.key_path),
            ("--tls-ca", self.ca_path),
            ("--tls-client-ca", client_ca),
        ):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")

    @property
    def serves_tls(self) -> bool:
        return self.cert_path is not None

    @property
    def dials_tls(self) -> bool:
        return self.ca_path is not None

    @property
    def verifying_ca(self) -> str | None:
        """The CA clients' certificates are verified against; None = none asked for."""
        if self.client_ca_path == NO_CLIENT_CERTS:
            return None
        return self.client_ca_path or self.ca_path

    @property
    def requires_client_cert(self) -> bool:
        return self.serves_tls and self.verifying_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None = serve plaintext."""
        if not self.serves_tls:
            return None
        ca = self.verifying_ca
        return grpc.ssl_server_credentials(
            [(_read(self.key_path), _read(self.cert_path))],
            root_certificates=_read(ca) if ca else None,
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
        """A channel to `address`; calls on it carry the internal token, when there is one."""
        credentials = self.channel_credentials()
        interceptors = client_interceptors(self.internal_token)
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(
            address, credentials, options=options, interceptors=interceptors
        )

    def flags(self) -> list[str]:
        """The command-line flags that give a child process this config (not the token:
        a secret travels in the environment)."""
        pairs = (
            ("--tls-cert", self.cert_path),
            ("--tls-key", self.key_path),
            ("--tls-ca", self.ca_path),
            ("--tls-client-ca", self.client_ca_path),
        )
        return [arg for flag, path in pairs if path is not None for arg in (flag, path)]


def _read(path: str | None) -> bytes:
    assert path is not None
    return Path(path).read_bytes()
