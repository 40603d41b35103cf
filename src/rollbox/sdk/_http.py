"""What every SDK call does over its transport (``_transport``): the API key, JSON bodies and
query values encoded as httpx did, a request id per call (``X-Request-Id``, repeated
as ``err.request_id`` on every error raised for it), typed errors from error answers, NDJSON lines, and sending
again a whole request that is safe to send again when its connection broke (``ConnectionLost``)
and the client has other API URLs (``_failover``) to send it to. The same for every transport;
owns no connection.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rollbox import errors, trace
from rollbox.sdk._transport import AsyncTransport, Request, Response

Params = Mapping[str, Any] | Iterable[tuple[str, Any]] | None


def query(params: Params) -> list[tuple[str, str]] | None:
    """httpx's query encoding (bools as true/false, None as empty); aiohttp refuses both."""
    if params is None:
        return None
    items = params.items() if isinstance(params, Mapping) else params
    return [(k, "true" if v is True else "false" if v is False else "" if v is None else str(v))
            for k, v in items]


def raise_for_status(status: int, body: bytes, request_id: str | None = None) -> None:
    """The typed error of an error answer (its JSON ``error``, else by the status), with the
    request's id (the answer's ``error.request_id``, else the one the request was sent with)."""
    if status < 400:
        return
    try:
        payload: Any = json.loads(body)
    except ValueError:
        payload = body.decode("utf-8", "replace")
    raise with_request_id(errors.error_from_payload(payload, status), request_id)


def with_request_id(exc: errors.RollboxError, request_id: str | None) -> errors.RollboxError:
    if exc.request_id is None:
        exc.request_id = request_id
    return exc


@dataclass(frozen=True, slots=True)
class FullResponse:
    """A fully read answer (status < 400)."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


# The SDK's attempt number of a call sent again (1 unless it is): a create seen with a key and
# an attempt above 1 is looked for on every node (api/routes/sandboxes.py).
ATTEMPT_HEADER = "X-Rollbox-Attempt"
# Every call's own id (rollbox.trace: X-Request-Id), made here: an error raised for the call
# carries it as ``err.request_id`` even when the request never got to the api.
REQUEST_ID_HEADER = trace.REQUEST_ID_HEADER
_SAFE_METHODS = ("GET", "HEAD")


class Http:
    """The client's requests over ``transport`` (``client._t``). ``places``: how many API URLs
    the transport has (a request safe to send again is sent at most that many times)."""

    def __init__(self, transport: AsyncTransport, api_key: str | None,
                 places: int = 1) -> None:
        self.transport = transport
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.places = places

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
                      headers: dict[str, str] | None = None,
                      idempotent: bool = False) -> FullResponse:
        """A whole answer; an error answer raises its typed error. A connection that broke
        (``ConnectionLost``) is tried again on the next API URL, up to once per URL, when
        the request is safe to send twice: a GET/HEAD without a body, or ``idempotent`` (a
        create or exec start with its idempotency key); attempts after the first carry
        ``X-Rollbox-Attempt``."""
        safe = idempotent or (method in _SAFE_METHODS and json is None and content is None)
        attempts = self.places if safe else 1
        attempt = 1
        lost: errors.ConnectionLost | None = None
        rid = trace.new_request_id()  # every attempt of one call: one id
        headers = {REQUEST_ID_HEADER: rid, **(headers or {})}
        while True:
            hdrs = headers if attempt == 1 else {**headers, ATTEMPT_HEADER: str(attempt)}
            try:
                resp = await self.transport.handle(self.request_of(
                    method, url, long=long, params=params, json_body=json, content=content,
                    headers=hdrs))
                try:
                    body = await resp.read()
                finally:
                    await resp.aclose()
            except errors.ConnectionLost as exc:
                lost = lost or exc
                if attempt >= attempts:
                    with_request_id(exc, rid)
                    raise
                attempt += 1
                continue
            except errors.ServerUnreachable as exc:
                if lost is None:
                    with_request_id(exc, rid)
                    raise
                # An earlier attempt may have been processed: not "certainly not".
                raise with_request_id(errors.ConnectionLost(
                    f"{lost.message}; sent again: {exc.message}", **exc.details), rid) from exc
            raise_for_status(resp.status, body, rid)
            return FullResponse(resp.status, body)

    async def stream(self, method: str, url: str, *, params: Params = None, json: Any = None,
                     content: Any = None, headers: dict[str, str] | None = None) -> Response:
        """An open streamed answer (the caller ``aclose``s it); error answers raise here."""
        rid = trace.new_request_id()
        try:
            resp = await self.transport.handle(self.request_of(
                method, url, long=True, params=params, json_body=json, content=content,
                headers={REQUEST_ID_HEADER: rid, **(headers or {})}))
        except errors.RollboxError as exc:
            with_request_id(exc, rid)
            raise
        if resp.status >= 400:
            try:
                body = await resp.read()
            finally:
                await resp.aclose()
            raise_for_status(resp.status, body, rid)
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
