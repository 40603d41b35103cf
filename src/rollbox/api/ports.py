"""Exposed ports: the api's HTTP and WebSocket proxy to a service listening inside a sandbox
(on its 127.0.0.1 or 0.0.0.0), also one with no network permission at all.

Two forms reach port ``P`` of sandbox ``ID``:

- the path form ``/v1/sandboxes/ID/ports/P/<path>`` (non-browser clients): answered with
  ``Content-Security-Policy: sandbox`` and without any ``Set-Cookie`` (the API's origin never
  carries a sandbox's cookies; its own Cookie header is not forwarded either);
- the per-sandbox origin ``P-ID.<domain>`` (``PortConfig.domain``; Host-header routing, for
  browsers): the service's own origin, never the API's; its cookies are host-only (a
  ``Set-Cookie`` with a ``Domain`` is dropped, so no origin tosses cookies to another);
  ``POST /_rollbox/login`` with a port token sets the origin's ``rollbox_port_token`` cookie.

Auth: the API key of the sandbox's project (``Authorization: Bearer`` or ``X-API-Key``), or a
port token (:class:`PortTokens`: HMAC-SHA256 of the sandbox id, port and expiry under a
secret the api owns) in ``X-Rollbox-Port-Token`` or, on the sandbox's origin only, its cookie;
never a query string. A token is refused once the sandbox is gone (its connection can not be
opened). ``Authorization``, ``X-API-Key``, the token header and the token cookie are never
forwarded into the sandbox.

The connection goes api -> edge (``EdgeAPI.port_open``: in-process, or a RemoteEdge's
WebSocket to the edge's service) -> that sandbox's own loopback (``Backend.open_port``): the
proxy names only (sandbox, port); the address is fixed below it, so no header, path or redirect
reaches another sandbox, the host or the platform. Redirects are passed to the client, never
followed. HTTP connections into the sandbox are kept alive and reused (:class:`UpstreamPool`):
only for the same (sandbox, port), only by a request that passed the auth above and whose
sandbox runs (``EdgeAPI.wake``: a paused one is woken or refused as ``port_open`` would), a few idle
per port and a bounded number in all, each closed after ``IDLE_S`` idle, as soon as the service
sends anything unasked or ends it, and with the sandbox (the edge closes its connections when
it goes). A request whose reused connection turns out closed before any answer byte is sent
again once on a new one when its body was small enough to keep (the retry browsers make).
WebSockets get a connection of their own.

Owns the proxy, the tokens and the login; must not touch sandboxes other than through the
edge's ``port_open``, nor the API's own routes (requests of neither form pass through).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httptools
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.client import ClientProtocol
from websockets.exceptions import InvalidState
from websockets.frames import Close, Frame, Opcode
from websockets.http11 import Response as WsResponse
from websockets.uri import parse_uri

from rollbox import errors
from rollbox.api.context import ApiContext
from rollbox.api.errors import error_payload
from rollbox.backends.base import PortStream
from rollbox.backends.ports import end_pumps
from rollbox.config import Settings
from rollbox.edge.interface import EdgeAPI
from rollbox.iam.keyfile import node_secret

log = logging.getLogger(__name__)

TOKEN_HEADER = "x-rollbox-port-token"
COOKIE = "rollbox_port_token"
LOGIN_PATH = "/_rollbox/login"
PATH_RE = re.compile(r"^/v1/sandboxes/(?P<id>[^/]+)/ports/(?P<port>[^/]*)(?P<rest>/.*)?$")
LABEL_RE = re.compile(r"^(?P<port>[0-9]{1,6})-(?P<id>[a-z0-9_-]+)$")
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"proxy-connection",
})
# Never forwarded into the sandbox: the platform's credentials.
NOT_FORWARDED = frozenset({b"authorization", b"x-api-key", TOKEN_HEADER.encode(), b"host",
                           b"content-length", b"x-forwarded-for", b"x-forwarded-host",
                           b"x-forwarded-proto", b"x-forwarded-prefix"})
NO_BODY_STATUS = frozenset({204, 304})
MAX_RESPONSE_HEAD = 256 << 10
WS_MAX_MESSAGE = 16 << 20
LOGIN_BODY_MAX = 8 << 10
# Kept-alive connections into sandboxes (UpstreamPool): idle ones per (sandbox, port), in all,
# and how long one stays idle (below the 5 s keep-alive of common servers: uvicorn, node).
POOL_PER_PORT = 8
POOL_MAX = 256
IDLE_S = 4.0
REPLAY_MAX = 64 << 10  # a request body kept for a resend on a new connection, at most


# ---- tokens -----------------------------------------------------------------------------
@dataclass(frozen=True)
class PortConfig:
    """``domain``: the per-sandbox origins' parent (``P-ID.<domain>``), None: the path form
    only; ``secret``: the tokens' HMAC key; ``token_ttl_s``/``max_token_ttl_s``: a token's
    default and longest life."""

    secret: bytes
    domain: str | None = None
    token_ttl_s: float = 3600.0
    max_token_ttl_s: float = 7 * 24 * 3600.0

    @classmethod
    def from_settings(cls, settings: Settings, key_dir: Path | None = None) -> PortConfig:
        """The node's settings; the key file in ``key_dir`` (default the data dir: a
        cluster's replicas pass their shared state dir)."""
        return cls(secret=token_secret(settings.port_token_secret,
                                       key_dir or Path(settings.data_dir)),
                   domain=settings.port_domain, token_ttl_s=settings.port_token_ttl_s)

    @classmethod
    def ephemeral(cls, domain: str | None = None) -> PortConfig:
        """A per-process random key (tokens die with the process)."""
        return cls(secret=secrets.token_bytes(32), domain=domain)


