"""The HTTP API (FastAPI): the only path from a trainer to its sandboxes.

Stateless apart from an owner cache: sandbox ids route through :class:`Placement`, the audit
trail goes to :class:`EventLog`, principals come from :class:`KeyStore`.
"""

import asyncio
import base64
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Query, Request, Security, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollbox import errors, models
from rollbox.api import frontdoors
from rollbox.edge.interface import EdgeAPI, ExecOutput
from rollbox.events import EventLog
from rollbox.iam import KeyStore, Principal
from rollbox.jobs import LeaseStore
from rollbox.iam.quotas import QuotaStore, check_project, check_quota
from rollbox.placement import Placement

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
MAX_JSON_BODY = 1 << 20
MAX_FILE_WRITE = 256 << 20
MAX_TAR_UPLOAD = 2 << 30
# One streamed file (GET/PUT .../files): memory stays bounded; the sandbox's disk cap still
# bounds what a write can store.
MAX_FILE_STREAM = 16 << 30
MAX_STDIN_BODY = 16 << 20
# An image upload's tar (the edge caps the bytes of its files by image_upload_max_bytes).
MAX_IMAGE_UPLOAD = 64 << 30
OWNER_CACHE_SIZE = 65536
T = TypeVar("T")


# ---- request bodies that are not shared wire models ---------------------------------------
class TTLRequest(BaseModel):
    ttl_s: float = Field(..., gt=0, le=models.MAX_TIMEOUT_S)


class KillRequest(BaseModel):
    signal: int = Field(9, ge=1, le=64)


class MkdirRequest(BaseModel):
    path: str = Field(..., min_length=1, max_length=4096)
    parents: bool = True


class ExecStarted(BaseModel):
    exec_id: str


class Health(BaseModel):
    status: str
    nodes: list[str]


def _body_limit(method: str, path: str) -> int:
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
        limit = _body_limit(scope["method"], scope["path"])
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    err = errors.PayloadTooLarge(f"request body over {limit} bytes", limit=limit)
                    await JSONResponse(err.to_payload(), err.status)(scope, receive, send)
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


def _error_response(err: errors.RollboxError) -> JSONResponse:
    return JSONResponse(err.to_payload(), status_code=err.status)


_HTTP_STATUS_ERRORS: dict[int, type[errors.RollboxError]] = {
    400: errors.BadRequest,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    405: errors.BadRequest,
    413: errors.PayloadTooLarge,
}


def validation_message(errs: Sequence[Any]) -> str:
    """One line from pydantic's ``.errors()`` (FastAPI's request validation or a model's own),
    the message of every BadRequest for malformed input."""
    parts = []
    for e in errs:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


# ---- auth: every route of the app and its front doors reads the key the same way ----
_bearer = HTTPBearer(auto_error=False)
_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False)


def request_key(request: Request) -> str | None:
    """The API key of a request: ``Authorization: Bearer`` first, else ``X-API-Key`` (what
    :func:`principal` reads, for routes that skip FastAPI's dependency solving)."""
    scheme, _, cred = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and cred:
        return cred
    return request.headers.get("x-api-key")


async def principal(
    request: Request,
    cred: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    header_key: Annotated[str | None, Security(_api_key_header)],
) -> Principal:
    """FastAPI dependency: the caller, by the keys of the app's ``_Api``."""
    keys: KeyStore = request.app.state.api.keys
    return keys.verify(cred.credentials if cred is not None else header_key)


Who = Annotated[Principal, Depends(principal)]


async def admin_principal(who: Who) -> Principal:
    """FastAPI dependency of admin-only routes: Forbidden for a project key."""
    if not who.admin:
        raise errors.Forbidden("this needs an admin key")
    return who


AdminWho = Annotated[Principal, Depends(admin_principal)]


