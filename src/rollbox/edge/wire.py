"""What an edge served over HTTP (``edge.service``) and its client (``edge.remote``) speak: the
method tables, each method's validated arguments (built from ``EdgeAPI``'s own annotations,
with the bounds of each argument by name), the frames of every answer, and the caps.

Routes (all under ``/edge/v1``; every request carries ``Authorization: Bearer <cluster token>``):

- ``POST /call/{method}``: a unary method of :data:`UNARY`; the body is the arguments as one
  JSON object, or (a method with a ``bytes`` argument: ``file_write``, ``exec_stdin``) that JSON
  object, a newline, then the raw bytes.
- ``POST /stream/{method}``: a server stream of :data:`SERVER_STREAMS` (JSON arguments).
- ``PUT /upload/{method}``: a client stream of :data:`CLIENT_STREAMS`: the raw body is the
  ``chunks`` argument, the other arguments are JSON in the ``X-Rollbox-Args`` header.
- ``POST /platform_exec`` opens a platform process (JSON ``{sandbox_id, req}``): its answer
  streams the process's events; ``POST /proc/{handle}/stdin|close_stdin|kill`` drive it.
- ``/port`` (a WebSocket, the cluster token in its handshake's ``Authorization``): one
  connection of ``port_open`` (the port proxy). The client's first message is the JSON
  arguments (:class:`PortOpenArgs`); the edge answers ``{"ok": true}`` or an error payload
  (text), then binary messages are the bytes each way; a text ``{"eof": true}`` is a
  half-close (either way), a text error payload the edge's error at a read (PortNotListening)
  or at a write (the live view's BadRequest for what its viewer sent), after which it ends.
- ``/display`` (a WebSocket, the same way): one ``display_open`` stream (the live view's RFB
  bytes), its first message :class:`DisplayOpenArgs`, then exactly as ``/port``.

Every 200 answer is a sequence of frames, ``>BI`` (kind, payload length) + payload, and ends
with exactly one terminal frame: ``Z`` (done) or ``E`` (the method raised: a JSON error payload,
``RollboxError.to_payload``). Before it: ``h`` heartbeats (every ``heartbeat_s`` while nothing
else is sent: a client that hears nothing for longer knows the edge is gone), ``j`` a JSON item
(a unary result, an event, an exec's started/exit item, a platform process's handle or exit),
``d`` raw bytes (file and tar streams, a ``bytes`` result), ``o``/``e`` exec output (8-byte
stream offset + bytes), ``x`` an exec's in-band error item, ``k`` a platform process's output
(kind, NUL, bytes). A request refused before any work (401 token, 400 arguments, 404 route, 413
body) is a JSON error answer with that status instead.

Owns no connection and no edge; imports only the models, errors and the interface.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import re
import struct
import typing
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, create_model

from rollbox import errors
from rollbox.agent.protocol import ExecRequest
from rollbox.edge.interface import EdgeAPI
from rollbox.models import PTY_MAX_SIZE

PREFIX = "/edge/v1"
ARGS_HEADER = "x-rollbox-args"
MAX_ARGS_HEADER = 16 << 10

# The unary methods of EdgeAPI (POST /call/{name}): one name here is all a new one needs.
UNARY: tuple[str, ...] = (
    "capacity", "report", "declare_lost", "create", "get", "list", "delete", "set_ttl", "set_network", "pause", "resume", "wake",
    "usage_history",
    "exec_start", "exec_wait", "exec_run", "exec_stdin", "exec_kill", "exec_resize", "exec_list",
    "file_read", "file_write", "file_stat", "file_list", "file_mkdir", "file_remove",
    "grade", "snapshot", "fork", "image_list", "image_delete", "image_usage", "image_stats",
    "record_event", "run_shell", "screenshot", "display_info", "computer_action",
    "display_takeover",
)
# Async iterators of EdgeAPI (POST /stream/{name}).
SERVER_STREAMS: tuple[str, ...] = ("exec_stream", "file_read_stream", "download_tar", "events")
# Methods taking ``chunks: AsyncIterator[bytes]`` (PUT /upload/{name}: the body is the chunks).
CLIENT_STREAMS: tuple[str, ...] = ("file_write_stream", "upload_tar", "image_upload")
# platform_exec, port_open and display_open are channels of their own (module docstring).

# Caps of request bodies (the api's own, ``api.bodies``: an edge takes what the api passes on).
MAX_JSON_BODY = 1 << 20
MAX_BYTES_ARG = {"file_write": 256 << 20, "exec_stdin": 16 << 20}
MAX_UPLOAD = {"file_write_stream": 16 << 30, "upload_tar": 2 << 30, "image_upload": 64 << 30}
MAX_STDIN_BODY = 16 << 20
# The most a client reads of one frame (a chunk is at most CHUNK; JSON items are smaller).
MAX_FRAME = 64 << 20
CHUNK = 1 << 20

# Frame kinds.
HEARTBEAT, DONE, ERROR = b"h", b"Z", b"E"
JSON_ITEM, DATA, STDOUT, STDERR, EXEC_ERROR, PROC_OUTPUT = b"j", b"d", b"o", b"e", b"x", b"k"
HEAD = struct.Struct(">cI")
OFFSET = struct.Struct(">Q")


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return HEAD.pack(kind, len(payload)) + payload


HEARTBEAT_FRAME = frame(HEARTBEAT)
DONE_FRAME = frame(DONE)


def error_frame(exc: errors.RollboxError) -> bytes:
    return frame(ERROR, json.dumps(exc.to_payload(), separators=(",", ":")).encode())


def json_frame(obj: Any, kind: bytes = JSON_ITEM) -> bytes:
    return frame(kind, json.dumps(obj, separators=(",", ":")).encode())


def error_of(payload: Any, status: int = 500) -> errors.RollboxError:
    """The typed error of a payload (``error_from_payload``; DiskFull travels as bad_request
    with ``reason == "disk_full"`` and is rebuilt as such)."""
    exc = errors.error_from_payload(payload, status)
    if type(exc) is errors.BadRequest and exc.details.get("reason") == "disk_full":
        return errors.DiskFull(exc.message, **exc.details)
    return exc


# ---- arguments ----------------------------------------------------------------------------
# The bounds of every argument of EdgeAPI, by name (types come from the interface).
SANDBOX_ID = r"^[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*-[0-9a-f]{8,64}$"
_NO_CONTROL = r"^[^\x00-\x1f\x7f]+$"
_STR_BOUNDS: dict[str, StringConstraints] = {
    "sandbox_id": StringConstraints(max_length=200, pattern=SANDBOX_ID),
    "exec_id": StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$"),
    "path": StringConstraints(min_length=1, max_length=4096, pattern=r"^[^\x00]+$"),
    "owner": StringConstraints(min_length=1, max_length=128,
                               pattern=r"^[A-Za-z0-9@_][A-Za-z0-9_.\-/@:]*$"),
    "project": StringConstraints(min_length=1, max_length=128,
                                 pattern=r"^[A-Za-z0-9@_][A-Za-z0-9_.\-/@:]*$"),
    "name": StringConstraints(min_length=1, max_length=256, pattern=_NO_CONTROL),
    "base": StringConstraints(min_length=1, max_length=256, pattern=_NO_CONTROL),
    "kind": StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z0-9_.]+$"),
    "data": StringConstraints(max_length=64 << 10),  # record_event's text
    "requested": StringConstraints(max_length=64 << 10),  # create's and delete's event text
    "cmd": StringConstraints(min_length=1, max_length=256 << 10),
    "format": StringConstraints(min_length=1, max_length=16, pattern=r"^[a-z0-9]+$"),
    "by": StringConstraints(min_length=1, max_length=200, pattern=_NO_CONTROL),
    "viewer": StringConstraints(min_length=1, max_length=200, pattern=_NO_CONTROL),
}
_NUM_BOUNDS: dict[str, Any] = {
    "max_bytes": Field(ge=0, le=1 << 40),
    "mode": Field(ge=0, le=0o7777),
    "signal": Field(ge=1, le=64),
    "cols": Field(ge=1, le=PTY_MAX_SIZE),
    "rows": Field(ge=1, le=PTY_MAX_SIZE),
    "ttl_s": Field(gt=0, le=7 * 24 * 3600),
    "timeout_s": Field(gt=0, le=7 * 24 * 3600),
    "tail": Field(ge=0, le=1 << 20),
    "after_seq": Field(ge=0, le=1 << 62),
    "max_sandboxes": Field(ge=0, le=1 << 24),
    "fence_s": Field(gt=0, le=7 * 24 * 3600),
}
_OFFSETS = tuple[Annotated[int, Field(ge=0, le=1 << 62)], Annotated[int, Field(ge=0, le=1 << 62)]]
_ENV = Annotated[dict[Annotated[str, StringConstraints(max_length=4096)],
                      Annotated[str, StringConstraints(max_length=128 << 10)]],
                 Field(max_length=4096)]


def _bounded(name: str, annotation: Any) -> Any:
    """``annotation`` with the bounds of argument ``name`` (``str | None`` stays optional)."""
    if name == "offsets":
        return _OFFSETS
    if name == "sandbox_ids":
        return Annotated[list[Annotated[str, _STR_BOUNDS["sandbox_id"]]],
                         Field(max_length=1 << 20)]
    if name in ("env", "labels"):
        return _ENV
    if name in _STR_BOUNDS:
        bounded = Annotated[str, _STR_BOUNDS[name]]
        args = typing.get_args(annotation)
        if annotation is str:
            return bounded
        if type(None) in args and str in args:
            return bounded | None
    if name in _NUM_BOUNDS:
        args = typing.get_args(annotation)
        if annotation in (int, float):
            return Annotated[annotation, _NUM_BOUNDS[name]]
        if type(None) in args and len(args) == 2:  # e.g. fence_s: float | None
            inner = next(a for a in args if a is not type(None))
            return Annotated[inner, _NUM_BOUNDS[name]] | None
    return annotation


_BYTES_CONFIG = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")


@dataclass(frozen=True)
class Method:
    """One EdgeAPI method on the wire: its arguments' model (without ``chunks`` and without a
    raw ``bytes`` argument, which travel as the body), the name of that raw argument, and its
    result's adapter (None: a stream)."""

    name: str
    signature: inspect.Signature
    args: type[BaseModel]
    raw: str | None  # the bytes argument sent as the body's tail
    result: TypeAdapter[Any] | None
    returns_bytes: bool = False

    def dump_args(self, bound: dict[str, Any]) -> bytes:
        """The JSON of the arguments (not the raw one nor ``chunks``); the edge validates it
        (not validated here too: the api's own input is validated already)."""
        values = {k: v for k, v in bound.items() if k != self.raw and k != "chunks"}
        return self.args.model_construct(**values).model_dump_json(warnings=False).encode()


