"""Routes ``/v1/sandboxes/{id}/exec``: start (NDJSON stream, background, or wait), list,
re-attach from byte offsets, wait, stdin, kill, resize (a pty command's terminal). A started command is recorded into the audit
log by a task of its own, independent of any client stream."""
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, TypeAdapter

from rollbox import errors, models
from rollbox.api import hot
from rollbox.api.deps import Edge, edge_of
from rollbox.api.errors import error_payload
from rollbox.api.streams import NDJSON, ndjson, output_line, primed
from rollbox.edge.interface import EdgeAPI, ExecOutput

log = logging.getLogger(__name__)
router = APIRouter(tags=["exec"])


class KillRequest(BaseModel):
    signal: int = Field(9, ge=1, le=64)


class ExecStarted(BaseModel):
    exec_id: str


def exec_stream_response(edge: EdgeAPI, sandbox_id: str, exec_id: str,
                         stream: AsyncIterator[ExecOutput] | None = None) -> Response:
    """NDJSON: started, then stdout/stderr (base64 ``data`` at stream ``offset``: a client
    that resumes passes what it has; an offset past it is output lost for good), then one
    exit (or error)."""
    async def body() -> AsyncIterator[bytes]:
        yield ndjson({"type": "started", "exec_id": exec_id})
        try:
            it = stream if stream is not None else edge.exec_stream(sandbox_id, exec_id)
            async for item in it:
                line = output_line(item)
                if line is not None:
                    yield line
                if item.kind in ("exit", "error"):
                    return
            # Stream ended without an exit: the sandbox went away under the command.
            yield ndjson({"type": "error", **error_payload(errors.SandboxDead(
                "exec stream ended without an exit status"))})
        except errors.RollboxError as exc:
            yield ndjson({"type": "error", **error_payload(exc)})
        except Exception as exc:  # noqa: BLE001 - reported in-band, headers are sent
            log.exception("exec stream %s/%s failed", sandbox_id, exec_id)
            yield ndjson({"type": "error", **error_payload(errors.InfraError(
                f"exec stream failed: {exc!r}"))})

    # A client that disconnects cancels only this generator; the command keeps running.
    return StreamingResponse(body(), media_type=NDJSON,
                             headers={"X-Rollbox-Exec-Id": exec_id})


async def _exec(edge: EdgeAPI, sandbox_id: str, spec: models.ExecSpec, wait: bool) -> Response:
    if wait and not spec.background:  # start and wait: one edge call (the edge logs exec.*)
        result = await edge.exec_run(sandbox_id, spec)
        return Response(result.model_dump_json(), media_type="application/json")
    exec_id = await edge.exec_start(sandbox_id, spec)
    if spec.background:
        return JSONResponse(ExecStarted(exec_id=exec_id).model_dump())
    return exec_stream_response(edge, sandbox_id, exec_id)


@router.post("/v1/sandboxes/{sandbox_id}/exec",
             responses={200: {"content": {NDJSON: {}}, "description":
                              "NDJSON stream, {exec_id} if background, ExecResult if wait=1"}})
async def exec_start(
    sandbox_id: str, spec: models.ExecSpec, edge: Edge,
    wait: Annotated[bool, Query(description="return one ExecResult when done")] = False,
) -> Response:
    return await _exec(edge, sandbox_id, spec, wait)


_wait = TypeAdapter(bool)


async def exec_start_lean(request: Request) -> Response:
    """``exec_start`` served by ``api.hot``: the caller, then its sandbox (NotFound for
    another project's, before anything of the body is looked at), then the body."""
    sandbox_id = request.path_params["sandbox_id"]
    who = await hot.caller(request)
    edge = await edge_of(sandbox_id, who, request)
    spec = await hot.json_body(request, models.ExecSpec)
    wait = hot.param(request.query_params, "wait", "query", _wait, False)
    return await _exec(edge, sandbox_id, spec, wait)


@router.get("/v1/sandboxes/{sandbox_id}/exec", response_model=list[models.ExecInfo])
async def exec_list(sandbox_id: str, edge: Edge) -> list[models.ExecInfo]:
    return await edge.exec_list(sandbox_id)


@router.get("/v1/sandboxes/{sandbox_id}/exec/{exec_id}/stream",
            responses={200: {"content": {NDJSON: {}}}})
async def exec_attach(
    sandbox_id: str, exec_id: str, edge: Edge,
    stdout_offset: Annotated[int, Query(ge=0, description="stdout bytes the client has")] = 0,
    stderr_offset: Annotated[int, Query(ge=0, description="stderr bytes the client has")] = 0,
) -> Response:
    stream = await primed(
        edge.exec_stream(sandbox_id, exec_id, (stdout_offset, stderr_offset)), 0.2)
    return exec_stream_response(edge, sandbox_id, exec_id, stream)


@router.get("/v1/sandboxes/{sandbox_id}/exec/{exec_id}", response_model=models.ExecResult)
async def exec_wait(sandbox_id: str, exec_id: str, edge: Edge) -> models.ExecResult:
    return await edge.exec_wait(sandbox_id, exec_id)


@router.post("/v1/sandboxes/{sandbox_id}/exec/{exec_id}/stdin", status_code=204)
async def exec_stdin(sandbox_id: str, exec_id: str, request: Request, edge: Edge,
                     eof: bool = False) -> Response:
    data = await request.body()
    await edge.exec_stdin(sandbox_id, exec_id, data, eof)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/exec/{exec_id}/kill", status_code=204)
async def exec_kill(sandbox_id: str, exec_id: str, edge: Edge,
                    body: KillRequest | None = None) -> Response:
    await edge.exec_kill(sandbox_id, exec_id, (body or KillRequest()).signal)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/exec/{exec_id}/resize", status_code=204)
async def exec_resize(sandbox_id: str, exec_id: str, size: models.PtySize,
                      edge: Edge) -> Response:
    """The terminal size of a command started with ``pty`` (SIGWINCH to its foreground
    process group); cols and rows 1..1000 (BadRequest else, or without a terminal)."""
    await edge.exec_resize(sandbox_id, exec_id, size.cols, size.rows)
    return Response(status_code=204)


# The cycle's route served by api.hot's lean path (create_app installs it).
LEAN = {exec_start: exec_start_lean}