def token_secret(secret: str | None, key_dir: Path) -> bytes:
    """``secret`` (port_token_secret), else a root-only file in ``key_dir`` (port-token.key,
    made once: tokens stay valid across restarts and for replicas sharing it)."""
    return node_secret(secret, key_dir / "port-token.key")


class PortTokens:
    """``v1.<expiry>.<mac>``: the MAC binds sandbox id, port and expiry (unix seconds)."""

    def __init__(self, config: PortConfig) -> None:
        self.config = config

    def _mac(self, sandbox_id: str, port: int, exp: int) -> str:
        msg = f"rollbox-port-token:v1:{sandbox_id}:{port}:{exp}".encode()
        digest = hmac.new(self.config.secret, msg, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def issue(self, sandbox_id: str, port: int, ttl_s: float | None = None) -> tuple[str, int]:
        ttl = self.config.token_ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl <= self.config.max_token_ttl_s:
            raise errors.BadRequest(f"ttl_s must be in (0, {self.config.max_token_ttl_s:g}]",
                                    ttl_s=ttl)
        check_port(port)
        exp = int(time.time() + ttl)
        return f"v1.{exp}.{self._mac(sandbox_id, port, exp)}", exp

    def verify(self, token: str, sandbox_id: str, port: int) -> None:
        """PortTokenInvalid unless ``token`` was issued for this sandbox and port and has not
        expired (the MAC first: a forged token learns nothing of expiry)."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != "v1" or not parts[1].isdigit() or len(token) > 200:
            raise errors.PortTokenInvalid("malformed port token", reason="malformed")
        exp = int(parts[1])
        if not hmac.compare_digest(parts[2].encode(), self._mac(sandbox_id, port, exp).encode()):
            raise errors.PortTokenInvalid("port token not valid for this sandbox and port",
                                          reason="forged")
        if exp <= time.time():
            raise errors.PortTokenInvalid("port token expired", reason="expired")


def check_port(port: Any) -> int:
    """``port`` as an int in 1..65535, else BadRequest."""
    if isinstance(port, str):
        port = int(port) if port.isdigit() and len(port) <= 6 else port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise errors.BadRequest(f"port must be an integer in 1..65535, not {str(port)[:20]!r}",
                                port=str(port)[:20])
    return port


# ---- kept-alive connections ---------------------------------------------------------------
@dataclass(eq=False)
class _Idle:
    stream: PortStream
    watch: asyncio.Task[None] | None = None


class UpstreamPool:
    """Idle HTTP/1.1 connections into sandboxes' ports, for the next request to the same
    (sandbox id, port): at most ``per_port`` per key (the newest reused first) and ``max_idle``
    in all (past it the oldest is closed). While idle, each is watched: closed after
    ``idle_s``, or as soon as the service sends anything (unasked bytes: the connection is out
    of step) or ends it, or the edge closes it (its sandbox deleted): then it leaves the pool at
    once. Nothing here authorizes: the proxy takes a connection only for a request that passed
    its auth for that very sandbox and port, so a revoked key or an expired token never reaches
    one, and no connection is ever handed to another sandbox's request."""

    def __init__(self, per_port: int | None = None, max_idle: int | None = None,
                 idle_s: float | None = None) -> None:
        """None: the module's POOL_PER_PORT, POOL_MAX, IDLE_S."""
        self.per_port = POOL_PER_PORT if per_port is None else per_port
        self.max_idle = POOL_MAX if max_idle is None else max_idle
        self.idle_s = IDLE_S if idle_s is None else idle_s
        self._idle: dict[tuple[str, int], list[_Idle]] = {}
        self._count = 0

    def idle(self, sandbox_id: str, port: int) -> int:
        """How many idle connections to (sandbox, port) are held now."""
        return len(self._idle.get((sandbox_id, port), ()))

    def _forget(self, key: tuple[str, int], entry: _Idle) -> bool:
        held = self._idle.get(key)
        if held is None or entry not in held:
            return False
        held.remove(entry)
        if not held:
            del self._idle[key]
        self._count -= 1
        return True

    async def take(self, sandbox_id: str, port: int) -> PortStream | None:
        """An idle connection to (sandbox, port), no longer watched; None when there is none."""
        key = (sandbox_id, port)
        while held := self._idle.get(key):
            entry = held[-1]
            self._forget(key, entry)
            assert entry.watch is not None
            entry.watch.cancel()
            await asyncio.wait({entry.watch})
            if entry.watch.cancelled():
                return entry.stream
            # it ended on its own just now (the service spoke or closed): closed, try the next
        return None

    async def put(self, sandbox_id: str, port: int, stream: PortStream) -> None:
        """Keep ``stream`` (its last answer read to the end) for reuse, or close it when the
        key holds ``per_port`` already; the oldest idle connection goes past ``max_idle``."""
        key = (sandbox_id, port)
        if len(self._idle.get(key, ())) >= self.per_port:
            await stream.close()
            return
        while self._count >= self.max_idle:
            old_key = next(iter(self._idle))
            old = self._idle[old_key][0]
            self._forget(old_key, old)
            assert old.watch is not None
            old.watch.cancel()
            await old.stream.close()
        entry = _Idle(stream)
        held = self._idle.setdefault(key, [])
        held.append(entry)
        self._count += 1
        entry.watch = asyncio.ensure_future(self._watch(key, entry))

    async def _watch(self, key: tuple[str, int], entry: _Idle) -> None:
        try:  # a cancel (take() took it: the stream is the taker's now) passes through
            async with asyncio.timeout(self.idle_s):
                await entry.stream.read()  # anything (b"" at its end) ends its reuse
        except Exception:  # noqa: BLE001 - timed out or failed: not reused
            pass
        self._forget(key, entry)
        await entry.stream.close()

    async def close(self) -> None:
        """Close every idle connection."""
        entries = [e for held in self._idle.values() for e in held]
        self._idle.clear()
        self._count = 0
        for entry in entries:
            if entry.watch is not None:
                entry.watch.cancel()
            await entry.stream.close()


# ---- the proxy ----------------------------------------------------------------------------
@dataclass
class Target:
    sandbox_id: str
    port: int
    form: str  # "path" | "host"
    path: bytes  # the path (and query) inside the service, from "/"
    prefix: str  # what the path form strips ("" on the host form)


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope["headers"]}


