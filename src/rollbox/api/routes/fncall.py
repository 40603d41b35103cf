"""Routes of the fncall service (``rollbox.fncall``).

``POST /v1/fncall`` one call (the hot path: no FastAPI dependency solving or response
re-validation; the body is parsed by pydantic-core straight from JSON and the result dumped
straight to JSON, the OpenAPI schema is declared by hand); ``POST /v1/fncall/batch`` many,
bounded concurrency, results in order; ``GET /v1/fncall/stats`` the pools. The pools live on
``app.state.fncall`` (front doors, e.g. SandboxFusion's ``/run_code``, use the same pools) and
are built at start-up over the first edge of the api's placement (:func:`pools`).
"""
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from pydantic import ValidationError

from rollbox import errors
from rollbox.api.context import ApiContext
from rollbox.api.deps import Who, context_of, request_key
from rollbox.api.errors import validation_message
from rollbox.edge.interface import EdgeAPI
from rollbox.fncall import FnCallBackend
from rollbox.models import (
    FnCallBatchItem,
    FnCallBatchRequest,
    FnCallBatchResult,
    FnCallResult,
    FnCallSpec,
)

router = APIRouter(tags=["fncall"])
_SPEC_SCHEMA = {"$ref": "#/components/schemas/FnCallSpec"}


def pool_edge(api: ApiContext) -> EdgeAPI | None:
    """The edge the pools make their workers on: the placement's first (its faces the pools
    need, ``platform_exec`` and ``capacity``, are EdgeAPI methods: local or remote alike)."""
    return next(iter(api.placement.edges.values()), None)


def backend_of(request: Request) -> FnCallBackend:
    backend: FnCallBackend | None = getattr(request.app.state, "fncall", None)
    if backend is None:
        raise errors.InfraError("the fncall backend is not available on this api (no edge)")
    return backend


@router.post("/v1/fncall", response_model=FnCallResult,
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": _SPEC_SCHEMA}}}})
async def fncall(request: Request) -> Response:
    await context_of(request).principal(request_key(request))
    try:
        spec = FnCallSpec.model_validate_json(await request.body())
    except ValidationError as exc:
        raise errors.BadRequest(validation_message(exc.errors())) from None
    res = await backend_of(request).call(spec)
    return Response(res.model_dump_json(), media_type="application/json")


@router.post("/v1/fncall/batch", response_model=FnCallBatchResult)
async def fncall_batch(body: FnCallBatchRequest, request: Request, _: Who
                       ) -> FnCallBatchResult:
    out = await backend_of(request).batch(body.calls, body.concurrency)
    return FnCallBatchResult(results=[
        FnCallBatchItem(error=r.to_payload()["error"]) if isinstance(r, errors.RollboxError)
        else FnCallBatchItem(result=r) for r in out])


@router.get("/v1/fncall/stats")
async def fncall_stats(request: Request, _: Who) -> dict[str, Any]:
    return backend_of(request).stats()


@contextlib.asynccontextmanager
async def pools(app: FastAPI, api: ApiContext) -> AsyncIterator[None]:
    """The app's fncall pools for its lifetime (none without an edge)."""
    edge = pool_edge(api)
    if edge is None:
        yield
        return
    backend = FnCallBackend(edge)
    app.state.fncall = backend
    await backend.start()
    try:
        yield
    finally:
        app.state.fncall = None
        await backend.close()
