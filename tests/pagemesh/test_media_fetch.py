"""pagemesh.runtime.media: http(s) image URLs fetched only from allowed hosts, against a real
aiohttp
server on 127.0.0.1 (no other traffic): the allowlist, redirects checked hop by hop, the
size limit with and without Content-Length, the total timeout, statuses and content types.
Every failure must be an ImageError whose message names what to fix."""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from PIL import Image

from pagemesh.runtime.images import ImageError, load_image
from pagemesh.runtime.media import MediaFetcher

LIMIT = 1000  # max_bytes of the fetchers below
SLOW_S = 5.0  # how long the slow handlers would take; the fetchers give up after 0.3 s


def png_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 30, 40)).save(out, format="PNG")
    return out.getvalue()


PNG = png_bytes()
assert len(PNG) < LIMIT


def make_app(seen: list[web.Request]) -> web.Application:
    routes = web.RouteTableDef()

    @web.middleware
    async def record(request: web.Request, handler):  # type: ignore[no-untyped-def]
        seen.append(request)
        return await handler(request)

    @routes.get("/image.png")
    async def image(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    @routes.get("/octet")
    async def octet(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="application/octet-stream")

    @routes.get("/big")
    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (LIMIT + 1), content_type="image/png")

    @routes.get("/claims-huge")  # says 10 GB, sends 10 bytes, then stalls: read it and time out
    async def claims_huge(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.content_length = 10**10
        await response.prepare(request)
        await response.write(b"0123456789")
        await asyncio.sleep(SLOW_S)
        return response

    @routes.get("/chunked")  # no Content-Length, and never ends unless the client hangs up
    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(10_000):
            await response.write(b"y" * 300)
            await asyncio.sleep(0.001)
        return response

    @routes.get("/chunked-small")
    async def chunked_small(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(PNG), 50):
            await response.write(PNG[start : start + 50])
        await response.write_eof()
        return response

    @routes.get("/hops/{n}")  # n redirects (relative, absolute, ...), then the image
    async def hops(request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        if n == 0:
            return web.Response(body=PNG, content_type="image/png")
        target = f"/hops/{n - 1}" if n % 2 else f"http://127.0.0.1:{request.url.port}/hops/{n - 1}"
        raise web.HTTPFound(target)

    @routes.get("/to-localhost")
    async def to_localhost(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://localhost:{request.url.port}/image.png")

    @routes.get("/to-credentials")
    async def to_credentials(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://user:hunter2@127.0.0.1:{request.url.port}/image.png")

    @routes.get("/to-ftp")
    async def to_ftp(request: web.Request) -> web.Response:
        raise web.HTTPFound("ftp://127.0.0.1/image.png")

    @routes.get("/loop")
    async def loop(request: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    @routes.get("/slow")
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(SLOW_S)
        return web.Response(body=PNG, content_type="image/png")

    @routes.get("/slow-hops/{n}")  # each hop quick alone (0.15 s), too slow together
    async def slow_hops(request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        await asyncio.sleep(0.15)
        raise web.HTTPFound(f"/slow-hops/{n - 1}" if n else "/image.png")

    @routes.get("/page.html")
    async def page(request: web.Request) -> web.Response:
        return web.Response(text="<html>an image</html>", content_type="text/html")

    @routes.get("/cookie")
    async def cookie(request: web.Request) -> web.Response:
        response = web.HTTPFound("/needs-no-cookie")
        response.set_cookie("session", "secret")
        raise response

    @routes.get("/needs-no-cookie")
    async def needs_no_cookie(request: web.Request) -> web.Response:
        if "Cookie" in request.headers:
            return web.Response(status=400, text="a cookie was sent")
        return web.Response(body=PNG, content_type="image/png")

    app = web.Application(middlewares=[record])
    app.add_routes(routes)
    return app


async def raw_server(answer: bytes) -> asyncio.AbstractServer:
    """A TCP server that reads the request head, writes `answer` and closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@contextlib.asynccontextmanager
async def served(seen: list[web.Request] | None = None) -> AsyncIterator[str]:
    """The test app on 127.0.0.1, a free port; yields its base URL."""
    # handler_cancellation: a handler whose client hung up (the slow ones) stops at once.
    runner = web.AppRunner(
        make_app([] if seen is None else seen), handler_cancellation=True, shutdown_timeout=0.5
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, shutdown_timeout=0.5)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def run(scenario: Callable[[str, MediaFetcher], Awaitable[None]], **kwargs: object) -> None:
    """`scenario(base_url, fetcher)` against the test app, the fetcher allowing 127.0.0.1."""

    async def body() -> None:
        fetcher = MediaFetcher(
            **{"allowed_domains": ["127.0.0.1"], "max_bytes": LIMIT, "timeout_s": 2.0, **kwargs}
        )  # type: ignore[arg-type]
        async with served() as base:
            try:
                await scenario(base, fetcher)
            finally:
                await fetcher.close()

    asyncio.run(body())


async def refused(fetcher: MediaFetcher, url: str) -> str:
    with pytest.raises(ImageError) as caught:
        await fetcher.fetch(url)
    return str(caught.value)


# check_url: no I/O


def test_remote_urls_are_off_by_default() -> None:
    fetcher = MediaFetcher()
    assert not fetcher.enabled
    with pytest.raises(ImageError) as caught:
        fetcher.check_url("https://images.example.com/cat.png")
    message = str(caught.value)
    assert "remote image URLs are off" in message and "'images.example.com'" in message
    assert "--allowed-media-domains images.example.com" in message and "data:" in message
    assert not MediaFetcher(["", " ", ","]).enabled


def test_only_listed_hosts_exactly_case_insensitively() -> None:
    fetcher = MediaFetcher(["Images.Example.COM", " cdn.example.org. "])
    assert fetcher.enabled
    fetcher.check_url("https://IMAGES.example.com/cat.png")
    fetcher.check_url("http://images.example.com:8080/cat.png?size=2")  # any port
    fetcher.check_url("https://images.example.com./cat.png")  # the trailing dot of an FQDN
    fetcher.check_url("https://cdn.example.org/cat.png")
    for host in (
        "example.com",
        "img.images.example.com",
        "images.example.com.evil.net",
        "evilimages.example.com",
    ):
        with pytest.raises(ImageError) as caught:
            fetcher.check_url(f"https://{host}/cat.png")
        message = str(caught.value)
        assert f"{host!r} is not allowed" in message and "--allowed-media-domains" in message
        assert "images.example.com" in message  # what is allowed


def test_allowed_domains_forms() -> None:
    assert MediaFetcher(["a.example.com,b.example.com", "c.example.com"]).allowed_domains == {
        "a.example.com",
        "b.example.com",
        "c.example.com",
    }
    assert MediaFetcher("a.example.com b.example.com").allowed_domains == {
        "a.example.com",
        "b.example.com",
    }  # one string is a list, not its characters
    assert MediaFetcher(["Bücher.example"]).allowed_domains == {"xn--bcher-kva.example"}
    MediaFetcher(["Bücher.example"]).check_url("http://bücher.example/x.png")
    MediaFetcher(["[::1]"]).check_url("http://[::1]:8000/x.png")
    for entry in ("https://example.com", "example.com:443", "example.com/images"):
        with pytest.raises(ValueError, match="without scheme, port or path"):
            MediaFetcher([entry])
    with pytest.raises(ValueError, match="wildcards"):
        MediaFetcher(["*.example.com"])
    with pytest.raises(ValueError, match="max_bytes"):
        MediaFetcher(["example.com"], max_bytes=0)


def test_urls_refused_before_any_io() -> None:
    fetcher = MediaFetcher(["example.com"])
    cases = {
        "ftp://example.com/cat.png": "is not http:// or https://",
        "file:///etc/passwd": "is not http:// or https://",
        "example.com/cat.png": "is not http:// or https://",
        "http:///cat.png": "has no host name",
        "http://example.com:port/cat.png": "not a valid URL",
    }
    for url, expected in cases.items():
        with pytest.raises(ImageError, match=expected):
            fetcher.check_url(url)
    for url in ("https://user:hunter2@example.com/cat.png", "https://user@example.com/c.png"):
        with pytest.raises(ImageError) as caught:
            fetcher.check_url(url)
        message = str(caught.value)
        assert "credentials" in message and "example.com" in message
        assert "hunter2" not in message and "user" not in message.split("credentials")[0]
    with pytest.raises(ImageError) as caught:  # messages never repeat a password
        fetcher.check_url("ftp://user:hunter2@example.com/cat.png")
    assert "'ftp://example.com/cat.png' is not http:// or https://" in str(caught.value)


# fetch, against the test server


def test_fetches_an_allowed_image_with_no_cookies_and_its_user_agent() -> None:
    seen: list[web.Request] = []

    async def body() -> None:
        # By host name: aiohttp's cookie jar would ignore a cookie from an IP address.
        by_name = MediaFetcher(["localhost"], max_bytes=LIMIT)
        async with served(seen) as base:
            try:
                assert await fetcher.fetch(f"{base}/image.png") == PNG
                assert await fetcher.fetch(f"{base}/octet") == PNG  # octet-stream is accepted
                assert await fetcher.fetch(f"{base}/chunked-small") == PNG
                local = base.replace("127.0.0.1", "localhost")
                assert await by_name.fetch(f"{local}/cookie") == PNG  # its cookie not sent back
                assert await by_name.fetch(f"{local}/needs-no-cookie") == PNG  # nor later
                await fetcher.close()
                await fetcher.close()  # twice is fine
                assert await fetcher.fetch(f"{base}/image.png") == PNG  # a new session
            finally:
                await fetcher.close()
                await by_name.close()

    fetcher = MediaFetcher(["127.0.0.1"], max_bytes=LIMIT)  # built before any loop runs
    asyncio.run(body())
    assert load_image(PNG).size == (8, 6)
    assert {request.headers["User-Agent"] for request in seen} == {"pagemesh"}
    assert not any("Cookie" in request.headers for request in seen)


def test_a_response_without_content_type_is_accepted() -> None:
    async def body() -> None:
        server = await raw_server(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(PNG) + PNG
        )
        port = server.sockets[0].getsockname()[1]
        fetcher = MediaFetcher(["127.0.0.1"], max_bytes=LIMIT)
        try:
            assert await fetcher.fetch(f"http://127.0.0.1:{port}/x") == PNG
        finally:
            await fetcher.close()
            server.close()
            await server.wait_closed()

    asyncio.run(body())


def test_redirects_are_followed_up_to_the_limit_each_hop_checked() -> None:
    async def scenario(base: str, fetcher: MediaFetcher) -> None:
        assert await fetcher.fetch(f"{base}/hops/3") == PNG  # 3 redirects: the limit
        message = await refused(fetcher, f"{base}/hops/4")
        assert "more than 3 times" in message
        message = await refused(fetcher, f"{base}/loop")
        assert "more than 3 times" in message and "/loop" in message

    run(scenario)


def test_a_redirect_to_a_host_not_allowed_is_refused() -> None:
    async def scenario(base: str, fetcher: MediaFetcher) -> None:
        message = await refused(fetcher, f"{base}/to-localhost")
        assert f"{base}/to-localhost redirected to http://localhost:" in message
        assert "'localhost' is not allowed" in message and "--allowed-media-domains" in message
        message = await refused(fetcher, f"{base}/to-credentials")
        assert "credentials" in message and "hunter2" not in message
        message = await refused(fetcher, f"{base}/to-ftp")
        assert "ftp://127.0.0.1/image.png" in message and "is not http:// or https://" in message

    run(scenario)


def test_a_status_other_than_2xx_is_refused() -> None:
    async def scenario(base: str, fetcher: MediaFetcher) -> None:
        message = await refused(fetcher, f"{base}/missing.png")
        assert "HTTP status 404" in message and f"{base}/missing.png" in message

    run(scenario)


def test_a_body_that_is_not_an_image_is_refused() -> None:
    async def scenario(base: str, fetcher: MediaFetcher) -> None:
        message = await refused(fetcher, f"{base}/page.html")
        assert "'text/html', not an image" in message and f"{base}/page.html" in message

    run(scenario)


def test_a_content_length_over_the_limit_is_refused_before_the_body() -> None:
    async def scenario(base: str, fetcher: MediaFetcher) -> None:
        message = await refused(fetcher, f"{base}/big")
        assert f"is {LIMIT + 1} bytes, over the limit of {LIMIT} bytes" in message
        started = time.monotonic()
        message = await refused(fetcher, f"{base}/claims-huge")  # reading it would stall
        assert f"is {10**10} bytes, over the limit of {LIMIT} bytes" in message
        assert time.monotonic() - started < 1.0

    run(scenario)


def test_a_streamed_body_stops_at_the_limit() -> None:
    async def scenario(base: str, fetcher: MediaFetcher) -> None:
        started = time.monotonic()
        message = await refused(fetcher, f"{base}/chunked")  # endless unless cut
        assert f"over the limit of {LIMIT} bytes" in message and "/chunked" in message
        assert time.monotonic() - started < 1.0

    run(scenario)


def test_the_timeout_covers_the_whole_fetch() -> None:
    async def scenario(base: str, fetcher: MediaFetcher) -> None:
        for path in ("/slow", "/slow-hops/2"):  # one slow answer; three quick hops, in total
            started = time.monotonic()
            message = await refused(fetcher, f"{base}{path}")
            assert "took over 0.3 s" in message and path in message
            assert time.monotonic() - started < 1.0

    run(scenario, timeout_s=0.3)


def test_connection_failures_are_image_errors() -> None:
    async def body() -> None:
        fetcher = MediaFetcher(["127.0.0.1"], max_bytes=LIMIT, timeout_s=2.0)
        hangs_up = await raw_server(b"")
        with socket.socket() as unlistened:  # bound, not listening: connections refused
            unlistened.bind(("127.0.0.1", 0))
            try:
                port = unlistened.getsockname()[1]
                message = await refused(fetcher, f"http://127.0.0.1:{port}/x.png")
                assert f"could not fetch the image http://127.0.0.1:{port}/x.png" in message
                port = hangs_up.sockets[0].getsockname()[1]
                message = await refused(fetcher, f"http://127.0.0.1:{port}/x.png")
                assert "could not fetch the image" in message
                assert "ServerDisconnectedError" in message
                garbage = await raw_server(b"NOT HTTP AT ALL\r\n\r\n")
                port = garbage.sockets[0].getsockname()[1]
                message = await refused(fetcher, f"http://127.0.0.1:{port}/x.png")
                assert "could not fetch the image" in message
                garbage.close()
            finally:
                await fetcher.close()
                hangs_up.close()

    asyncio.run(body())
