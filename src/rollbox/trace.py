"""The ids that tie one piece of work together across processes: the request id of the api
request in hand, and the sandbox and exec it is about (context variables), the header that
carries the request id from the SDK to the api and from the api to an edge, and the ASGI
middleware that takes it from a request (or makes one) and gives it back on the answer.

A failed rollout is traced from the trainer's exception (``err.request_id`` in the SDK) to the
api's and the edge's log lines (``terminal.JsonFormatter`` writes these ids into every line).
A request id a client sends is kept if it is a short token (``ID_RE``), else replaced: it
lands in logs and headers, so nothing else of it is trusted.

Owns the ids and their header; imports nothing of rollbox (every layer may bind them). Must not
touch what a request does: the middleware only reads one header and adds one.
"""
from __future__ import annotations

import contextlib
import contextvars
import re
import secrets
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

REQUEST_ID_HEADER = "X-Request-Id"
_HEADER_KEY = b"x-request-id"  # as ASGI gives header names: lowercase
# The ASGI messages that begin an answer: a response, a WebSocket's accept, and a WebSocket
# refused with an HTTP answer (the websocket.http.response extension: the port proxy's).
_ANSWER_STARTS = ("http.response.start", "websocket.accept", "websocket.http.response.start")
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")  # fullmatch: no "$" newline

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rollbox_request_id", default=None)
sandbox_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rollbox_sandbox_id", default=None)
exec_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rollbox_exec_id", default=None)


def new_request_id() -> str:
    return f"req_{secrets.token_hex(8)}"


def accepted(value: str | bytes | None) -> str:
    """``value`` as a request id if it is a short token, else a new id."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value and ID_RE.fullmatch(value):
        return value
    return new_request_id()


def current() -> dict[str, str]:
    """The bound ids: ``{"request_id", "sandbox_id", "exec_id"}``, the unset ones left out."""
    out = {}
    for name, var in (("request_id", request_id), ("sandbox_id", sandbox_id),
                      ("exec_id", exec_id)):
        v = var.get()
        if v is not None:
            out[name] = v
    return out


def bind_sandbox(sid: str | None) -> None:
    """Name the sandbox the work in hand is about (for the rest of this task's context)."""
    if sid is not None:
        sandbox_id.set(sid)


def bind_exec(eid: str | None) -> None:
    if eid is not None:
        exec_id.set(eid)


@contextlib.contextmanager
def bound(*, request: str | None = None, sandbox: str | None = None,
          exec_: str | None = None) -> Iterator[None]:
    """Bind ids for a block (those given), restoring the previous ones after it."""
    tokens = [(var, var.set(v)) for var, v in ((request_id, request), (sandbox_id, sandbox),
                                                (exec_id, exec_)) if v is not None]
    try:
        yield
    finally:
        for var, tok in reversed(tokens):
            var.reset(tok)


def outgoing() -> dict[str, str]:
    """The header that carries the bound request id to the next hop (empty when none)."""
    rid = request_id.get()
    return {REQUEST_ID_HEADER: rid} if rid is not None else {}


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestIdMiddleware:
    """Pure ASGI (no per-request task or body buffering: streams pass through as they are).
    For each HTTP request and WebSocket: the request id from ``X-Request-Id`` if acceptable,
    else a new one, bound for the request's handling, put in ``scope["rollbox.request_id"]``
    and sent back as ``X-Request-Id`` on the answer (the response start, the WebSocket's
    accept, or the HTTP answer that refuses a WebSocket)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = None
        for k, v in scope.get("headers") or ():
            if k == _HEADER_KEY:
                given = v
                break
        rid = accepted(given)
        scope["rollbox.request_id"] = rid
        header = (_HEADER_KEY, rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] in _ANSWER_STARTS:
                headers = [h for h in message.get("headers") or () if h[0].lower() !=
                           _HEADER_KEY]
                message["headers"] = [*headers, header]
            await send(message)

        token = request_id.set(rid)
        stoken, etoken = sandbox_id.set(None), exec_id.set(None)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            exec_id.reset(etoken)
            sandbox_id.reset(stoken)
            request_id.reset(token)
