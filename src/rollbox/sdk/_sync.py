"""The sync face: the same async core run on a private event-loop thread (one core, two faces).

Callbacks passed to ``Sandbox.exec`` run on that private thread.
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

from rollbox import errors
from rollbox.models import (
    ApiKeyInfo, CreatedKey, Event, ExecInfo, ExecResult, FileStat, GradeResult, ImageInfo,
    ForkResult, JobEnded, JobInfo, LayerUsage, PortAccess, Project, Quota, SandboxInfo, SnapshotResult,
    UsageSample, ComputerAction, ComputerActionResult, DisplayInfo, ViewAccess,
)
from rollbox.sdk._resume import DEFAULT_RECONNECT_S
from rollbox.sdk._async import (
    AsyncClient, AsyncFiles, AsyncImages, AsyncJob, AsyncProcess, AsyncSandbox, FileContent,
    OutputCallback, OutputChunk, Progress,
)
from rollbox.sdk._failover import DEFAULT_BACKOFF_S
from rollbox.sdk._transport import AsyncTransport

T = TypeVar("T")


class _Portal:
    """An event loop on a daemon thread; ``call`` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="rollbox-sdk", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("sync rollbox API called from one of its own callbacks")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt: do not leave the request running
            raise

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self.call(agen.__anext__())  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and self.loop.is_running():
                self.call(aclose())

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Process:
    def __init__(self, portal: _Portal, proc: AsyncProcess) -> None:
        self._p = portal
        self._proc = proc
        self.exec_id = proc.exec_id

    def __repr__(self) -> str:
        return f"<Process {self.exec_id}>"

    def attach(self, stdout_offset: int = 0, stderr_offset: int = 0) -> Iterator[OutputChunk]:
        return self._p.iterate(self._proc.attach(stdout_offset, stderr_offset))

    def wait(self, *, check: bool = False) -> ExecResult:
        return self._p.call(self._proc.wait(check=check))

    def kill(self, signal: int = 9) -> None:
        self._p.call(self._proc.kill(signal))

    def write_stdin(self, data: bytes | str) -> None:
        self._p.call(self._proc.write_stdin(data))

    def close_stdin(self) -> None:
        self._p.call(self._proc.close_stdin())

    def resize(self, cols: int, rows: int) -> None:
        """See :meth:`AsyncProcess.resize`."""
        self._p.call(self._proc.resize(cols, rows))


class Files:
    def __init__(self, portal: _Portal, files: AsyncFiles) -> None:
        self._p = portal
        self._f = files

    def read(self, path: str) -> bytes:
        return self._p.call(self._f.read(path))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self._p.call(self._f.read_text(path, encoding))

    def read_stream(self, path: str) -> Iterator[bytes]:
        return self._p.iterate(self._f.read_stream(path))

    def download_file(self, path: str, local: str | os.PathLike[str]) -> int:
        return self._p.call(self._f.download_file(path, local))

    def write(self, path: str, data: FileContent, mode: int = 0o644) -> None:
        """See :meth:`AsyncFiles.write` (bytes, str, a binary file object or an iterator of
        byte chunks)."""
        self._p.call(self._f.write(path, data, mode))

    def stat(self, path: str) -> FileStat:
        return self._p.call(self._f.stat(path))

    def list(self, path: str) -> list[FileStat]:
        return self._p.call(self._f.list(path))

    def mkdir(self, path: str, parents: bool = True) -> None:
        self._p.call(self._f.mkdir(path, parents))

    def remove(self, path: str, recursive: bool = False) -> None:
        self._p.call(self._f.remove(path, recursive))

    def upload_dir(self, local: str | os.PathLike[str], remote: str) -> int:
        return self._p.call(self._f.upload_dir(local, remote))

    def download_dir(self, remote: str, local: str | os.PathLike[str]) -> None:
        self._p.call(self._f.download_dir(remote, local))


