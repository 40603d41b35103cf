"""How the api answers an error: the typed error tree (``rollbox.errors``) -> HTTP status and
the one error body (``RollboxError.to_payload``), for what routes raise, for FastAPI's request
validation, for Starlette's own HTTP errors (404 route, 405 method, 413 body cap) and for a bug.

Owns the mapping only; front doors with a peer's error format (E2B, SWE-ReX) answer their own.
"""
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollbox import errors

log = logging.getLogger(__name__)

HTTP_STATUS_ERRORS: dict[int, type[errors.RollboxError]] = {
    400: errors.BadRequest,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    405: errors.BadRequest,
    413: errors.PayloadTooLarge,
}


def error_response(err: errors.RollboxError) -> JSONResponse:
    return JSONResponse(err.to_payload(), status_code=err.status)


def validation_message(errs: Sequence[Any]) -> str:
    """One line from pydantic's ``.errors()`` (FastAPI's request validation or a model's own),
    the message of every BadRequest for malformed input."""
    parts = []
    for e in errs:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


async def _rollbox_error(_: Request, exc: errors.RollboxError) -> JSONResponse:
    return error_response(exc)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(errors.BadRequest(validation_message(exc.errors())))


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    cls = HTTP_STATUS_ERRORS.get(exc.status_code, errors.RollboxError)
    err = cls(str(exc.detail))
    return JSONResponse(err.to_payload(), status_code=exc.status_code)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(errors.RollboxError("internal error"))


def install(app: FastAPI) -> None:
    """The handlers of every error an app's routes and front doors can raise."""
    app.exception_handler(errors.RollboxError)(_rollbox_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(Exception)(_unexpected)
