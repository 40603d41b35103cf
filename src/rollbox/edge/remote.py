"""``RemoteEdge``: the ``EdgeAPI`` of an edge served over HTTP (``edge.service``), as an api
replica of a cluster holds it (its ``Placement`` routes a sandbox id to it like a local edge).

One aiohttp session per edge (kept-alive connections, no pool cap: each stream holds one),
bounded connect timeouts and an idle read timeout that the service's heartbeats keep from
firing while a call or a stream is merely slow. Failures read as typed, retryable errors, never
as aiohttp's own: ``EdgeUnreachable`` when the request never got to the edge (refused, reset or
timed out while connecting), ``ConnectionLost`` when it broke after it was sent (or the edge
went silent). What the edge raised comes back as the same class with its details
(``wire.error_of``). A stream that breaks mid-way ends: an exec stream with one ``error``
item, a byte or event stream by raising. Owns its connections only; imports no api.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp

from rollbox import errors, trace
from rollbox.agent.protocol import ExecRequest, Exited
from rollbox.backends.base import PortStream
from rollbox.edge import wire
from rollbox.edge.interface import EdgeAPI, ExecOutput, PlatformProcess
from rollbox.models import Event, ExecResult

CONNECT_TIMEOUT_S = 3.0
# No byte from the edge for this long (5 of its heartbeats): it is gone (or cut off).
IDLE_TIMEOUT_S = 10.0
MAX_ERROR_BODY = 1 << 20
# What one unary answer may carry in all (a ``bytes`` result: at most its ``max_bytes``).
MAX_UNARY_ANSWER = wire.MAX_FRAME

_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, OSError,
                     asyncio.IncompleteReadError)


# What decoding a malformed answer raises (pydantic's ValidationError and JSON's errors are
# ValueErrors): the edge broke the wire, an InfraError, never the decoder's own exception.
_DECODE_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error)


@contextlib.contextmanager
def _decoding(node: str, what: str) -> Iterator[None]:
    try:
        yield
    except _DECODE_ERRORS as exc:
        raise errors.InfraError(f"edge {node}: {what}: a malformed answer ({exc!r:.200})",
                                node=node) from None


def _edge_error(node: str, what: str, payload: Any, status: int = 500) -> errors.RollboxError:
    """The typed error of an error frame or answer (InfraError if it is not one)."""
    with _decoding(node, what):
        return wire.error_of(payload, status)
    raise AssertionError("unreachable")  # pragma: no cover


class _Source:
    """A request body's chunks, remembering what the caller's iterator raised (the api's own
    body cap, a client that went away): that, not the broken request, is what the call raises."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks
        self.error: BaseException | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.chunks:
                if chunk:
                    yield chunk
        except BaseException as exc:
            self.error = exc
            raise


class _Answer:
    """One open 200 answer: its frames, then released (or closed if not read to its end)."""

    def __init__(self, edge: RemoteEdge, resp: aiohttp.ClientResponse, what: str,
                 source: _Source | None = None) -> None:
        self.edge = edge
        self.resp = resp
        self.what = what
        self.source = source

    async def frames(self) -> AsyncIterator[tuple[bytes, bytes]]:
        """(kind, payload) up to the terminal frame; ERROR raises the edge's error."""
        try:
            async for kind, payload in wire.read_frames(self.resp.content.iter_any()):
                if kind == wire.ERROR:
                    with _decoding(self.edge.node_id, self.what):
                        obj = json.loads(payload)
                    raise _edge_error(self.edge.node_id, self.what, obj)
                yield kind, payload
                if kind == wire.DONE:
                    return
        except _TRANSPORT_ERRORS as exc:
            if self.source is not None and self.source.error is not None:
                raise self.source.error from None
            raise errors.ConnectionLost(
                f"edge {self.edge.node_id}: {self.what} broke off: {_describe(exc)}",
                node=self.edge.node_id) from None
        finally:
            self.close()

    def close(self) -> None:
        if self.resp.content.at_eof():
            self.resp.release()
        else:
            self.resp.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the edge closed the answer before its end"
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer (not even a heartbeat) within the idle timeout"
    return repr(exc)


