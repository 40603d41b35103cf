"""The live view of a "vm" sandbox's screen (issue 16 item 4): a page the api serves with
noVNC, its WebSocket to the sandbox's edge, and the take-over of mouse and keyboard.

How a person gets in (no token in a query string, none in the page):

1. ``POST /v1/sandboxes/{id}/view`` with the project's API key (``routes.computer``) gives
   ``/view/{id}/login/{code}``: a one-time code, signed, bound to the sandbox, valid
   ``code_ttl_s`` (60 s), used once (per api process: a replica that never saw it used would
   take it again within those seconds; across replicas it is short-lived, not strictly once).
2. ``GET /view/{id}/login/{code}`` exchanges it for the cookie ``rollbox_view``:
   ``v1.<expiry>.<session>.<mac>`` (HMAC-SHA256 of the sandbox id, expiry and session under the
   port tokens' key with a message format of its own), ``HttpOnly; SameSite=Strict;
   Path=/view/{id}/`` (``Secure`` over https), living ``token_ttl_s`` (15 min) unless asked
   for less; the answer is a page that goes on to ``/view/{id}/`` by a same-site navigation (a
   redirect would carry a cross-site login's context, and a Strict cookie is withheld there).
3. ``GET /view/{id}/``: the page (noVNC, view-only); ``WS /view/{id}/ws``: the screen;
   ``GET /view/{id}/state``; ``POST /view/{id}/takeover`` and ``/release`` (a person takes the
   mouse and keyboard, and gives them back; they need the header ``X-Rollbox-View: 1``, which
   no cross-site form can send, and a same-origin ``Origin`` where the browser sends one).

Every ``/view/{id}/`` request checks the cookie first (a missing, forged, expired or other
sandbox's one: 401 ``view_token_invalid``, nothing learnt of the sandbox), then that the
sandbox lives (deleted: 410 ``sandbox_dead``; unknown: 404). The WebSocket is refused the
same way before its accept, and ends when the cookie expires or the sandbox goes.

The bytes: browser <-> this WebSocket <-> ``EdgeAPI.display_open`` (in-process, or a
RemoteEdge's WebSocket to the edge's service, as the port proxy's connections) <-> the VM's
checked RFB stream (``backends.vm.rfb``: only what draws the screen reaches QEMU; keyboard and
pointer become QMP ``input-send-event`` while taken over, nothing otherwise). No VNC port is
ever opened: QEMU got its end of a socketpair.

Static files: ``/view/static/novnc/`` is noVNC's package as ``make novnc`` unpacked it
(pinned, sha512 checked; ``ViewConfig.novnc_dir``), ``/view/static/rollbox/`` the page's own
script and style (``api/static/liveview``). The page's CSP allows scripts, styles and
connections of its own origin only.

Owns the view's tokens, page and WebSocket relay; must not touch a sandbox other than through
the edge's ``display_open`` / ``display_takeover`` / ``get``.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import html
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocketDisconnect

from rollbox import errors
from rollbox.api.context import ApiContext
from rollbox.api.ports import deny_websocket
from rollbox.backends.ports import end_pumps
from rollbox.config import Settings
from rollbox.edge.interface import EdgeAPI
from rollbox.edge.wire import SANDBOX_ID
from rollbox.models import SandboxInfo

log = logging.getLogger(__name__)

COOKIE = "rollbox_view"
HEADER = "x-rollbox-view"
PREFIX = "/view"
ASSETS = Path(__file__).parent / "static" / "liveview"
LIVE = ("running", "paused", "creating")
_ID_RE = re.compile(SANDBOX_ID)
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data: blob:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
WS_MAX_MESSAGE = 1 << 20
USED_KEEP = 100_000  # redeemed codes remembered (until they expire)


@dataclass(frozen=True)
class ViewConfig:
    """``secret``: the tokens' HMAC key (the port tokens', with a message format of its own);
    ``novnc_dir``: noVNC's unpacked package (None or missing: the page says so, 404);
    lifetimes of the cookie (default, longest) and of the one-time code."""

    secret: bytes
    novnc_dir: Path | None = None
    token_ttl_s: float = 900.0
    max_token_ttl_s: float = 4 * 3600.0
    code_ttl_s: float = 60.0

    @classmethod
    def from_settings(cls, settings: Settings, secret: bytes) -> ViewConfig:
        return cls(secret=secret, novnc_dir=settings.view_novnc_dir,
                   token_ttl_s=settings.view_token_ttl_s,
                   max_token_ttl_s=settings.view_token_max_ttl_s,
                   code_ttl_s=settings.view_code_ttl_s)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


class ViewTokens:
    """Codes ``c1.<code expiry>.<session ttl>.<session>.<mac>`` and cookies
    ``v1.<expiry>.<session>.<mac>``; each MAC binds the sandbox id and every field."""

    def __init__(self, config: ViewConfig) -> None:
        self.config = config
        self._used: dict[str, float] = {}  # session of a redeemed code -> its code's expiry

    def _mac(self, kind: str, sandbox_id: str, *fields: object) -> str:
        msg = ":".join(["rollbox-view-token", kind, sandbox_id, *map(str, fields)]).encode()
        return _b64(hmac.new(self.config.secret, msg, hashlib.sha256).digest())

    def issue_code(self, sandbox_id: str, ttl_s: float | None = None) -> tuple[str, int, int]:
        """(code, its expiry, the cookie's life in seconds) for one login to ``sandbox_id``."""
        ttl = self.config.token_ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl <= self.config.max_token_ttl_s:
            raise errors.BadRequest(f"ttl_s must be in (0, {self.config.max_token_ttl_s:g}]",
                                    ttl_s=ttl)
        life = max(1, int(ttl))
        exp = int(time.time() + self.config.code_ttl_s)
        session = _b64(secrets.token_bytes(12))
        return f"c1.{exp}.{life}.{session}.{self._mac('c1', sandbox_id, exp, life, session)}", \
            exp, life

    def redeem(self, code: str, sandbox_id: str) -> tuple[str, int, str]:
        """(cookie token, its expiry, session) for a valid, unused code; ViewTokenInvalid."""
        parts = code.split(".")
        if (len(code) > 200 or len(parts) != 5 or parts[0] != "c1"
                or not parts[1].isdigit() or not parts[2].isdigit()):
            raise errors.ViewTokenInvalid("malformed live view code", reason="malformed")
        exp, life, session = int(parts[1]), int(parts[2]), parts[3]
        good = self._mac("c1", sandbox_id, exp, life, session)
        if not hmac.compare_digest(parts[4].encode(), good.encode()):
            raise errors.ViewTokenInvalid("live view code not valid for this sandbox",
                                          reason="forged")
        now = time.time()
        if exp <= now:
            raise errors.ViewTokenInvalid("live view code expired", reason="expired")
        if session in self._used:
            raise errors.ViewTokenInvalid("live view code already used", reason="used")
        self._forget_expired(now)
        self._used[session] = exp
        t_exp = int(now + min(life, self.config.max_token_ttl_s))
        return (f"v1.{t_exp}.{session}.{self._mac('v1', sandbox_id, t_exp, session)}", t_exp,
                session)

    def _forget_expired(self, now: float) -> None:
        for s in [s for s, e in self._used.items() if e <= now]:
            del self._used[s]
        while len(self._used) >= USED_KEEP:  # bounded: the oldest go (they expire soonest)
            del self._used[next(iter(self._used))]

    def verify(self, token: str | None, sandbox_id: str) -> tuple[int, str]:
        """(expiry, session) of a valid cookie token for ``sandbox_id``; ViewTokenInvalid."""
        if not token:
            raise errors.ViewTokenInvalid(
                "the live view needs its cookie: open the URL that POST "
                "/v1/sandboxes/{id}/view gave", reason="missing")
        parts = token.split(".")
        if len(token) > 200 or len(parts) != 4 or parts[0] != "v1" or not parts[1].isdigit():
            raise errors.ViewTokenInvalid("malformed live view token", reason="malformed")
        exp, session = int(parts[1]), parts[2]
        if not hmac.compare_digest(parts[3].encode(),
                                   self._mac("v1", sandbox_id, exp, session).encode()):
            raise errors.ViewTokenInvalid("live view token not valid for this sandbox",
                                          reason="forged")
        if exp <= time.time():
            raise errors.ViewTokenInvalid("live view token expired", reason="expired")
        return exp, session


def view_path(sandbox_id: str) -> str:
    return f"{PREFIX}/{sandbox_id}/"


# ---- the routes -----------------------------------------------------------------------------
def _check_id(sandbox_id: str) -> None:
    if not _ID_RE.match(sandbox_id) or len(sandbox_id) > 200:
        raise errors.NotFound("no such sandbox")


def _same_origin(headers: Any) -> None:
    """A request a browser sent from another origin (its Origin header) is refused."""
    origin = headers.get("origin")
    if origin is None:
        return
    host = headers.get("host", "")
    if origin.split("://", 1)[-1] != host:
        raise errors.Forbidden("the live view takes requests of its own origin only",
                               origin=origin[:200])


class LiveView:
    """The view's routes over the app's context (see the module docstring)."""

    def __init__(self, api: ApiContext, config: ViewConfig) -> None:
        self.api = api
        self.config = config
        self.tokens = ViewTokens(config)

    async def _live_edge(self, sandbox_id: str) -> EdgeAPI:
        edge = self.api.placement.edge_for(sandbox_id)
        info = await edge.get(sandbox_id)
        if info.state not in LIVE:
            raise errors.SandboxDead(f"sandbox {sandbox_id} is {info.state}", state=info.state)
        return edge

    async def _authorized(self, sandbox_id: str, cookies: dict[str, str]) -> tuple[
            EdgeAPI, int, str]:
        _check_id(sandbox_id)
        exp, session = self.tokens.verify(cookies.get(COOKIE), sandbox_id)
        return await self._live_edge(sandbox_id), exp, session

    async def login(self, sandbox_id: str, code: str, request: Request) -> Response:
        _check_id(sandbox_id)
        token, exp, session = self.tokens.redeem(code, sandbox_id)
        edge = await self._live_edge(sandbox_id)
        await edge.record_event(sandbox_id, "computer.view_login", data=json.dumps(
            {"session": session, "expires_at": exp}))
        path = view_path(sandbox_id)
        body = (f'<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" '
                f'content="0;url={html.escape(path)}"><title>rollbox live view</title>'
                f'<a href="{html.escape(path)}">open the live view</a>')
        resp = HTMLResponse(body, headers=_page_headers())
        resp.set_cookie(COOKIE, token, max_age=max(1, exp - int(time.time())), path=path,
                        httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
        return resp

    async def page(self, sandbox_id: str, request: Request) -> Response:
        await self._authorized(sandbox_id, request.cookies)
        if self.config.novnc_dir is None or not (self.config.novnc_dir / "core" /
                                                 "rfb.js").is_file():
            raise errors.NotFound("noVNC is not installed on this api (make novnc)")
        sid = html.escape(sandbox_id)
        body = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>rollbox live view: {sid}</title>
<link rel="stylesheet" href="{PREFIX}/static/rollbox/view.css">
<script type="module" src="{PREFIX}/static/rollbox/view.js"></script>
</head><body data-sandbox="{sid}">
<header><strong>rollbox</strong> <span id="sandbox">{sid}</span>
<span id="status">connecting</span>
<button id="takeover" type="button">Take over</button>
<button id="release" type="button" hidden>Release</button>
<span id="mode">view only</span></header>
<main id="screen"></main>
</body></html>"""
        return HTMLResponse(body, headers=_page_headers())

    async def state(self, sandbox_id: str, request: Request) -> Response:
        edge, exp, session = await self._authorized(sandbox_id, request.cookies)
        info = await edge.get(sandbox_id)
        return _state(info, session, exp)

    async def takeover(self, sandbox_id: str, request: Request, taken: bool) -> Response:
        edge, exp, session = await self._authorized(sandbox_id, request.cookies)
        _same_origin(request.headers)
        if request.headers.get(HEADER) != "1":
            raise errors.Forbidden(f"a take-over needs the {HEADER} header (the view page's "
                                   "own request)")
        info = await edge.display_takeover(sandbox_id, taken, _viewer(session))
        return _state(info, session, exp)

    async def websocket(self, sandbox_id: str, ws: WebSocket) -> None:
        stream = None
        try:
            edge, exp, session = await self._authorized(sandbox_id, ws.cookies)
            _same_origin(ws.headers)
            stream = await edge.display_open(sandbox_id, _viewer(session))
        except errors.RollboxError as exc:
            if stream is not None:
                await stream.close()
            await deny_websocket(ws.scope, ws.send, exc.status,
                                 json.dumps(exc.to_payload()).encode())
            return
        try:
            offered = ws.scope.get("subprotocols") or []
            await ws.accept(subprotocol="binary" if "binary" in offered else None)
            try:
                async with asyncio.timeout(max(0.0, exp - time.time())):
                    await _relay(ws, stream)
                code, why = 1000, ""
            except TimeoutError:
                code, why = 1008, "live view token expired"
            except errors.RollboxError as exc:
                code, why = 1008, exc.message[:120]
            with contextlib.suppress(Exception):
                await ws.close(code=code, reason=why)
        finally:
            await stream.close()


def _viewer(session: str) -> str:
    """The viewer a view session is to the edge (its take-over's holder, its streams')."""
    return f"live view {session}"


def _state(info: SandboxInfo, session: str, exp: int) -> JSONResponse:
    """The page's view of the take-over: ``taken_over`` by anyone, ``yours`` when this
    session holds the mouse and keyboard (rollbox.edge.takeover: only its input counts)."""
    return JSONResponse({"sandbox_id": info.id, "taken_over": info.taken_over,
                         "yours": info.taken_over and info.taken_over_by == _viewer(session),
                         "takeovers": info.takeovers, "expires_at": exp},
                        headers={"cache-control": "no-store"})


async def _relay(ws: WebSocket, stream: Any) -> None:
    """Bytes both ways until either side ends; the edge's refusal of what the viewer sent
    (BadRequest of the RFB filter) is raised."""

    async def down() -> None:
        while data := await stream.read():
            await ws.send_bytes(data)

    async def up() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            data = msg.get("bytes")
            if data is None:
                raise errors.BadRequest("the live view's WebSocket carries binary RFB only")
            if len(data) > WS_MAX_MESSAGE:
                raise errors.PayloadTooLarge("a live view message over 1 MiB")
            await stream.write(data)

    tasks = (asyncio.ensure_future(down()), asyncio.ensure_future(up()))
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            exc = task.exception()
            if isinstance(exc, errors.RollboxError):
                raise exc
            if exc is not None and not isinstance(exc, (OSError, WebSocketDisconnect)):
                raise exc
    finally:
        await end_pumps(*tasks)


def _page_headers() -> dict[str, str]:
    return {"content-security-policy": CSP, "cache-control": "no-store",
            "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
            "x-frame-options": "DENY"}


def install(app: FastAPI, api: ApiContext, config: ViewConfig) -> ViewTokens:
    """Mount the view's static files and routes on ``app`` (``app.state.view``)."""
    view = LiveView(api, config)
    app.state.view = view
    if config.novnc_dir is not None:
        app.mount(f"{PREFIX}/static/novnc",
                  StaticFiles(directory=config.novnc_dir, check_dir=False), name="novnc")
    app.mount(f"{PREFIX}/static/rollbox", StaticFiles(directory=ASSETS), name="view-assets")

    @app.get(PREFIX + "/{sandbox_id}/login/{code}", include_in_schema=False)
    async def view_login(sandbox_id: str, code: str, request: Request) -> Response:
        return await view.login(sandbox_id, code, request)

    @app.get(PREFIX + "/{sandbox_id}/", include_in_schema=False)
    async def view_page(sandbox_id: str, request: Request) -> Response:
        return await view.page(sandbox_id, request)

    @app.get(PREFIX + "/{sandbox_id}/state", include_in_schema=False)
    async def view_state(sandbox_id: str, request: Request) -> Response:
        return await view.state(sandbox_id, request)

    @app.post(PREFIX + "/{sandbox_id}/takeover", include_in_schema=False)
    async def view_takeover(sandbox_id: str, request: Request) -> Response:
        return await view.takeover(sandbox_id, request, True)

    @app.post(PREFIX + "/{sandbox_id}/release", include_in_schema=False)
    async def view_release(sandbox_id: str, request: Request) -> Response:
        return await view.takeover(sandbox_id, request, False)

    @app.websocket(PREFIX + "/{sandbox_id}/ws")
    async def view_ws(sandbox_id: str, websocket: WebSocket) -> None:
        await view.websocket(sandbox_id, websocket)

    return view.tokens


__all__ = ["COOKIE", "LiveView", "ViewConfig", "ViewTokens", "install", "view_path"]