def _cookie_token(raw: bytes | None) -> str | None:
    if not raw:
        return None
    try:
        jar: SimpleCookie = SimpleCookie(raw.decode("latin-1"))
    except CookieError:
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else None


def _without_our_cookie(raw: bytes) -> bytes:
    parts = [p for p in raw.split(b";") if p.strip() and not p.strip().startswith(
        COOKIE.encode() + b"=")]
    return b";".join(parts).strip()


class PortProxy:
    """ASGI middleware in front of the api: requests of either form are proxied, any other
    passes to ``app``."""

    def __init__(self, app: ASGIApp, api: ApiContext, config: PortConfig,
                 pool: UpstreamPool | None = None) -> None:
        self.app = app
        self.api = api
        self.config = config
        self.tokens = PortTokens(config)
        self.pool = pool if pool is not None else UpstreamPool()
        # A domain may carry the public port its URLs name ("localhost:7420"): the Host
        # header's name is compared without either port.
        self.domain = (config.domain.lower().rsplit(":", 1)[0].strip(".")
                       if config.domain else None)

    # -- routing --
    def target(self, scope: Scope) -> Target | None:
        if self.domain is not None:
            host = _headers(scope).get(b"host", b"").decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name.endswith("." + self.domain):
                label = name[:-len(self.domain) - 1]
                m = LABEL_RE.match(label)
                if m is None:
                    raise errors.NotFound(f"no sandbox port at {label[:80]!r}.{self.domain}")
                path = scope.get("raw_path") or scope["path"].encode()
                if scope.get("query_string"):
                    path += b"?" + scope["query_string"]
                return Target(m["id"], check_port(m["port"]), "host", path, "")
        m = PATH_RE.match(scope["path"])
        if m is None:
            return None
        port = check_port(m["port"])
        raw = scope.get("raw_path") or scope["path"].encode()
        prefix = f"/v1/sandboxes/{m['id']}/ports/{m['port']}"
        rest = raw[len(prefix.encode()):] if raw.startswith(prefix.encode()) else (
            (m["rest"] or "/").encode())
        path = rest if rest.startswith(b"/") else b"/" + rest
        if scope.get("query_string"):
            path += b"?" + scope["query_string"]
        return Target(m["id"], port, "path", path, prefix)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        try:
            target = self.target(scope)
        except errors.RollboxError as exc:
            await _refuse(scope, send, exc)
            return
        if target is None:
            await self.app(scope, receive, send)
            return
        try:
            if (target.form == "host" and scope["type"] == "http"
                    and scope["path"] == LOGIN_PATH):
                await self.login(scope, receive, send, target)
                return
            edge = await self.authorize(scope, target)
            if scope["type"] == "websocket":
                await self.websocket(scope, receive, send, target, edge)
            else:
                await self.http(scope, receive, send, target, edge)
        except errors.RollboxError as exc:
            await _refuse(scope, send, exc)

    # -- auth --
    async def authorize(self, scope: Scope, target: Target) -> EdgeAPI:
        """The sandbox's edge, if the request carries its project's key or a valid token."""
        h = _headers(scope)
        token = h.get(TOKEN_HEADER.encode(), b"").decode("latin-1") or None
        if token is None and target.form == "host":
            token = _cookie_token(h.get(b"cookie"))
        if token is not None:
            self.tokens.verify(token, target.sandbox_id, target.port)
            return self.api.placement.edge_for(target.sandbox_id)
        scheme, _, cred = h.get(b"authorization", b"").decode("latin-1").partition(" ")
        key = cred if scheme.lower() == "bearer" and cred else (
            h.get(b"x-api-key", b"").decode("latin-1") or None)
        if key is None:
            raise errors.Unauthorized("the port proxy needs the sandbox project's API key or "
                                      f"a port token ({TOKEN_HEADER} header)")
        who = await self.api.principal(key)
        return await self.api.sandbox_edge(target.sandbox_id, who)

    async def login(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        """``POST /_rollbox/login`` (form field ``token`` or the token header): the origin's
        cookie, then 303 to ``/``."""
        if scope["method"] != "POST":
            raise errors.BadRequest(f"{LOGIN_PATH} takes POST with a port token")
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if len(body) > LOGIN_BODY_MAX:
                raise errors.PayloadTooLarge("login body too large", limit=LOGIN_BODY_MAX)
            if not msg.get("more_body"):
                break
        token = _headers(scope).get(TOKEN_HEADER.encode(), b"").decode("latin-1")
        if not token:
            token = (parse_qs(body.decode("latin-1")).get("token") or [""])[0]
        if not token:
            raise errors.Unauthorized("no port token given")
        self.tokens.verify(token, target.sandbox_id, target.port)
        await self.api.placement.edge_for(target.sandbox_id).get(target.sandbox_id)
        exp = int(token.split(".")[1])
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        cookie = (f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax; "
                  f"Max-Age={max(0, exp - int(time.time()))}{secure}")
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", b"/"), (b"set-cookie", cookie.encode()),
                                (b"content-length", b"0"), (b"cache-control", b"no-store")]})
        await send({"type": "http.response.body", "body": b""})

    # -- forwarding --
    def _request_headers(self, scope: Scope, target: Target) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        host = b""
        for k, v in scope["headers"]:
            k = k.lower()
            if k == b"host":
                host = v
            if k in HOP_BY_HOP or k in NOT_FORWARDED or k.startswith(b"sec-websocket-"):
                continue
            if k == b"cookie":
                if target.form == "path":
                    continue  # the API origin's cookies are the API's
                v = _without_our_cookie(v)
                if not v:
                    continue
            out.append((k, v))
        fwd_host = host if target.form == "host" else f"127.0.0.1:{target.port}".encode()
        out.insert(0, (b"host", fwd_host))
        client = scope.get("client")
        if client:
            out.append((b"x-forwarded-for", str(client[0]).encode()))
        out.append((b"x-forwarded-proto", str(scope.get("scheme", "http")).encode()))
        if host:
            out.append((b"x-forwarded-host", host))
        if target.prefix:
            out.append((b"x-forwarded-prefix", target.prefix.encode()))
        return out

    def _response_headers(self, raw: list[tuple[bytes, bytes]],
                          target: Target) -> list[tuple[bytes, bytes]]:
        out = []
        for k, v in raw:
            k = k.lower()
            if k in HOP_BY_HOP:
                continue
            if k == b"set-cookie":
                if target.form == "path":
                    continue  # never the API origin's cookies
                attrs = [a.strip().lower() for a in v.split(b";")[1:]]
                if (any(a.startswith(b"domain") for a in attrs)
                        or v.strip().startswith(COOKIE.encode() + b"=")):
                    continue  # host-only cookies, and never ours
            out.append((k, v))
        if target.form == "path":
            out.append((b"content-security-policy", b"sandbox"))
        return out

    async def http(self, scope: Scope, receive: Receive, send: Send, target: Target,
                   edge: EdgeAPI) -> None:
        """One request on a kept-alive connection to the service (:class:`UpstreamPool`), or
        a new one; the connection goes back to the pool when its answer was read to its end
        and the service keeps it alive."""
        method = scope["method"].encode()
        headers = self._request_headers(scope, target)
        h = _headers(scope)
        length = h.get(b"content-length")
        chunked = not length and b"chunked" in h.get(b"transfer-encoding", b"").lower()
        if length:
            headers.append((b"content-length", length))
        elif chunked:
            headers.append((b"transfer-encoding", b"chunked"))
        head = b"".join([method, b" ", target.path, b" HTTP/1.1\r\n",
                         *(k + b": " + v + b"\r\n" for k, v in headers), b"\r\n"])
        # A body that can be sent again (whole, small) may go on a reused connection: if that
        # one turns out closed before any answer, it is resent once on a new connection.
        small = not chunked and (not length or (length.isdigit() and int(length) <= REPLAY_MAX))
        body = _Body(pending=bool(length or chunked), chunked=chunked, keep=small)
        stream = None
        if small and self.pool.idle(target.sandbox_id, target.port):
            # What port_open checks first: a paused sandbox is woken (resume_on_traffic) or
            # refused there, never reached through a connection kept from before its pause.
            if (await edge.wake(target.sandbox_id)).state == "running":
                stream = await self.pool.take(target.sandbox_id, target.port)
        reused = stream is not None
        if stream is None:
            stream = await edge.port_open(target.sandbox_id, target.port)
        keep = False
        try:
            try:
                keep = await self._exchange(stream, head, body, receive, send, target, method,
                                            reused)
            except _NoAnswer:
                if not reused:
                    raise
                await stream.close()  # the service closed it while idle: a new one, once
                stream = await edge.port_open(target.sandbox_id, target.port)
                keep = await self._exchange(stream, head, body, receive, send, target, method,
                                            False)
        finally:
            if keep:
                await self.pool.put(target.sandbox_id, target.port, stream)
            else:
                await stream.close()

    async def _exchange(self, stream: PortStream, head: bytes, body: _Body, receive: Receive,
                        send: Send, target: Target, method: bytes, reused: bool) -> bool:
        """Send the request (what of its body was read already, then the rest from
        ``receive``) and relay the answer; whether ``stream`` may serve another request. On a
        ``reused`` connection, a failure before any byte of an answer is _NoAnswer (nothing
        reached the client; the caller resends)."""
        try:
            await stream.write(head + b"".join(body.pieces))
            while body.pending:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return False
                data = msg.get("body", b"")
                if data:
                    piece = b"%x\r\n%b\r\n" % (len(data), data) if body.chunked else data
                    if body.keep:
                        body.pieces.append(piece)
                    await stream.write(piece)
                if not msg.get("more_body"):
                    body.pending = False
                    if body.chunked:
                        await stream.write(b"0\r\n\r\n")
            return await self._relay_response(stream, send, target, method == b"HEAD", body)
        except _NoAnswer:
            raise
        except (errors.RollboxError, OSError) as exc:
            if reused and not body.answered:
                raise _NoAnswer(f"the kept-alive connection failed: {exc}") from None
            raise

    async def _relay_response(self, stream: PortStream, send: Send, target: Target,
                              head_only: bool, body: _Body) -> bool:
        """Relay one answer; whether the connection may serve another request (the answer
        read to its end, exactly, and the service keeps the connection alive)."""
        parser_state = _Response()
        parser = parser_state.parser = httptools.HttpResponseParser(parser_state)
        started = False
        interim = False
        seen = 0
        while True:
            data = await stream.read()
            if not data:
                if not seen:
                    raise _NoAnswer("the sandbox's service closed the connection without "
                                    "an answer")
                break
            body.answered = True
            seen += len(data)
            try:
                parser.feed_data(data)
            except httptools.HttpParserError as exc:
                if not started:
                    raise errors.UpstreamBadResponse(
                        f"the sandbox's service answered no valid HTTP: {exc}") from None
                break
            if not started and not parser_state.headers_done and seen > MAX_RESPONSE_HEAD:
                raise errors.UpstreamBadResponse("the sandbox's service sent a header over "
                                                 f"{MAX_RESPONSE_HEAD} bytes")
            if parser_state.headers_done and not started:
                status = parser.get_status_code()
                if 100 <= status < 200:  # an interim answer (100 Continue): skip it
                    parser_state.reset()
                    parser = parser_state.parser = httptools.HttpResponseParser(parser_state)
                    interim = True  # what followed it in this read is lost: not reused
                    continue
                started = True
                await send({"type": "http.response.start", "status": status,
                            "headers": self._response_headers(parser_state.raw, target)})
                if head_only or status in NO_BODY_STATUS:
                    break
            if parser_state.complete:
                break
            if started:
                for chunk in parser_state.take():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if not started:
            raise errors.UpstreamBadResponse("the sandbox's service closed the connection "
                                             "without an answer")
        rest = parser_state.take()  # the last chunk ends the answer (one write fewer)
        for chunk in rest[:-1]:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": rest[-1] if rest else b"",
                    "more_body": False})
        return (parser_state.complete and parser_state.messages == 1 and not interim
                and not head_only and parser_state.keep_alive)

    # -- websockets --
    async def websocket(self, scope: Scope, receive: Receive, send: Send, target: Target,
                        edge: EdgeAPI) -> None:
        msg = await receive()
        if msg["type"] != "websocket.connect":
            return
        stream = await edge.port_open(target.sandbox_id, target.port)
        try:
            uri = parse_uri(f"ws://127.0.0.1:{target.port}{target.path.decode('latin-1')}")
            subprotocols = [p.strip() for p in scope.get("subprotocols", ()) if p.strip()]
            proto = ClientProtocol(uri, subprotocols=subprotocols or None,
                                   max_size=WS_MAX_MESSAGE)
            request = proto.connect()
            for k, v in self._request_headers(scope, target):
                if k not in (b"host", b"sec-websocket-extensions"):
                    request.headers[k.decode("latin-1")] = v.decode("latin-1")
            if target.form == "host":
                request.headers["Host"] = _headers(scope).get(b"host", b"").decode("latin-1")
            proto.send_request(request)
            response = await _ws_handshake(proto, stream)
            if response.status_code != 101 or proto.handshake_exc is not None:
                await deny_websocket(scope, send, response.status_code, response.body or b"")
                return
            accept: Message = {"type": "websocket.accept",
                               "subprotocol": response.headers.get("Sec-WebSocket-Protocol"),
                               "headers": []}
            await send(accept)
            try:
                await _ws_relay(proto, stream, receive, send)
            except errors.RollboxError as exc:  # after the accept: a close, not an answer
                log.info("port proxy websocket to %s:%d ended: %s", target.sandbox_id,
                         target.port, exc)
                with contextlib.suppress(OSError, RuntimeError):
                    await send({"type": "websocket.close", "code": 1011})
        finally:
            await stream.close()