class Images:
    """See :class:`AsyncImages` (``client.images``)."""

    def __init__(self, portal: _Portal, images: AsyncImages) -> None:
        self._p = portal
        self._i = images

    def upload(self, name: str, source: str | os.PathLike[str], *, base: str | None = None,
               progress: Progress | None = None) -> ImageInfo:
        """``progress`` runs on the SDK's own thread."""
        return self._p.call(self._i.upload(name, source, base=base, progress=progress))

    def list(self) -> list[ImageInfo]:
        return self._p.call(self._i.list())

    def delete(self, name: str) -> None:
        self._p.call(self._i.delete(name))

    def usage(self) -> LayerUsage:
        return self._p.call(self._i.usage())


class Mouse:
    """See :class:`rollbox.sdk._async.AsyncMouse`."""

    def __init__(self, portal: _Portal, sandbox: AsyncSandbox) -> None:
        self._p = portal
        self._m = sandbox.mouse

    def move(self, x: int, y: int, **kw: Any) -> ComputerActionResult:
        return self._p.call(self._m.move(x, y, **kw))

    def click(self, x: int, y: int, button: str = "left", **kw: Any) -> ComputerActionResult:
        return self._p.call(self._m.click(x, y, button, **kw))

    def double_click(self, x: int, y: int, button: str = "left",
                     **kw: Any) -> ComputerActionResult:
        return self._p.call(self._m.double_click(x, y, button, **kw))

    def drag(self, x: int, y: int, x2: int, y2: int, button: str = "left",
             **kw: Any) -> ComputerActionResult:
        return self._p.call(self._m.drag(x, y, x2, y2, button, **kw))

    def scroll(self, x: int, y: int, dy: int, **kw: Any) -> ComputerActionResult:
        return self._p.call(self._m.scroll(x, y, dy, **kw))


class Keyboard:
    """See :class:`rollbox.sdk._async.AsyncKeyboard`."""

    def __init__(self, portal: _Portal, sandbox: AsyncSandbox) -> None:
        self._p = portal
        self._k = sandbox.keyboard

    def type(self, text: str, **kw: Any) -> ComputerActionResult:
        return self._p.call(self._k.type(text, **kw))

    def press(self, keys: str, **kw: Any) -> ComputerActionResult:
        return self._p.call(self._k.press(keys, **kw))


