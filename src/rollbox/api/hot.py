"""The lean path of the routes every sandbox's cycle calls (create, exec, delete): each such
route keeps its FastAPI declaration (its OpenAPI schema, its parameters' documentation) but is
served by a plain ``handler(request)`` that reads what FastAPI's dependency solving would have
given it, by the same rules: the caller (:func:`caller`, the key as ``deps.principal`` reads
it), the JSON body parsed and validated by its model as FastAPI does it (:func:`json_body`), a
header or query parameter by its own validator (:func:`param`); the caller before the body.
Malformed input raises FastAPI's ``RequestValidationError`` with the locations and messages
FastAPI gives, so it reaches the same error handler (``api.errors``: BadRequest with the
request's id); every other error goes to the app's handlers as from any route (Starlette's
``request_response``).

Owns the parsing of those requests; what a route does is the route module's (the FastAPI
endpoint and its lean handler call the same function). Measured in ``docs/benchmarks.md``
("The api's lean path").
"""
from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, request_response

from rollbox.api import deps
from rollbox.api.deps import request_key
from rollbox.iam import Principal

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


async def caller(request: Request) -> Principal:
    """The caller, as ``deps.principal`` finds it (``deps.caller`` with the request's key)."""
    return await deps.caller(request, request_key(request))


def _is_json(content_type: str | None) -> bool:
    """FastAPI's test of a body's type (strict: a body without one is not JSON)."""
    if not content_type:
        return False
    main, _, sub = content_type.partition(";")[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _located(errs: Iterable[Any], where: tuple[str | int, ...]) -> list[dict[str, Any]]:
    return [{**e, "loc": (*where, *e.get("loc", ()))} for e in errs]


async def json_body(request: Request, model: type[M]) -> M:
    """The request's body as ``model`` (a required body); RequestValidationError as FastAPI
    raises it for a missing, non-JSON, malformed or invalid one."""
    raw = await request.body()
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    if not _is_json(request.headers.get("content-type")):
        return _validated_python(model, raw)  # FastAPI validates the bytes themselves
    try:  # json, then the model in Python mode: FastAPI's steps, so its very messages
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{
            "type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
            "input": {}, "ctx": {"error": exc.msg}}], body=exc.doc) from None
    return _validated_python(model, data)


def _validated_python(model: type[M], value: object) -> M:
    try:
        return model.model_validate(value, from_attributes=True)  # as FastAPI validates
    except ValidationError as exc:
        raise RequestValidationError(_located(exc.errors(), ("body",))) from None


def param(values: Mapping[str, str], name: str, where: str, adapter: TypeAdapter[T],
          default: T) -> T:
    """The header (``where`` "header") or query parameter ``name`` of ``values`` by
    ``adapter`` (the constraints of its declaration), ``default`` when absent."""
    raw = values.get(name)
    if raw is None:
        return default
    try:
        return adapter.validate_python(raw)
    except ValidationError as exc:
        raise RequestValidationError(_located(exc.errors(), (where, name))) from None


def install(routes: list[BaseRoute], handlers: Mapping[Callable[..., Any], Handler]) -> None:
    """Serve each route of ``routes`` (an app's own list) whose endpoint has a lean handler in
    ``handlers`` by it: a copy of the route takes its place (the routers' route objects are
    shared by every app made in the process), its matching, methods and schema unchanged."""
    for i, route in enumerate(routes):
        if isinstance(route, APIRoute) and route.endpoint in handlers:
            lean = copy.copy(route)
            lean.app = request_response(handlers[route.endpoint])
            routes[i] = lean
