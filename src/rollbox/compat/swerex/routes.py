"""The SWE-ReX remote-runtime routes, one runtime per sandbox under ``/swerex/{sandbox_id}``.

``RemoteRuntime(host=f"{url}/swerex/{sandbox_id}", auth_token=<rollbox api key>)`` joins its
endpoint names onto ``host`` (when ``port`` is None), so each sandbox is its own runtime.

Error shapes follow the SWE-ReX server: errors of the runtime (missing session, timeout,
non-zero exit with ``check``, missing file, unsupported call) are HTTP 511 with
``{"swerexception": {...}}``, which the client re-raises as the named class; a bad key (401),
an unknown or foreign sandbox (404), a dead one (410) and platform faults (503) are plain HTTP
errors with ``detail`` (``is_alive`` turns them into ``is_alive=False`` with that message,
the other calls into ``aiohttp.ClientResponseError``).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import tarfile
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import IO, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from rollbox import errors
from rollbox.api.bodies import MAX_FILE_STREAM, upload_chunks
from rollbox.api.context import ApiContext
from rollbox.api.errors import error_payload
from rollbox.compat.swerex import wire
from rollbox.compat.swerex.session import BashSession, SessionGone, SyntaxChecker
from rollbox.edge.interface import EdgeAPI
from rollbox.models import MAX_TIMEOUT_S, ExecSpec

log = logging.getLogger(__name__)

PREFIX = "/swerex"
MAX_SESSIONS_PER_SANDBOX = 64
MAX_FILE_READ = 256 << 20
MAX_EXECUTE_OUTPUT = 64 << 20  # per stream, kept for the response
MAX_UNZIPPED = 8 << 30  # declared size of an uploaded zip's members; the disk cap bounds reality
CHUNK = 1 << 20
STATUS_OF_HTTP_ERRORS = (errors.Unauthorized, errors.NotFound, errors.SandboxDead)
NO_KEY = "Not authenticated: no API key (X-API-Key)"
ENDPOINTS = frozenset({"", "is_alive", "close", "create_session", "run_in_session",
                       "close_session", "execute", "read_file", "write_file", "upload"})


def _http_error(exc: errors.RollboxError) -> JSONResponse:
    # ``detail`` is what the SWE-ReX client prints; ``error`` is rollbox's usual body (with
    # the request's id).
    return JSONResponse({"detail": exc.message, **error_payload(exc)}, status_code=exc.status)


def _transfer(exc: wire.RemoteError) -> JSONResponse:
    return JSONResponse(exc.transfer(), status_code=511)


def _as_remote(exc: errors.RollboxError) -> wire.RemoteError:
    """A sandbox-level rollbox error raised by an operation, as the exception the SWE-ReX
    runtime would raise for the same failure on its own machine."""
    if isinstance(exc, errors.NotFound):
        return wire.RemoteError("builtins.FileNotFoundError", exc.message)
    if isinstance(exc, (errors.BadRequest, errors.PayloadTooLarge)):
        return wire.RemoteError("builtins.OSError", exc.message)
    if isinstance(exc, errors.CommandTimeout):
        return wire.RemoteError(wire.CommandTimeoutError, exc.message)
    return wire.RemoteError(wire.SwerexException, exc.message)


def _abs(path: str) -> str:
    if not path or "\0" in path:
        raise wire.RemoteError("builtins.FileNotFoundError", f"invalid path {path!r}")
    return posixpath.join("/", path)  # relative paths: from / (the runtime's working dir)


class Sessions:
    """The bash sessions of every sandbox, by (sandbox id, session name)."""

    def __init__(self) -> None:
        self.by_sandbox: dict[str, dict[str, BashSession]] = {}
        self.checker = SyntaxChecker()

    def get(self, sandbox_id: str, name: str) -> BashSession:
        session = self.by_sandbox.get(sandbox_id, {}).get(name)
        if session is None or session.exited:
            raise wire.RemoteError(wire.SessionDoesNotExistError,
                                   f"session {name!r} does not exist")
        return session

    def add(self, session: BashSession) -> None:
        per = self.by_sandbox.setdefault(session.sandbox_id, {})
        old = per.get(session.name)
        if old is not None and not old.exited:
            raise wire.RemoteError(wire.SessionExistsError,
                                   f"session {session.name} already exists")
        if len(per) >= MAX_SESSIONS_PER_SANDBOX:
            raise wire.RemoteError(wire.SwerexException, f"at most {MAX_SESSIONS_PER_SANDBOX} "
                                   "sessions per sandbox")
        per[session.name] = session

    def discard(self, session: BashSession) -> None:
        per = self.by_sandbox.get(session.sandbox_id)
        if per is not None and per.get(session.name) is session:
            del per[session.name]
            if not per:
                del self.by_sandbox[session.sandbox_id]

    def of(self, sandbox_id: str) -> list[BashSession]:
        return list(self.by_sandbox.get(sandbox_id, {}).values())

    async def close_all(self) -> None:
        every = [s for per in self.by_sandbox.values() for s in per.values()]
        await asyncio.gather(*(s.close() for s in every), return_exceptions=True)
        self.by_sandbox.clear()
        await self.checker.close()


async def _zip_as_tar(archive: IO[bytes]) -> AsyncIterator[bytes]:
    """Re-encode an uploaded zip as a tar stream for the edge (names cleaned like
    ``ZipFile.extract``: no absolute paths, no ``..``; unix modes kept when recorded)."""
    zf = await asyncio.to_thread(zipfile.ZipFile, archive)
    try:
        infos = zf.infolist()
        if sum(i.file_size for i in infos) > MAX_UNZIPPED:
            raise wire.RemoteError("builtins.OSError", "zip expands beyond "
                                   f"{MAX_UNZIPPED} bytes")
        for info in infos:
            parts = [p for p in info.filename.replace("\\", "/").split("/")
                     if p not in ("", ".", "..")]
            if not parts:
                continue
            ti = tarfile.TarInfo("/".join(parts))
            mode = (info.external_attr >> 16) & 0o7777
            if info.is_dir():
                ti.type = tarfile.DIRTYPE
                ti.mode = mode or 0o755
                yield ti.tobuf(format=tarfile.PAX_FORMAT)
                continue
            ti.size = info.file_size
            ti.mode = mode or 0o644
            yield ti.tobuf(format=tarfile.PAX_FORMAT)
            left = info.file_size
            with zf.open(info) as member:
                while left > 0:
                    data = await asyncio.to_thread(member.read, min(CHUNK, left))
                    if not data:
                        raise wire.RemoteError("builtins.OSError",
                                               f"zip member {info.filename!r} is truncated")
                    left -= len(data)
                    yield data
            if info.file_size % 512:
                yield b"\0" * (512 - info.file_size % 512)
        yield b"\0" * 1024
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError) as exc:
        raise wire.RemoteError("zipfile.BadZipFile", f"bad zip upload: {exc}") from None
    finally:
        zf.close()


class _KeyFirst:
    """SWE-ReX's server checks the key before routing or reading a body: a request below
    ``/swerex/`` with no key at all is 403 whatever its path, method or body (a bad key is
    401, from the route). Pure ASGI; every other path passes untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX + "/"):
            headers = dict(scope["headers"])
            scheme, _, cred = headers.get(b"authorization", b"").partition(b" ")
            if not headers.get(b"x-api-key") and not (scheme.lower() == b"bearer" and cred):
                await _http_error(errors.Forbidden(NO_KEY))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def mount(app: FastAPI, api: ApiContext) -> contextlib.AbstractAsyncContextManager[None]:
    sessions = Sessions()
    app.add_middleware(_KeyFirst)
    router = APIRouter(prefix=PREFIX + "/{sandbox_id}", tags=["swe-rex"])

    def key_of(request: Request) -> str:
        key = request.headers.get("x-api-key")
        if not key:
            scheme, _, cred = request.headers.get("authorization", "").partition(" ")
            key = cred if scheme.lower() == "bearer" else None
        if not key:  # SWE-ReX's server (FastAPI's APIKeyHeader, as released): 403
            raise errors.Forbidden(NO_KEY)
        return key

    async def resolve(sandbox_id: str, request: Request) -> EdgeAPI:
        return await api.sandbox_edge(sandbox_id, await api.principal(key_of(request)))

    async def call(sandbox_id: str, request: Request,
                   op: Callable[[EdgeAPI], Awaitable[BaseModel]]) -> JSONResponse:
        try:
            edge = await resolve(sandbox_id, request)
        except errors.RollboxError as exc:
            return _http_error(exc)
        try:
            result = await op(edge)
        except wire.RemoteError as exc:
            return await gone_or(edge, sandbox_id, exc)
        except SessionGone as exc:
            return await gone_or(edge, sandbox_id, wire.RemoteError(
                wire.SessionNotInitializedError, str(exc)))
        except errors.InfraError as exc:
            return _http_error(exc)
        except errors.RollboxError as exc:
            return await gone_or(edge, sandbox_id, _as_remote(exc))
        except Exception as exc:
            log.exception("swe-rex %s on %s failed", request.url.path, sandbox_id)
            return _transfer(wire.RemoteError(wire.SwerexException, f"{exc!r}"))
        return JSONResponse(result.model_dump(mode="json"))

    async def gone_or(edge: EdgeAPI, sandbox_id: str, exc: wire.RemoteError) -> JSONResponse:
        """The sandbox vanishing under a call is a 404/410, not an error of the call."""
        try:
            info = await edge.get(sandbox_id)
        except errors.RollboxError as gone:
            return _http_error(gone)
        if info.state in ("dead", "deleted"):
            return _http_error(errors.SandboxDead(f"sandbox {sandbox_id} is {info.state}"))
        return _transfer(exc)

    # ---- runtime ----
    @router.get("/is_alive")
    async def is_alive(sandbox_id: str, request: Request) -> JSONResponse:
        async def op(edge: EdgeAPI) -> BaseModel:
            info = await edge.get(sandbox_id)
            if info.state != "running":
                return wire.IsAliveResponse(is_alive=False, message=f"sandbox is {info.state}")
            return wire.IsAliveResponse(is_alive=True)
        return await call(sandbox_id, request, op)

    @router.get("/")
    async def root(sandbox_id: str, request: Request) -> JSONResponse:
        async def op(edge: EdgeAPI) -> BaseModel:
            await edge.get(sandbox_id)
            return _Message(message="hello world")
        return await call(sandbox_id, request, op)

    @router.post("/close")
    async def close(sandbox_id: str, request: Request) -> JSONResponse:
        """Closes the runtime's sessions; the sandbox itself lives on until deleted."""
        async def op(edge: EdgeAPI) -> BaseModel:
            for s in sessions.of(sandbox_id):
                sessions.discard(s)
                await s.close()
            return wire.Empty()
        return await call(sandbox_id, request, op)

    # ---- sessions ----
    @router.post("/create_session")
    async def create_session(sandbox_id: str, body: wire.CreateBashSessionRequest,
                             request: Request) -> JSONResponse:
        async def op(edge: EdgeAPI) -> BaseModel:
            session = BashSession(edge, sandbox_id, body.session, sessions.checker)
            sessions.add(session)
            try:
                output = await session.start(body)
            except BaseException:
                sessions.discard(session)
                await session.close()
                raise
            session.add_done_callback(lambda: sessions.discard(session))
            return wire.CreateBashSessionResponse(output=output)
        return await call(sandbox_id, request, op)

    @router.post("/run_in_session")
    async def run_in_session(sandbox_id: str, body: wire.Action,
                             request: Request) -> JSONResponse:
        async def op(edge: EdgeAPI) -> BaseModel:
            session = sessions.get(sandbox_id, body.session)
            if isinstance(body, wire.BashInterruptAction):
                await api.record(edge, sandbox_id, "swerex.interrupt",
                                 {"exec_id": session.exec_id})
                return await session.interrupt(body)
            await api.record(edge, sandbox_id, "swerex.command",
                             {"exec_id": session.exec_id, "command": body.command})
            return await session.run(body)
        return await call(sandbox_id, request, op)

    @router.post("/close_session")
    async def close_session(sandbox_id: str, body: wire.CloseBashSessionRequest,
                            request: Request) -> JSONResponse:
        async def op(edge: EdgeAPI) -> BaseModel:
            session = sessions.get(sandbox_id, body.session)
            sessions.discard(session)
            await session.close()
            return wire.CloseBashSessionResponse()
        return await call(sandbox_id, request, op)

    # ---- commands and files ----
    @router.post("/execute")
    async def execute(sandbox_id: str, body: wire.Command, request: Request) -> JSONResponse:
        async def op(edge: EdgeAPI) -> BaseModel:
            return await _execute(edge, sandbox_id, body)
        return await call(sandbox_id, request, op)

    @router.post("/read_file")
    async def read_file(sandbox_id: str, body: wire.ReadFileRequest,
                        request: Request) -> JSONResponse:
        async def op(edge: EdgeAPI) -> BaseModel:
            data = await edge.file_read(sandbox_id, _abs(body.path), MAX_FILE_READ)
            try:
                text = data.decode(body.encoding or "utf-8", body.errors or "strict")
            except LookupError as exc:
                raise wire.RemoteError("builtins.LookupError", str(exc)) from None
            except UnicodeDecodeError as exc:
                raise wire.RemoteError("builtins.ValueError", str(exc)) from None
            return wire.ReadFileResponse(content=text)
        return await call(sandbox_id, request, op)

    @router.post("/write_file")
    async def write_file(sandbox_id: str, body: wire.WriteFileRequest,
                         request: Request) -> JSONResponse:
        async def op(edge: EdgeAPI) -> BaseModel:
            await edge.file_write(sandbox_id, _abs(body.path), body.content.encode(), 0o644)
            return wire.Empty()
        return await call(sandbox_id, request, op)

    @router.post("/upload")
    async def upload(sandbox_id: str, request: Request) -> JSONResponse:
        async def op(edge: EdgeAPI) -> BaseModel:
            form = await request.form(max_files=1, max_fields=8)
            try:
                file = form.get("file")
                target = form.get("target_path")
                unzip = str(form.get("unzip", "false")).lower() in ("true", "1", "yes", "on")
                if file is None or isinstance(file, str) or not isinstance(target, str):
                    raise wire.RemoteError("builtins.ValueError", "upload needs a file part "
                                           "and a target_path field")
                path = _abs(target)
                if unzip:
                    await edge.upload_tar(sandbox_id, path, _zip_as_tar(file.file))
                else:
                    await edge.file_write_stream(sandbox_id, path, upload_chunks(file), 0o644,
                                                 MAX_FILE_STREAM)
            finally:
                await form.close()
            return wire.Empty()
        return await call(sandbox_id, request, op)

    # Last: any other path or method under a sandbox. SWE-ReX's server checks the key before
    # routing, so a request without one is 403 and one with a bad key 401 whatever its path;
    # with a good key, a known endpoint with the wrong method is 405, anything else 404.
    @router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                               "OPTIONS"], include_in_schema=False)
    async def other(sandbox_id: str, rest: str, request: Request) -> JSONResponse:
        try:
            await resolve(sandbox_id, request)
        except errors.RollboxError as exc:
            return _http_error(exc)
        if rest.strip("/") in ENDPOINTS:
            return JSONResponse({"detail": "Method Not Allowed"}, status_code=405)
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    app.include_router(router)

    @contextlib.asynccontextmanager
    async def lifetime() -> AsyncIterator[None]:
        try:
            yield
        finally:
            await sessions.close_all()

    app.state.swerex_sessions = sessions
    return lifetime()