class RemoteProcess:
    """A platform process of a remote edge (``EdgeAPI.platform_exec``)."""

    def __init__(self, edge: RemoteEdge, handle: str, answer: _Answer,
                 frames: AsyncIterator[tuple[bytes, bytes]]) -> None:
        self.edge = edge
        self.handle = handle
        self._answer = answer
        self._frames = frames

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        try:
            async for kind, payload in self._frames:
                with _decoding(self.edge.node_id, "platform process events"):
                    if kind == wire.PROC_OUTPUT:
                        name, _, data = payload.partition(b"\0")
                        event: tuple[str, Any] | None = (name.decode(), data)
                    elif kind == wire.JSON_ITEM:
                        item = json.loads(payload)
                        event = (("exited", Exited(**item)) if item.pop("kind", None) == "exited"
                                 else None)
                    else:
                        event = None
                if event is not None:
                    yield event
        finally:
            await self._frames.aclose()  # type: ignore[attr-defined]

    async def _op(self, op: str, data: bytes = b"") -> None:
        await self.edge._call_frames("POST", f"/proc/{self.handle}/{op}", data,
                                     f"platform process {op}")

    async def write_stdin(self, data: bytes) -> None:
        await self._op("stdin", data)

    async def close_stdin(self) -> None:
        await self._op("close_stdin")

    async def kill(self) -> None:
        await self._op("kill")


