"""How the api answers an error: the typed error tree (``rollbox.errors``) -> HTTP status and
the one error body (``RollboxError.to_payload`` with the request's id,
``error.request_id``), for what routes raise, for FastAPI's request
validation, for Starlette's own HTTP errors (404 route, 405 method, 413 body cap) and for a bug.

Owns the mapping only; front doors with a peer's error format (E2B, SWE-ReX) answer their own.
"""
import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollbox import errors, trace
from rollbox.iam import Principal

log = logging.getLogger(__name__)

RECENT_ERRORS = 200  # error answers the dashboard can list

HTTP_STATUS_ERRORS: dict[int, type[errors.RollboxError]] = {
    400: errors.BadRequest,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    405: errors.BadRequest,
    413: errors.PayloadTooLarge,
}


def error_payload(err: errors.RollboxError) -> dict[str, Any]:
    """``err.to_payload()`` with the request's id as ``error.request_id`` (rollbox.trace)."""
    payload = err.to_payload()
    rid = trace.request_id.get()
    if rid is not None:
        payload["error"]["request_id"] = rid
    return payload


def error_response(err: errors.RollboxError, status: int | None = None) -> JSONResponse:
    return JSONResponse(error_payload(err), status_code=status or err.status)


def validation_message(errs: Sequence[Any]) -> str:
    """One line from pydantic's ``.errors()`` (FastAPI's request validation or a model's own),
    the message of every BadRequest for malformed input."""
    parts = []
    for e in errs:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


@dataclass(frozen=True)
class ErrorSeen:
    """One error answer, as the dashboard lists it (api.dashboard)."""

    ts: float
    request_id: str | None
    method: str
    route: str  # the route's template, never the path (it may hold ids of others)
    status: int
    code: str
    message: str
    project: str | None  # the caller's, when the key was read

    def visible_to(self, who: Principal) -> bool:
        return who.admin or (self.project is not None and (
            self.project == who.project or who.administers(self.project)))


class RecentErrors:
    """The last ``keep`` error answers of this api (``app.state.recent_errors``)."""

    def __init__(self, keep: int = RECENT_ERRORS) -> None:
        self._ring: collections.deque[ErrorSeen] = collections.deque(maxlen=keep)

    def add(self, e: ErrorSeen) -> None:
        self._ring.append(e)

    def visible(self, who: Principal) -> list[ErrorSeen]:
        """Newest first, those ``who`` may see (an admin all; a key its project's)."""
        return [e for e in reversed(self._ring) if e.visible_to(who)]


def logged(request: Request, err: errors.RollboxError, status: int) -> None:
    """One line per error answer, naming the request id (bound: rollbox.trace), so a client's
    ``err.request_id`` finds it: a platform fault (5xx) as a warning, a refusal as info; and
    the answer kept among the recent errors."""
    log.log(logging.WARNING if status >= 500 else logging.INFO, "%s %s -> %d %s: %s",
            request.method, request.url.path, status, err.code, err.message)
    route = request.scope.get("route")
    request.app.state.recent_errors.add(ErrorSeen(
        time.time(), trace.request_id.get(), request.method,
        getattr(route, "path", None) or "unmatched", status, err.code, err.message[:300],
        getattr(request.state, "caller_project", None)))


async def _rollbox_error(request: Request, exc: errors.RollboxError) -> JSONResponse:
    logged(request, exc, exc.status)
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = errors.BadRequest(validation_message(exc.errors()))
    logged(request, err, err.status)
    return error_response(err)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    cls = HTTP_STATUS_ERRORS.get(exc.status_code, errors.RollboxError)
    err = cls(str(exc.detail))
    logged(request, err, exc.status_code)
    return error_response(err, exc.status_code)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(errors.RollboxError("internal error"))


def install(app: FastAPI) -> None:
    """The handlers of every error an app's routes and front doors can raise, and the ring
    of recent ones."""
    app.state.recent_errors = RecentErrors()
    app.exception_handler(errors.RollboxError)(_rollbox_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(Exception)(_unexpected)
