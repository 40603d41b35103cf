"""Request bodies: the cap of each route's body (:class:`BodyLimitMiddleware`, enforced while
it streams in; Content-Length is not trusted) and bodies read as chunks.

Owns the limits; the edge still caps what a write can store (the sandbox's disk, the image
upload's bytes).
"""
from collections.abc import AsyncIterator

from fastapi import Request, UploadFile
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollbox import errors
from rollbox.api.errors import error_payload

MAX_JSON_BODY = 1 << 20
MAX_FILE_WRITE = 256 << 20
MAX_TAR_UPLOAD = 2 << 30
# One streamed file (GET/PUT .../files): memory stays bounded; the sandbox's disk cap still
# bounds what a write can store.
MAX_FILE_STREAM = 16 << 30
MAX_STDIN_BODY = 16 << 20
# An image upload's tar (the edge caps the bytes of its files by image_upload_max_bytes).
MAX_IMAGE_UPLOAD = 64 << 30


def body_limit(method: str, path: str) -> int:
    if method == "PUT" and path.endswith("/files"):
        return MAX_FILE_STREAM
    if method == "PUT" and path.endswith("/tar"):
        return MAX_TAR_UPLOAD
    if method == "POST" and path == "/v1/images":
        return MAX_IMAGE_UPLOAD
    if method == "POST" and path.endswith("/stdin"):
        return MAX_STDIN_BODY
    if method == "POST" and path == "/e2b/envd/files":  # E2B's multipart file upload
        return MAX_FILE_WRITE
    if method == "POST" and path.startswith("/swerex/"):  # SWE-ReX: zip upload, inline write
        if path.endswith("/upload"):
            return MAX_TAR_UPLOAD
        if path.endswith("/write_file"):
            return MAX_FILE_WRITE
    return MAX_JSON_BODY


class BodyLimitMiddleware:
    """Caps request bodies per route while they stream in (Content-Length is not trusted)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = body_limit(scope["method"], scope["path"])
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    err = errors.PayloadTooLarge(f"request body over {limit} bytes", limit=limit)
                    await JSONResponse(error_payload(err), err.status)(scope, receive, send)
                    return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    # HTTPException passes through FastAPI's body parsing untouched.
                    raise StarletteHTTPException(413, f"request body over {limit} bytes")
            return msg

        await self.app(scope, limited_receive, send)


async def body_chunks(request: Request) -> AsyncIterator[bytes]:
    """A request body as it streams in (BodyLimitMiddleware caps it per route)."""
    async for chunk in request.stream():
        if chunk:
            yield chunk


async def upload_chunks(upload: UploadFile, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """A multipart file part (spooled by Starlette) in chunks, for ``file_write_stream``."""
    while chunk := await upload.read(size):
        yield chunk
