"""What every SDK call does over its transport (``_transport``): the API key, JSON bodies and
query values encoded as httpx did, typed errors from error answers, NDJSON lines. The same for
every transport; owns no connection.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rollbox import errors
from rollbox.sdk._transport import AsyncTransport, Request, Response

Params = Mapping[str, Any] | Iterable[tuple[str, Any]] | None


def query(params: Params) -> list[tuple[str, str]] | None:
    """httpx's query encoding (bools as true/false, None as empty); aiohttp refuses both."""
    if params is None:
        return None
    items = params.items() if isinstance(params, Mapping) else params
    return [(k, "true" if v is True else "false" if v is False else "" if v is None else str(v))
            for k, v in items]


def raise_for_status(status: int, body: bytes) -> None:
    """The typed error of an error answer (its JSON ``error``, else by the status)."""
    if status < 400:
        return
    try:
        payload: Any = json.loads(body)
    except ValueError:
        payload = body.decode("utf-8", "replace")
    raise errors.error_from_payload(payload, status)


@dataclass(frozen=True, slots=True)
class FullResponse:
    """A fully read answer (status < 400)."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


class Http:
    """The client's requests over ``transport`` (``client._t``)."""

    def __init__(self, transport: AsyncTransport, api_key: str | None) -> None:
        self.transport = transport
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def request_of(self, method: str, url: str, *, long: bool = False, params: Params = None,
                   json_body: Any = None, content: Any = None,
                   headers: dict[str, str] | None = None) -> Request:
        hdrs = {**self.headers, **(headers or {})}
        if json_body is not None:  # encoded as httpx did
            content = json.dumps(json_body, ensure_ascii=False, separators=(",", ":"),
                                 allow_nan=False).encode()
            hdrs["Content-Type"] = "application/json"
        return Request(method, url, query(params), hdrs, content, long)

    async def request(self, method: str, url: str, *, long: bool = False, params: Params = None,
                      json: Any = None, content: Any = None,
                      headers: dict[str, str] | None = None) -> FullResponse:
        """A whole answer; an error answer raises its typed error."""
        resp = await self.transport.handle(self.request_of(
            method, url, long=long, params=params, json_body=json, content=content,
            headers=headers))
        try:
            body = await resp.read()
        finally:
            await resp.aclose()
        raise_for_status(resp.status, body)
        return FullResponse(resp.status, body)

    async def stream(self, method: str, url: str, *, params: Params = None, json: Any = None,
                     content: Any = None, headers: dict[str, str] | None = None) -> Response:
        """An open streamed answer (the caller ``aclose``s it); error answers raise here."""
        resp = await self.transport.handle(self.request_of(
            method, url, long=True, params=params, json_body=json, content=content,
            headers=headers))
        if resp.status >= 400:
            try:
                body = await resp.read()
            finally:
                await resp.aclose()
            raise_for_status(resp.status, body)
        return resp

    async def lines(self, resp: Response) -> AsyncIterator[dict[str, Any]]:
        """NDJSON messages, each as soon as its line is complete (split here: aiohttp's
        readline refuses lines over 128 KiB); closes ``resp`` at the end."""
        tail = b""
        try:
            async for chunk in resp.chunks():
                *done, tail = (tail + chunk).split(b"\n")
                for line in done:
                    if line:
                        yield json.loads(line)
            if tail.strip():
                yield json.loads(tail)
        finally:
            await resp.aclose()

    async def aclose(self) -> None:
        await self.transport.aclose()