class _Message(BaseModel):
    message: str


async def _execute(edge: EdgeAPI, sandbox_id: str, cmd: wire.Command) -> wire.CommandResponse:
    """``subprocess.run`` semantics: a string runs through a shell only with ``shell`` (the
    platform shell, never the sandbox's ``/bin/sh``); the deadline is enforced inside the
    sandbox."""
    if isinstance(cmd.command, str):
        # An empty script runs nothing and exits 0 (``sh -c ""``, SWE-ReX's server); ``:`` is
        # the same script in a form the exec API accepts.
        argv: str | list[str] = (cmd.command or ":") if cmd.shell else [cmd.command]
    elif cmd.shell:  # subprocess: the first item is the script, the rest its $0, $1...
        if len(cmd.command) != 1:
            raise wire.RemoteError("builtins.ValueError", "shell=True takes a string or a "
                                   "one-item list here (no positional arguments)")
        argv = cmd.command[0] or ":"
    else:
        argv = list(cmd.command)
    if cmd.timeout is not None and not 0 < cmd.timeout <= MAX_TIMEOUT_S:
        raise wire.RemoteError("builtins.ValueError", f"timeout out of range: {cmd.timeout}")
    try:
        spec = ExecSpec(cmd=argv, env=cmd.env or {}, cwd=_abs(cmd.cwd or "/"),
                        timeout_s=cmd.timeout)
    except ValueError as exc:  # pydantic: bad env names, NUL bytes, empty argv
        raise wire.RemoteError("builtins.ValueError", str(exc)) from None
    exec_id = await edge.exec_start(sandbox_id, spec)  # the edge logs exec.* itself
    out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
    result = None
    async for item in edge.exec_stream(sandbox_id, exec_id):
        if item.kind in ("stdout", "stderr"):
            buf = out["stdout" if cmd.merge_output_streams else item.kind]
            if len(buf) < MAX_EXECUTE_OUTPUT:
                buf += item.data[: MAX_EXECUTE_OUTPUT - len(buf)]
        elif item.kind == "exit":
            result = item.result
            break
        elif item.kind == "error":
            err = item.error
            raise err if isinstance(err, Exception) else errors.InfraError("exec failed")
    if result is None:
        raise errors.SandboxDead("exec stream ended without an exit status")
    if result.timed_out:
        raise wire.RemoteError(wire.CommandTimeoutError,
                               f"Timeout ({cmd.timeout}s) exceeded while running command")
    code = result.exit_code if result.exit_code is not None else -(result.signal or 0)
    response = wire.CommandResponse(
        stdout=out["stdout"].decode(errors="backslashreplace"),
        stderr=out["stderr"].decode(errors="backslashreplace"), exit_code=code)
    if cmd.check and code != 0:
        msg = (f"Command {cmd.command!r} failed with exit code {code}. "
               f"Stdout:\n{response.stdout!r}\nStderr:\n{response.stderr!r}")
        if cmd.error_msg:
            msg = f"{cmd.error_msg}: {msg}"
        raise wire.RemoteError(wire.NonZeroExitCodeError, msg)
    return response
