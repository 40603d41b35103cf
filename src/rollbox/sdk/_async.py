"""The async SDK core: every behaviour lives here; the sync face only runs these coroutines."""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import io
import json
import os
import random
import tarfile
import threading
import time
import urllib.parse
from collections.abc import (
    AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, TypeVar

import pydantic

from rollbox import errors
from rollbox.errors import CommandFailed
from rollbox.sdk._aiohttp import AiohttpTransport
from rollbox.sdk._env import default_api_key, default_url
from rollbox.sdk._failover import DEFAULT_BACKOFF_S, FailoverTransport, parse_urls
from rollbox.sdk._http import FullResponse, Http, Params, raise_for_status
from rollbox.sdk._resume import (
    DEFAULT_RECONNECT_S, Offsets, Reconnect, new_idempotency_key,
)
from rollbox.sdk._transport import AsyncTransport, BlockingTransport, Request, Response
from rollbox.models import (
    FnCallResult, FnCallSpec,
    ApiKeyInfo, CreatedKey, Event, ExecInfo, ExecResult, ExecSpec, FileStat, GradeResult, GradeSpec,
    ImageInfo, JobEnded, JobInfo, JobSpec, LayerUsage, PortAccess, Project, PtySize, Quota,
    Resources, SandboxInfo, SandboxSpec, SnapshotResult, SnapshotSpec, ForkResult, ForkSpec,
    UsageSample, ComputerAction, ComputerActionResult, DisplayInfo, ViewAccess,
)

TAR_CHUNK = 256 << 10
_T = TypeVar("_T")
FILE_CHUNK = 1 << 20

OutputCallback = Callable[[str], Any]


def _fncall_spec(fields: dict[str, Any]) -> FnCallSpec:
    try:
        return FnCallSpec(**fields)
    except pydantic.ValidationError as exc:
        raise errors.BadRequest(str(exc)) from None


@dataclass(frozen=True)
class OutputChunk:
    stream: Literal["stdout", "stderr"]
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def _check_command(result: ExecResult, cmd: str | list[str]) -> None:
    if result.timed_out:
        raise errors.CommandTimeout(f"command timed out: {cmd!r}", exec_id=result.exec_id)
    if result.exit_code != 0:
        how = (f"signal {result.signal}" if result.signal is not None
               else f"exit code {result.exit_code}")
        raise CommandFailed(f"command failed with {how}: {cmd!r}", result)


def _exec_spec(cmd: str | list[str], env: Mapping[str, str] | None, cwd: str, user: str,
               timeout: float | None, stdin: bool, background: bool,
               idempotency_key: str | None, pty: bool = False, cols: int = 80,
               rows: int = 24) -> dict[str, Any]:
    try:  # validated here so a bad call fails before any request
        spec = ExecSpec(cmd=cmd, env=dict(env or {}), cwd=cwd, user=user, timeout_s=timeout,
                        stdin=stdin, background=background,
                        pty=PtySize(cols=cols, rows=rows) if pty else None,
                        idempotency_key=idempotency_key or new_idempotency_key())
    except pydantic.ValidationError as exc:
        raise errors.BadRequest(str(exc)) from None
    return spec.model_dump(mode="json")


class _Decoders:
    def __init__(self) -> None:
        self.dec = {k: codecs.getincrementaldecoder("utf-8")("replace")
                    for k in ("stdout", "stderr")}


async def _consume_exec(
    messages: AsyncIterator[dict[str, Any]],
    on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
    offsets: Offsets, dec: dict[str, codecs.IncrementalDecoder],
    on_started: Callable[[str], None],
) -> ExecResult:
    """Deliver one exec stream (possibly a resumed one: bytes the client has are skipped)."""
    callbacks = {"stdout": on_stdout, "stderr": on_stderr}
    async for msg in messages:
        kind = msg.get("type")
        if kind == "started":
            on_started(msg["exec_id"])
        elif kind in ("stdout", "stderr"):
            data = offsets.take(msg)
            cb = callbacks[kind]
            if cb is not None and data:
                text = dec[kind].decode(data)
                if text:
                    r = cb(text)
                    if asyncio.iscoroutine(r):
                        await r
        elif kind == "exit":
            for k, cb in callbacks.items():
                tail = dec[k].decode(b"", final=True)
                if cb is not None and tail:
                    r = cb(tail)
                    if asyncio.iscoroutine(r):
                        await r
            return ExecResult.model_validate(msg["result"])
        elif kind == "error":
            raise errors.error_from_payload(msg, 500)
    # EOF without an exit line: the server went away mid-stream (it reports its own failures
    # in-band), so the stream is resumed.
    raise errors.ConnectionLost("exec stream ended without an exit status")


class AsyncProcess:
    """A command started with ``exec_background``; can be re-attached any number of times."""

    def __init__(self, sandbox: AsyncSandbox, exec_id: str, cmd: str | list[str]) -> None:
        self.sandbox = sandbox
        self.exec_id = exec_id
        self.cmd = cmd
        self._t = sandbox._t
        self._base = f"/v1/sandboxes/{sandbox.id}/exec/{exec_id}"
        # of the last attach(): output per stream a server restart lost before it was seen
        self.truncated = {"stdout": 0, "stderr": 0}

    def __repr__(self) -> str:
        return f"<AsyncProcess {self.exec_id} in {self.sandbox.id}>"

    async def attach(self, stdout_offset: int = 0,
                     stderr_offset: int = 0) -> AsyncIterator[OutputChunk]:
        """Output from the start of the command (replayed; or from the given byte offsets of
        each stream, e.g. what an earlier attach yielded) until it exits. A stream broken by
        a server restart is resumed from the bytes already yielded (within the client's
        reconnect window); output the restarted server no longer had is skipped and counted
        in ``truncated`` (bytes per stream). A pty command's output is all ``stdout``, raw
        terminal bytes (escape sequences, ``\r\n``)."""
        if stdout_offset < 0 or stderr_offset < 0:
            raise errors.BadRequest("offsets must be >= 0")
        offsets = Offsets()
        offsets.have.update(stdout=stdout_offset, stderr=stderr_offset)
        self.truncated = offsets.truncated
        retry = Reconnect(self.sandbox.client.reconnect_s)
        while True:
            try:
                resp = await self._t.stream("GET", self._base + "/stream",
                                            params=offsets.params())
                async for msg in self._t.lines(resp):
                    kind = msg.get("type")
                    if kind in ("stdout", "stderr"):
                        data = offsets.take(msg)
                        if data:
                            yield OutputChunk(kind, data)
                    elif kind == "error":
                        raise errors.error_from_payload(msg, 500)
                    elif kind == "exit":
                        return
                raise errors.ConnectionLost("exec stream ended without an exit status")
            except (errors.ServerUnreachable, errors.ConnectionLost) as exc:
                await retry.wait(exc)

    async def wait(self, *, check: bool = False) -> ExecResult:
        """The command's result; waits through a server restart (reconnect window)."""
        r = await Reconnect(self.sandbox.client.reconnect_s).call(
            lambda: self._t.request("GET", self._base, long=True))
        result = ExecResult.model_validate(r.json())
        if check:
            _check_command(result, self.cmd)
        return result

    async def kill(self, signal: int = 9) -> None:
        await self._t.request("POST", self._base + "/kill", json={"signal": signal})

    async def write_stdin(self, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode()
        await self._t.request("POST", self._base + "/stdin", content=data)

    async def close_stdin(self) -> None:
        """End of input (a pty command's terminal stays open: it gets ^D, end of file to a
        program reading it in canonical mode)."""
        await self._t.request("POST", self._base + "/stdin", params={"eof": 1}, content=b"")

    async def resize(self, cols: int, rows: int) -> None:
        """The terminal size of a command started with ``pty=True`` (it gets SIGWINCH);
        ``BadRequest`` outside 1..1000, for a command without a terminal, or one that exited."""
        try:
            size = PtySize(cols=cols, rows=rows)
        except pydantic.ValidationError as exc:
            raise errors.BadRequest(str(exc)) from None
        await self._t.request("POST", self._base + "/resize", json=size.model_dump())


class _TarPipe:
    """File-like bridge between tarfile (in a worker thread) and an async stream, with
    backpressure: a bounded queue, so neither side holds a whole tree in memory."""

    def __init__(self, loop: asyncio.AbstractEventLoop, depth: int = 8) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[bytes | None | BaseException] = asyncio.Queue(depth)
        self.buf = bytearray()
        self.eof = False
        self.error: BaseException | None = None  # what ``chunks`` raised (the producer's)

    # writer side (thread) -> async reader
    def write(self, data: bytes) -> int:
        self.buf += data
        if len(self.buf) >= TAR_CHUNK:
            self._put(bytes(self.buf))
            self.buf.clear()
        return len(data)

    def _put(self, item: bytes | None | BaseException) -> None:
        asyncio.run_coroutine_threadsafe(self.queue.put(item), self.loop).result()

    def finish(self, exc: BaseException | None = None) -> None:
        if self.buf and exc is None:
            self._put(bytes(self.buf))
            self.buf.clear()
        self._put(exc)

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                self.error = item
                raise item
            yield item

    # async writer -> reader side (thread)
    def read(self, n: int = -1) -> bytes:
        while not self.eof and (not self.buf or n < 0):
            item = asyncio.run_coroutine_threadsafe(self.queue.get(), self.loop).result()
            if item is None:
                self.eof = True
                break
            if isinstance(item, BaseException):
                raise item
            self.buf += item
            if n >= 0 and len(self.buf) >= n:
                break
        if n < 0 or n >= len(self.buf):
            out = bytes(self.buf)
            self.buf.clear()
        else:
            out = bytes(self.buf[:n])
            del self.buf[:n]
        return out


# What ``files.write`` takes: content, a binary file object, or a stream of byte chunks.
FileContent = (bytes | bytearray | memoryview | str | IO[bytes] | AsyncIterable[bytes]
               | Iterable[bytes])


async def _content_chunks(data: FileContent) -> AsyncIterator[bytes]:
    """``data`` as a stream of chunks of at most 1 MiB; a file object or a sync iterator is
    read in a worker thread, so a slow disk never blocks the event loop."""
    if isinstance(data, str):
        data = data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for i in range(0, len(view), FILE_CHUNK):
            yield bytes(view[i:i + FILE_CHUNK])
        return
    if isinstance(data, AsyncIterable):
        async for chunk in data:
            yield bytes(chunk)
        return
    read = getattr(data, "read", None)  # a file object (binary)
    if callable(read):
        while chunk := await asyncio.to_thread(read, FILE_CHUNK):
            if isinstance(chunk, str):
                raise errors.BadRequest("files.write takes a binary file object (open 'rb')")
            yield chunk
        return
    it = iter(data)
    end = object()
    while (chunk := await asyncio.to_thread(next, it, end)) is not end:
        yield bytes(chunk)  # type: ignore[arg-type]


Progress = Callable[[int, int | None], Any]  # (bytes sent, bytes expected or None)


async def _counted(chunks: AsyncIterator[bytes], progress: Progress | None,
                   total: int | None) -> AsyncIterator[bytes]:
    sent = 0
    async for chunk in chunks:
        sent += len(chunk)
        yield chunk
        if progress is not None:
            progress(sent, total)


def _tree_bytes(src: Path) -> int:
    """Bytes of the regular files below ``src`` (what a tar of it carries, headers aside)."""
    total = 0
    for dirpath, _dirs, files in os.walk(src):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if not os.path.islink(os.path.join(dirpath, name)):
                    total += st.st_size
    return total


async def _send_tar(t: Http, method: str, url: str, params: Params, src: Path,
                    progress: Progress | None = None) -> FullResponse:
    """Send a tar of directory ``src``'s contents (members named relative to it) as a request
    body, made by a producer thread as it is sent (memory stays bounded)."""
    if not src.is_dir():
        raise errors.BadRequest(f"{src} is not a directory")
    total = await asyncio.to_thread(_tree_bytes, src) if progress is not None else None
    pipe = _TarPipe(asyncio.get_running_loop())

    def produce() -> None:
        try:
            with tarfile.open(fileobj=pipe, mode="w|") as tf:  # type: ignore[call-overload]
                for child in sorted(src.iterdir()):
                    tf.add(child, arcname=child.name)
        except BaseException as exc:  # reported to the consumer
            pipe.finish(exc)
        else:
            pipe.finish()

    producer = threading.Thread(target=produce, name="rollbox-tar-up", daemon=True)
    producer.start()
    try:
        return await t.request(method, url, params=params, long=True,
                               content=_counted(pipe.chunks(), progress, total))
    except errors.InfraError:
        if pipe.error is not None:  # a transport wraps a body's error; raise it as it was
            raise pipe.error from None
        raise
    finally:
        # Unblock the producer if the request stopped consuming early.
        while producer.is_alive():
            while not pipe.queue.empty():
                pipe.queue.get_nowait()
            await asyncio.sleep(0.01)


async def _resumed(open_stream: Callable[[], Awaitable[Response]],
                   items: Callable[[Response], AsyncIterator[_T]],
                   window_s: float) -> AsyncIterator[_T]:
    """The items of a streamed GET, resumed where it broke: ``open_stream()`` opens it from
    where the caller is (it reads the caller's position, which the caller moves on as it takes
    each item). A connection that breaks mid-stream (``ConnectionLost``: an api replica died)
    is opened again on the next API URL, retrying (``ServerUnreachable`` too) within
    ``window_s`` of the break; the first open is not retried here (the transport already
    tried every URL)."""
    retry: Reconnect | None = None
    while True:
        try:
            resp = await open_stream()
        except (errors.ServerUnreachable, errors.ConnectionLost) as exc:
            if retry is None:
                raise
            await retry.wait(exc)
            continue
        try:
            async for item in items(resp):
                yield item
            return
        except errors.ConnectionLost as exc:
            retry = retry or Reconnect(window_s)
            await retry.wait(exc)
        finally:
            await resp.aclose()


class AsyncFiles:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._t = sandbox._t
        self._base = f"/v1/sandboxes/{sandbox.id}"
        self._window_s = sandbox.client.reconnect_s

    async def read(self, path: str) -> bytes:
        """The whole file in memory; for big files use :meth:`read_stream` or
        :meth:`download_file`."""
        return (await self._t.request("GET", self._base + "/files", params={"path": path},
                                      long=True)).content

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding, "replace")

    async def read_stream(self, path: str) -> AsyncIterator[bytes]:
        """The file's bytes as they arrive (memory stays bounded whatever its size). A stream
        broken mid-way (an api replica died) is resumed on the next API URL at the byte the
        client has (``offset``), within the client's ``reconnect_s``: every byte once, in
        order (a file replaced meanwhile is not detected: its rest is the new file's)."""
        have = 0

        def opened() -> Awaitable[Response]:
            params = {"path": path, "offset": have} if have else {"path": path}
            return self._t.stream("GET", self._base + "/files", params=params)

        async for chunk in _resumed(opened, lambda resp: resp.chunks(), self._window_s):
            have += len(chunk)
            yield chunk

    async def download_file(self, path: str, local: str | os.PathLike[str]) -> int:
        """Stream the file at ``path`` into local file ``local`` (replaced only once complete);
        returns its size."""
        dest = Path(local)
        tmp = dest.with_name(f".{dest.name}.rollbox-part")
        size = 0
        try:
            with open(tmp, "wb") as f:
                async for chunk in self.read_stream(path):
                    await asyncio.to_thread(f.write, chunk)
                    size += len(chunk)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    async def write(self, path: str, data: FileContent, mode: int = 0o644) -> None:
        """Replace the file at ``path`` with ``data``: bytes or str, a binary file object
        (``open(local, "rb")``), or an (async) iterator of byte chunks. Streamed: memory
        stays bounded; the file appears only once complete. Above the sandbox's disk cap it
        raises the disk-full error (``details["reason"] == "disk_full"``). Content in memory
        (bytes, str) whose connection broke (an api replica died) is sent again whole on the
        next API URL (the file is replaced atomically: the same file either way); a file
        object or a stream of chunks, which the SDK can not send again, raises
        ``ConnectionLost`` (retryable: the file was not replaced unless the server had it
        all; send it again)."""
        if isinstance(data, io.TextIOBase):
            raise errors.BadRequest("files.write takes a binary file object (open 'rb')")
        params = {"path": path, "mode": format(mode, "o")}
        if isinstance(data, (bytes, bytearray, memoryview, str)):
            body = data.encode() if isinstance(data, str) else bytes(data)
            await self._t.request("PUT", self._base + "/files", content=body, long=True,
                                  params=params, idempotent=True)
            return
        await self._t.request("PUT", self._base + "/files", content=_content_chunks(data),
                              long=True, params=params)

    async def stat(self, path: str) -> FileStat:
        r = await self._t.request("GET", self._base + "/files/stat", params={"path": path})
        return FileStat.model_validate(r.json())

    async def list(self, path: str) -> list[FileStat]:
        r = await self._t.request("GET", self._base + "/files/list", params={"path": path})
        return [FileStat.model_validate(x) for x in r.json()]

    async def mkdir(self, path: str, parents: bool = True) -> None:
        await self._t.request("POST", self._base + "/files/mkdir",
                              json={"path": path, "parents": parents})

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._t.request("DELETE", self._base + "/files",
                              params={"path": path, "recursive": int(recursive)})

    async def upload_dir(self, local: str | os.PathLike[str], remote: str) -> int:
        """Upload the contents of a local directory into ``remote`` as a tar stream. One
        whose connection broke (an api replica died) is sent again whole, made anew from
        ``local``, on the next API URL (once per URL): its members overwrite what an earlier
        attempt wrote of them. ``ConnectionLost`` when the last URL broke too."""
        for attempt in range(1, self._t.places + 1):
            try:
                r = await _send_tar(self._t, "PUT", self._base + "/tar", {"path": remote},
                                    Path(local))
                return int(r.json().get("written", 0))
            except errors.ConnectionLost:
                if attempt == self._t.places:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def download_dir(self, remote: str, local: str | os.PathLike[str]) -> None:
        """Download ``remote`` (a directory) into ``local``; unsafe members are refused. A
        tar stream broken mid-way (an api replica died) is downloaded again from its start
        on the next API URL, within the client's ``reconnect_s``, its members written over
        what the broken one left of them (a tar has no offsets to resume at)."""
        dest = Path(local)
        dest.mkdir(parents=True, exist_ok=True)
        retry: Reconnect | None = None
        while True:
            try:
                await self._download_tar(remote, dest)
                return
            except errors.ConnectionLost as exc:
                retry = retry or Reconnect(self._window_s)
                await retry.wait(exc)
            except errors.ServerUnreachable as exc:
                if retry is None:
                    raise
                await retry.wait(exc)

    async def _download_tar(self, remote: str, dest: Path) -> None:
        """One download of ``remote``'s tar into ``dest``; ConnectionLost if it broke."""
        resp = await self._t.stream("GET", self._base + "/tar", params={"path": remote})
        pipe = _TarPipe(asyncio.get_running_loop())

        def consume() -> None:
            with tarfile.open(fileobj=pipe, mode="r|") as tf:  # type: ignore[call-overload]
                tf.extractall(dest, filter="data")

        extract = asyncio.get_running_loop().run_in_executor(None, consume)

        async def feed(item: bytes | None | BaseException) -> bool:
            # False once the extractor stopped (it failed): never block on a dead reader.
            put = asyncio.ensure_future(pipe.queue.put(item))
            await asyncio.wait({put, extract}, return_when=asyncio.FIRST_COMPLETED)
            if not put.done():
                put.cancel()
                return False
            return True

        lost: errors.ConnectionLost | None = None
        try:
            try:
                async for chunk in resp.chunks():
                    if not await feed(chunk):
                        break
                else:
                    await feed(None)
            except errors.InfraError as exc:
                lost = exc if isinstance(exc, errors.ConnectionLost) else None
                await feed(errors.InfraError(f"tar download broken: {exc}"))
            try:
                await extract  # raises the extractor's error (e.g. a member escaping ``local``)
            except errors.InfraError:
                if lost is not None:
                    raise lost from None  # the stream broke: downloaded again
                raise
        finally:
            await resp.aclose()
            if not extract.done():
                # Cancelled midway: wake the extractor thread so it ends.
                with contextlib.suppress(BaseException):
                    async with asyncio.timeout(5):
                        await feed(errors.InfraError("download cancelled"))


class AsyncImages:
    """A project's task images on the node (``client.images``)."""

    def __init__(self, t: Http) -> None:
        self._t = t

    async def upload(self, name: str, source: str | os.PathLike[str], *,
                     base: str | None = None, progress: Progress | None = None) -> ImageInfo:
        """Build image ``name`` (with a path: ``myproject/task:1``) owned by your project from
        a local directory (its contents become the image's tree) or a tar file (optionally
        gz/bz2/xz), streamed; the server packs the layer itself. With ``base`` the image is
        ``base``'s layers + this one. ``progress(sent, total)`` is called as bytes go out.
        Above the node's upload cap: PayloadTooLarge; above your project's layer storage:
        QuotaExceeded; the node's image store at its reserve: CapacityExceeded (retryable)."""
        src = Path(source)
        params = {"name": name, **({"base": base} if base is not None else {})}
        if src.is_dir():
            r = await _send_tar(self._t, "POST", "/v1/images", params, src, progress)
        elif src.is_file():
            with open(src, "rb") as f:
                r = await self._t.request(
                    "POST", "/v1/images", params=params, long=True,
                    content=_counted(_content_chunks(f), progress, src.stat().st_size))
        else:
            raise errors.BadRequest(f"{src} is neither a directory nor a tar file")
        return ImageInfo.model_validate(r.json())

    async def list(self) -> list[ImageInfo]:
        """The node's images and your project's own."""
        return [ImageInfo.model_validate(x)
                for x in (await self._t.request("GET", "/v1/images")).json()]

    async def delete(self, name: str) -> None:
        """Delete one of your project's images (its layer storage is freed at once)."""
        await self._t.request("DELETE", "/v1/images", params={"name": name})

    async def usage(self) -> LayerUsage:
        """Your project's layer storage on the node (snapshots and uploads)."""
        return LayerUsage.model_validate(
            (await self._t.request("GET", "/v1/images/usage")).json())


def _port_path(sandbox_id: str, port: int) -> str:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise errors.BadRequest(f"port must be an integer in 1..65535, not {port!r}")
    return f"/v1/sandboxes/{sandbox_id}/ports/{port}/"


class AsyncMouse:
    """The pointer of a "vm" sandbox's screen (``sandbox.mouse``): absolute pixel coordinates
    on the display (``await sandbox.display()``); off-screen is a BadRequest. Every action is
    recorded in the sandbox's event log (``computer.<action>``); ``screenshot_hash=True`` also
    records the sha256 of the screen right after it."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def move(self, x: int, y: int, **kw: Any) -> ComputerActionResult:
        return await self._sb.computer(ComputerAction(action="move", x=x, y=y, **kw))

    async def click(self, x: int, y: int, button: str = "left",
                    **kw: Any) -> ComputerActionResult:
        return await self._sb.computer(ComputerAction(action="click", x=x, y=y,
                                                      button=button, **kw))  # type: ignore[arg-type]

    async def double_click(self, x: int, y: int, button: str = "left",
                           **kw: Any) -> ComputerActionResult:
        return await self._sb.computer(ComputerAction(
            action="double_click", x=x, y=y, button=button, **kw))  # type: ignore[arg-type]

    async def drag(self, x: int, y: int, x2: int, y2: int, button: str = "left",
                   **kw: Any) -> ComputerActionResult:
        """Press at (x, y), move to (x2, y2), release."""
        return await self._sb.computer(ComputerAction(
            action="drag", x=x, y=y, x2=x2, y2=y2, button=button, **kw))  # type: ignore[arg-type]

    async def scroll(self, x: int, y: int, dy: int, **kw: Any) -> ComputerActionResult:
        """``dy`` wheel steps at (x, y): positive scrolls down, negative up."""
        return await self._sb.computer(ComputerAction(action="scroll", x=x, y=y, dy=dy, **kw))


class AsyncKeyboard:
    """The keyboard of a "vm" sandbox (``sandbox.keyboard``): ``type`` printable ASCII, tab
    and newline on a US layout; ``press`` a key or chord (``"ctrl+s"``, ``"alt+f4"``,
    ``"enter"``). Unknown keys or text it can not type: BadRequest, nothing sent."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def type(self, text: str, **kw: Any) -> ComputerActionResult:
        return await self._sb.computer(ComputerAction(action="type", text=text, **kw))

    async def press(self, keys: str, **kw: Any) -> ComputerActionResult:
        return await self._sb.computer(ComputerAction(action="press", keys=keys, **kw))


class AsyncSandbox:
    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self.client = client
        self.info = info
        self.id = info.id
        self._t = client._t
        self._base = f"/v1/sandboxes/{info.id}"
        self.files = AsyncFiles(self)
        self.mouse = AsyncMouse(self)
        self.keyboard = AsyncKeyboard(self)
        self.last_fork: ForkResult | None = None  # what the last fork() answered

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.state}>"

    async def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.model_validate((await self._t.request("GET", self._base)).json())
        return self.info

    async def usage(self) -> list[UsageSample]:
        """CPU (cumulative µs), memory and disk use over time, oldest first (sampled by the
        node every few seconds, the last hour), ending with a sample taken now."""
        r = await self._t.request("GET", f"{self._base}/usage")
        return [UsageSample.model_validate(x) for x in r.json()]

    async def exec(
        self, cmd: str | list[str], *, env: Mapping[str, str] | None = None, cwd: str = "/",
        user: str = "root", timeout: float | None = None, stdin: bytes | str | None = None,
        on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
        check: bool = False, idempotency_key: str | None = None,
        pty: bool = False, cols: int = 80, rows: int = 24,
    ) -> ExecResult:
        """Run a command to completion, streaming its output to the callbacks (str chunks).
        ``timeout`` is enforced inside the sandbox; a timed-out result has ``timed_out``.
        ``pty=True``: on a terminal of ``cols`` x ``rows`` (1..1000); its output (echo of
        ``stdin`` included) is all stdout, and ``stdin`` is typed into it, then ^D.

        Survives a server restart: the start carries ``idempotency_key`` (a fresh one per call
        unless given), so a retry after a broken connection returns the recorded command
        instead of running it twice; a stream broken mid-way is re-attached from the bytes
        already delivered. Retries back off within the client's ``reconnect_s``. Output the
        restarted server no longer had (it keeps the last 1 MiB per stream) is counted in the
        result's ``*_truncated_bytes``. If the server stays unreachable past the window, the
        call raises ``ExecIndeterminate`` when the start may have reached it (re-check later
        with the same ``idempotency_key``, in its details) and ``ServerUnreachable`` when it
        certainly did not."""
        body = _exec_spec(cmd, env, cwd, user, timeout, stdin is not None, False,
                          idempotency_key, pty, cols, rows)
        key = body["idempotency_key"]
        retry = Reconnect(self.client.reconnect_s)
        if stdin is None and on_stdout is None and on_stderr is None:
            # Nobody watches the output live: one JSON answer is cheaper than a stream.
            r = await retry.call(lambda: self._t.request(
                "POST", self._base + "/exec", json=body, params={"wait": 1}, long=True), key)
            result = ExecResult.model_validate(r.json())
            if check:
                _check_command(result, cmd)
            return result
        offsets = Offsets()
        dec = _Decoders().dec
        exec_id: str | None = None
        feeder: asyncio.Task[None] | None = None
        data = stdin.encode() if isinstance(stdin, str) else stdin

        def started(eid: str) -> None:
            nonlocal exec_id, feeder
            exec_id = eid
            if data is not None and feeder is None:
                proc = AsyncProcess(self, eid, cmd)

                async def feed() -> None:
                    if data:
                        await proc.write_stdin(data)
                    await proc.close_stdin()

                feeder = asyncio.create_task(feed())

        try:
            while True:
                try:
                    if exec_id is None:  # (again) with the key: the recorded one if it ran
                        resp = await self._t.stream("POST", self._base + "/exec", json=body)
                    else:
                        resp = await self._t.stream("GET", f"{self._base}/exec/{exec_id}/stream",
                                                    params=offsets.params())
                    messages = self._t.lines(resp)
                    try:
                        result = await _consume_exec(messages, on_stdout, on_stderr, offsets,
                                                     dec, started)
                    finally:
                        await messages.aclose()
                    break
                except (errors.ServerUnreachable, errors.ConnectionLost) as exc:
                    await retry.wait_exec(exc, key, exec_id)
            if feeder is not None:
                try:
                    await feeder
                except errors.RollboxError:
                    pass  # the command may exit without reading its stdin
        finally:
            if feeder is not None and not feeder.done():
                feeder.cancel()
        if check:
            _check_command(result, cmd)
        return result

    async def exec_background(
        self, cmd: str | list[str], *, env: Mapping[str, str] | None = None, cwd: str = "/",
        user: str = "root", timeout: float | None = None, stdin: bool = False,
        idempotency_key: str | None = None, pty: bool = False, cols: int = 80, rows: int = 24,
    ) -> AsyncProcess:
        """Start a command and return its handle. Retried through a server restart with an
        idempotency key like :meth:`exec` (same errors when the window runs out).
        ``pty=True``: on a terminal of ``cols`` x ``rows`` (1..1000): stdin is always open
        (raw bytes, ``b"\x03"`` is ctrl-C), ``resize`` changes its size, ``attach`` yields its
        raw output as stdout."""
        body = _exec_spec(cmd, env, cwd, user, timeout, stdin, True, idempotency_key,
                          pty, cols, rows)
        r = await Reconnect(self.client.reconnect_s).call(
            lambda: self._t.request("POST", self._base + "/exec", json=body),
            body["idempotency_key"])
        return AsyncProcess(self, r.json()["exec_id"], cmd)

    def process(self, exec_id: str) -> AsyncProcess:
        """Handle on an existing command (e.g. one started by a previous trainer process)."""
        return AsyncProcess(self, exec_id, "")

    async def processes(self) -> list[ExecInfo]:
        r = await self._t.request("GET", self._base + "/exec")
        return [ExecInfo.model_validate(x) for x in r.json()]

    async def stream_events(self, after: int = 0, follow: bool = True) -> AsyncIterator[Event]:
        """The audit log's events after seq ``after`` (``follow``: and new ones until the
        sandbox is deleted). A stream broken mid-way (an api replica died) is resumed on the
        next API URL after the last event delivered, within the client's ``reconnect_s``:
        each event once, in order."""
        last = after

        def opened() -> Awaitable[Response]:
            return self._t.stream("GET", self._base + "/events",
                                  params={"after": last, "follow": int(follow)})

        async for msg in _resumed(opened, self._t.lines, self.client.reconnect_s):
            event = Event.model_validate(msg)
            last = event.seq
            yield event

    async def events(self, after: int = 0, follow: bool = False) -> list[Event]:
        """The audit log (also after deletion). ``follow=True`` collects until deletion."""
        return [ev async for ev in self.stream_events(after, follow)]

    def url(self, port: int) -> str:
        """The HTTP URL of ``port`` in this sandbox (a service listening on its 127.0.0.1 or
        0.0.0.0; WebSocket upgrades too: ``ws://`` the same), served by the API: the path form
        ``<api>/v1/sandboxes/<id>/ports/<port>/``. Send the API key (``Authorization: Bearer``)
        or a port token (:meth:`port_access`) in ``X-Rollbox-Port-Token``. No request is made
        here; BadRequest for a port outside 1..65535."""
        return self.client.base_url.rstrip("/") + _port_path(self.id, port)

    async def port_access(self, port: int, ttl_s: float | None = None) -> PortAccess:
        """A token for ``port`` alone (it expires after ``ttl_s``, the server's default if
        None, and with the sandbox), the path form's URL and, where the API has a port
        domain, the per-sandbox origin ``<port>-<id>.<domain>`` for browsers (log in there
        with ``POST /_rollbox/login``, form field ``token``)."""
        _port_path(self.id, port)
        body: dict[str, Any] = {"port": port}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        r = await self._t.request("POST", self._base + "/port-tokens", json=body)
        return PortAccess.model_validate(r.json())

    # ---- computer use ("vm" sandboxes; others answer BadRequest) ------------------------
    async def screenshot(self, format: str = "png") -> bytes:
        """The screen as PNG bytes (drawn by the guest). A paused sandbox: SandboxPaused."""
        r = await self._t.request("GET", self._base + "/screenshot", params={"format": format})
        return r.content

    async def display(self) -> DisplayInfo:
        """The display's size now (``width``, ``height`` in pixels)."""
        r = await self._t.request("GET", self._base + "/display")
        return DisplayInfo.model_validate(r.json())

    async def computer(self, action: ComputerAction) -> ComputerActionResult:
        """One input action (``mouse`` and ``keyboard`` build them)."""
        r = await self._t.request("POST", self._base + "/computer",
                                  json=action.model_dump(exclude_none=True))
        return ComputerActionResult.model_validate(r.json())

    async def live_view(self, ttl_s: float | None = None) -> ViewAccess:
        """A live view of the screen for a person: ``url`` (below the api's URL) is opened once
        in a browser before ``code_expires_at`` (its one-time code becomes the view's cookie);
        the page shows the screen view-only and lets the person take over mouse and keyboard
        (the agent's input then answers DisplayLocked until they release it)."""
        r = await self._t.request("POST", self._base + "/view",
                                  json={} if ttl_s is None else {"ttl_s": ttl_s})
        return ViewAccess.model_validate(r.json())

    async def set_ttl(self, ttl_s: float) -> SandboxInfo:
        r = await self._t.request("POST", self._base + "/ttl", json={"ttl_s": ttl_s})
        self.info = SandboxInfo.model_validate(r.json())
        return self.info

    async def pause(self, keep_memory: bool = True) -> SandboxInfo:
        """Freeze the whole sandbox (no CPU; memory and files kept). Until :meth:`resume`,
        exec raises :class:`rollbox.errors.SandboxPaused`; files, TTL and delete still work and
        the TTL keeps counting (extend it with :meth:`set_ttl`). Idempotent.
        ``keep_memory=False``: filesystem-only (``info.memory_kept`` False): every process is
        stopped and its memory and CPU released, its files kept; :meth:`resume` boots it
        again (a fresh boot id, no process of before). NotSupported where its backend can
        not."""
        r = await self._t.request("POST", self._base + "/pause",
                                  json=None if keep_memory else {"keep_memory": False})
        self.info = SandboxInfo.model_validate(r.json())
        return self.info

    async def resume(self) -> SandboxInfo:
        """Thaw a paused sandbox; its processes continue (paused filesystem-only: it boots
        again over its files). Idempotent."""
        r = await self._t.request("POST", self._base + "/resume")
        self.info = SandboxInfo.model_validate(r.json())
        return self.info

    async def set_network(self, allow: Iterable[str] = ()) -> SandboxInfo:
        """Replace the network policy: ``allow`` names permissions (``pypi``, ``npm``,
        ``debian``, ``go``) and rules ``HOST:PORT[/udp]``, ``CIDR:PORT[/udp]``; empty = deny
        all. Takes effect for open connections too (e.g. before the graded phase)."""
        r = await self._t.request("PUT", self._base + "/network", json={"allow": list(allow)})
        self.info = SandboxInfo.model_validate(r.json())
        return self.info

    async def grade(
        self, cmd: str | list[str], *, files: Iterable[str], layers: Iterable[str] = (),
        cwd: str = "/", env: Mapping[str, str] | None = None, timeout: float = 600,
        max_bytes: int | None = None, resources: Resources | Mapping[str, Any] | None = None,
    ) -> GradeResult:
        """Run ``cmd`` in a fresh sandbox of this one's pristine layers plus ``layers`` (e.g.
        hidden tests), with only ``files`` (declared paths) copied over from this sandbox.
        Whatever else the agent changed here (tests, conftest.py, /usr) can not reach it.
        ``resources`` (e.g. ``{"memory_mib": 4096}``): the grader's; default this sandbox's."""
        try:
            spec = GradeSpec(cmd=cmd, files=list(files), layers=list(layers), cwd=cwd,
                             env=dict(env or {}), timeout_s=timeout,
                             resources=(Resources.model_validate(dict(resources))
                                        if isinstance(resources, Mapping) else resources),
                             **({"max_bytes": max_bytes} if max_bytes is not None else {}))
        except pydantic.ValidationError as exc:
            raise errors.BadRequest(str(exc)) from None
        r = await self._t.request("POST", self._base + "/grade",
                                  json=spec.model_dump(mode="json"), long=True)
        return GradeResult.model_validate(r.json())

    async def snapshot(
        self, name: str, *, exclude: Iterable[str] = (), scrub: bool = True,
        keep_git_history: bool = False, push: str | None = None, pause: bool = True,
        max_bytes: int | None = None, max_entries: int | None = None,
    ) -> SnapshotResult:
        """pack_diff: this sandbox's writable layer, minus caches (scrub) and ``exclude``
        globs ("/abs/glob" or a basename glob), becomes a new layer; ``name`` is tagged as
        this sandbox's layers + it, so ``client.create(result.image)`` starts from the same
        tree. Its git repositories keep only what HEAD reaches unless ``keep_git_history``.
        ``pause`` freezes the sandbox during the copy. ``push``: 'default' or an allowed
        chunk store URL. A ``backend="vm"`` sandbox's snapshot is its machine instead (disk +
        memory, ``result.kind == "machine"``): ``client.create(result.image, backend="vm")``
        with the same resources restores it running, as a new sandbox; exclude and push are
        refused (docs/backends/vm.md, Snapshot)."""
        try:
            spec = SnapshotSpec(
                name=name, exclude=list(exclude), scrub=scrub,
                keep_git_history=keep_git_history, push=push, pause=pause,
                **({"max_bytes": max_bytes} if max_bytes is not None else {}),
                **({"max_entries": max_entries} if max_entries is not None else {}))
        except pydantic.ValidationError as exc:
            raise errors.BadRequest(str(exc)) from None
        r = await self._t.request("POST", self._base + "/snapshot",
                                  json=spec.model_dump(mode="json"), long=True)
        return SnapshotResult.model_validate(r.json())

    async def fork(self, n: int = 1, *, labels: Mapping[str, str] | None = None,
                   idempotency_key: str | None = None) -> list[AsyncSandbox]:
        """``n`` new sandboxes with this one's filesystem as it is now (writable layer
        included, nothing copied), env, hidden paths, network policy, resources, labels (+
        ``labels`` and ``fork_of=<this id>``), job and deadline; each with its own hostname,
        machine-id and random seeds. This sandbox keeps running (held still for an instant);
        none of its later writes reaches a child. A container's processes are not carried (a
        microVM's are). A paused sandbox can be forked and stays paused. All ``n`` count
        against the project's quota at once: QuotaExceeded or CapacityExceeded makes none.
        The children are on this sandbox's node. ``self.last_fork`` keeps the answer
        (``frozen_s``: how long this sandbox was held still). ``idempotency_key`` (a fresh
        one per call unless given): a fork whose connection broke is sent again (on the next
        API URL) with it and returns the children the first attempt made (those still live),
        never ``n`` more; the same key for another source, ``n`` or labels while one of them
        lives is ``IdempotencyConflict``."""
        try:
            spec = ForkSpec(n=n, labels=dict(labels or {}),
                            idempotency_key=idempotency_key or new_idempotency_key())
        except pydantic.ValidationError as exc:
            raise errors.BadRequest(str(exc)) from None
        r = await self._t.request("POST", self._base + "/fork",
                                  json=spec.model_dump(mode="json"), long=True,
                                  idempotent=True)
        self.last_fork = ForkResult.model_validate(r.json())
        return [AsyncSandbox(self.client, info) for info in self.last_fork.children]

    async def delete(self) -> None:
        await self._t.request("DELETE", self._base)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self.delete()
        except errors.NotFound:
            pass


