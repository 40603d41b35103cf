"""Connect RPC (connectrpc.com/docs/protocol) server side, JSON codec only: unary calls are a
JSON body in and out; server-streaming calls take one enveloped message and answer with
enveloped messages (1 flag byte + 4-byte big-endian length + JSON) ending with an end-stream
envelope (flag 0x02) that carries ``{}`` or ``{"error": {...}}``.
"""
from __future__ import annotations

import json
import logging
import struct
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rollbox import errors

log = logging.getLogger(__name__)

END_STREAM = 0x02
COMPRESSED = 0x01
MAX_MESSAGE = 16 << 20
STREAM_MEDIA_TYPE = "application/connect+json"

# Connect code -> HTTP status of a unary error (the protocol's table).
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def from_rollbox(exc: BaseException) -> ConnectError:
    """The Connect error the E2B SDK expects for a rollbox error."""
    if isinstance(exc, ConnectError):
        return exc
    msg = str(exc)
    if isinstance(exc, errors.NotFound):
        return ConnectError("not_found", msg)
    if isinstance(exc, errors.NotSupported):
        return ConnectError("unimplemented", msg)
    if isinstance(exc, errors.Unauthorized):
        return ConnectError("unauthenticated", msg)
    if isinstance(exc, (errors.PayloadTooLarge, errors.QuotaExceeded)):
        return ConnectError("resource_exhausted", msg)
    if isinstance(exc, errors.CommandTimeout):
        return ConnectError("deadline_exceeded", msg)
    if isinstance(exc, (errors.SandboxDead, errors.InfraError)):
        return ConnectError("unavailable", msg)
    if isinstance(exc, errors.BadRequest):
        return ConnectError("invalid_argument", msg)
    if isinstance(exc, ValidationError):
        return ConnectError("invalid_argument", "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()))
    log.error("e2b envd call failed", exc_info=exc)
    return ConnectError("internal", f"internal error: {type(exc).__name__}")


def envelope(msg: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(msg, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_stream(err: ConnectError | None = None) -> bytes:
    if err is None:
        return envelope({}, END_STREAM)
    return envelope({"error": {"code": err.code, "message": err.message}}, END_STREAM)


def error_response(err: ConnectError) -> Response:
    return JSONResponse({"code": err.code, "message": err.message},
                        status_code=HTTP_STATUS.get(err.code, 500))


def _check_codec(request: Request, streaming: bool) -> None:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    want = STREAM_MEDIA_TYPE if streaming else "application/json"
    if ctype != want:
        raise ConnectError("unimplemented", f"content type {ctype!r} not supported (use {want})")
    enc = request.headers.get("connect-content-encoding" if streaming else "content-encoding")
    if enc not in (None, "", "identity"):
        raise ConnectError("unimplemented", f"encoding {enc!r} not supported")


async def read_message(request: Request, streaming: bool) -> dict[str, Any]:
    _check_codec(request, streaming)
    body = await request.body()
    if len(body) > MAX_MESSAGE + 5:
        raise ConnectError("resource_exhausted", "message too large")
    if streaming:
        if len(body) < 5:
            raise ConnectError("invalid_argument", "missing envelope")
        flags, size = struct.unpack(">BI", body[:5])
        if flags & COMPRESSED or size != len(body) - 5:
            raise ConnectError("invalid_argument", "bad envelope")
        body = body[5:]
    if not body:
        return {}
    try:
        msg = json.loads(body)
    except ValueError:
        raise ConnectError("invalid_argument", "body is not JSON") from None
    if not isinstance(msg, dict):
        raise ConnectError("invalid_argument", "message must be a JSON object")
    return msg


async def read_messages(request: Request) -> AsyncIterator[dict[str, Any]]:
    """The messages of a client stream, as they arrive (each at most ``MAX_MESSAGE``)."""
    _check_codec(request, streaming=True)
    buf = b""
    async for chunk in request.stream():
        buf += chunk
        while len(buf) >= 5:
            flags, size = struct.unpack(">BI", buf[:5])
            if flags & COMPRESSED or size > MAX_MESSAGE:
                raise ConnectError("invalid_argument", "bad envelope")
            if len(buf) < 5 + size:
                break
            body, buf = buf[5:5 + size], buf[5 + size:]
            if flags & END_STREAM:
                return
            try:
                msg = json.loads(body) if body else {}
            except ValueError:
                raise ConnectError("invalid_argument", "message is not JSON") from None
            if not isinstance(msg, dict):
                raise ConnectError("invalid_argument", "message must be a JSON object")
            yield msg
        if len(buf) > MAX_MESSAGE + 5:
            raise ConnectError("resource_exhausted", "message too large")
    if buf:
        raise ConnectError("invalid_argument", "truncated envelope")


def timeout_s(request: Request) -> float | None:
    """``connect-timeout-ms``: the deadline of the whole call."""
    raw = request.headers.get("connect-timeout-ms")
    if not raw:
        return None
    try:
        ms = int(raw)
    except ValueError:
        raise ConnectError("invalid_argument", "bad connect-timeout-ms") from None
    return ms / 1000 if ms > 0 else None