@dataclass
class _Body:
    """A proxied request's body: still to be read from the client (``pending``), the pieces
    sent so far when ``keep`` (a small one, for a resend), and whether any answer came."""

    pending: bool
    chunked: bool
    keep: bool
    pieces: list[bytes] = field(default_factory=list)
    answered: bool = False


class _NoAnswer(errors.UpstreamBadResponse):
    """The connection failed before any byte of an answer (a reused one: resent once)."""


class _Response:
    """httptools callbacks of one response: its headers, body chunks and end."""

    def __init__(self) -> None:
        self.parser: Any = None  # the httptools parser these callbacks are of
        self.reset()

    def reset(self) -> None:
        self.raw: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.headers_done = False
        self.complete = False
        self.messages = 0  # answers begun: a second one in the same bytes is out of step
        self.keep_alive = False  # the service keeps the connection after this answer

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw.append((bytes(name), bytes(value)))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(bytes(body))

    def on_message_complete(self) -> None:
        self.complete = True
        # (llhttp forgets it once the message is over: asked now)
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()

    def take(self) -> list[bytes]:
        out, self.body = self.body, []
        return out


async def _ws_handshake(proto: ClientProtocol, stream: Any) -> WsResponse:
    await stream.write(b"".join(proto.data_to_send()))
    while True:
        data = await stream.read()
        if not data:
            proto.receive_eof()
        else:
            proto.receive_data(data)
        for event in proto.events_received():
            if isinstance(event, WsResponse):
                return event
        if not data:
            raise errors.UpstreamBadResponse("the sandbox's service closed the connection "
                                             "during the WebSocket handshake")


