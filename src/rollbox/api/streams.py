"""Streamed responses: NDJSON lines (exec output, events) and :func:`primed`, which turns an
early error of a stream into a proper HTTP status instead of a truncated 200."""
import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from rollbox import errors
from rollbox.api.errors import error_payload
from rollbox.edge.interface import ExecOutput

NDJSON = "application/x-ndjson"
T = TypeVar("T")


def ndjson(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def output_line(item: ExecOutput) -> bytes | None:
    """One item of a command's output stream as its NDJSON line (None: not sent)."""
    if item.kind in ("stdout", "stderr"):
        return ndjson({"type": item.kind, "data": base64.b64encode(item.data).decode(),
                       "offset": item.offset})
    if item.kind == "exit" and item.result is not None:
        return ndjson({"type": "exit", "result": item.result.model_dump(mode="json")})
    if item.kind == "error":
        err = item.error
        if not isinstance(err, errors.RollboxError):
            err = errors.InfraError(f"exec stream failed: {err!r}")
        return ndjson({"type": "error", **error_payload(err)})
    return None


async def primed(agen: AsyncIterator[T], wait_s: float) -> AsyncIterator[T]:
    """Start ``agen`` and wait briefly for its first item so that an early error (unknown exec,
    missing path) becomes a proper HTTP status instead of a truncated 200 stream."""
    first: asyncio.Future[T] = asyncio.ensure_future(agen.__anext__())  # type: ignore[arg-type]
    done, _ = await asyncio.wait({first}, timeout=wait_s)
    if done:
        exc = first.exception()
        if isinstance(exc, StopAsyncIteration):
            first = None  # type: ignore[assignment]
        elif exc is not None:
            raise exc

    async def rest() -> AsyncIterator[T]:
        try:
            if first is None:
                return
            try:
                yield await first
            except StopAsyncIteration:
                return
            async for item in agen:
                yield item
        finally:
            if first is not None and not first.done():
                first.cancel()
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    return rest()
