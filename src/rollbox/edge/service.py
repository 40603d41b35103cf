"""One edge's ``EdgeAPI`` served over HTTP to the api replicas of a cluster (issue 14: the data
path goes api -> edge over HTTP): :func:`create_edge_app` (a Starlette app) and
:func:`serve_edge` (it under uvicorn, started and stopped from async code).

Every request needs ``Authorization: Bearer <cluster token>`` (compared in constant time) and
is answered 401 before any work without it. Arguments are validated by the models of
``edge.wire`` (built from the interface's annotations, bounded by name), bodies are capped while
they stream in, answers are ``edge.wire`` frames with heartbeats. Unary methods come from one
table (``wire.UNARY``): a method added to ``EdgeAPI`` needs its name there and nothing here.

A call the client gives up on (its connection closes) is not cancelled: a create, delete or
snapshot runs to its end, as in the api (streams are: a follower that left is gone). Owns the
routes and the platform processes opened through them (killed when their stream closes); not
the edge (the caller starts and closes it), nor the token (the cluster's set-up writes it).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from rollbox import errors, metrics, trace
from rollbox.trace import RequestIdMiddleware
from rollbox.backends.base import PortStream
from rollbox.backends.ports import end_pumps
from rollbox.edge import wire
from rollbox.edge.interface import EdgeAPI, ExecOutput, PlatformProcess
from rollbox.edge.server import BackgroundServer

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # a silent answer sends a heartbeat this often (edge.remote times out on 5x)
MIN_TOKEN = 16
FRAMES = "application/x-rollbox-frames"


def _error_response(err: errors.RollboxError) -> JSONResponse:
    return JSONResponse(err.to_payload(), status_code=err.status)


def _as_rollbox(exc: BaseException, what: str) -> errors.RollboxError:
    """What the client gets for ``exc``: the edge's typed error, or ``internal`` for a bug;
    logged either way (a platform fault as a warning, a refusal as info) with the api's
    request id and the call's sandbox bound (rollbox.trace): the api's line for the same
    request names the same id."""
    if isinstance(exc, errors.RollboxError):
        _logged(what, exc)
        return exc
    log.error("edge service: %s failed", what, exc_info=exc)
    return errors.RollboxError("internal error")


def _logged(what: str, err: errors.RollboxError) -> None:
    log.log(logging.WARNING if err.status >= 500 else logging.INFO, "edge %s -> %d %s: %s",
            what, err.status, err.code, err.message)


class TokenAuth:
    """Every HTTP request needs the cluster token (401 before the app sees it)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):  # websocket: the port connections
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(got, self.expected):
                if scope["type"] == "websocket":  # refused before the handshake: 403
                    await send({"type": "websocket.close", "code": 1008})
                    return
                err = errors.Unauthorized("this edge needs the cluster token")
                await _error_response(err)(scope, receive, send)
                return
        elif scope["type"] != "lifespan":
            return
        await self.app(scope, receive, send)


class Frames(Response):
    """A 200 answer of frames from ``body`` (its last is the terminal one). ``listen``: stop
    (closing ``body``) when the client disconnects; only where the request body is read
    already (the listener consumes receive())."""

    media_type = FRAMES

    def __init__(self, body: AsyncGenerator[bytes, None], listen: bool = True) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-store"})  # no body: chunked, no length
        self.body_iter = body
        self.listen = listen

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": self.raw_headers})
        async for chunk in self.body_iter:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if not self.listen:
                await self._pump(send)
                return
            pump = asyncio.ensure_future(self._pump(send))

            async def disconnected() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass

            gone = asyncio.ensure_future(disconnected())
            try:
                await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not pump.done():
                    pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await pump
        finally:
            await self.body_iter.aclose()


_BEAT = object()
_ITEM, _END, _RAISED = 0, 1, 2
BATCH_BYTES = 1 << 20  # what one write of a stream carries at most (about)
QUEUE_ITEMS = 64  # items read ahead of the client (bounded memory: with BATCH_BYTES)


def _size(item: Any) -> int:
    if isinstance(item, bytes):
        return len(item)
    if isinstance(item, ExecOutput):
        return len(item.data)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], bytes):
        return len(item[1])  # a platform process's (kind, bytes)
    return 0