class RemoteEdge:
    """``EdgeAPI`` over HTTP to the edge of node ``node_id`` at ``url`` (``http://host:port``),
    authenticated with the cluster ``token``. Unary methods are made from ``wire.UNARY``'s
    table (one name there is one method here); ``close()`` when done."""

    def __init__(self, node_id: str, url: str, token: str, *,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        if not url.startswith(("http://", "https://")):
            raise errors.BadRequest(f"edge url must be http(s)://host:port, got {url[:100]!r}")
        self.node_id = node_id
        self.url = url.rstrip("/")
        self._root = self.url + wire.PREFIX
        self._headers = {"Authorization": f"Bearer {token}"}
        self._timeout = aiohttp.ClientTimeout(total=None, connect=None,
                                              sock_connect=connect_timeout_s,
                                              sock_read=idle_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"RemoteEdge({self.node_id!r}, {self.url!r})"

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            if self._closed:
                raise errors.InfraError(f"RemoteEdge {self.node_id} is closed")
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, headers=self._headers,
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=15.0))
        return self._session

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def __aenter__(self) -> RemoteEdge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- requests -----------------------------------------------------------------------
    async def _open(self, method: str, route: str, data: Any, what: str,
                    headers: dict[str, str] | None = None,
                    source: _Source | None = None) -> _Answer:
        """Send; an error answer (401, 400, 404, 413) raises its typed error."""
        headers = {**trace.outgoing(), **(headers or {})}  # the api request's id, kept
        try:
            resp = await self._http().request(method, self._root + route, data=data,
                                              headers=headers, allow_redirects=False)
        except _CONNECT_ERRORS as exc:
            raise errors.EdgeUnreachable(f"edge {self.node_id} at {self.url}: {exc!r}",
                                         node=self.node_id) from None
        except _TRANSPORT_ERRORS as exc:
            if source is not None and source.error is not None:
                raise source.error from None
            raise errors.ConnectionLost(f"edge {self.node_id}: {what}: {exc!r}",
                                        node=self.node_id) from None
        if resp.status != 200:
            try:
                body = await resp.content.read(MAX_ERROR_BODY)
            except _TRANSPORT_ERRORS:
                body = b""
            finally:
                resp.close()
            try:
                payload: Any = json.loads(body)
            except ValueError:
                payload = body.decode("utf-8", "replace")
            raise _edge_error(self.node_id, what, payload, resp.status)
        return _Answer(self, resp, what, source)

    async def _call_frames(self, method: str, route: str, data: Any, what: str,
                           headers: dict[str, str] | None = None,
                           source: _Source | None = None,
                           limit: int = MAX_UNARY_ANSWER) -> list[tuple[bytes, bytes]]:
        """The frames of one answer, at most ``limit`` bytes of payload in all (more: the
        edge broke the wire, InfraError)."""
        answer = await self._open(method, route, data, what, headers, source)
        out, seen = [], 0
        frames = answer.frames()
        try:
            async for f in frames:
                seen += len(f[1])
                if seen > limit:
                    raise errors.InfraError(f"edge {self.node_id}: {what} answered over "
                                            f"{limit} bytes", node=self.node_id)
                out.append(f)
        finally:
            await frames.aclose()  # type: ignore[attr-defined]
        return out

    async def _unary(self, name: str, bound: dict[str, Any]) -> Any:
        m = wire.METHODS[name]
        body = m.dump_args(bound)
        if m.raw is not None:
            body = body + b"\n" + bytes(bound[m.raw])
        limit = MAX_UNARY_ANSWER
        if m.returns_bytes and isinstance(bound.get("max_bytes"), int):
            limit = max(0, bound["max_bytes"])
        frames = await self._call_frames("POST", f"/call/{name}", body, name, limit=limit)
        with _decoding(self.node_id, name):
            return _result(m, frames)

    async def _upload(self, name: str, bound: dict[str, Any]) -> Any:
        m = wire.METHODS[name]
        source = _Source(bound["chunks"])
        headers = {wire.ARGS_HEADER: m.dump_args(bound).decode(),
                   "Content-Type": "application/octet-stream"}
        frames = await self._call_frames("PUT", f"/upload/{name}", source.__aiter__(), name,
                                         headers, source)
        with _decoding(self.node_id, name):
            return _result(m, frames)

    async def _stream(self, name: str, args: dict[str, Any]) -> AsyncIterator[tuple[bytes, bytes]]:
        answer = await self._open("POST", f"/stream/{name}",
                                  wire.METHODS[name].dump_args(args), name)
        async for f in answer.frames():
            yield f

    # ---- server streams -----------------------------------------------------------------
    async def exec_stream(self, sandbox_id: str, exec_id: str,
                          offsets: tuple[int, int] = (0, 0)) -> AsyncIterator[ExecOutput]:
        got_any = False
        try:
            async for kind, payload in self._stream("exec_stream", {
                    "sandbox_id": sandbox_id, "exec_id": exec_id, "offsets": offsets}):
                try:
                    with _decoding(self.node_id, "exec_stream"):
                        item = _exec_item(kind, payload, exec_id)
                except errors.InfraError as exc:  # a malformed item ends the stream
                    if not got_any:
                        raise
                    yield ExecOutput("error", exec_id, error=exc)
                    return
                if item is None:
                    continue
                got_any = True
                yield item
                if item.kind in ("exit", "error"):
                    return
        except (errors.ConnectionLost, errors.EdgeUnreachable) as exc:
            if not got_any:
                raise
            yield ExecOutput("error", exec_id, error=exc)

    async def file_read_stream(self, sandbox_id: str, path: str, max_bytes: int,
                               offset: int = 0) -> AsyncIterator[bytes]:
        async for kind, payload in self._stream("file_read_stream", {
                "sandbox_id": sandbox_id, "path": path, "max_bytes": max_bytes,
                "offset": offset}):
            if kind == wire.DATA:
                yield payload

    async def download_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        async for kind, payload in self._stream("download_tar",
                                                {"sandbox_id": sandbox_id, "path": path}):
            if kind == wire.DATA:
                yield payload

    async def events(self, sandbox_id: str, after_seq: int,
                     follow: bool) -> AsyncIterator[Event]:
        async for kind, payload in self._stream("events", {
                "sandbox_id": sandbox_id, "after_seq": after_seq, "follow": follow}):
            if kind == wire.JSON_ITEM:
                with _decoding(self.node_id, "events"):
                    event = Event.model_validate_json(payload)
                yield event

    # ---- the platform's own processes ---------------------------------------------------
    async def platform_exec(self, sandbox_id: str, req: ExecRequest) -> PlatformProcess:
        body = wire.PlatformExecArgs(sandbox_id=sandbox_id, req=req).model_dump_json().encode()
        answer = await self._open("POST", "/platform_exec", body, "platform_exec")
        frames = answer.frames()
        try:
            kind, payload = await frames.__anext__()
            with _decoding(self.node_id, "platform_exec"):
                handle = json.loads(payload)["handle"] if kind == wire.JSON_ITEM else None
            if not isinstance(handle, str) or not wire.HANDLE_RE.match(handle):
                raise errors.InfraError(f"edge {self.node_id}: platform_exec answered "
                                        "without a process handle")
        except BaseException:
            await frames.aclose()
            raise
        return RemoteProcess(self, handle, answer, frames)

    async def port_open(self, sandbox_id: str, port: int) -> PortStream:
        """A WebSocket to the edge's ``/port`` (wire docstring), authenticated like every call;
        the bytes of the sandbox's port over its binary messages."""
        args = wire.PortOpenArgs.model_construct(sandbox_id=sandbox_id, port=port)
        return await self._channel("/port", args.model_dump_json(), "port_open")

    async def display_open(self, sandbox_id: str, viewer: str) -> PortStream:
        """The live view's stream over the edge's ``/display`` WebSocket (as ``port_open``)."""
        args = wire.DisplayOpenArgs.model_construct(sandbox_id=sandbox_id, viewer=viewer)
        return await self._channel("/display", args.model_dump_json(), "display_open")

    async def _channel(self, route: str, args_json: str, what: str) -> PortStream:
        try:
            ws = await self._http().ws_connect(
                self._root + route, headers=trace.outgoing(), autoping=True, heartbeat=None,
                compress=0,
                max_msg_size=wire.PORT_MESSAGE + 4096, autoclose=False)
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status == 401:
                raise errors.Unauthorized(f"edge {self.node_id} refused the cluster token"
                                          ) from None
            raise errors.EdgeUnreachable(f"edge {self.node_id}: {what}: {exc!r}",
                                         node=self.node_id) from None
        except _CONNECT_ERRORS as exc:
            raise errors.EdgeUnreachable(f"edge {self.node_id} at {self.url}: {exc!r}",
                                         node=self.node_id) from None
        except _TRANSPORT_ERRORS as exc:
            raise errors.ConnectionLost(f"edge {self.node_id}: {what}: {exc!r}",
                                        node=self.node_id) from None
        remote = RemotePort(self, ws)
        try:
            await ws.send_str(args_json)
            first = await remote.control()
            if first != "ok":
                raise errors.InfraError(f"edge {self.node_id}: {what}: no answer")
        except BaseException:
            await remote.close()
            raise
        return remote


