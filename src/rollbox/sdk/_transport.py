"""The SDK's transport seam, in httpx's shape: the client turns each call into a :class:`Request`,
a transport answers it with a :class:`Response` once the status is known, the body still to be
read (streamed). Everything above the bytes is the client's (``_http``): auth, JSON encoding,
typed errors from error bodies, NDJSON lines, retries; so every transport behaves the same.

- ``AiohttpTransport`` (``_aiohttp``): HTTP to a server; the default.
- ``ASGITransport`` (``_asgi``): calls an ASGI app (the api's FastAPI app) in-process: no server,
  no socket; streamed answers stream.

A transport reports its own failures as typed errors, which the SDK's retries depend on:
``ServerUnreachable`` when the request certainly never reached the app, ``ConnectionLost`` when
it may have. Owns the seam's types only.
"""
from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

Body = bytes | AsyncIterable[bytes] | None


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    # The path, as sent (percent-encoded), maybe with a query: "/v1/jobs/a%20b?project=p".
    target: str
    # More query items, encoded by the transport (values already strings).
    params: Sequence[tuple[str, str]] | None = None
    headers: dict[str, str] | None = None
    body: Body = None
    # A stream or a wait: may stay silent for as long as a command runs (no read timeout).
    long: bool = False


class Response(Protocol):
    """An answer whose body is read once, by ``read`` or ``chunks``; ``aclose`` it after."""

    status: int

    async def read(self) -> bytes:
        """The whole body."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; ``ConnectionLost`` if the answer breaks off."""
        ...

    async def aclose(self) -> None:
        """Done with it; an answer not read to its end is dropped (the app sees a disconnect)."""
        ...


class BlockingTransport(Protocol):
    """Whole requests from a thread of their own, not through the client's event loop (job
    heartbeats: a training step that blocks the loop must not stop them)."""

    def handle(self, request: Request) -> tuple[int, bytes]:
        """(status, body); the typed errors of :class:`AsyncTransport`."""
        ...

    def close(self) -> None:
        ...


class AsyncTransport(Protocol):
    # Where requests go (messages, URLs other protocols derive from it: SWE-ReX's runtime).
    base_url: str

    async def handle(self, request: Request) -> Response:
        """Send ``request``; return once the answer's status is known."""
        ...

    def blocking(self, timeout_s: float) -> BlockingTransport:
        """A :class:`BlockingTransport` to the same place (one per thread)."""
        ...

    async def aclose(self) -> None:
        """Close connections (and what the transport runs); a closed transport stays closed."""
        ...