class Sandbox:
    def __init__(self, portal: _Portal, sandbox: AsyncSandbox) -> None:
        self._p = portal
        self._sb = sandbox
        self.id = sandbox.id
        self.files = Files(portal, sandbox.files)
        self.mouse = Mouse(portal, sandbox)
        self.keyboard = Keyboard(portal, sandbox)

    def __repr__(self) -> str:
        return f"<Sandbox {self.id}>"

    @property
    def info(self) -> SandboxInfo:
        return self._sb.info

    def refresh(self) -> SandboxInfo:
        return self._p.call(self._sb.refresh())

    def usage(self) -> list[UsageSample]:
        """See :meth:`AsyncSandbox.usage`."""
        return self._p.call(self._sb.usage())

    def exec(
        self, cmd: str | list[str], *, env: Mapping[str, str] | None = None, cwd: str = "/",
        user: str = "root", timeout: float | None = None, stdin: bytes | str | None = None,
        on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
        check: bool = False, idempotency_key: str | None = None,
        pty: bool = False, cols: int = 80, rows: int = 24,
    ) -> ExecResult:
        """See :meth:`AsyncSandbox.exec` (survives a server restart; ``ExecIndeterminate``)."""
        return self._p.call(self._sb.exec(
            cmd, env=env, cwd=cwd, user=user, timeout=timeout, stdin=stdin,
            on_stdout=on_stdout, on_stderr=on_stderr, check=check,
            idempotency_key=idempotency_key, pty=pty, cols=cols, rows=rows))

    def exec_background(
        self, cmd: str | list[str], *, env: Mapping[str, str] | None = None, cwd: str = "/",
        user: str = "root", timeout: float | None = None, stdin: bool = False,
        idempotency_key: str | None = None, pty: bool = False, cols: int = 80, rows: int = 24,
    ) -> Process:
        """See :meth:`AsyncSandbox.exec_background` (``pty=True``: a terminal)."""
        return Process(self._p, self._p.call(self._sb.exec_background(
            cmd, env=env, cwd=cwd, user=user, timeout=timeout, stdin=stdin,
            idempotency_key=idempotency_key, pty=pty, cols=cols, rows=rows)))

    def process(self, exec_id: str) -> Process:
        return Process(self._p, self._sb.process(exec_id))

    def processes(self) -> list[ExecInfo]:
        return self._p.call(self._sb.processes())

    def events(self, after: int = 0, follow: bool = False) -> list[Event]:
        return self._p.call(self._sb.events(after, follow))

    def stream_events(self, after: int = 0, follow: bool = True) -> Iterator[Event]:
        return self._p.iterate(self._sb.stream_events(after, follow))

    def url(self, port: int) -> str:
        """See :meth:`AsyncSandbox.url` (no request is made)."""
        return self._sb.url(port)

    def port_access(self, port: int, ttl_s: float | None = None) -> PortAccess:
        """See :meth:`AsyncSandbox.port_access`."""
        return self._p.call(self._sb.port_access(port, ttl_s))

    def screenshot(self, format: str = "png") -> bytes:
        """See :meth:`AsyncSandbox.screenshot`."""
        return self._p.call(self._sb.screenshot(format))

    @property
    def display(self) -> DisplayInfo:
        """The display's size now (asked of the sandbox at each read)."""
        return self._p.call(self._sb.display())

    def live_view(self, ttl_s: float | None = None) -> ViewAccess:
        """See :meth:`AsyncSandbox.live_view`."""
        return self._p.call(self._sb.live_view(ttl_s))

    def computer(self, action: ComputerAction) -> ComputerActionResult:
        return self._p.call(self._sb.computer(action))

    def set_ttl(self, ttl_s: float) -> SandboxInfo:
        return self._p.call(self._sb.set_ttl(ttl_s))

    def pause(self, keep_memory: bool = True) -> SandboxInfo:
        return self._p.call(self._sb.pause(keep_memory))

    def resume(self) -> SandboxInfo:
        return self._p.call(self._sb.resume())

    def set_network(self, allow: Iterable[str] = ()) -> SandboxInfo:
        return self._p.call(self._sb.set_network(allow))

    def grade(self, cmd: str | list[str], **kw: Any) -> GradeResult:
        return self._p.call(self._sb.grade(cmd, **kw))

    def snapshot(self, name: str, **kw: Any) -> SnapshotResult:
        return self._p.call(self._sb.snapshot(name, **kw))

    def fork(self, n: int = 1, *, labels: Mapping[str, str] | None = None,
             idempotency_key: str | None = None) -> list[Sandbox]:
        """See :meth:`AsyncSandbox.fork` (all ``n`` or none; ``last_fork``; a retry with
        the same ``idempotency_key`` returns the same children)."""
        return [Sandbox(self._p, sb) for sb in self._p.call(
            self._sb.fork(n, labels=labels, idempotency_key=idempotency_key))]

    @property
    def last_fork(self) -> ForkResult | None:
        return self._sb.last_fork

    def delete(self) -> None:
        self._p.call(self._sb.delete())

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._p.call(self._sb.__aexit__(et, e, tb))


class Job:
    """Blocking face of :class:`AsyncJob`; its heartbeats run on their own thread as there."""

    def __init__(self, portal: _Portal, job: AsyncJob) -> None:
        self._p = portal
        self._j = job
        self.name = job.name

    def __repr__(self) -> str:
        return f"<Job {self.name}>"

    @property
    def info(self) -> JobInfo | None:
        return self._j.info

    @property
    def lost(self) -> errors.RollboxError | None:
        return self._j.lost

    def open(self) -> Job:
        self._p.call(self._j.open())
        return self

    def refresh(self) -> JobInfo:
        return self._p.call(self._j.refresh())

    def create(self, image: str, **kw: Any) -> Sandbox:
        return Sandbox(self._p, self._p.call(self._j.create(image, **kw)))

    def create_many(self, n: int, image: str, **kw: Any) -> list[Sandbox]:
        return [Sandbox(self._p, sb) for sb in self._p.call(self._j.create_many(n, image, **kw))]

    def list(self) -> list[Sandbox]:
        return [Sandbox(self._p, sb) for sb in self._p.call(self._j.list())]

    def end(self) -> JobEnded:
        return self._p.call(self._j.end())

    def __enter__(self) -> Job:
        return self.open()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._p.call(self._j.__aexit__(et, e, tb))