_CLEANUPS: set[asyncio.Future[None]] = set()


async def _delete_created(requests: Iterable[asyncio.Future[AsyncSandbox]]) -> None:
    """Wait for every create request and delete the sandboxes they made."""
    done = await asyncio.gather(*requests, return_exceptions=True)
    await asyncio.gather(*(sb.delete() for sb in done if isinstance(sb, AsyncSandbox)),
                         return_exceptions=True)


class AsyncClient:
    def __init__(self, base_url: str | Sequence[str] | None = None, api_key: str | None = None,
                 timeout: float = 60.0, max_connections: int = 1024,
                 reconnect_s: float = DEFAULT_RECONNECT_S, *,
                 transport: AsyncTransport | Sequence[AsyncTransport] | None = None,
                 url_backoff_s: float = DEFAULT_BACKOFF_S) -> None:
        """``base_url``: the API, or several API URLs (a list, or one string of them
        comma-separated; default ``$ROLLBOX_URL``, same form, else this host's server) that
        the client fails over between (docs/sdk.md): a request that could not be sent goes to
        the next URL at once; one whose connection broke is sent again on the next only when
        that is safe (reads; creates and exec starts, by their idempotency keys); a URL that
        failed is skipped for ``url_backoff_s`` (doubling per failure in a row, up to 30 s)
        while another is not; requests stay on the URL that answered. An empty list, a
        malformed or repeated URL: BadRequest, here.
        ``reconnect_s``: how long exec calls keep retrying (with backoff) while no server is
        reachable, e.g. restarting; their commands keep running meanwhile.
        ``transport``: how requests travel (default: HTTP with aiohttp to each URL, with
        ``timeout`` (also each connect's) and ``max_connections`` (per URL)); e.g.
        ``ASGITransport(app)`` calls an api app in-process; a list of transports is failed
        over between like URLs. A given transport has its own place and limits: no
        ``base_url`` then. The client closes its transports."""
        self.reconnect_s = reconnect_s
        if transport is None:
            urls = parse_urls(base_url if base_url not in (None, "") else default_url())
            places: list[AsyncTransport] = [
                AiohttpTransport(url, timeout=timeout, max_connections=max_connections)
                for url in urls]
        elif base_url is not None:
            raise TypeError("base_url is the transport's: give one or the other")
        else:
            places = [transport] if not isinstance(transport, Sequence) else list(transport)
            if not places:
                raise errors.BadRequest("no API transport given (an empty list)")
        one: AsyncTransport = (places[0] if len(places) == 1 else
                               FailoverTransport(places, backoff_s=url_backoff_s))
        self.urls = [t.base_url for t in places]
        api_key = api_key or default_api_key()
        self._t = Http(one, api_key, places=len(places))
        self._heartbeats: set[_Heartbeat] = set()  # of this client's open jobs
        self.images = AsyncImages(self._t)

    @property
    def base_url(self) -> str:
        """The API URL requests go to now (the one that last answered)."""
        return self._t.transport.base_url

    async def create(
        self, image: str, *, layers: Iterable[str] = (), cpus: float | None = None,
        memory_mib: int | None = None, disk_mib: int | None = None, ttl_s: float | None = None,
        labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
        hidden_paths: Iterable[str] = (), network: Iterable[str] | None = None,
        job: str | None = None, disk_tier: str | None = None, backend: str | None = None,
        idempotency_key: str | None = None, on_expiry: str | None = None,
        resume_on_traffic: bool = False, qos: str | None = None,
        pause_keep_memory: bool = True,
        vm_console: str | None = None,
    ) -> AsyncSandbox:
        """``qos``: the service class, ``"batch"`` (the default: best-effort, the node's idle
        CPU class) or ``"latency"`` (normal CPU class, placed with more headroom); another
        name is a bad_request. ``backend``: the kind of sandbox (``"container"``, the default, or ``"microvm"``;
        a kind no node offers is a bad_request). ``hidden_paths``: paths the sandbox's commands can not see (a task's tests).
        ``network``: None = no network at all; a list = default-deny policy allowing those
        permissions/rules (see ``AsyncSandbox.set_network``). ``job``: a live job of this
        project (see :meth:`job`), which deletes the sandbox when it ends or expires.
        ``disk_tier``: ``"disk"`` (the default: the writable layer on the node's disk, capped
        by ``disk_mib``) or ``"memory"`` (a tmpfs, its bytes counted in the sandbox's memory).
        ``on_expiry``: what the TTL's end does, ``"delete"`` (the default) or ``"pause"`` (frozen
        in place; it lives ROLLBOX_PAUSED_TTL_S more unless resumed with a new TTL).
        ``resume_on_traffic``: a paused sandbox is resumed by a port proxy connection to it
        (``url(port)``) and given ``ttl_s`` again; concurrent requests wait for one resume.
        ``pause_keep_memory=False`` (with ``on_expiry="pause"``): that pause is filesystem-only
        (see :meth:`AsyncSandbox.pause`). ``idempotency_key`` (a fresh one per call unless given): a create whose connection
        broke is sent again (on the next API URL) with it, and returns the sandbox the first
        attempt made instead of a second one; the same key with another spec, while that
        sandbox lives, is ``IdempotencyConflict``. ``vm_console``: a ``"vm"`` sandbox's
        screen, ``"none"`` (the kernel's console) or ``"shell"`` (a shell on tty1 inside the
        sandbox, for a person at the live view)."""
        spec = self._spec(image, layers, cpus, memory_mib, disk_mib, ttl_s, labels, env,
                          hidden_paths, job)
        if network is not None:
            spec["network"] = {"allow": list(network)}
        if disk_tier is not None:
            spec["disk_tier"] = disk_tier  # checked by the server (bad_request)
        if backend is not None:
            spec["backend"] = backend
        if on_expiry is not None:
            spec["on_expiry"] = on_expiry  # checked by the server (bad_request)
        if resume_on_traffic:
            spec["resume_on_traffic"] = True
        if qos is not None:
            spec["qos"] = qos  # checked by the server (bad_request)
        if not pause_keep_memory:
            spec["pause_keep_memory"] = False  # needs on_expiry "pause" (bad_request)
        if vm_console is not None:
            spec["vm_console"] = vm_console  # checked by the server (bad_request)
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 128:
            raise errors.BadRequest("idempotency_key must be 1 to 128 characters")
        spec["idempotency_key"] = idempotency_key or new_idempotency_key()
        r = await self._t.request("POST", "/v1/sandboxes", json=spec, long=True,
                                  idempotent=True)
        return AsyncSandbox(self, SandboxInfo.model_validate(r.json()))

    @staticmethod
    def _spec(image: str, layers: Iterable[str], cpus: float | None, memory_mib: int | None,
              disk_mib: int | None, ttl_s: float | None, labels: Mapping[str, str] | None,
              env: Mapping[str, str] | None, hidden_paths: Iterable[str] = (),
              job: str | None = None) -> dict[str, Any]:
        res = {k: v for k, v in (("cpus", cpus), ("memory_mib", memory_mib),
                                  ("disk_mib", disk_mib)) if v is not None}
        try:
            spec = SandboxSpec(image=image, layers=list(layers), resources=Resources(**res),
                               labels=dict(labels or {}), env=dict(env or {}),
                               hidden_paths=list(hidden_paths), job=job,
                               **({"ttl_s": ttl_s} if ttl_s is not None else {}))
        except pydantic.ValidationError as exc:
            raise errors.BadRequest(str(exc)) from None
        return spec.model_dump(mode="json")

    async def create_many(
        self, n: int, image: str, *, concurrency: int = 32, max_attempts: int = 8,
        backoff_s: float = 0.2, max_backoff_s: float = 10.0, **kw: Any,
    ) -> list[AsyncSandbox]:
        """Create ``n`` sandboxes with at most ``concurrency`` requests in flight, retrying
        retryable errors (capacity, infrastructure) with full-jitter exponential backoff.
        If one finally fails, or the call is cancelled, the ones created are deleted (also
        those whose request was in flight) and the error raised. Each of the ``n`` keeps one
        idempotency key over its attempts (``{idempotency_key}-{i}`` when one is given), so
        an attempt whose connection broke after the server made its sandbox is that sandbox
        when tried again, not a second one nobody would delete."""
        sem = asyncio.Semaphore(concurrency)
        requests: list[asyncio.Future[AsyncSandbox]] = []
        base = kw.pop("idempotency_key", None) or new_idempotency_key()

        async def one(i: int) -> AsyncSandbox:
            attempt = 0
            while True:
                async with sem:
                    # Shielded: a create the server is running is waited for even when we are
                    # cancelled, so that what it made is known and can be deleted.
                    request = asyncio.ensure_future(self.create(
                        image, idempotency_key=f"{base}-{i}", **kw))
                    requests.append(request)
                    try:
                        return await asyncio.shield(request)
                    except errors.RollboxError as exc:
                        attempt += 1
                        if not exc.retryable or attempt >= max_attempts:
                            raise
                # Sleep outside the semaphore so others can use the slot.
                await asyncio.sleep(random.uniform(0, min(max_backoff_s,
                                                          backoff_s * 2 ** attempt)))

        try:
            results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        except asyncio.CancelledError:
            cleanup = asyncio.ensure_future(_delete_created(requests))
            _CLEANUPS.add(cleanup)  # a second cancel must not drop it half-way
            cleanup.add_done_callback(_CLEANUPS.discard)
            await asyncio.shield(cleanup)
            raise
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await _delete_created(requests)
            raise failures[0]
        return [r for r in results if isinstance(r, AsyncSandbox)]

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        r = await self._t.request("GET", f"/v1/sandboxes/{sandbox_id}")
        return AsyncSandbox(self, SandboxInfo.model_validate(r.json()))

    async def list(self, labels: Mapping[str, str] | None = None,
                   state: str | Iterable[str] | None = None, *, job: str | None = None,
                   project: str | None = None) -> list[AsyncSandbox]:
        """Live sandboxes with all ``labels``; ``state`` ("running", "paused"...), ``job``
        and (admin keys) ``project`` narrow."""
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        states = [state] if isinstance(state, str) else list(state or ())
        params += [("state", s) for s in states]
        params += [(k, v) for k, v in (("job", job), ("project", project)) if v is not None]
        r = await self._t.request("GET", "/v1/sandboxes", params=params)
        return [AsyncSandbox(self, SandboxInfo.model_validate(x)) for x in r.json()]

    async def health(self) -> dict[str, Any]:
        return dict((await self._t.request("GET", "/v1/health")).json())

    # ---- trainer jobs ----
    def job(self, name: str, *, heartbeat_s: float = 10.0) -> AsyncJob:
        """A trainer job (``async with client.job("run-42") as job:``): sandboxes created
        through it are deleted when it ends, or when its heartbeats (sent from a thread of
        their own) stop for MISSED_HEARTBEATS intervals, e.g. because the trainer died.
        Opening a live job's name again resumes it."""
        return AsyncJob(self, name, heartbeat_s)

    async def jobs(self, project: str | None = None) -> list[JobInfo]:
        """This project's jobs, newest first (admin keys: every project's, or ``project``)."""
        params = {"project": project} if project is not None else None
        r = await self._t.request("GET", "/v1/jobs", params=params)
        return [JobInfo.model_validate(x) for x in r.json()]

    # ---- API keys (admin keys: of their project's subtree) ----
    async def create_key(self, project: str, *, admin: bool = False,
                         format: Literal["rollbox", "e2b"] = "rollbox") -> CreatedKey:
        """A new key of ``project`` (one this key administers: else Forbidden); ``admin``:
        it administers ``project`` and its sub-projects; ``format="e2b"``: in E2B's own form
        (``e2b_`` + hex) for the E2B SDK. ``.key`` is shown only here."""
        r = await self._t.request("POST", "/v1/keys", json={"project": project, "admin": admin,
                                                           "format": format})
        return CreatedKey.model_validate(r.json())

    async def keys(self, project: str | None = None) -> list[ApiKeyInfo]:
        """The API keys this key administers (or one project's): ids, projects, creation and
        last use, revoked or not; never a secret."""
        params = {"project": project} if project is not None else None
        r = await self._t.request("GET", "/v1/keys", params=params)
        return [ApiKeyInfo.model_validate(x) for x in r.json()]

    async def revoke_key(self, key_id: str) -> None:
        """Revoke a key; the server refuses it from the next request on."""
        await self._t.request("DELETE", f"/v1/keys/{urllib.parse.quote(key_id, safe='')}")

    # ---- projects ----
    async def create_project(self, name: str, *, parent: str | None = None,
                             sandboxes: int | None = None, cpus: float | None = None,
                             memory_mib: int | None = None,
                             layer_mib: int | None = None) -> Project:
        """A sub-project ``name`` (a full path, or one segment under ``parent``) of a
        project this key administers, its limits carved out of the parent's; with no limit
        given it holds nothing of what the parent limits. Above what the parent has left:
        BadRequest; an unknown parent: NotFound; a parent not administered: Forbidden."""
        limits = {"sandboxes": sandboxes, "cpus": cpus, "memory_mib": memory_mib,
                  "layer_mib": layer_mib}
        body: dict[str, Any] = {"name": name, "parent": parent}
        if any(v is not None for v in limits.values()):
            body["quota"] = limits
        r = await self._t.request("POST", "/v1/projects", json=body)
        return Project.model_validate(r.json())

    async def projects(self) -> list[Project]:
        """This key's subtree (a project key: its own project), with limits and use."""
        r = await self._t.request("GET", "/v1/projects")
        return [Project.model_validate(x) for x in r.json()]

    async def project_quota(self, project: str) -> Quota:
        """A project's limits (None fields: unlimited); its own project's for any key, its
        subtree's for an admin key."""
        path = f"/v1/projects/{urllib.parse.quote(project, safe='/')}/quota"
        return Quota.model_validate((await self._t.request("GET", path)).json())

    async def set_project_quota(self, project: str, *, sandboxes: int | None = None,
                                cpus: float | None = None, memory_mib: int | None = None,
                                layer_mib: int | None = None) -> Quota:
        """Replace a project's limits (an omitted one is unlimited; an admin key of a project
        above it); creates beyond them raise QuotaExceeded. Negative limits, ones above a
        node's capacity or above what the parent has left raise BadRequest and change
        nothing."""
        body = {"sandboxes": sandboxes, "cpus": cpus, "memory_mib": memory_mib,
                "layer_mib": layer_mib}
        path = f"/v1/projects/{urllib.parse.quote(project, safe='/')}/quota"
        r = await self._t.request("PUT", path, json=body)
        return Quota.model_validate(r.json())

    # ---- fncall: stateless calls on warm pools (no sandbox of your own) ----
    async def fncall(self, code: str, language: str = "python", **kw: Any) -> FnCallResult:
        """Run ``code`` once (fields of :class:`FnCallSpec`: files, stdin, timeout_s,
        memory_mib, preload, ...). The result's ``status`` says ok / runtime_error / timeout /
        memory_exceeded / compile_error; bad requests raise typed errors."""
        spec = _fncall_spec({"code": code, "language": language, **kw})
        r = await self._t.request("POST", "/v1/fncall", json=spec.model_dump(mode="json"),
                                  long=True)
        return FnCallResult.model_validate(r.json())

    async def fncall_batch(
        self, calls: Iterable[FnCallSpec | Mapping[str, Any]], *, concurrency: int = 32,
        return_exceptions: bool = False, chunk_bytes: int = 768 << 10,
    ) -> list[FnCallResult | errors.RollboxError]:
        """Run many calls with at most ``concurrency`` in flight on the server; results in
        input order. Requests are split to stay under the api's body limit. A call that failed
        with a typed error raises it, or is returned in its place with return_exceptions."""
        specs = [c if isinstance(c, FnCallSpec) else _fncall_spec(dict(c)) for c in calls]
        chunks: list[list[dict[str, Any]]] = [[]]
        size = 0
        for spec in specs:
            body = spec.model_dump(mode="json", exclude_defaults=True)
            n = len(json.dumps(body))
            if chunks[-1] and size + n > chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(body)
            size += n
        per = max(1, concurrency // max(1, len(chunks)))

        async def send(chunk: list[dict[str, Any]]) -> list[dict[str, Any]]:
            if not chunk:
                return []
            r = await self._t.request("POST", "/v1/fncall/batch", long=True,
                                      json={"calls": chunk, "concurrency": per})
            return list(r.json()["results"])

        items = [x for part in await asyncio.gather(*(send(c) for c in chunks)) for x in part]
        out: list[FnCallResult | errors.RollboxError] = []
        for item in items:
            if item.get("error") is not None:
                exc = errors.error_from_payload({"error": item["error"]})
                if not return_exceptions:
                    raise exc
                out.append(exc)
            else:
                out.append(FnCallResult.model_validate(item["result"]))
        return out

    async def close(self) -> None:
        """Close the connections; jobs left open stop heartbeating (their leases expire)."""
        for heartbeat in list(self._heartbeats):
            heartbeat.stop()
        await self._t.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()



class _Heartbeat:
    """A job's heartbeats, from a daemon thread through the transport's blocking face (over
    HTTP its own connection): a training step that blocks the event loop (or holds the GIL in
    C for a while) does not stop them; a killed process does, which is the point."""

    def __init__(self, transport: AsyncTransport, headers: Mapping[str, str], name: str,
                 interval_s: float) -> None:
        self._request = Request(
            "POST", f"/v1/jobs/{urllib.parse.quote(name, safe='')}/heartbeat",
            headers=dict(headers), body=b"")
        self._channel: BlockingTransport = transport.blocking(max(1.0, interval_s))
        self.interval_s = interval_s
        self.lost: errors.RollboxError | None = None  # why the lease is gone, once it is
        self.last_ok: float | None = None  # time.time() of the last answered heartbeat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rollbox-job-{name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No more heartbeats (one in flight may still land: harmless). Never blocks."""
        self._stop.set()

    def beat(self) -> None:
        raise_for_status(*self._channel.handle(self._request))
        self.last_ok = time.time()

    def _run(self) -> None:
        wait = self.interval_s
        try:
            while not self._stop.wait(wait):
                wait = self.interval_s
                try:
                    self.beat()
                except errors.RollboxError as exc:
                    if not exc.retryable:  # ended, expired, key revoked: nothing to keep alive
                        self.lost = exc
                        break
                    wait = self.interval_s / 3  # three misses are allowed: try again sooner
        finally:
            self._channel.close()


class AsyncJob:
    """A trainer job's lease (see :meth:`AsyncClient.job`). ``open`` (or ``async with``)
    starts it and its heartbeat thread; ``end`` (or leaving the ``async with``) deletes its
    sandboxes. ``lost`` says why the lease went away under it (expired, revoked key)."""

    def __init__(self, client: AsyncClient, name: str, heartbeat_s: float) -> None:
        try:
            self.spec = JobSpec(name=name, heartbeat_s=heartbeat_s)
        except pydantic.ValidationError as exc:
            raise errors.BadRequest(str(exc)) from None
        self.client = client
        self.name = name
        self._t = client._t
        self._base = f"/v1/jobs/{urllib.parse.quote(name, safe='')}"
        self._heartbeat: _Heartbeat | None = None
        self.info: JobInfo | None = None

    def __repr__(self) -> str:
        return f"<AsyncJob {self.name}>"

    @property
    def lost(self) -> errors.RollboxError | None:
        return self._heartbeat.lost if self._heartbeat is not None else None

    async def open(self) -> AsyncJob:
        r = await self._t.request("POST", "/v1/jobs", json=self.spec.model_dump(mode="json"))
        self.info = JobInfo.model_validate(r.json())
        if self._heartbeat is None or self._heartbeat.lost is not None:
            self._heartbeat = _Heartbeat(self._t.transport, self._t.headers, self.name,
                                         self.spec.heartbeat_s)
            self._heartbeat.start()
            self.client._heartbeats.add(self._heartbeat)
        return self

    async def refresh(self) -> JobInfo:
        self.info = JobInfo.model_validate((await self._t.request("GET", self._base)).json())
        return self.info

    async def create(self, image: str, **kw: Any) -> AsyncSandbox:
        """:meth:`AsyncClient.create` in this job."""
        return await self.client.create(image, job=self.name, **kw)

    async def create_many(self, n: int, image: str, **kw: Any) -> list[AsyncSandbox]:
        """:meth:`AsyncClient.create_many` in this job."""
        return await self.client.create_many(n, image, job=self.name, **kw)

    async def list(self) -> list[AsyncSandbox]:
        """The job's live sandboxes."""
        r = await self._t.request("GET", self._base + "/sandboxes")
        return [AsyncSandbox(self.client, SandboxInfo.model_validate(x)) for x in r.json()]

    async def end(self) -> JobEnded:
        """Stop the heartbeats, end the lease and delete the job's sandboxes."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self.client._heartbeats.discard(self._heartbeat)
        r = await self._t.request("DELETE", self._base, long=True)
        ended = JobEnded.model_validate(r.json())
        self.info = ended.job
        return ended

    async def __aenter__(self) -> AsyncJob:
        return await self.open()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self.end()
        except errors.NotFound:
            pass  # expired meanwhile: its sandboxes are gone already
