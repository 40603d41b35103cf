"""FastAPI dependencies of the api's routes: the app's :class:`ApiContext`, the caller
(:func:`principal`: every route and front door reads the key the same way), an admin caller,
and the edge of a sandbox the caller may use.

All are ``async def``: FastAPI runs a plain ``def`` dependency in its thread pool.
"""
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from rollbox import errors, trace
from rollbox.api.context import ApiContext
from rollbox.api.sessions import cookie_principal
from rollbox.edge.interface import EdgeAPI
from rollbox.iam import Principal

_bearer = HTTPBearer(auto_error=False)
_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False)


def context_of(request: Request) -> ApiContext:
    """The context of the app serving ``request`` (for routes that skip dependency solving)."""
    api: ApiContext = request.app.state.api
    return api


async def context(request: Request) -> ApiContext:
    return context_of(request)


Api = Annotated[ApiContext, Depends(context)]


def request_key(request: Request) -> str | None:
    """The API key of a request: ``Authorization: Bearer`` first, else ``X-API-Key`` (what
    :func:`principal` reads, for routes that skip FastAPI's dependency solving)."""
    scheme, _, cred = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and cred:
        return cred
    return request.headers.get("x-api-key")


async def principal(
    request: Request,
    cred: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    header_key: Annotated[str | None, Security(_api_key_header)],
) -> Principal:
    """The caller, by the keys of the app's context; without a key, a GET or HEAD may carry
    a dashboard session (api.sessions: read-only by construction). The caller's project is
    kept on the request for the recent-errors ring."""
    return await caller(request, cred.credentials if cred is not None else header_key)


async def caller(request: Request, key: str | None) -> Principal:
    """:func:`principal` given the request's key (``request_key``: for the routes that skip
    FastAPI's dependency solving; the same checks, in the same order)."""
    who = await cookie_principal(request) if key is None else None
    if who is None:
        who = await context_of(request).principal(key)
    request.state.caller_project = who.project
    return who


Who = Annotated[Principal, Depends(principal)]


async def admin_principal(who: Who) -> Principal:
    """The caller of an operator-only route: Forbidden for any other key (a project admin's
    included)."""
    if not who.admin:
        raise errors.Forbidden("this needs an admin key")
    return who


AdminWho = Annotated[Principal, Depends(admin_principal)]


async def edge_of(sandbox_id: str, who: Who, request: Request) -> EdgeAPI:
    """The edge of the route's sandbox; NotFound for another project's (it looks absent).
    The context from the request, not ``Api``: a dependency more costs every exec and file
    request ~10 us of FastAPI's solving. The sandbox is bound for the request's log lines
    (rollbox.trace)."""
    trace.bind_sandbox(sandbox_id)
    return await context_of(request).sandbox_edge(sandbox_id, who)


Edge = Annotated[EdgeAPI, Depends(edge_of)]