class Client:
    """Blocking client; same arguments and methods as :class:`AsyncClient`. With an
    ``ASGITransport`` the app runs on the client's private loop thread."""

    def __init__(self, base_url: str | Sequence[str] | None = None, api_key: str | None = None,
                 timeout: float = 60.0, max_connections: int = 1024,
                 reconnect_s: float = DEFAULT_RECONNECT_S, *,
                 transport: AsyncTransport | Sequence[AsyncTransport] | None = None,
                 url_backoff_s: float = DEFAULT_BACKOFF_S) -> None:
        self._p = _Portal()

        async def make() -> AsyncClient:
            return AsyncClient(base_url, api_key, timeout, max_connections, reconnect_s,
                               transport=transport, url_backoff_s=url_backoff_s)

        try:
            self._c = self._p.call(make())
        except BaseException:
            self._p.stop()
            raise
        self.urls = self._c.urls
        self.images = Images(self._p, self._c.images)

    @property
    def base_url(self) -> str:
        """The API URL requests go to now (see :attr:`AsyncClient.base_url`)."""
        return self._c.base_url

    def create(self, image: str, *, layers: Iterable[str] = (), **kw: Any) -> Sandbox:
        return Sandbox(self._p, self._p.call(self._c.create(image, layers=layers, **kw)))

    def create_many(self, n: int, image: str, **kw: Any) -> list[Sandbox]:
        return [Sandbox(self._p, sb) for sb in self._p.call(self._c.create_many(n, image, **kw))]

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self._p, self._p.call(self._c.get(sandbox_id)))

    def list(self, labels: Mapping[str, str] | None = None,
             state: str | Iterable[str] | None = None, *, job: str | None = None,
             project: str | None = None) -> list[Sandbox]:
        return [Sandbox(self._p, sb) for sb in self._p.call(
            self._c.list(labels, state, job=job, project=project))]

    def health(self) -> dict[str, Any]:
        return self._p.call(self._c.health())

    def job(self, name: str, *, heartbeat_s: float = 10.0) -> Job:
        """See :meth:`AsyncClient.job`: ``with client.job("run-42") as job:``."""
        return Job(self._p, self._c.job(name, heartbeat_s=heartbeat_s))

    def jobs(self, project: str | None = None) -> list[JobInfo]:
        return self._p.call(self._c.jobs(project))

    def keys(self, project: str | None = None) -> list[ApiKeyInfo]:
        return self._p.call(self._c.keys(project))

    def create_key(self, project: str, *, admin: bool = False,
                   format: Literal["rollbox", "e2b"] = "rollbox") -> CreatedKey:
        """See :meth:`AsyncClient.create_key`."""
        return self._p.call(self._c.create_key(project, admin=admin, format=format))

    def create_project(self, name: str, **kw: Any) -> Project:
        """See :meth:`AsyncClient.create_project`."""
        return self._p.call(self._c.create_project(name, **kw))

    def projects(self) -> list[Project]:
        """See :meth:`AsyncClient.projects`."""
        return self._p.call(self._c.projects())

    def revoke_key(self, key_id: str) -> None:
        self._p.call(self._c.revoke_key(key_id))

    def project_quota(self, project: str) -> Quota:
        """See :meth:`AsyncClient.project_quota`."""
        return self._p.call(self._c.project_quota(project))

    def set_project_quota(self, project: str, **kw: Any) -> Quota:
        """See :meth:`AsyncClient.set_project_quota`."""
        return self._p.call(self._c.set_project_quota(project, **kw))

    def fncall(self, code: str, language: str = "python", **kw: Any) -> Any:
        """See :meth:`AsyncClient.fncall`."""
        return self._p.call(self._c.fncall(code, language, **kw))

    def fncall_batch(self, calls: Iterable[Any], **kw: Any) -> list[Any]:
        """See :meth:`AsyncClient.fncall_batch`."""
        return self._p.call(self._c.fncall_batch(calls, **kw))

    def close(self) -> None:
        if self._p.loop.is_running():
            self._p.call(self._c.close())
        self._p.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
