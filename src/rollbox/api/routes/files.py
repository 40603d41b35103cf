"""Routes ``/v1/sandboxes/{id}/files`` and ``/tar``: single files streamed both ways, stat,
list, mkdir, remove, tar upload/download. Bodies are capped per route (``api.bodies``)."""
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from rollbox import errors, models
from rollbox.api.bodies import MAX_FILE_STREAM, body_chunks
from rollbox.api.deps import Edge
from rollbox.api.streams import primed

router = APIRouter(tags=["files"])
PathQ = Annotated[str, Query(min_length=1, max_length=4096)]


class MkdirRequest(BaseModel):
    path: str = Field(..., min_length=1, max_length=4096)
    parents: bool = True


@router.get("/v1/sandboxes/{sandbox_id}/files",
            responses={200: {"content": {"application/octet-stream": {}}}})
async def file_read(sandbox_id: str, path: PathQ, edge: Edge,
                    offset: Annotated[int, Query(ge=0, le=1 << 62)] = 0) -> Response:
    """The file's bytes from ``offset`` on (the SDK resumes a broken download there)."""
    stream = await primed(edge.file_read_stream(sandbox_id, path, MAX_FILE_STREAM, offset),
                          10.0)
    return StreamingResponse(stream, media_type="application/octet-stream")


@router.put("/v1/sandboxes/{sandbox_id}/files", status_code=204)
async def file_write(sandbox_id: str, path: PathQ, request: Request, edge: Edge,
                     mode: str = "644") -> Response:
    try:
        mode_i = int(mode.removeprefix("0o"), 8)
    except ValueError:
        raise errors.BadRequest(f"mode must be octal, got {mode!r}") from None
    if not 0 <= mode_i <= 0o7777:
        raise errors.BadRequest(f"mode out of range: {mode!r}")
    await edge.file_write_stream(sandbox_id, path, body_chunks(request), mode_i,
                                 MAX_FILE_STREAM)
    return Response(status_code=204)


@router.get("/v1/sandboxes/{sandbox_id}/files/stat", response_model=models.FileStat)
async def file_stat(sandbox_id: str, path: PathQ, edge: Edge) -> models.FileStat:
    return await edge.file_stat(sandbox_id, path)


@router.get("/v1/sandboxes/{sandbox_id}/files/list", response_model=list[models.FileStat])
async def file_list(sandbox_id: str, path: PathQ, edge: Edge) -> list[models.FileStat]:
    return await edge.file_list(sandbox_id, path)


@router.post("/v1/sandboxes/{sandbox_id}/files/mkdir", status_code=204)
async def file_mkdir(sandbox_id: str, body: MkdirRequest, edge: Edge) -> Response:
    await edge.file_mkdir(sandbox_id, body.path, body.parents)
    return Response(status_code=204)


@router.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
async def file_remove(sandbox_id: str, path: PathQ, edge: Edge,
                      recursive: bool = False) -> Response:
    await edge.file_remove(sandbox_id, path, recursive)
    return Response(status_code=204)


@router.put("/v1/sandboxes/{sandbox_id}/tar")
async def tar_upload(sandbox_id: str, path: PathQ, request: Request,
                     edge: Edge) -> dict[str, int]:
    written = await edge.upload_tar(sandbox_id, path, body_chunks(request))
    return {"written": written}


@router.get("/v1/sandboxes/{sandbox_id}/tar",
            responses={200: {"content": {"application/x-tar": {}}}})
async def tar_download(sandbox_id: str, path: PathQ, edge: Edge) -> Response:
    stream = await primed(edge.download_tar(sandbox_id, path), 10.0)
    return StreamingResponse(stream, media_type="application/x-tar")
