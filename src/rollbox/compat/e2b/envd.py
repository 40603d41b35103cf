"""E2B's in-sandbox ``envd`` protocol on the edge interface: ``process.Process`` and
``filesystem.Filesystem`` over Connect RPC (JSON), plus ``/files`` and ``/health``.

Every request names its sandbox by the ``X-Access-Token`` issued at create/connect (and, from
the SDK's create path, ``E2b-Sandbox-Id``); the token is the only credential envd calls carry.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import posixpath
import re
import stat as statmod
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollbox import errors
from rollbox.api.bodies import MAX_FILE_STREAM, upload_chunks
from rollbox.api.context import ApiContext
from rollbox.api.streams import primed
from rollbox.compat.e2b import connectrpc as rpc
from rollbox.compat.e2b.state import (
    DEFAULT_USER,
    E2B_UID,
    E2B_USER,
    USER_LABEL,
    E2BState,
    abs_path,
    exec_of,
    home,
    iso,
    pid_of,
    set_default_user,
    user_of,
)
from rollbox.compat.e2b.watch import InotifyWatch, SyncWatchers
from rollbox.compat.shell import script_of
from rollbox.edge.interface import EdgeAPI, ExecOutput
from rollbox.models import ExecInfo, ExecSpec, FileStat, PtySize

log = logging.getLogger(__name__)

PREFIX = "/e2b/envd"
MAX_FILE_READ = 256 << 20
KEEPALIVE_HEADER = "keepalive-ping-interval"
LIST_MAX_ENTRIES = 100_000
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}


# ---- conversions ------------------------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(value: Any) -> bytes:
    if not value:
        return b""
    try:
        return base64.b64decode(value)
    except (ValueError, TypeError):
        raise rpc.ConnectError("invalid_argument", "bytes field is not base64") from None


def _owner(uid: int) -> str:
    if uid == 0:
        return "root"
    if uid == E2B_UID and user_of(None) == E2B_USER:  # E2B's base template's `user`
        return E2B_USER
    return str(uid)


def entry_info(st: FileStat, path: str | None = None) -> dict[str, Any]:
    kind = "FILE_TYPE_DIRECTORY" if st.type == "dir" else "FILE_TYPE_FILE"
    mode_bits = {"dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}.get(st.type, statmod.S_IFREG)
    out: dict[str, Any] = {
        "name": st.name,
        "type": kind,
        "path": path or st.path,
        "size": str(st.size),
        "mode": st.mode & 0o7777,
        "permissions": statmod.filemode(mode_bits | (st.mode & 0o7777)),
        "owner": _owner(st.uid),
        "group": _owner(st.gid),
        "modifiedTime": iso(st.mtime),
    }
    if meta := metadata_of_stat(st):
        out["metadata"] = meta
    if st.link_target is not None:  # envd reports where the link points, made absolute
        where = path or st.path
        out["symlinkTarget"] = posixpath.normpath(
            posixpath.join(posixpath.dirname(where), st.link_target))
    return out


def _selector(msg: dict[str, Any]) -> str:
    sel = msg.get("process") or {}
    if "pid" in sel:
        try:
            return exec_of(int(sel["pid"]))
        except (TypeError, ValueError):
            raise rpc.ConnectError("invalid_argument", "pid must be a number") from None
    if "tag" in sel:
        raise rpc.ConnectError("not_found", f"process with tag {sel['tag']!r} not found")
    raise rpc.ConnectError("invalid_argument", "process selector (pid) is required")


def _basic_user(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("basic "):
        try:
            return user_of(base64.b64decode(auth[6:]).decode().partition(":")[0])
        except (ValueError, UnicodeDecodeError):
            raise rpc.ConnectError("invalid_argument", "bad Authorization header") from None
    return user_of(None)


METADATA_HEADER = "x-metadata-"
# envd >= 0.6.2's file metadata: X-Metadata-<key> upload headers, stored as the file's
# user.e2b.<key> extended attributes (key lowercased), surfaced by stat/list/watch entries.
METADATA_XATTR = "user.e2b."
# what the SDK accepts (an HTTP token for the key, printable US-ASCII for the value)
_META_KEY = re.compile(r"\A[a-z0-9!#$%&'*+\-.^_`|~]+\Z")
_META_VALUE = re.compile(r"\A[\x20-\x7e]*\Z")


def metadata_xattrs(request: Request) -> dict[str, str] | None:
    """The upload's X-Metadata-* headers as the extended attributes the file gets (None:
    none). A bad key or value is a BadRequest (the SDK's InvalidArgumentException), before
    anything is written; the caps are hostfs.check_xattrs'."""
    out: dict[str, str] = {}
    for name, value in request.headers.items():  # names come lowercased
        if not name.startswith(METADATA_HEADER):
            continue
        key = name[len(METADATA_HEADER):]
        if not _META_KEY.match(key):
            raise errors.BadRequest(f"invalid metadata key {key[:100]!r}")
        if not _META_VALUE.match(value):
            raise errors.BadRequest(f"invalid metadata value for key {key[:100]!r}: "
                                    "printable US-ASCII only")
        out[METADATA_XATTR + key] = value
    return out or None


def metadata_of_stat(st: FileStat) -> dict[str, str] | None:
    """The file's user.e2b.* attributes, prefix stripped (envd's EntryInfo.metadata)."""
    meta = {k[len(METADATA_XATTR):]: v for k, v in (st.xattrs or {}).items()
            if k.startswith(METADATA_XATTR) and len(k) > len(METADATA_XATTR)}
    return meta or None


def _written(target: str, xattrs: dict[str, str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": posixpath.basename(target), "type": "file", "path": target}
    if xattrs:
        out["metadata"] = {k[len(METADATA_XATTR):]: v for k, v in xattrs.items()}
    return out


async def _body_chunks(request: Request) -> AsyncIterator[bytes]:
    """An octet-stream upload's body, gunzipped when ``Content-Encoding: gzip`` (bounded by
    the caller's byte cap as it is inflated: a small bomb can not grow past it)."""
    enc = (request.headers.get("content-encoding") or "identity").strip().lower()
    if enc not in ("identity", "gzip"):
        raise errors.BadRequest(f"Content-Encoding {enc[:32]!r} not supported (gzip or none)")
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if enc == "gzip" else None
    async for chunk in request.stream():
        if inflate is None:
            yield chunk
            continue
        try:
            while chunk:
                out = inflate.decompress(chunk, 1 << 20)
                chunk = inflate.unconsumed_tail
                if out:
                    yield out
        except zlib.error:
            raise errors.BadRequest("body is not valid gzip") from None
    if inflate is not None:
        if not inflate.eof:
            raise errors.BadRequest("gzip body ends early")
        if tail := inflate.flush():
            yield tail


# Trees the kernel makes up inside the sandbox (envd, in the sandbox, reads them live; the
# edge's file API reads the sandbox's filesystem host-side, where they are not mounted).
LIVE_TREES = ("/proc/", "/sys/")
LIVE_READ_MAX = 1 << 20


async def _read_live(edge: EdgeAPI, sid: str, path: str) -> bytes:
    """A /proc or /sys file as the sandbox sees it: read by ``cat`` in the sandbox (as root,
    at most LIVE_READ_MAX bytes, text: the kernel's files there are)."""
    exec_id = await edge.exec_start(sid, ExecSpec(
        cmd=["head", "-c", str(LIVE_READ_MAX), "--", path], timeout_s=10))
    res = await edge.exec_wait(sid, exec_id)
    if res.exit_code != 0:
        if "No such file" in res.stderr:
            raise errors.NotFound(f"no such file or directory: {path}")
        raise errors.BadRequest(f"reading {path} failed: {res.stderr.strip()[:200]}")
    return res.stdout.encode()


async def _missing_parents(edge: EdgeAPI, sid: str, path: str) -> list[str]:
    """The directories above ``path`` that do not exist yet (nearest the root first): what a
    write or mkdir with parents will make. Only asked where files are handed to ``user``."""
    if user_of(None) == DEFAULT_USER:
        return []
    missing: list[str] = []
    parent = posixpath.dirname(posixpath.normpath(path))
    while parent not in ("/", ""):
        try:
            await edge.file_stat(sid, parent)
            break
        except errors.NotFound:
            missing.append(parent)
            parent = posixpath.dirname(parent)
    return missing[::-1]


async def _own(edge: EdgeAPI, sid: str, paths: list[str]) -> None:
    """In E2B's base template files are the user's: what envd wrote (as root, the edge's file
    API) is handed to ``user`` when it is the sandbox's default user, with the parents the
    write made on the way (``_missing_parents``, as envd, which runs as the user, makes them).
    Root images: nothing to do."""
    if user_of(None) == DEFAULT_USER or not paths:
        return
    user = user_of(None)
    exec_id = await edge.exec_start(sid, ExecSpec(
        cmd=["chown", "-h", f"{user}:{user}", "--", *paths], timeout_s=30))
    res = await edge.exec_wait(sid, exec_id)
    if res.exit_code != 0:
        raise errors.InfraError(f"chown to {user} failed: {res.stderr.strip()[:200]}")


# ---- output streams ---------------------------------------------------------------------
async def _with_keepalive(items: AsyncIterator[Any], interval: float | None,
                          deadline: float | None) -> AsyncIterator[Any]:
    """Yield ``items``; None after ``interval`` s of silence; stop with a ConnectError at the
    deadline. A pump task reads the source so a tick never cancels it mid-item."""
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=256)

    async def pump() -> None:
        try:
            async for item in items:
                await queue.put(("item", item))
            await queue.put(("end", None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - forwarded to the stream
            await queue.put(("error", exc))

    task = asyncio.ensure_future(pump())
    try:
        while True:
            wait = interval
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise rpc.ConnectError("deadline_exceeded", "deadline exceeded")
                wait = left if wait is None else min(wait, left)
            try:
                async with asyncio.timeout(wait):
                    kind, val = await queue.get()
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise rpc.ConnectError("deadline_exceeded", "deadline exceeded") from None
                yield None
                continue
            if kind == "end":
                return
            if kind == "error":
                raise val
            yield val
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(BaseException):
                await aclose()


def _keepalive_interval(request: Request) -> float | None:
    raw = request.headers.get(KEEPALIVE_HEADER)
    try:
        return max(1.0, float(raw)) if raw else None
    except ValueError:
        return None


def _stream_response(first: dict[str, Any] | None, events: AsyncIterator[dict[str, Any] | None],
                     keepalive: dict[str, Any]) -> Response:
    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield rpc.envelope(first)
            async for msg in events:
                yield rpc.envelope(keepalive if msg is None else msg)
        except Exception as exc:  # noqa: BLE001 - reported in-band, headers are sent
            yield rpc.end_stream(rpc.from_rollbox(exc))
            return
        yield rpc.end_stream()

    return StreamingResponse(body(), media_type=rpc.STREAM_MEDIA_TYPE)


def _pty_size(msg: dict[str, Any]) -> PtySize:
    """``{"pty": {"size": {"rows", "cols"}}}`` of Start and Update (an absent field is 0, as
    proto3 JSON leaves zeros out): invalid_argument outside 1..1000."""
    size = (msg.get("pty") or {}).get("size") or {}
    try:
        return PtySize(cols=size.get("cols", 0), rows=size.get("rows", 0))
    except ValueError as exc:  # pydantic's ValidationError
        raise rpc.ConnectError("invalid_argument", f"bad pty size: {exc}") from None


def _process_events(stream: AsyncIterator[ExecOutput | None], edge: EdgeAPI, sandbox_id: str,
                    command_deadline: bool, pty: bool = False
                    ) -> AsyncIterator[dict[str, Any] | None]:
    # A command whose sandbox is killed under it: envd's stream ends "unavailable" with a
    # message that does not say the sandbox is gone; the SDK then probes /health, which
    # answers "was not found", and reports "the sandbox was killed or reached its end of
    # life" (TimeoutException), not the command's exit.
    lost = f"the connection to sandbox {sandbox_id} ended before the command completed"

    async def gone() -> bool:
        try:
            return (await edge.get(sandbox_id)).state not in ("creating", "running", "paused")
        except errors.NotFound:
            return True

    async def gen() -> AsyncIterator[dict[str, Any] | None]:
        async for item in stream:
            if item is None:
                yield None
            elif item.kind in ("stdout", "stderr") and item.data:
                # a terminal's output (all of it stdout) is envd's ``pty`` data
                yield {"event": {"data": {"pty" if pty else item.kind: _b64(item.data)}}}
            elif item.kind == "exit" and item.result is not None:
                res = item.result
                if res.timed_out and command_deadline:
                    raise rpc.ConnectError("deadline_exceeded",
                                           "command exceeded its timeout and was killed")
                if res.signal is not None and await gone():
                    raise errors.SandboxDead(lost)
                end: dict[str, Any] = {"exited": res.signal is None}
                if res.signal is not None:
                    end["exitCode"] = -1
                    end["status"] = f"signal: {'killed' if res.signal == 9 else res.signal}"
                else:
                    end["exitCode"] = res.exit_code or 0
                    end["status"] = f"exit status {res.exit_code}"
                    if res.exit_code:
                        end["error"] = f"exit status {res.exit_code}"
                yield {"event": {"end": end}}
                return
            elif item.kind == "error":
                if await gone():
                    raise errors.SandboxDead(lost)
                raise item.error or errors.SandboxDead("command stream failed")
        raise errors.SandboxDead(lost)

    return gen()


# ---- directory watching (an inotify watch in the sandbox: rollbox.compat.e2b.watch) -------
async def with_entries(edge: EdgeAPI, sid: str, root: str,
                       events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """envd >= 0.6.3's ``include_entry``: each event carries the EntryInfo of what it names,
    when that can still be stat-ed (not for a remove)."""
    for ev in events:
        if ev["type"] == "EVENT_TYPE_REMOVE":
            continue
        full = posixpath.join(root, ev["name"])
        with contextlib.suppress(errors.NotFound):
            ev["entry"] = entry_info(await edge.file_stat(sid, full), full)
    return events


# ---- routes -----------------------------------------------------------------------------
def mount_envd(app: FastAPI, api: ApiContext, state: E2BState) -> None:
    watchers = SyncWatchers(api.placement.edge_for)

    async def route(request: Request) -> tuple[str, EdgeAPI]:
        sid, key_id = state.sandbox_of(request.headers.get("x-access-token"),
                                       request.headers.get("e2b-sandbox-id"))
        await api.keys.key_active(key_id)  # the token ends with the key that got it
        edge = api.placement.edge_for(sid)
        try:
            info = await edge.get(sid)
            if info.state == "paused" and info.resume_on_traffic:  # E2B's auto_resume
                info = await edge.wake(sid)
            now_in = info.state
        except errors.NotFound:
            now_in = "deleted"
        else:
            set_default_user(info.labels.get(USER_LABEL, DEFAULT_USER))
        # E2B's proxy answers for a sandbox that is gone (and a paused one: its envd is
        # unreachable until connect/resume) with 502 "... was not found": the SDK reads that
        # phrase as "not running" (SandboxNotRunningException, a health probe's False).
        if now_in not in ("creating", "running"):
            raise errors.SandboxDead(f"the sandbox {sid} was not found ({now_in})")
        return sid, edge

    # -- plain HTTP: /health, /files --
    def http_error(exc: Exception) -> Response:
        if isinstance(exc, (errors.SandboxDead, errors.InfraError)):
            status = 502
        elif isinstance(exc, errors.RollboxError):
            status = exc.status
        elif isinstance(exc, StarletteHTTPException):  # e.g. a malformed multipart body
            return JSONResponse({"code": exc.status_code, "message": str(exc.detail)},
                                status_code=exc.status_code)
        else:
            log.error("e2b envd http call failed", exc_info=exc)
            status = 500
        msg = str(exc) if isinstance(exc, errors.RollboxError) else "internal error"
        return JSONResponse({"code": status, "message": msg}, status_code=status)

    @app.get(PREFIX + "/health", include_in_schema=False)
    async def health(request: Request) -> Response:
        try:
            await route(request)
        except Exception as exc:  # noqa: BLE001
            return http_error(exc)
        return Response(status_code=204)

    @app.get(PREFIX + "/files", include_in_schema=False)
    async def files_get(request: Request, path: str = "") -> Response:
        try:
            sid, edge = await route(request)
            target = abs_path(path)
            if posixpath.normpath(target).startswith(LIVE_TREES):
                return Response(await _read_live(edge, sid, target),
                                media_type="application/octet-stream")
            stream = await primed(edge.file_read_stream(sid, target, MAX_FILE_READ), 10.0)
        except Exception as exc:  # noqa: BLE001
            return http_error(exc)
        return StreamingResponse(stream, media_type="application/octet-stream")

    @app.post(PREFIX + "/files", include_in_schema=False)
    async def files_post(request: Request, path: str = "") -> Response:
        try:
            sid, edge = await route(request)
            xattrs = metadata_xattrs(request)  # the same map on every file of the upload
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype == "application/octet-stream":  # envd >= 0.5.7: one file, the raw body
                target = abs_path(path)
                made = await _missing_parents(edge, sid, target)
                await edge.file_write_stream(sid, target, _body_chunks(request), 0o644,
                                             MAX_FILE_STREAM, xattrs=xattrs)
                await _own(edge, sid, [*made, target])
                return JSONResponse([_written(target, xattrs)])
            form = await request.form(max_files=1000)
            written = []
            made: list[str] = []
            try:
                parts = form.multi_items()
                for _, part in parts:
                    if isinstance(part, str):
                        raise errors.BadRequest("multipart part without a file name")
                    target = path if path and len(parts) == 1 else (part.filename or "")
                    target = abs_path(target)
                    made += await _missing_parents(edge, sid, target)
                    await edge.file_write_stream(sid, target, upload_chunks(part), 0o644,
                                                 MAX_FILE_STREAM, xattrs=xattrs)
                    written.append(_written(target, xattrs))
            finally:
                await form.close()
            if not written:
                raise errors.BadRequest("no file in the request")
            await _own(edge, sid, [*dict.fromkeys(made), *(w["path"] for w in written)])
        except Exception as exc:  # noqa: BLE001
            return http_error(exc)
        return JSONResponse(written)

    # -- Connect RPC --
    async def unary(request: Request,
                    handler: Callable[[str, EdgeAPI, dict[str, Any]], Awaitable[dict[str, Any]]]
                    ) -> Response:
        try:
            msg = await rpc.read_message(request, streaming=False)
            sid, edge = await route(request)
            return JSONResponse(await handler(sid, edge, msg))
        except Exception as exc:  # noqa: BLE001
            return rpc.error_response(rpc.from_rollbox(exc))

    async def process_start(request: Request) -> Response:
        msg = await rpc.read_message(request, streaming=True)
        sid, edge = await route(request)
        pty = _pty_size(msg) if msg.get("pty") is not None else None
        proc = msg.get("process") or {}
        cmd = proc.get("cmd")
        if not cmd or not isinstance(cmd, str):
            raise rpc.ConnectError("invalid_argument", "process.cmd is required")
        args = proc.get("args") or []
        envs = proc.get("envs") or {}
        if not isinstance(args, list) or not isinstance(envs, dict):
            raise rpc.ConnectError("invalid_argument", "bad process.args or process.envs")
        deadline_s = rpc.timeout_s(request)
        argv = [cmd, *[str(a) for a in args]]
        try:  # commands.run's `/bin/bash -l -c CMD`: the platform shell, not the sandbox's
            script = script_of(argv)
        except ValueError as exc:
            raise rpc.ConnectError("invalid_argument", str(exc)) from None
        spec = ExecSpec(cmd=argv if script is None else script,
                        env={str(k): str(v) for k, v in envs.items()},
                        cwd=abs_path(proc.get("cwd") or home()), user=_basic_user(request),
                        timeout_s=deadline_s, stdin=bool(msg.get("stdin")), pty=pty)
        exec_id = await edge.exec_start(sid, spec)  # the edge logs exec.* itself
        pid = pid_of(exec_id)
        # The command's own deadline (agent-enforced) ends it; no stream deadline on top.
        items = _with_keepalive(edge.exec_stream(sid, exec_id), _keepalive_interval(request),
                                None)
        return _stream_response({"event": {"start": {"pid": pid}}},
                                _process_events(items, edge, sid, command_deadline=True,
                                                pty=pty is not None),
                                {"event": {"keepalive": {}}})

    async def _running(edge: EdgeAPI, sid: str, exec_id: str) -> ExecInfo:
        for info in await edge.exec_list(sid):
            if info.exec_id == exec_id:
                if info.state != "running":
                    raise rpc.ConnectError("not_found", f"process {pid_of(exec_id)} has exited")
                return info
        raise rpc.ConnectError("not_found", f"process {pid_of(exec_id)} not found")

    async def process_connect(request: Request) -> Response:
        msg = await rpc.read_message(request, streaming=True)
        sid, edge = await route(request)
        exec_id = _selector(msg)
        info = await _running(edge, sid, exec_id)
        t = rpc.timeout_s(request)
        deadline = time.monotonic() + t if t else None
        items = _with_keepalive(edge.exec_stream(sid, exec_id), _keepalive_interval(request),
                                deadline)
        return _stream_response({"event": {"start": {"pid": pid_of(exec_id)}}},
                                _process_events(items, edge, sid, command_deadline=False,
                                                pty=info.pty),
                                {"event": {"keepalive": {}}})

    async def process_list(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        procs = []
        for info in await edge.exec_list(sid):
            if info.state != "running":
                continue
            argv = info.cmd if isinstance(info.cmd, list) else ["/bin/bash", "-c", info.cmd]
            procs.append({"config": {"cmd": argv[0], "args": argv[1:], "envs": {}},
                          "pid": pid_of(info.exec_id)})
        return {"processes": procs}

    async def process_signal(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        exec_id = _selector(msg)
        sig = SIGNALS.get(msg.get("signal", "SIGNAL_SIGKILL"))
        if sig is None:
            raise rpc.ConnectError("invalid_argument", f"unsupported signal {msg.get('signal')!r}")
        await _running(edge, sid, exec_id)
        await edge.exec_kill(sid, exec_id, sig)
        return {}

    async def process_input(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        exec_id = _selector(msg)
        inp = msg.get("input") or {}
        await _running(edge, sid, exec_id)
        # a terminal's input is raw bytes to its master (``pty``), else the command's stdin
        await edge.exec_stdin(sid, exec_id, _unb64(inp.get("pty" if "pty" in inp else "stdin")),
                              False)
        return {}

    async def process_stream_input(request: Request) -> Response:
        """StreamInput (``commands.stream_input`` / ``pty.stream_input``): a start event naming
        the process, then data events (``input.pty`` or ``input.stdin``) and keepalives, each
        written in order as it arrives; answered once the client ends its stream."""
        sid, edge = await route(request)
        exec_id: str | None = None
        async for msg in rpc.read_messages(request):
            event = msg.get("event") or msg  # the SDK's JSON puts the oneof at the top
            if "start" in event:
                exec_id = _selector(event["start"] or {})
                await _running(edge, sid, exec_id)
            elif "data" in event:
                if exec_id is None:
                    raise rpc.ConnectError("invalid_argument", "data before the start event")
                inp = (event["data"] or {}).get("input") or {}
                data = _unb64(inp.get("pty" if "pty" in inp else "stdin"))
                if data:
                    await edge.exec_stdin(sid, exec_id, data, False)
            elif "keepalive" not in event:
                raise rpc.ConnectError("invalid_argument",
                                       f"unknown StreamInput event {str(msg)[:80]}")
        if exec_id is None:
            raise rpc.ConnectError("invalid_argument", "StreamInput needs a start event")
        return StreamingResponse(iter([rpc.envelope({}), rpc.end_stream()]),
                                 media_type=rpc.STREAM_MEDIA_TYPE)

    async def process_update(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        """Update: a terminal's new size (``pty.size``); nothing else is updatable."""
        exec_id = _selector(msg)
        if msg.get("pty") is None:
            raise rpc.ConnectError("invalid_argument", "Update takes a pty size")
        size = _pty_size(msg)
        await _running(edge, sid, exec_id)
        await edge.exec_resize(sid, exec_id, size.cols, size.rows)
        return {}

    async def process_close_stdin(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        exec_id = _selector(msg)
        await _running(edge, sid, exec_id)
        await edge.exec_stdin(sid, exec_id, b"", True)
        return {}

    # -- filesystem --
    def _path(msg: dict[str, Any], key: str = "path") -> str:
        p = msg.get(key)
        if not isinstance(p, str) or not p:
            raise rpc.ConnectError("invalid_argument", f"{key} is required")
        return abs_path(p)

    async def fs_stat(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        p = _path(msg)
        return {"entry": entry_info(await edge.file_stat(sid, p), p)}

    async def fs_make_dir(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        p = _path(msg)
        try:
            await edge.file_stat(sid, p)
        except errors.NotFound:
            made = await _missing_parents(edge, sid, p)
            await edge.file_mkdir(sid, p, True)
            await _own(edge, sid, [*made, p])
            return {"entry": entry_info(await edge.file_stat(sid, p), p)}
        raise rpc.ConnectError("already_exists", f"path already exists: {p}")

    async def fs_move(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        src, dst = _path(msg, "source"), _path(msg, "destination")
        await edge.file_stat(sid, src)  # not_found before anything runs
        # The edge has no rename: mv runs in the sandbox, as root, like a user's command.
        exec_id = await edge.exec_start(sid, ExecSpec(cmd=["mv", "-f", "--", src, dst],
                                                      timeout_s=60))
        res = await edge.exec_wait(sid, exec_id)
        if res.exit_code != 0:
            raise rpc.ConnectError("invalid_argument",
                                   f"rename failed: {res.stderr.strip() or res.exit_code}")
        return {"entry": entry_info(await edge.file_stat(sid, dst), dst)}

    async def fs_list(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        root = _path(msg)
        depth = int(msg.get("depth") or 1)
        if depth < 1:
            raise rpc.ConnectError("invalid_argument", "depth should be at least 1")
        top = await edge.file_stat(sid, root)
        if top.type != "dir":
            raise rpc.ConnectError("invalid_argument", f"path is not a directory: {root}")
        entries: list[dict[str, Any]] = []

        async def walk(d: str, level: int) -> None:  # envd's order: depth first, by name
            for st in sorted(await edge.file_list(sid, d), key=lambda s: s.name):
                if len(entries) >= LIST_MAX_ENTRIES:
                    return
                full = posixpath.join(d, st.name)
                entries.append(entry_info(st, full))
                if st.type == "dir" and level < depth:
                    await walk(full, level + 1)

        await walk(root, 1)
        return {"entries": entries}

    async def fs_remove(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        with contextlib.suppress(errors.NotFound):  # E2B: removing what is not there is ok
            await edge.file_remove(sid, _path(msg), True)
        return {}

    async def _watch_root(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> tuple[str, bool]:
        p = _path(msg)
        st = await edge.file_stat(sid, p)
        if st.type != "dir":
            raise rpc.ConnectError("invalid_argument", f"path is not a directory: {p}")
        # allowNetworkMounts (envd >= 0.6.4): inotify of a network mount sees only this
        # sandbox's own changes, as on E2B; nothing to lift.
        return p, bool(msg.get("recursive"))

    async def _watch_of(sid: str, edge: EdgeAPI, msg: dict[str, Any],
                        on_end: Callable[[InotifyWatch], None] | None = None) -> InotifyWatch:
        root, recursive = await _watch_root(sid, edge, msg)
        return InotifyWatch(sid, root, recursive, bool(msg.get("includeEntry")), on_end)

    async def fs_watch(request: Request) -> Response:
        msg = await rpc.read_message(request, streaming=True)
        sid, edge = await route(request)
        w = await _watch_of(sid, edge, msg)
        await w.start(edge)
        t = rpc.timeout_s(request)
        deadline = time.monotonic() + t if t else None

        async def watched() -> AsyncIterator[dict[str, Any]]:
            try:
                async for events in w.stream():
                    if w.include_entry:
                        events = await with_entries(edge, sid, w.path, events)
                    for ev in events:
                        yield {"filesystem": ev}
            finally:
                await w.close()

        items = _with_keepalive(watched(), _keepalive_interval(request), deadline)
        return _stream_response({"start": {}}, items, {"keepalive": {}})

    async def fs_create_watcher(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        w = await _watch_of(sid, edge, msg, on_end=watchers.ended)
        return {"watcherId": await watchers.add(w, edge)}

    async def fs_watcher_events(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        w = watchers.get(sid, str(msg.get("watcherId") or ""))
        events = await w.poll()
        if w.include_entry:
            events = await with_entries(edge, sid, w.path, events)
        return {"events": events}

    async def fs_remove_watcher(sid: str, edge: EdgeAPI, msg: dict[str, Any]) -> dict[str, Any]:
        wid = str(msg.get("watcherId") or "")
        watchers.get(sid, wid)  # not_found for another sandbox's
        await watchers.remove(wid)
        return {}

    UNARY = {
        ("process.Process", "List"): process_list,
        ("process.Process", "SendSignal"): process_signal,
        ("process.Process", "SendInput"): process_input,
        ("process.Process", "Update"): process_update,
        ("process.Process", "CloseStdin"): process_close_stdin,
        ("filesystem.Filesystem", "Stat"): fs_stat,
        ("filesystem.Filesystem", "MakeDir"): fs_make_dir,
        ("filesystem.Filesystem", "Move"): fs_move,
        ("filesystem.Filesystem", "ListDir"): fs_list,
        ("filesystem.Filesystem", "Remove"): fs_remove,
        ("filesystem.Filesystem", "CreateWatcher"): fs_create_watcher,
        ("filesystem.Filesystem", "GetWatcherEvents"): fs_watcher_events,
        ("filesystem.Filesystem", "RemoveWatcher"): fs_remove_watcher,
    }
    STREAMS = {
        ("process.Process", "Start"): process_start,
        ("process.Process", "Connect"): process_connect,
        ("process.Process", "StreamInput"): process_stream_input,
        ("filesystem.Filesystem", "WatchDir"): fs_watch,
    }

    @app.post(PREFIX + "/{service}/{method}", include_in_schema=False)
    async def connect_call(service: str, method: str, request: Request) -> Response:
        key = (service, method)
        if key in UNARY:
            return await unary(request, UNARY[key])
        if key in STREAMS:
            try:
                return await STREAMS[key](request)
            except Exception as exc:  # noqa: BLE001
                return rpc.error_response(rpc.from_rollbox(exc))
        return rpc.error_response(rpc.ConnectError(
            "unimplemented", f"{service}/{method} is not supported by rollbox"))