async def _ws_relay(proto: ClientProtocol, stream: Any, receive: Receive, send: Send) -> None:
    """Messages both ways between the client (ASGI) and the service (``proto`` over
    ``stream``) until either closes."""
    parts: list[bytes] = []
    text = False

    async def flush() -> None:
        data = proto.data_to_send()
        if data:
            await stream.write(b"".join(d for d in data if d))

    async def from_service() -> None:
        nonlocal text
        while True:
            data = await stream.read()
            if data:
                proto.receive_data(data)
            else:
                proto.receive_eof()
            for frame in proto.events_received():
                assert isinstance(frame, Frame)
                if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                    parts[:] = [frame.data]
                    text = frame.opcode == Opcode.TEXT
                elif frame.opcode == Opcode.CONT:
                    parts.append(frame.data)
                    if sum(map(len, parts)) > WS_MAX_MESSAGE:
                        raise errors.PayloadTooLarge("a WebSocket message over the cap")
                elif frame.opcode == Opcode.CLOSE:
                    close = Close.parse(frame.data) if frame.data else None
                    await flush()
                    await send({"type": "websocket.close",
                                "code": close.code if close else 1000,
                                "reason": close.reason if close else ""})
                    return
                else:
                    continue  # ping/pong: the protocol answers pings itself
                if frame.fin:
                    payload = b"".join(parts)
                    parts.clear()
                    if text:
                        await send({"type": "websocket.send",
                                    "text": payload.decode("utf-8", "replace")})
                    else:
                        await send({"type": "websocket.send", "bytes": payload})
            await flush()
            if not data:
                await send({"type": "websocket.close", "code": 1006})
                return

    async def from_client() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "websocket.disconnect":
                with contextlib.suppress(InvalidState):
                    proto.send_close(_client_code(msg.get("code", 1000)))
                with contextlib.suppress(errors.RollboxError, OSError):
                    await flush()
                return
            if msg.get("text") is not None:
                proto.send_text(msg["text"].encode())
            elif msg.get("bytes") is not None:
                proto.send_binary(msg["bytes"])
            await flush()

    down = asyncio.ensure_future(from_service())
    up = asyncio.ensure_future(from_client())
    try:
        await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
        for task in (down, up):
            if task.done() and not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                if not isinstance(exc, (errors.RollboxError, OSError, InvalidState)):
                    raise exc  # type: ignore[misc]
    finally:
        await end_pumps(down, up)