def _adapter(tp: Any) -> TypeAdapter[Any]:
    """An adapter for ``tp``; bytes inside travel as base64 (config only where pydantic takes
    one: not for a model type itself)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return TypeAdapter(tp)
    return TypeAdapter(tp, config=_BYTES_CONFIG)


def _method(name: str) -> Method:
    fn = getattr(EdgeAPI, name)
    hints = typing.get_type_hints(fn)
    sig = inspect.signature(fn)
    fields: dict[str, Any] = {}
    raw = None
    for pname, param in sig.parameters.items():
        if pname == "self" or pname == "chunks":
            continue
        tp = hints[pname]
        if tp is bytes:
            raw = pname
            continue
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (_bounded(pname, tp), default)
    model = create_model(f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields)
    ret = hints.get("return")
    streaming = name in SERVER_STREAMS
    result = None if streaming or ret is bytes else _adapter(ret)
    return Method(name, sig, model, raw, result, returns_bytes=ret is bytes)


METHODS: dict[str, Method] = {n: _method(n) for n in (*UNARY, *SERVER_STREAMS, *CLIENT_STREAMS)}


class PlatformExecArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sandbox_id: Annotated[str, _STR_BOUNDS["sandbox_id"]]
    req: ExecRequest


class PortOpenArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sandbox_id: Annotated[str, _STR_BOUNDS["sandbox_id"]]
    port: Annotated[int, Field(ge=1, le=65535)]


class DisplayOpenArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sandbox_id: Annotated[str, _STR_BOUNDS["sandbox_id"]]
    viewer: Annotated[str, _STR_BOUNDS["viewer"]]


PORT_OK = b'{"ok":true}'
PORT_EOF = b'{"eof":true}'
PORT_MESSAGE = 1 << 20  # the most bytes one binary message of a port connection carries

HANDLE_RE = re.compile(r"^[A-Za-z0-9_-]{22,64}$")
PROC_OPS = ("stdin", "close_stdin", "kill")


# ---- reading frames -----------------------------------------------------------------------
async def read_frames(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[bytes, bytes]]:
    """(kind, payload) of each frame in the bytes ``chunks`` (as they arrive, any split) but
    heartbeats, up to and with the terminal one; a frame announced over MAX_FRAME is the edge
    breaking the wire (InfraError); the bytes ending before a terminal frame:
    ``asyncio.IncompleteReadError``. Holds at most one frame and one chunk."""
    buf = bytearray()
    pos = 0
    async for chunk in chunks:
        buf += chunk
        while len(buf) - pos >= HEAD.size:
            kind, n = HEAD.unpack_from(buf, pos)
            if n > MAX_FRAME:
                raise errors.InfraError(f"edge sent a frame of {n} bytes (at most {MAX_FRAME})")
            end = pos + HEAD.size + n
            if end > len(buf):
                break
            payload = bytes(buf[pos + HEAD.size:end])
            pos = end
            if kind == HEARTBEAT:
                continue
            yield kind, payload
            if kind in (DONE, ERROR):
                return
        if pos:
            del buf[:pos]
            pos = 0
    raise asyncio.IncompleteReadError(bytes(buf), None)
