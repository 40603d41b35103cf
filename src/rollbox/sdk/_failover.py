"""Several API URLs behind one transport (``_transport``'s seam): which URL a request goes to,
and which URLs are in back-off. Owns the URL list's validation, the sticky order and the
back-off clock; never retries a request that may have reached an app (``ConnectionLost``):
it raises it, marking that URL, and the client above (``_http``, ``_async``) decides whether
the request is safe to send again, which then goes to the next URL.

- ``ServerUnreachable`` from one URL (refused, connect timeout: never reached the app): the
  next URL at once, in the same call.
- A URL that failed either way is in back-off (``backoff_s``, doubling per failure in a row
  up to ``max_backoff_s``): skipped while another URL is not; tried again only once every
  other is in back-off too.
- Sticky: requests keep going to the URL that last answered, until it fails.
- Every URL unreachable: ``ServerUnreachable`` naming how many were tried.
"""
from __future__ import annotations

import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence

from rollbox import errors
from rollbox.sdk._transport import AsyncTransport, BlockingTransport, Request, Response

DEFAULT_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


def parse_urls(urls: str | Sequence[str]) -> list[str]:
    """API URLs from a comma-separated string or a list: each ``http(s)://host[:port][/path]``
    (no query, fragment or credentials), none twice; BadRequest otherwise or if none."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for raw in items:
        if not isinstance(raw, str):
            raise errors.BadRequest(f"an API URL must be a string, got {type(raw).__name__}")
        url = raw.strip()
        if not url and isinstance(urls, str):
            continue  # "a,,b" or a trailing comma
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as exc:
            raise errors.BadRequest(f"malformed API URL {url[:200]!r}: {exc}") from None
        if (parts.scheme not in ("http", "https") or not parts.hostname or parts.query
                or parts.fragment or parts.username is not None or any(c.isspace() for c in url)):
            raise errors.BadRequest(
                f"malformed API URL {url[:200]!r}: want http(s)://host[:port][/path]")
        if url.rstrip("/") in (u.rstrip("/") for u in out):
            raise errors.BadRequest(f"API URL {url[:200]!r} is listed twice")
        out.append(url)
    if not out:
        raise errors.BadRequest("no API URL given (an empty list)")
    return out


class _Place:
    def __init__(self, transport: AsyncTransport) -> None:
        self.transport = transport
        self.failures = 0  # in a row
        self.dead_until = 0.0


class FailoverTransport:
    """An :class:`AsyncTransport` over one transport per URL (``transports``, in the order
    given). The client closes it; it closes them all."""

    def __init__(self, transports: Sequence[AsyncTransport], *,
                 backoff_s: float = DEFAULT_BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not transports:
            raise errors.BadRequest("no API URL given (an empty list)")
        if not backoff_s > 0 or not max_backoff_s >= backoff_s:
            raise errors.BadRequest(
                f"url back-off must be > 0 and at most its maximum, got {backoff_s!r}, "
                f"{max_backoff_s!r}")
        self.places = [_Place(t) for t in transports]
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.current = 0  # index of the URL requests go to first (sticky)

    @property
    def base_url(self) -> str:
        """The URL requests go to now."""
        return self.places[self.current].transport.base_url

    @property
    def urls(self) -> list[str]:
        return [p.transport.base_url for p in self.places]

    def order(self) -> list[int]:
        """Where the next request is tried, in turn: the current URL, then the others in list
        order after it, those in back-off last (soonest out of it first)."""
        n = len(self.places)
        now = self.clock()
        ring = [(self.current + i) % n for i in range(n)]
        ready = [i for i in ring if self.places[i].dead_until <= now]
        resting = sorted((i for i in ring if self.places[i].dead_until > now),
                         key=lambda i: self.places[i].dead_until)
        return ready + resting

    def failed(self, i: int) -> None:
        """URL ``i`` did not answer (or broke off): in back-off; the current URL moves on."""
        place = self.places[i]
        place.failures += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (place.failures - 1))
        place.dead_until = self.clock() + delay
        if i == self.current:
            self.current = self.order()[0]

    def answered(self, i: int) -> None:
        place = self.places[i]
        place.failures = 0
        place.dead_until = 0.0
        self.current = i

    async def handle(self, request: Request) -> Response:
        tried: list[str] = []
        last: errors.ServerUnreachable | None = None
        for i in self.order():
            place = self.places[i]
            tried.append(place.transport.base_url)
            try:
                resp = await place.transport.handle(request)
            except errors.ServerUnreachable as exc:
                self.failed(i)
                last = exc
                continue
            except errors.ConnectionLost:
                self.failed(i)
                raise
            self.answered(i)
            return _Watched(resp, self, i)
        assert last is not None
        if len(self.places) == 1:
            raise last
        raise errors.ServerUnreachable(
            f"{request.method} {request.target}: none of the {len(tried)} API URLs tried "
            f"answered ({', '.join(tried)}); last: {last.message}",
            tried=len(tried), urls=tried)

    def blocking(self, timeout_s: float) -> BlockingFailover:
        return BlockingFailover([p.transport.blocking(timeout_s) for p in self.places],
                                self.current)

    async def aclose(self) -> None:
        for place in self.places:
            await place.transport.aclose()


class _Watched:
    """A :class:`Response` whose breaking off puts its URL in back-off."""

    def __init__(self, resp: Response, pool: FailoverTransport, i: int) -> None:
        self.resp = resp
        self.status = resp.status
        self._pool = pool
        self._i = i

    async def read(self) -> bytes:
        try:
            return await self.resp.read()
        except errors.ConnectionLost:
            self._pool.failed(self._i)
            raise

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.resp.chunks():
                yield chunk
        except errors.ConnectionLost:
            self._pool.failed(self._i)
            raise

    async def aclose(self) -> None:
        await self.resp.aclose()


class BlockingFailover:
    """The blocking face (job heartbeats, a thread of their own): the next URL on
    ``ServerUnreachable``, sticky on the one that answered; its own order, no back-off (a
    heartbeat every few seconds pays at most the refused connects)."""

    def __init__(self, channels: Sequence[BlockingTransport], current: int) -> None:
        self.channels = list(channels)
        self.current = current

    def handle(self, request: Request) -> tuple[int, bytes]:
        n = len(self.channels)
        last: errors.ServerUnreachable | None = None
        for k in range(n):
            i = (self.current + k) % n
            try:
                answer = self.channels[i].handle(request)
            except errors.ServerUnreachable as exc:
                last = exc
                continue
            except errors.ConnectionLost:
                self.current = (i + 1) % n
                raise
            self.current = i
            return answer
        assert last is not None
        if n == 1:
            raise last
        raise errors.ServerUnreachable(
            f"{request.method} {request.target}: none of the {n} API URLs tried answered; "
            f"last: {last.message}", tried=n)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
