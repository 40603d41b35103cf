"""The operator dashboard: a read-only page the api serves (``/dashboard``) that shows nodes
and their capacity, live sandboxes with filters, one sandbox's command log with its live
output, its events and network denials, and recent errors.

Sign-in exchanges an API key (``POST /dashboard/login``) for a session cookie
(``rollbox_dashboard``: HttpOnly, SameSite=Strict, ``Secure`` over https): a token signed with
a key of its own (derived from the api's port-token secret, so replicas sharing that secret
accept each other's), naming the key's principal and an expiry; the key is never stored in the
browser. At every use the key must still be active (a revoked key's sessions end at once).
The page's script reads the ordinary ``/v1`` routes with the cookie: :func:`cookie_principal`
is what ``api.deps.principal`` falls back to for a GET or HEAD without a key, so the cookie can
only read (anything else still needs the key itself), and what a key sees is what its session
sees (an admin key every project, a project key its own). Sandbox-served content never runs on
this origin: the port proxy's path form answers with ``Content-Security-Policy: sandbox`` (an
opaque origin, which a SameSite=Strict cookie is not sent from) and drops the api's cookies on
the way in (api.ports). The page itself is static (``static/dashboard``: plain HTML, CSS and a
script, no framework, nothing fetched at run time) under a strict CSP.

Owns the session tokens, the login/logout routes, the page, the dashboard's own list route
(filters checked: an unknown one is a BadRequest) and the recent-errors ring the error
handlers feed; must not touch what the ``/v1`` routes answer.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Form, Query, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse

from rollbox import errors, models
from rollbox.api.deps import Api, Who
from rollbox.api.errors import RecentErrors
from rollbox.api.sessions import COOKIE, Sessions, cookie_principal

STATIC = Path(__file__).resolve().parent / "static" / "dashboard"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
FILTERS = ("project", "label", "backend", "state")
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    # same-origin, not no-referrer: under no-referrer a form post says "Origin: null", which
    # the sign-in's same-origin check must refuse
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

router = APIRouter(tags=["dashboard"])


# ---- routes ---------------------------------------------------------------------------

def _page(name: str) -> HTMLResponse:
    return HTMLResponse((STATIC / name).read_text(), headers=HEADERS)


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard(request: Request) -> Response:
    """The page if the request has a valid session, else the sign-in page."""
    try:
        who = await cookie_principal(request)
    except errors.Unauthorized:
        who = None
    return _page("index.html" if who is not None else "login.html")


@router.get("/dashboard/static/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    if name not in ASSETS:
        raise errors.NotFound(f"no dashboard asset {name!r}")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers=HEADERS)


def _same_origin(request: Request) -> None:
    """A sign-in posted from another site's page (login CSRF) is refused."""
    origin = request.headers.get("origin")
    host = request.headers.get("host", "")
    if origin is not None and origin.split("://", 1)[-1] != host:
        raise errors.Forbidden("a dashboard sign-in must come from the dashboard's own page")


@router.post("/dashboard/login", include_in_schema=False)
async def dashboard_login(request: Request, api: Api,
                          key: Annotated[str, Form(max_length=512)]) -> Response:
    _same_origin(request)
    who = await api.principal(key.strip())
    sessions: Sessions = request.app.state.dashboard_sessions
    resp = RedirectResponse("/dashboard", status_code=303, headers=HEADERS)
    resp.set_cookie(COOKIE, sessions.issue(who), max_age=int(sessions.ttl_s), path="/",
                    httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return resp


@router.post("/dashboard/logout", include_in_schema=False)
async def dashboard_logout(request: Request) -> Response:
    _same_origin(request)
    resp = RedirectResponse("/dashboard", status_code=303, headers=HEADERS)
    resp.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return resp


@router.get("/dashboard/api/whoami", include_in_schema=False)
async def dashboard_whoami(who: Who) -> dict[str, Any]:
    return {"project": who.project, "admin": who.admin, "key_id": who.key_id}


@router.get("/dashboard/api/nodes", include_in_schema=False)
async def dashboard_nodes(who: Who, api: Api) -> list[dict[str, Any]]:
    """Every node the api places on, with its capacity as its edge reports it (or the error
    that edge answered: the page shows a node it can not reach as such)."""
    out: list[dict[str, Any]] = []
    for node, edge in sorted(dict(api.placement.edges).items()):
        try:
            cap = await edge.capacity()
        except errors.RollboxError as exc:
            out.append({"node": node, "health": f"{exc.code}: {exc.message}"})
            continue
        out.append({"node": node, "health": "ok", "sandboxes": cap.get("sandboxes"),
                    "max_sandboxes": cap.get("max_sandboxes"),
                    "memory_available_mib": cap.get("memory_available_mib"),
                    "requested_cpus": cap.get("requested_cpus")})
    return out


@router.get("/dashboard/api/sandboxes", response_model=list[models.SandboxInfo],
            include_in_schema=False)
async def dashboard_sandboxes(
    request: Request, who: Who, api: Api,
    project: Annotated[str | None, Query(max_length=128)] = None,
    label: Annotated[list[str], Query()] = [],  # noqa: B006 - FastAPI's query list
    backend: Annotated[str | None, Query(max_length=32)] = None,
    state: Annotated[list[models.SandboxState], Query()] = [],  # noqa: B006
) -> list[models.SandboxInfo]:
    """The live sandboxes ``who`` may see, filtered (every filter ANDed; unknown filters are a
    BadRequest naming them, not ignored)."""
    from rollbox.api.routes.sandboxes import list_sandboxes

    unknown = sorted(set(request.query_params) - set(FILTERS))
    if unknown:
        raise errors.BadRequest(f"unknown dashboard filter(s): {', '.join(unknown)} (known: "
                                f"{', '.join(FILTERS)})", unknown=unknown)
    found = await list_sandboxes(who=who, api=api, label=label, state=state, job=None,
                                 project=project)
    return [s for s in found if backend is None or s.backend == backend]


@router.get("/dashboard/api/errors", include_in_schema=False)
async def dashboard_errors(request: Request, who: Who) -> list[dict[str, Any]]:
    ring: RecentErrors = request.app.state.recent_errors
    return [e.__dict__ for e in ring.visible(who)]