def _ndjson(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _output_line(item: ExecOutput) -> bytes | None:
    if item.kind in ("stdout", "stderr"):
        return _ndjson({"type": item.kind, "data": base64.b64encode(item.data).decode(),
                        "offset": item.offset})
    if item.kind == "exit" and item.result is not None:
        return _ndjson({"type": "exit", "result": item.result.model_dump(mode="json")})
    if item.kind == "error":
        err = item.error
        if not isinstance(err, errors.RollboxError):
            err = errors.InfraError(f"exec stream failed: {err!r}")
        return _ndjson({"type": "error", **err.to_payload()})
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


async def body_chunks(request: Request) -> AsyncIterator[bytes]:
    """A request body as it streams in (BodyLimitMiddleware caps it per route)."""
    async for chunk in request.stream():
        if chunk:
            yield chunk


async def upload_chunks(upload: UploadFile, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """A multipart file part (spooled by Starlette) in chunks, for ``file_write_stream``."""
    while chunk := await upload.read(size):
        yield chunk


class _Api:
    """Route logic shared by the handlers (kept off the module so several apps can coexist)."""

    def __init__(self, placement: Placement, events: EventLog, keys: KeyStore,
                 record_events: bool | None, leases: LeaseStore | None = None) -> None:
        self.placement = placement
        self.events = events
        self.keys = keys
        self.leases = leases
        self.record_events = record_events
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._recorders: dict[str, set[asyncio.Task[None]]] = {}
        self._recorded_execs: OrderedDict[tuple[str, str], None] = OrderedDict()

    # -- auth and ownership --
    def remember_owner(self, sandbox_id: str, owner: str) -> None:
        self._owners[sandbox_id] = owner
        self._owners.move_to_end(sandbox_id)
        while len(self._owners) > OWNER_CACHE_SIZE:
            self._owners.popitem(last=False)

    async def sandbox_edge(self, sandbox_id: str, who: Principal) -> EdgeAPI:
        """The edge of a sandbox the principal may use; others' sandboxes look absent."""
        edge = self.placement.edge_for(sandbox_id)
        owner = self._owners.get(sandbox_id)
        if owner is None:
            owner = (await edge.get(sandbox_id)).owner
            self.remember_owner(sandbox_id, owner)
        if not who.admin and owner != who.project:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return edge

    async def logged_owner(self, sandbox_id: str) -> str | None:
        # The first event of every sandbox created through the api is sandbox.created with
        # its owner: this is what authorises reading the log of a deleted sandbox.
        first = await self.events.read(sandbox_id, 0, 1)
        if first and first[0].kind == "sandbox.created":
            try:
                return str(json.loads(first[0].data).get("owner"))
            except (ValueError, AttributeError):
                return None
        return None

    def check_image_name(self, owner: str, name: str) -> None:
        """An image name under another project's name (``teamA/...``) is that project's: no
        other project may take it (squatting its names, or probing them through the
        name-taken error). Names under no project's name stay node-wide."""
        if name.startswith(f"{owner}/"):
            return
        for project in self.keys.projects():
            if project.name != owner and name.startswith(f"{project.name}/"):
                raise errors.BadRequest(f"image {name!r}: names under {project.name + '/'!r} "
                                        f"are that project's; use e.g. '{owner}/...'",
                                        image=name)

    def lease_store(self) -> LeaseStore:
        if self.leases is None:
            raise errors.BadRequest("this server keeps no job leases")
        return self.leases

    # -- recording --
    def records(self, edge: EdgeAPI) -> bool:
        """Whether the api writes the audit trail for this edge's sandboxes. An edge that
        writes into this same EventLog itself (embedded mode) is not doubled; a remote edge
        with its own log is recorded here."""
        if self.record_events is not None:
            return self.record_events
        return getattr(edge, "event_log", None) is not self.events

    def spawn(self, coro: Awaitable[None], sandbox_id: str | None = None) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if sandbox_id is not None:
            per = self._recorders.setdefault(sandbox_id, set())
            per.add(task)

            def done(t: asyncio.Task[None]) -> None:
                per.discard(t)
                if not per and self._recorders.get(sandbox_id) is per:
                    del self._recorders[sandbox_id]

            task.add_done_callback(done)

    async def drain_recorders(self, sandbox_id: str, timeout_s: float) -> None:
        """Let the commands' last output and exit reach the log before sandbox.deleted."""
        tasks = self._recorders.get(sandbox_id)
        if tasks:
            await asyncio.wait(set(tasks), timeout=timeout_s)

    def first_record(self, sandbox_id: str, exec_id: str) -> bool:
        """False for an exec start that an idempotency key mapped to a recorded exec."""
        key = (sandbox_id, exec_id)
        if key in self._recorded_execs:
            return False
        self._recorded_execs[key] = None
        while len(self._recorded_execs) > OWNER_CACHE_SIZE:
            self._recorded_execs.popitem(last=False)
        return True

    async def record_exec(self, edge: EdgeAPI, sandbox_id: str, exec_id: str) -> None:
        """Copy one command's output into the audit log, independent of any client stream."""
        try:
            async for item in edge.exec_stream(sandbox_id, exec_id):
                if item.kind == "stdout":
                    self.events.append(sandbox_id, "exec.stdout", exec_id, item.data)
                elif item.kind == "stderr":
                    self.events.append(sandbox_id, "exec.stderr", exec_id, item.data)
                elif item.kind == "exit" and item.result is not None:
                    summary = item.result.model_dump(exclude={"stdout", "stderr"})
                    self.events.append(sandbox_id, "exec.exited", exec_id, json.dumps(summary))
                elif item.kind == "error":
                    self.events.append(sandbox_id, "exec.error", exec_id, repr(item.error))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.events.append(sandbox_id, "exec.error", exec_id, repr(exc))

    async def shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def create_app(placement: Placement, events: EventLog, keys: KeyStore, *,
               record_events: bool | None = None, leases: LeaseStore | None = None,
               quotas: QuotaStore | None = None) -> FastAPI:
    """``record_events``: None (default) = record for every edge that does not write into
    ``events`` itself; True/False forces it for all edges. ``leases``: the trainer-job lease
    store the edges sweep (None: no jobs on this server; see rollbox.api.jobs). ``quotas``:
    the project quotas the edges enforce (the quota routes answer bad_request without)."""
    api = _Api(placement, events, keys, record_events, leases)
    front_doors: list[contextlib.AbstractAsyncContextManager[None]] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with front_doors[0]:
            yield
        await api.shutdown()

    app = FastAPI(
        title="rollbox",
        version="0.1.0",
        description="Sandboxes for RL training of LLM agents.",
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimitMiddleware)
    app.state.api = api

    # ---- errors ----
    @app.exception_handler(errors.RollboxError)
    async def _rollbox_error(_: Request, exc: errors.RollboxError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(errors.BadRequest(validation_message(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        cls = _HTTP_STATUS_ERRORS.get(exc.status_code, errors.RollboxError)
        err = cls(str(exc.detail))
        return JSONResponse(err.to_payload(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return _error_response(errors.RollboxError("internal error"))

    # ---- auth (module level: principal, Who) ----
    async def edge_of(sandbox_id: str, who: Who) -> EdgeAPI:
        return await api.sandbox_edge(sandbox_id, who)

    Edge = Annotated[EdgeAPI, Depends(edge_of)]

    # ---- health ----
    @app.get("/v1/health", response_model=Health, tags=["meta"])
    async def health() -> Health:
        return Health(status="ok", nodes=sorted(placement.edges))

    # ---- sandboxes ----
    @app.post("/v1/sandboxes", status_code=201, response_model=models.SandboxInfo,
              tags=["sandboxes"])
    async def create_sandbox(spec: models.SandboxSpec, who: Who) -> models.SandboxInfo:
        if spec.job is not None:  # NotFound unless the project's job is live
            api.lease_store().live(who.project, spec.job)
        info = await placement.create(spec, who.project)
        api.remember_owner(info.id, who.project)
        if api.records(placement.edge_for(info.id)):
            events.append(info.id, "sandbox.created", None, json.dumps({
                "owner": who.project, "key_id": who.key_id, "node": info.node,
                "image": spec.image, "layers": spec.layers, "labels": spec.labels, "job": spec.job,
                "resources": spec.resources.model_dump(), "ttl_s": spec.ttl_s,
            }))
        return info

    @app.get("/v1/sandboxes", response_model=list[models.SandboxInfo], tags=["sandboxes"])
    async def list_sandboxes(
        who: Who,
        label: Annotated[list[str], Query(description="k=v, repeatable; all must match")] = [],
        state: Annotated[list[models.SandboxState],
                         Query(description="repeatable; any may match (e.g. paused)")] = [],
        job: Annotated[str | None, Query(max_length=128, description="a job's sandboxes")] = None,
        project: Annotated[str | None, Query(max_length=128,
                                             description="admin: one project's")] = None,
    ) -> list[models.SandboxInfo]:
        labels: dict[str, str] = {}
        for item in label:
            k, sep, v = item.partition("=")
            if not sep or not k:
                raise errors.BadRequest(f"label filter must be k=v, got {item!r}")
            labels[k] = v
        owner = None if who.admin else who.project
        if project is not None and project != who.project:
            if not who.admin:
                return []  # another project's sandboxes look absent
            owner = project
        found = await placement.list(owner, labels)
        # Filter again here: the edge's own filtering is trusted for speed, not for isolation.
        return [
            i for i in found
            if (owner is None or i.owner == owner)
            and all(i.labels.get(k) == v for k, v in labels.items())
            and (not state or i.state in state)
            and (job is None or i.job == job)
        ]

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=models.SandboxInfo,
             tags=["sandboxes"])
    async def get_sandbox(sandbox_id: str, edge: Edge) -> models.SandboxInfo:
        return await edge.get(sandbox_id)

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204, tags=["sandboxes"])
    async def delete_sandbox(sandbox_id: str, edge: Edge, who: Who) -> Response:
        await edge.delete(sandbox_id)
        if api.records(edge):
            await api.drain_recorders(sandbox_id, 2.0)
            events.append(sandbox_id, "sandbox.deleted", None,
                          json.dumps({"by": who.key_id, "reason": "api"}))
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/ttl", response_model=models.SandboxInfo,
              tags=["sandboxes"])
    async def set_ttl(sandbox_id: str, body: TTLRequest, edge: Edge) -> models.SandboxInfo:
        info = await edge.set_ttl(sandbox_id, body.ttl_s)
        events.append(sandbox_id, "sandbox.ttl", None, json.dumps({"ttl_s": body.ttl_s}))
        return info

    @app.post("/v1/sandboxes/{sandbox_id}/pause", response_model=models.SandboxInfo,
              tags=["sandboxes"])
    async def pause_sandbox(sandbox_id: str, edge: Edge, who: Who) -> models.SandboxInfo:
        """Freeze the whole sandbox (state ``paused``): exec answers 409 sandbox_paused until
        resume; files, TTL, network and delete still work; the TTL keeps counting."""
        info = await edge.pause(sandbox_id)
        if api.records(edge):
            events.append(sandbox_id, "sandbox.paused", None, json.dumps({"by": who.key_id}))
        return info

    @app.post("/v1/sandboxes/{sandbox_id}/resume", response_model=models.SandboxInfo,
              tags=["sandboxes"])
    async def resume_sandbox(sandbox_id: str, edge: Edge, who: Who) -> models.SandboxInfo:
        """Thaw a paused sandbox; its processes continue where they stopped."""
        info = await edge.resume(sandbox_id)
        if api.records(edge):
            events.append(sandbox_id, "sandbox.resumed", None, json.dumps({"by": who.key_id}))
        return info

    @app.put("/v1/sandboxes/{sandbox_id}/network", response_model=models.SandboxInfo,
             tags=["sandboxes"])
    async def set_network(sandbox_id: str, body: models.NetworkPolicy,
                          edge: Edge) -> models.SandboxInfo:
        """Replace the sandbox's network policy (default deny; effective for open connections)."""
        return await edge.set_network(sandbox_id, body)

    # ---- exec ----
    @app.post("/v1/sandboxes/{sandbox_id}/grade", response_model=models.GradeResult,
              tags=["sandboxes"])
    async def grade(sandbox_id: str, spec: models.GradeSpec, edge: Edge,
                    who: Who) -> models.GradeResult:
        owner = (await edge.get(sandbox_id)).owner
        result = await edge.grade(sandbox_id, spec, owner)
        events.append(sandbox_id, "sandbox.graded", None, json.dumps(
            {"grader": result.grader_id, "files": result.files,
             "exit_code": result.result.exit_code, "by": who.key_id}))
        return result

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot", response_model=models.SnapshotResult,
              tags=["sandboxes"])
    async def snapshot(sandbox_id: str, spec: models.SnapshotSpec, edge: Edge,
                       who: Who) -> models.SnapshotResult:
        """pack_diff: the sandbox's writable layer, scrubbed, becomes a new layer; ``name`` is
        tagged as the sandbox's layers + it (create sandboxes from it on this node). The image
        belongs to the sandbox's project: other projects can't see or use it."""
        owner = (await edge.get(sandbox_id)).owner
        api.check_image_name(owner, spec.name)
        return await edge.snapshot(sandbox_id, spec, owner)

    def exec_stream_response(edge: EdgeAPI, sandbox_id: str, exec_id: str,
                             stream: AsyncIterator[ExecOutput] | None = None) -> Response:
        """NDJSON: started, then stdout/stderr (base64 ``data`` at stream ``offset``: a client
        that resumes passes what it has; an offset past it is output lost for good), then one
        exit (or error)."""
        async def body() -> AsyncIterator[bytes]:
            yield _ndjson({"type": "started", "exec_id": exec_id})
            try:
                it = stream if stream is not None else edge.exec_stream(sandbox_id, exec_id)
                async for item in it:
                    line = _output_line(item)
                    if line is not None:
                        yield line
                    if item.kind in ("exit", "error"):
                        return
                # Stream ended without an exit: the sandbox went away under the command.
                yield _ndjson({"type": "error", **errors.SandboxDead(
                    "exec stream ended without an exit status").to_payload()})
            except errors.RollboxError as exc:
                yield _ndjson({"type": "error", **exc.to_payload()})
            except Exception as exc:  # noqa: BLE001 - reported in-band, headers are sent
                log.exception("exec stream %s/%s failed", sandbox_id, exec_id)
                yield _ndjson({"type": "error", **errors.InfraError(
                    f"exec stream failed: {exc!r}").to_payload()})

        # A client that disconnects cancels only this generator; the command keeps running.
        return StreamingResponse(body(), media_type=NDJSON,
                                 headers={"X-Rollbox-Exec-Id": exec_id})

    @app.post("/v1/sandboxes/{sandbox_id}/exec", tags=["exec"],
              responses={200: {"content": {NDJSON: {}}, "description":
                               "NDJSON stream, {exec_id} if background, ExecResult if wait=1"}})
    async def exec_start(
        sandbox_id: str, spec: models.ExecSpec, edge: Edge,
        wait: Annotated[bool, Query(description="return one ExecResult when done")] = False,
    ) -> Response:
        exec_id = await edge.exec_start(sandbox_id, spec)
        if api.records(edge) and api.first_record(sandbox_id, exec_id):
            events.append(sandbox_id, "exec.started", exec_id, json.dumps({
                "cmd": spec.cmd, "cwd": spec.cwd, "user": spec.user,
                "timeout_s": spec.timeout_s, "background": spec.background,
                "env_keys": sorted(spec.env),
            }))
            api.spawn(api.record_exec(edge, sandbox_id, exec_id), sandbox_id)
        if spec.background:
            return JSONResponse(ExecStarted(exec_id=exec_id).model_dump())
        if wait:
            result = await edge.exec_wait(sandbox_id, exec_id)
            return JSONResponse(result.model_dump(mode="json"))
        return exec_stream_response(edge, sandbox_id, exec_id)

    @app.get("/v1/sandboxes/{sandbox_id}/exec", response_model=list[models.ExecInfo],
             tags=["exec"])
    async def exec_list(sandbox_id: str, edge: Edge) -> list[models.ExecInfo]:
        return await edge.exec_list(sandbox_id)

    @app.get("/v1/sandboxes/{sandbox_id}/exec/{exec_id}/stream", tags=["exec"],
             responses={200: {"content": {NDJSON: {}}}})
    async def exec_attach(
        sandbox_id: str, exec_id: str, edge: Edge,
        stdout_offset: Annotated[int, Query(ge=0, description="stdout bytes the client has")] = 0,
        stderr_offset: Annotated[int, Query(ge=0, description="stderr bytes the client has")] = 0,
    ) -> Response:
        stream = await primed(
            edge.exec_stream(sandbox_id, exec_id, (stdout_offset, stderr_offset)), 0.2)
        return exec_stream_response(edge, sandbox_id, exec_id, stream)

    @app.get("/v1/sandboxes/{sandbox_id}/exec/{exec_id}", response_model=models.ExecResult,
             tags=["exec"])
    async def exec_wait(sandbox_id: str, exec_id: str, edge: Edge) -> models.ExecResult:
        return await edge.exec_wait(sandbox_id, exec_id)

    @app.post("/v1/sandboxes/{sandbox_id}/exec/{exec_id}/stdin", status_code=204,
              tags=["exec"])
    async def exec_stdin(sandbox_id: str, exec_id: str, request: Request, edge: Edge,
                         eof: bool = False) -> Response:
        data = await request.body()
        await edge.exec_stdin(sandbox_id, exec_id, data, eof)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/exec/{exec_id}/kill", status_code=204,
              tags=["exec"])
    async def exec_kill(sandbox_id: str, exec_id: str, edge: Edge,
                        body: KillRequest | None = None) -> Response:
        await edge.exec_kill(sandbox_id, exec_id, (body or KillRequest()).signal)
        return Response(status_code=204)

    # ---- files ----
    PathQ = Annotated[str, Query(min_length=1, max_length=4096)]

    @app.get("/v1/sandboxes/{sandbox_id}/files", tags=["files"],
             responses={200: {"content": {"application/octet-stream": {}}}})
    async def file_read(sandbox_id: str, path: PathQ, edge: Edge) -> Response:
        stream = await primed(edge.file_read_stream(sandbox_id, path, MAX_FILE_STREAM), 10.0)
        return StreamingResponse(stream, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files", status_code=204, tags=["files"])
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

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat", response_model=models.FileStat,
             tags=["files"])
    async def file_stat(sandbox_id: str, path: PathQ, edge: Edge) -> models.FileStat:
        return await edge.file_stat(sandbox_id, path)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list", response_model=list[models.FileStat],
             tags=["files"])
    async def file_list(sandbox_id: str, path: PathQ, edge: Edge) -> list[models.FileStat]:
        return await edge.file_list(sandbox_id, path)

    @app.post("/v1/sandboxes/{sandbox_id}/files/mkdir", status_code=204, tags=["files"])
    async def file_mkdir(sandbox_id: str, body: MkdirRequest, edge: Edge) -> Response:
        await edge.file_mkdir(sandbox_id, body.path, body.parents)
        return Response(status_code=204)

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204, tags=["files"])
    async def file_remove(sandbox_id: str, path: PathQ, edge: Edge,
                          recursive: bool = False) -> Response:
        await edge.file_remove(sandbox_id, path, recursive)
        return Response(status_code=204)

    @app.put("/v1/sandboxes/{sandbox_id}/tar", tags=["files"])
    async def tar_upload(sandbox_id: str, path: PathQ, request: Request,
                         edge: Edge) -> dict[str, int]:
        written = await edge.upload_tar(sandbox_id, path, body_chunks(request))
        return {"written": written}

    @app.get("/v1/sandboxes/{sandbox_id}/tar", tags=["files"],
             responses={200: {"content": {"application/x-tar": {}}}})
    async def tar_download(sandbox_id: str, path: PathQ, edge: Edge) -> Response:
        stream = await primed(edge.download_tar(sandbox_id, path), 10.0)
        return StreamingResponse(stream, media_type="application/x-tar")

    # ---- projects (admin) ----
    def quota_store(who: Principal, project: str, write: bool) -> QuotaStore:
        if not who.admin and (write or project != who.project):
            raise errors.Forbidden("setting quotas, or reading another project's, needs an "
                                   "admin key")
        check_project(project)
        if quotas is None:
            raise errors.BadRequest("this api has no quota store")
        return quotas

    @app.get("/v1/projects/{project:path}/quota", response_model=models.Quota,
             tags=["projects"])
    async def get_quota(project: str, who: Who) -> models.Quota:
        """A project's per-node limits; a project key may read its own."""
        return quota_store(who, project, write=False).get(project)

    @app.put("/v1/projects/{project:path}/quota", response_model=models.Quota,
             tags=["projects"])
    async def set_quota(project: str, body: models.Quota, who: Who) -> models.Quota:
        """Replace a project's per-node limits (a null field is unlimited). A negative limit
        or one above a node's capacity is refused and nothing is stored."""
        store = quota_store(who, project, write=True)
        check_quota(body, await placement.node_limits())
        return store.set(project, body)

    # ---- events ----
    @app.get("/v1/sandboxes/{sandbox_id}/events", tags=["events"],
             responses={200: {"content": {NDJSON: {}}}})
    async def sandbox_events(
        sandbox_id: str, who: Who,
        after: Annotated[int, Query(ge=0)] = 0, follow: bool = False,
    ) -> Response:
        try:
            await api.sandbox_edge(sandbox_id, who)
        except (errors.NotFound, errors.SandboxDead):
            # Gone (or never ours): the log itself says who owned it.
            owner = await api.logged_owner(sandbox_id)
            if owner is None or (not who.admin and owner != who.project):
                raise errors.NotFound(f"no sandbox {sandbox_id!r}") from None

        async def body() -> AsyncIterator[bytes]:
            if follow:
                async for ev in events.follow(sandbox_id, after):
                    yield ev.model_dump_json().encode() + b"\n"
                return
            last = after
            while True:
                batch = await events.read(sandbox_id, last, 1000)
                for ev in batch:
                    yield ev.model_dump_json().encode() + b"\n"
                if len(batch) < 1000:
                    return
                last = batch[-1].seq

        return StreamingResponse(body(), media_type=NDJSON)

    front_doors.append(frontdoors.mount_all(app, api))
    return app


__all__ = ["create_app", "BodyLimitMiddleware", "TTLRequest", "KillRequest", "MkdirRequest"]