def _client_code(code: int) -> int:
    return code if 1000 <= code < 5000 and code not in (1005, 1006, 1015) else 1000


async def deny_websocket(scope: Scope, send: Send, status: int, body: bytes) -> None:
    """A WebSocket refused before its accept: an HTTP answer where the server can send one
    (the ASGI websocket.http.response extension), else a close (uvicorn: 403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


async def _refuse(scope: Scope, send: Send, exc: errors.RollboxError) -> None:
    body = json.dumps(error_payload(exc)).encode()
    if scope["type"] == "websocket":
        await deny_websocket(scope, send, exc.status, body)
        return
    with contextlib.suppress(OSError, RuntimeError):  # a response already started: cut
        await send({"type": "http.response.start", "status": exc.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"content-security-policy", b"sandbox")]})
        await send({"type": "http.response.body", "body": body})


def install(app: Any, api: ApiContext, config: PortConfig) -> PortTokens:
    """Put the proxy in front of ``app`` (outermost: proxied requests skip the api's body
    caps, they stream); the tokens it checks (``app.state.port_tokens``). Its kept-alive
    connections are ``app.state.port_pool`` (the app's lifespan closes them at its end)."""
    pool = UpstreamPool()
    app.add_middleware(PortProxy, api=api, config=config, pool=pool)
    tokens = PortTokens(config)
    app.state.port_tokens = tokens
    app.state.port_config = config
    app.state.port_pool = pool
    return tokens


__all__ = ["PortConfig", "PortProxy", "PortTokens", "UpstreamPool", "check_port", "deny_websocket",
           "install", "token_secret"]