class RemotePort:
    """One ``port_open`` connection over the edge's WebSocket (a PortStream)."""

    def __init__(self, edge: RemoteEdge, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.edge = edge
        self.ws = ws
        self._eof = False

    async def control(self) -> str:
        """The edge's next text message: "ok" | "eof", or its error raised."""
        msg = await self._receive()
        if msg is None:
            return "eof"
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise errors.InfraError(f"edge {self.edge.node_id}: port_open: a binary answer "
                                    "before the edge said ok")
        return self._text(msg.data)

    def _text(self, data: str) -> str:
        with _decoding(self.edge.node_id, "port_open"):
            obj = json.loads(data)
            if obj.get("ok") is True:
                return "ok"
            if obj.get("eof") is True:
                return "eof"
        raise _edge_error(self.edge.node_id, "port_open", obj)

    async def _receive(self) -> aiohttp.WSMessage | None:
        try:
            msg = await self.ws.receive()
        except _TRANSPORT_ERRORS as exc:
            raise errors.ConnectionLost(f"edge {self.edge.node_id}: port connection broke off: "
                                        f"{_describe(exc)}", node=self.edge.node_id) from None
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                        aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
            return None
        return msg

    async def read(self) -> bytes:
        while not self._eof:
            msg = await self._receive()
            if msg is None:
                self._eof = True
                break
            if msg.type == aiohttp.WSMsgType.BINARY:
                if msg.data:
                    return bytes(msg.data)
                continue
            if msg.type == aiohttp.WSMsgType.TEXT and self._text(msg.data) == "eof":
                self._eof = True
        return b""

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            for i in range(0, len(view), wire.PORT_MESSAGE):
                await self.ws.send_bytes(bytes(view[i:i + wire.PORT_MESSAGE]))
        except _TRANSPORT_ERRORS as exc:
            raise errors.ConnectionLost(f"edge {self.edge.node_id}: port connection broke off: "
                                        f"{_describe(exc)}", node=self.edge.node_id) from None

    async def write_eof(self) -> None:
        with contextlib.suppress(*_TRANSPORT_ERRORS):
            await self.ws.send_str(wire.PORT_EOF.decode())

    async def close(self) -> None:
        with contextlib.suppress(*_TRANSPORT_ERRORS):
            await self.ws.close()


def _exec_item(kind: bytes, payload: bytes, exec_id: str) -> ExecOutput | None:
    """One exec stream frame as its item (None: not one of its kinds)."""
    if kind in (wire.STDOUT, wire.STDERR):
        (offset,) = wire.OFFSET.unpack_from(payload)
        return ExecOutput("stdout" if kind == wire.STDOUT else "stderr", exec_id,
                          payload[wire.OFFSET.size:], offset=offset)
    if kind == wire.JSON_ITEM:
        obj = json.loads(payload)
        if obj["kind"] not in ("started", "exit"):
            raise ValueError(f"exec item kind {str(obj['kind'])[:40]!r}")
        result = obj.get("result")
        return ExecOutput(obj["kind"], str(obj.get("exec_id", exec_id)),
                          result=ExecResult.model_validate(result)
                          if result is not None else None)
    if kind == wire.EXEC_ERROR:
        return ExecOutput("error", exec_id, error=wire.error_of(json.loads(payload)))
    return None


def _result(m: wire.Method, frames: list[tuple[bytes, bytes]]) -> Any:
    if m.returns_bytes:
        return b"".join(p for k, p in frames if k == wire.DATA)
    for kind, payload in frames:
        if kind == wire.JSON_ITEM:
            assert m.result is not None
            return m.result.validate_json(payload)
    return None


def _bound_caller(name: str, send: Callable[[RemoteEdge, str, dict[str, Any]], Any]) -> Any:
    """A method ``name`` of RemoteEdge with EdgeAPI's signature, sending its bound arguments."""
    sig = wire.METHODS[name].signature

    async def method(self: RemoteEdge, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        return await send(self, name, arguments)

    method.__name__ = name
    method.__qualname__ = f"RemoteEdge.{name}"
    method.__doc__ = inspect.getdoc(getattr(EdgeAPI, name))
    method.__signature__ = sig  # type: ignore[attr-defined]
    return method


for _name in wire.UNARY:
    setattr(RemoteEdge, _name, _bound_caller(_name, RemoteEdge._unary))
for _name in wire.CLIENT_STREAMS:
    setattr(RemoteEdge, _name, _bound_caller(_name, RemoteEdge._upload))
del _name

__all__ = ["RemoteEdge", "RemoteProcess"]