async def _beating(items: AsyncIterator[Any], every_s: float) -> AsyncIterator[Any]:
    """``items`` in batches (lists of what was ready together, about BATCH_BYTES at most: one
    write each, not one per item), with ``_BEAT`` whenever nothing came for ``every_s``. A task
    reads ``items`` ahead, at most QUEUE_ITEMS; ``items`` is closed at the end (also when the
    consumer leaves)."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(QUEUE_ITEMS)

    async def produce() -> None:
        try:
            async for item in items:
                await queue.put((_ITEM, item))
        except Exception as exc:  # noqa: BLE001 - raised to the consumer, in order
            await queue.put((_RAISED, exc))
            return
        await queue.put((_END, None))

    producer = asyncio.ensure_future(produce())
    try:
        while True:
            try:
                async with asyncio.timeout(every_s):
                    kind, value = await queue.get()
            except TimeoutError:
                yield _BEAT
                continue
            batch: list[Any] = []
            size = 0
            while True:
                if kind == _ITEM:
                    batch.append(value)
                    size += _size(value)
                if kind != _ITEM or size >= BATCH_BYTES or queue.empty():
                    break
                kind, value = queue.get_nowait()
            if batch:
                yield batch
            if kind == _END:
                return
            if kind == _RAISED:
                raise value
    finally:
        producer.cancel()
        with contextlib.suppress(BaseException):
            await producer
        if isinstance(items, AsyncGenerator):  # the edge's streams are async generators
            with contextlib.suppress(Exception):
                await items.aclose()


def _exec_frame(item: ExecOutput) -> bytes | None:
    if item.kind in ("stdout", "stderr"):
        kind = wire.STDOUT if item.kind == "stdout" else wire.STDERR
        return wire.frame(kind, wire.OFFSET.pack(item.offset) + item.data)
    if item.kind == "started":
        return wire.json_frame({"kind": "started", "exec_id": item.exec_id})
    if item.kind == "exit":
        result = item.result.model_dump(mode="json") if item.result is not None else None
        return wire.json_frame({"kind": "exit", "exec_id": item.exec_id, "result": result})
    if item.kind == "error":
        err = item.error
        if not isinstance(err, errors.RollboxError):
            err = errors.InfraError(f"exec stream failed: {err!r}")
        return wire.json_frame(err.to_payload(), wire.EXEC_ERROR)
    return None


def _bytes_frames(data: bytes) -> list[bytes]:
    view = memoryview(data)
    return [wire.frame(wire.DATA, bytes(view[i:i + wire.CHUNK]))
            for i in range(0, len(data), wire.CHUNK)]


def _stream_frames(name: str, item: Any) -> bytes | None:
    if name == "exec_stream":
        return _exec_frame(item)
    if name == "events":
        return wire.frame(wire.JSON_ITEM, item.model_dump_json().encode())
    return b"".join(_bytes_frames(item))  # file_read_stream, download_tar


class EdgeService:
    """The routes over one edge (``app.state.service``)."""

    def __init__(self, edge: EdgeAPI, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.edge = edge
        self.heartbeat_s = heartbeat_s
        self._calls: set[asyncio.Future[Any]] = set()  # unary calls left by their client
        self._procs: dict[str, PlatformProcess] = {}

    # ---- helpers ------------------------------------------------------------------------
    @staticmethod
    def _parse(model: type[wire.BaseModel], raw: bytes | str) -> Any:
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            parts = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" if e["loc"]
                     else str(e["msg"]) for e in exc.errors()]
            raise errors.BadRequest("; ".join(parts) or "invalid arguments") from None

    @staticmethod
    async def _body(request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise errors.PayloadTooLarge(f"request body over {limit} bytes", limit=limit)
        parts, seen = [], 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > limit:
                raise errors.PayloadTooLarge(f"request body over {limit} bytes", limit=limit)
            parts.append(chunk)
        return b"".join(parts)

    @staticmethod
    async def _chunks(request: Request, limit: int) -> AsyncIterator[bytes]:
        """The request body as it streams in, capped at ``limit`` bytes."""
        seen = 0
        try:
            async for chunk in request.stream():
                if not chunk:
                    continue
                seen += len(chunk)
                if seen > limit:
                    raise errors.PayloadTooLarge(f"request body over {limit} bytes",
                                                 limit=limit)
                yield chunk
        except ClientDisconnect:
            raise errors.ConnectionLost("the api's upload broke off") from None

    @staticmethod
    def _kwargs(args: wire.BaseModel) -> dict[str, Any]:
        """The call's arguments; the sandbox and exec they name are bound for its log lines
        (rollbox.trace)."""
        kwargs = {k: getattr(args, k) for k in type(args).model_fields}
        trace.bind_sandbox(kwargs.get("sandbox_id"))
        trace.bind_exec(kwargs.get("exec_id"))
        return kwargs

    def _keep(self, fut: asyncio.Future[Any]) -> None:
        """A call runs to its end even if its client leaves; its failure is then logged."""
        self._calls.add(fut)

        def done(f: asyncio.Future[Any]) -> None:
            self._calls.discard(f)
            if not f.cancelled() and f.exception() is not None:
                f.exception()  # retrieved: reported to the client, if it stayed

        fut.add_done_callback(done)

    @staticmethod
    def _result_frames(method: wire.Method, value: Any) -> bytes:
        if method.returns_bytes:
            return b"".join(_bytes_frames(value)) + wire.DONE_FRAME
        if method.result is None:  # a platform process's control: nothing to say
            return wire.DONE_FRAME
        return wire.frame(wire.JSON_ITEM, method.result.dump_json(value)) + wire.DONE_FRAME

    async def _answer(self, method: wire.Method, call: Awaitable[Any],
                      listen: bool = True) -> Response:
        """The answer of one unary call: its frames at once if it ends within a heartbeat,
        else heartbeats until it does."""
        fut = asyncio.ensure_future(call)
        self._keep(fut)
        done, _ = await asyncio.wait({fut}, timeout=self.heartbeat_s)
        if done:
            return Response(self._finish(method, fut), media_type=FRAMES)

        async def body() -> AsyncIterator[bytes]:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=self.heartbeat_s)
                if done:
                    yield self._finish(method, fut)
                    return
                yield wire.HEARTBEAT_FRAME

        return Frames(body(), listen=listen)

    def _finish(self, method: wire.Method, fut: asyncio.Future[Any]) -> bytes:
        if fut.cancelled():  # the edge is shutting down under the call
            return wire.error_frame(errors.InfraError(f"{method.name} was cancelled on the edge"))
        exc = fut.exception()
        if exc is not None:
            return wire.error_frame(_as_rollbox(exc, method.name))
        try:
            return self._result_frames(method, fut.result())
        except Exception as exc:  # noqa: BLE001 - a result that does not serialise: a bug
            return wire.error_frame(_as_rollbox(exc, f"{method.name} (result)"))

    # ---- routes -------------------------------------------------------------------------
    async def call(self, request: Request) -> Response:
        name = request.path_params["method"]
        if name not in wire.UNARY:
            raise errors.NotFound(f"no unary edge method {name!r}")
        method = wire.METHODS[name]
        if method.raw is None:
            body = await self._body(request, wire.MAX_JSON_BODY)
            raw = None
        else:
            body = await self._body(request, wire.MAX_JSON_BODY + wire.MAX_BYTES_ARG[name])
            head, sep, raw = body.partition(b"\n")
            if not sep or len(head) > wire.MAX_JSON_BODY:
                raise errors.BadRequest(f"{name}: the JSON arguments, a newline, then the data")
            body = head
        kwargs = self._kwargs(self._parse(method.args, body or b"{}"))
        if method.raw is not None:
            kwargs[method.raw] = raw
        return await self._answer(method, getattr(self.edge, name)(**kwargs))

    async def stream(self, request: Request) -> Response:
        name = request.path_params["method"]
        if name not in wire.SERVER_STREAMS:
            raise errors.NotFound(f"no streaming edge method {name!r}")
        args = self._parse(wire.METHODS[name].args,
                           await self._body(request, wire.MAX_JSON_BODY) or b"{}")
        items = getattr(self.edge, name)(**self._kwargs(args))
        return Frames(self._stream_body(name, items))

    async def _stream_body(self, name: str, items: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        try:
            async for batch in _beating(items, self.heartbeat_s):
                if batch is _BEAT:
                    yield wire.HEARTBEAT_FRAME
                    continue
                out = b"".join(f for item in batch if (f := _stream_frames(name, item)))
                if out:
                    yield out
        except Exception as exc:  # noqa: BLE001 - in-band: the 200 is sent
            yield wire.error_frame(_as_rollbox(exc, name))
            return
        yield wire.DONE_FRAME

    async def upload(self, request: Request) -> Response:
        name = request.path_params["method"]
        if name not in wire.CLIENT_STREAMS:
            raise errors.NotFound(f"no uploading edge method {name!r}")
        method = wire.METHODS[name]
        head = request.headers.get(wire.ARGS_HEADER, "{}")
        if len(head) > wire.MAX_ARGS_HEADER:
            raise errors.BadRequest(f"{wire.ARGS_HEADER} over {wire.MAX_ARGS_HEADER} bytes")
        limit = wire.MAX_UPLOAD[name]
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise errors.PayloadTooLarge(f"request body over {limit} bytes", limit=limit)
        kwargs = self._kwargs(self._parse(method.args, head))
        call = getattr(self.edge, name)(chunks=self._chunks(request, limit), **kwargs)
        # No disconnect listener: it would take the body's chunks from the edge.
        return await self._answer(method, call, listen=False)

    async def platform_exec(self, request: Request) -> Response:
        args = self._parse(wire.PlatformExecArgs, await self._body(request, wire.MAX_JSON_BODY))
        proc = await self.edge.platform_exec(args.sandbox_id, args.req)
        handle = secrets.token_urlsafe(24)
        self._procs[handle] = proc
        return Frames(self._proc_body(handle, proc))

    async def _proc_body(self, handle: str, proc: PlatformProcess) -> AsyncIterator[bytes]:
        exited = False
        try:
            yield wire.json_frame({"handle": handle})
            try:
                async for batch in _beating(proc.events(), self.heartbeat_s):
                    if batch is _BEAT:
                        yield wire.HEARTBEAT_FRAME
                        continue
                    out = []
                    for kind, payload in batch:
                        if kind == "exited":
                            exited = True
                            out.append(wire.json_frame({"kind": "exited", **vars(payload)}))
                        else:
                            out.append(wire.frame(wire.PROC_OUTPUT,
                                                  kind.encode() + b"\0" + payload))
                    yield b"".join(out)
            except Exception as exc:  # noqa: BLE001 - in-band
                yield wire.error_frame(_as_rollbox(exc, "platform_exec"))
                return
            yield wire.DONE_FRAME
        finally:
            self._procs.pop(handle, None)
            if not exited:  # its client left: nobody can drive it any more
                with contextlib.suppress(Exception):
                    await proc.kill()

    async def proc(self, request: Request) -> Response:
        handle, op = request.path_params["handle"], request.path_params["op"]
        proc = self._procs.get(handle) if wire.HANDLE_RE.match(handle) else None
        if proc is None or op not in wire.PROC_OPS:
            raise errors.NotFound("no such platform process (it ended, or its stream closed)")
        if op == "stdin":
            call: Awaitable[None] = proc.write_stdin(
                await self._body(request, wire.MAX_STDIN_BODY))
        else:
            await self._body(request, 0)
            call = proc.close_stdin() if op == "close_stdin" else proc.kill()
        return await self._answer(_PROC_METHOD, call)

    async def port(self, ws: WebSocket) -> None:
        """One port_open connection (see edge.wire): the bytes both ways until either ends."""
        async def open_port(text: str) -> PortStream:
            args = self._parse(wire.PortOpenArgs, text)
            return await self.edge.port_open(args.sandbox_id, args.port)

        await self._channel(ws, open_port, "port_open")

    async def display(self, ws: WebSocket) -> None:
        """One display_open stream (the live view, see edge.wire), as a port connection."""
        async def open_display(text: str) -> PortStream:
            args = self._parse(wire.DisplayOpenArgs, text)
            return await self.edge.display_open(args.sandbox_id, args.viewer)

        await self._channel(ws, open_display, "display_open")

    async def _channel(self, ws: WebSocket, opener: Callable[[str], Awaitable[PortStream]],
                       what: str) -> None:
        await ws.accept()
        stream: PortStream | None = None
        try:
            try:
                stream = await opener(await ws.receive_text())
            except (WebSocketDisconnect, KeyError):
                return
            except Exception as exc:  # noqa: BLE001 - the client gets the typed error
                await ws.send_text(json.dumps(_as_rollbox(exc, what).to_payload()))
                return
            await ws.send_text(wire.PORT_OK.decode())
            await _pump_port(ws, stream)
        finally:
            if stream is not None:
                await stream.close()
            with contextlib.suppress(Exception):
                await ws.close()

    async def close(self) -> None:
        """Kill the platform processes still open; leave calls running to their end."""
        for proc in list(self._procs.values()):
            with contextlib.suppress(Exception):
                await proc.kill()


async def _pump_port(ws: WebSocket, stream: PortStream) -> None:
    """Bytes of ``stream`` to ``ws`` and back until the service ends (its EOF, then the
    client's close) or the client leaves."""

    async def to_client() -> None:
        try:
            while data := await stream.read():
                await ws.send_bytes(data)
            await ws.send_text(wire.PORT_EOF.decode())
        except errors.RollboxError as exc:  # PortNotListening at a relay's first read
            await ws.send_text(json.dumps(exc.to_payload()))

    async def from_client() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            try:
                if msg.get("bytes"):
                    await stream.write(msg["bytes"])
                elif msg.get("text") == wire.PORT_EOF.decode():
                    await stream.write_eof()
            except errors.RollboxError as exc:  # the live view's refusal of what it was sent
                await ws.send_text(json.dumps(exc.to_payload()))
                return

    down = asyncio.ensure_future(to_client())
    up = asyncio.ensure_future(from_client())
    try:
        done, _ = await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
        if down in done and not up.done():  # the service ended: the client closes next
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(PORT_LINGER_S):
                    await asyncio.shield(up)
    finally:
        await end_pumps(down, up)


PORT_LINGER_S = 30.0  # after the service's end, how long the client may still send

# A platform process's stdin/close_stdin/kill: answered with DONE (or its error).
_PROC_METHOD = wire.Method("proc", wire.METHODS["delete"].signature,
                           wire.METHODS["delete"].args, None, None)


async def _metrics(_: Request) -> Response:
    """This edge process's Prometheus metrics (rollbox.metrics)."""
    return Response(metrics.process_metrics().exposition(), media_type=metrics.CONTENT_TYPE)


async def _rollbox_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.RollboxError)
    _logged(request.url.path, exc)
    return _error_response(exc)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    cls = {404: errors.NotFound, 405: errors.BadRequest}.get(exc.status_code, errors.RollboxError)
    return JSONResponse(cls(str(exc.detail)).to_payload(), exc.status_code)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("edge service: unhandled error on %s %s", request.method, request.url.path,
              exc_info=exc)
    return _error_response(errors.RollboxError("internal error"))


