"""Images of requests given by http(s) URL, fetched only from host names the operator allows.

Remote image URLs are off unless the router is started with `--allowed-media-domains`
(as vLLM's flag): a URL is fetched only when its host name is one of those listed, compared
exactly and case-insensitively (a trailing dot ignored), whatever the port. No wildcards, no
subdomains: allowing `example.com` does not allow `img.example.com`. Only http and https, and
no credentials (`user:pass@host`).

`MediaFetcher.fetch` follows up to `max_redirects` redirects itself, checking each hop's
Location like the first URL, so an allowed host cannot bounce the router to one that is not.
It refuses what would cost too much before paying for it: a Content-Length over `max_bytes`
before reading the body, a body without one once it grows past `max_bytes`, a fetch (all hops
together) over `timeout_s`. A Content-Type that is present must be image/* or
application/octet-stream; `images.load_image` checks the bytes later. No cookies are kept or
sent. Every failure is an ImageError.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from pagemesh.runtime.images import MIB, ImageError, parse_data_url

FLAG = "--allowed-media-domains"
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class RemoteImage:
    """An image a request gives by http(s) URL: fetched by the router (`MediaFetcher`)
    before the request is checked and scheduled."""

    url: str


def image_from_url(url: str, max_bytes: int | None = None) -> bytes | RemoteImage:
    """An `image_url` part's image: a data: URL's bytes, or an http(s) URL to fetch."""
    if url.startswith(("http://", "https://")):
        return RemoteImage(url)
    return parse_data_url(url, max_bytes)


class MediaFetcher:
    """Fetches image URLs from `allowed_domains` only; the aiohttp session is opened on the
    first fetch, so this may be built outside an event loop. `close` closes it."""

    def __init__(
        self,
        allowed_domains: Iterable[str] = (),
        max_bytes: int = 20 * MIB,
        timeout_s: float = 10.0,
        max_redirects: int = 3,
    ) -> None:
        if max_bytes <= 0 or timeout_s <= 0 or max_redirects < 0:
            raise ValueError(
                f"MediaFetcher needs max_bytes > 0, timeout_s > 0 and "
                f"max_redirects >= 0, got {max_bytes}, {timeout_s}, {max_redirects}"
            )
        # One string, or each entry, may list several names separated by commas or spaces.
        entries = [allowed_domains] if isinstance(allowed_domains, str) else allowed_domains
        names = [name for entry in entries for name in entry.replace(",", " ").split()]
        self.allowed_domains = frozenset(map(_domain, names)) - {""}
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects
        self._session: aiohttp.ClientSession | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_domains)

    def check_url(self, url: str) -> None:
        """Raise ImageError unless `url` may be fetched. No I/O."""
        self._checked(url)

    def _checked(self, url: str) -> URL:
        try:
            parsed = URL(url)
        except (ValueError, TypeError) as error:
            raise ImageError(f"the image URL {url!r} is not a valid URL ({error})") from error
        if parsed.scheme not in ("http", "https"):
            raise ImageError(
                f"the image URL {_shown(parsed)!r} is not http:// or https://; "
                "send one that is, or the image inline as a data: URL"
            )
        if not parsed.raw_host:
            raise ImageError(f"the image URL {url!r} has no host name")
        if parsed.user is not None or parsed.password is not None:
            raise ImageError(
                f"the image URL {_shown(parsed)!r} carries "
                "credentials (user:password@), which are not supported; remove them"
            )
        host = parsed.raw_host.rstrip(".")
        if not self.allowed_domains:
            raise ImageError(
                f"remote image URLs are off, so {host!r} cannot be fetched: start "
                f"the router with {FLAG} {host} to allow that host, or send the "
                "image inline as a data:image/png;base64,<base64 bytes> URL"
            )
        if host not in self.allowed_domains:
            raise ImageError(
                f"the image URL's host {host!r} is not allowed (allowed: "
                f"{', '.join(sorted(self.allowed_domains))}); add it with {FLAG}, "
                "or send the image inline as a data: URL"
            )
        return parsed

    async def fetch(self, url: str) -> bytes:
        """The body of `url`, after `check_url`; each redirect's target is checked too."""
        current = self._checked(url)
        try:
            return await asyncio.wait_for(self._follow(current), self.timeout_s)
        except ImageError:
            raise
        except asyncio.TimeoutError as error:  # the builtin TimeoutError from Python 3.11 on
            raise ImageError(
                f"fetching the image {url} took over {self.timeout_s} s; use a "
                "faster host or send the image as a data: URL"
            ) from error
        except (aiohttp.ClientError, HttpProcessingError, OSError, ValueError) as error:
            raise ImageError(
                f"could not fetch the image {url}: {type(error).__name__}: {error}"
            ) from error

    async def _follow(self, url: URL) -> bytes:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None),
                headers={
                    "User-Agent": "pagemesh",
                    "Accept": "image/*",
                    "Accept-Encoding": "identity",
                },
            )
        for _ in range(self.max_redirects + 1):
            async with self._session.get(url, allow_redirects=False) as response:
                location = response.headers.get("Location")
                if response.status in REDIRECT_STATUSES and location:
                    url = self._redirect(url, location)
                    continue
                return await self._body(url, response)
        raise ImageError(
            f"the image URL redirected more than {self.max_redirects} times "
            f"(next to {url}); give the image's final URL"
        )

    def _redirect(self, url: URL, location: str) -> URL:
        """The redirect's target, resolved against `url`, if it may be fetched."""
        try:
            target = url.join(URL(location))
        except ValueError as error:
            raise ImageError(f"{url} redirected to {location!r}, not a valid URL") from error
        try:
            return self._checked(str(target))
        except ImageError as error:
            raise ImageError(
                f"{url} redirected to {_shown(target)}, which is refused: {error}"
            ) from None

    async def _body(self, url: URL, response: aiohttp.ClientResponse) -> bytes:
        if not 200 <= response.status < 300:
            raise ImageError(
                f"fetching the image {url} failed with HTTP status "
                f"{response.status} {response.reason or ''}".rstrip()
            )
        # aiohttp reads an absent Content-Type as application/octet-stream.
        if not (
            response.content_type.startswith("image/")
            or response.content_type == "application/octet-stream"
        ):
            raise ImageError(
                f"{url} is of type {response.content_type!r}, not an image; "
                "give the URL of the image file itself"
            )
        if response.content_length is not None and response.content_length > self.max_bytes:
            raise ImageError(
                f"the image at {url} is {response.content_length} bytes, over the "
                f"limit of {self.max_bytes} bytes; send a smaller image"
            )
        body = bytearray()
        while len(body) <= self.max_bytes:
            chunk = await response.content.read(min(CHUNK_BYTES, self.max_bytes + 1 - len(body)))
            if not chunk:
                return bytes(body)
            body += chunk
        raise ImageError(
            f"the image at {url} is over the limit of {self.max_bytes} bytes; send a smaller image"
        )

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def _domain(name: str) -> str:
    """One `--allowed-media-domains` entry as compared: IDNA-encoded, lower case."""
    bare = name.strip().strip("[]").rstrip(".")
    if "*" in bare:
        raise ValueError(f"{FLAG} does not take wildcards ({name!r}): list each host name")
    try:
        host = URL.build(scheme="http", host=bare).raw_host
    except ValueError as error:
        raise ValueError(
            f"{FLAG} takes host names such as images.example.com, without "
            f"scheme, port or path; got {name!r}"
        ) from error
    return (host or "").lower()


def _shown(url: URL) -> str:
    """`url` without its credentials, for messages."""
    has_credentials = url.user is not None or url.password is not None
    return str(url.with_user(None)) if url.raw_host and has_credentials else str(url)