def create_edge_app(edge: EdgeAPI, token: str, *, heartbeat_s: float = HEARTBEAT_S) -> ASGIApp:
    """The edge's HTTP app (routes: ``edge.wire``); every request needs ``token``."""
    if not isinstance(token, str) or len(token) < MIN_TOKEN or not token.isprintable():
        raise errors.BadRequest(f"the cluster token must be at least {MIN_TOKEN} printable "
                                "characters")
    service = EdgeService(edge, heartbeat_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await service.close()

    p = wire.PREFIX
    app = Starlette(
        routes=[
            Route(f"{p}/call/{{method}}", service.call, methods=["POST"]),
            Route(f"{p}/stream/{{method}}", service.stream, methods=["POST"]),
            Route(f"{p}/upload/{{method}}", service.upload, methods=["PUT"]),
            Route(f"{p}/platform_exec", service.platform_exec, methods=["POST"]),
            Route(f"{p}/proc/{{handle}}/{{op}}", service.proc, methods=["POST"]),
            WebSocketRoute(f"{p}/port", service.port),
            Route(f"{p}/metrics", _metrics, methods=["GET"]),  # the cluster token, as all
            WebSocketRoute(f"{p}/display", service.display),
        ],
        exception_handlers={errors.RollboxError: _rollbox_error, HTTPException: _http_error,
                            Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.service = service
    return RequestIdMiddleware(TokenAuth(app, token))  # the api's X-Request-Id, kept


def serve_edge(edge: EdgeAPI, host: str, port: int, token: str) -> BackgroundServer:
    """The edge's HTTP service under uvicorn on ``host:port`` (0: a free port), not started:
    ``await srv.start()`` (returns its URL) / ``await srv.stop()``, or ``async with``. The
    port must be one sandboxes can not reach: ``settings.edge_port`` is among the platform's
    ports (``netpolicy.policy.platform_ports``)."""
    return BackgroundServer(create_edge_app(edge, token), host, port)
