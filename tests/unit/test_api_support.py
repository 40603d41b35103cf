"""Test-only in-memory EdgeAPI: sandboxes are temp directories, commands are real host
subprocesses (no isolation at all). Used by the api and sdk unit tests; never a deliverable.

Also holds the shared fixtures-as-helpers (``ApiStack``) so test_api_* and test_sdk_* agree.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import secrets
import shutil
import signal
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer, create_app
from rollbox.compat.frontdoors import FRONT_DOORS
from rollbox.edge.interface import ExecOutput
from rollbox.events import EventLog
from rollbox.iam import KeyStore
from rollbox.jobs import SqliteLeaseStore
from rollbox.models import (
    Event, ExecInfo, ExecResult, ExecSpec, FileStat, NodeReport, NodeSandbox, SandboxInfo,
    SandboxSpec,
)
from rollbox.placement import Placement
from rollbox.sdk import ASGITransport, Lifespan
from rollbox.watcher import Watcher, placement_over


@dataclass
class _Exec:
    exec_id: str
    spec: ExecSpec
    proc: asyncio.subprocess.Process
    started_at: float
    items: list[ExecOutput] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: ExecResult | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    sandbox_id: str = ""

    def push(self, item: ExecOutput) -> None:
        self.items.append(item)
        self.changed.set()


@dataclass
class _Sandbox:
    info: SandboxInfo
    root: Path
    execs: dict[str, _Exec] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def watched(edges: list[FakeEdge]) -> AsyncIterator[Placement]:
    """A Placement over ``edges`` deciding from a Watcher of them, started (stopped after)."""
    placement = placement_over(edges)
    assert isinstance(placement.view, Watcher)
    async with placement.view:
        yield placement


async def poll(placement: Placement) -> None:
    """A probe round of the placement's watcher now (its view changes at the next one)."""
    assert isinstance(placement.view, Watcher)
    await placement.view.poll()


class FakeEdge:
    """``events``: the audit trail this edge keeps of its sandboxes, like Edge's (sandbox.*,
    exec.*; None: none kept, for tests that read no trail)."""

    def __init__(self, node_id: str, root: Path, max_sandboxes: int = 1000,
                 events: EventLog | None = None) -> None:
        self.node_id = node_id
        self.event_log = events
        self.root = root
        self.max_sandboxes = max_sandboxes
        self.sandboxes: dict[str, _Sandbox] = {}
        self.inject: dict[str, BaseException] = {}  # method name -> error to raise
        self.upload_chunks: list[int] = []
        self.upload_first_chunk = asyncio.Event()
        self.creates = 0
        # backend kinds -> offered (what report() says; creates do not check it)
        self.kinds: dict[str, bool] = {"container": True}
        self.incarnation = secrets.token_hex(8)

    async def capacity(self) -> dict[str, object]:
        """The part of Edge.capacity()'s dict a fake can say (EdgeAPI: a dict)."""
        return {"sandboxes": len(self.sandboxes), "max_sandboxes": self.max_sandboxes,
                "free": self.max_sandboxes - len(self.sandboxes)}

    async def report(self, max_sandboxes: int = 10000,
                     fence_s: float | None = None) -> NodeReport:
        """One probe of the watcher (EdgeAPI.report), from memory like Edge's: the room left
        in sandboxes (no CPU or memory budget: unbounded), the offered kinds, the sandboxes."""
        self._check("report")
        listed = [NodeSandbox(id=sid, owner=s.info.owner, backend=s.info.backend,
                              state=s.info.state, cpus=s.info.resources.cpus,
                              memory_mib=s.info.resources.memory_mib,
                              created_at=s.info.created_at, expires_at=s.info.expires_at,
                              image=s.info.image, job=s.info.job)
                  for sid, s in list(self.sandboxes.items())[:max_sandboxes]]
        by_project: dict[str, int] = {}
        by_backend: dict[str, int] = {}
        for s in self.sandboxes.values():
            by_project[s.info.owner] = by_project.get(s.info.owner, 0) + 1
            by_backend[s.info.backend] = by_backend.get(s.info.backend, 0) + 1
        return NodeReport(
            node_id=self.node_id, incarnation=self.incarnation, started_at=0.0, at=time.time(),
            backends=sorted(k for k, v in self.kinds.items() if v),
            free={"sandboxes": float(max(0, self.max_sandboxes - len(self.sandboxes)))},
            limits={"sandboxes": float(self.max_sandboxes)}, memory_available_mib=0,
            starting=0, sandboxes=listed, sandboxes_total=len(self.sandboxes),
            truncated=len(listed) < len(self.sandboxes),
            by_backend=by_backend, by_project=by_project)

    def _check(self, op: str) -> None:
        if op in self.inject:
            raise self.inject[op]

    def _sb(self, sandbox_id: str) -> _Sandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise errors.NotFound(f"no sandbox {sandbox_id}")
        return sb

    def _log(self, sandbox_id: str, kind: str, exec_id: str | None = None,
             data: str | bytes = "") -> None:
        if self.event_log is not None:
            self.event_log.append(sandbox_id, kind, exec_id, data)

    def _path(self, sandbox_id: str, path: str) -> Path:
        return self._sb(sandbox_id).root / path.lstrip("/")

    async def create(self, spec: SandboxSpec, owner: str,
                     requested: str | None = None) -> SandboxInfo:
        info = await self._create(spec, owner)
        if requested is not None:  # after sandbox.created, like Edge.create
            self._log(info.id, "sandbox.requested", data=requested)
        return info

    async def _create(self, spec: SandboxSpec, owner: str) -> SandboxInfo:
        self._check("create")
        self.creates += 1
        for sb in self.sandboxes.values():  # a keyed create is the edge's once (Edge.create)
            if spec.idempotency_key is not None and (sb.info.owner, sb.info.idempotency_key) \
                    == (owner, spec.idempotency_key):
                return sb.info
        if len(self.sandboxes) >= self.max_sandboxes:
            raise errors.CapacityExceeded(f"node {self.node_id} full")
        sid = f"{self.node_id}-{secrets.token_hex(8)}"
        root = self.root / sid
        root.mkdir(parents=True)
        now = time.time()
        info = SandboxInfo(id=sid, node=self.node_id, image=spec.image, layers=spec.layers,
                           state="running", created_at=now, expires_at=now + spec.ttl_s,
                           labels=spec.labels, resources=spec.resources, owner=owner,
                           idempotency_key=spec.idempotency_key, qos=spec.qos)
        self.sandboxes[sid] = _Sandbox(info, root)
        self._log(sid, "sandbox.created", data=json.dumps(
            {"image": spec.image, "layers": spec.layers, "owner": owner, "job": spec.job}))
        return info

    async def get(self, sandbox_id: str) -> SandboxInfo:
        self._check("get")
        return self._sb(sandbox_id).info

    async def list(self, owner: str | None, labels: dict[str, str]) -> list[SandboxInfo]:
        return [s.info for s in self.sandboxes.values()
                if (owner is None or s.info.owner == owner)
                and all(s.info.labels.get(k) == v for k, v in labels.items())]

    async def delete(self, sandbox_id: str, requested: str | None = None) -> None:
        self._check("delete")
        sb = self._sb(sandbox_id)
        if requested is not None:  # before the delete's own events, like Edge.delete
            self._log(sandbox_id, "sandbox.requested", data=requested)
        for ex in sb.execs.values():
            if ex.proc.returncode is None:
                with_contextless_kill(ex.proc.pid)  # the whole group, like a cgroup kill
        for ex in sb.execs.values():
            await ex.done.wait()
        del self.sandboxes[sandbox_id]
        shutil.rmtree(sb.root, ignore_errors=True)
        self._log(sandbox_id, "sandbox.deleted")

    async def set_ttl(self, sandbox_id: str, ttl_s: float) -> SandboxInfo:
        sb = self._sb(sandbox_id)
        sb.info = sb.info.model_copy(update={"expires_at": time.time() + ttl_s})
        return sb.info

    async def exec_start(self, sandbox_id: str, spec: ExecSpec) -> str:
        self._check("exec_start")
        sb = self._sb(sandbox_id)
        argv = ["/bin/sh", "-c", spec.cmd] if isinstance(spec.cmd, str) else spec.cmd
        cwd = sb.root / spec.cwd.lstrip("/")
        if not cwd.is_dir():
            raise errors.BadRequest(f"cwd {spec.cwd} does not exist")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(sb.root), **spec.env}
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=env, start_new_session=True,
            stdin=asyncio.subprocess.PIPE if spec.stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        ex = _Exec("e" + secrets.token_hex(6), spec, proc, time.time(), sandbox_id=sandbox_id)
        sb.execs[ex.exec_id] = ex
        self._log(sandbox_id, "exec.started", ex.exec_id, json.dumps({"cmd": spec.cmd}))
        ex.push(ExecOutput("started", ex.exec_id))
        ex.tasks.append(asyncio.create_task(self._run(ex)))
        return ex.exec_id

    async def _run(self, ex: _Exec) -> None:
        out = {"stdout": bytearray(), "stderr": bytearray()}

        async def pump(kind: str, reader: asyncio.StreamReader) -> None:
            while chunk := await reader.read(65536):
                ex.push(ExecOutput(kind, ex.exec_id, data=chunk,  # type: ignore[arg-type]
                                   offset=len(out[kind])))
                self._log(ex.sandbox_id, f"exec.{kind}", ex.exec_id, chunk)
                out[kind] += chunk

        assert ex.proc.stdout and ex.proc.stderr
        pumps = asyncio.gather(pump("stdout", ex.proc.stdout), pump("stderr", ex.proc.stderr))
        timed_out = False
        try:
            await asyncio.wait_for(ex.proc.wait(), ex.spec.timeout_s)
        except TimeoutError:
            timed_out = True
            os.killpg(ex.proc.pid, signal.SIGKILL)
            await ex.proc.wait()
        with_contextless_kill(ex.proc.pid)
        await pumps
        rc = ex.proc.returncode
        assert rc is not None
        ex.result = ExecResult(
            exec_id=ex.exec_id, exit_code=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None, timed_out=timed_out,
            duration_s=time.time() - ex.started_at,
            stdout=out["stdout"].decode(errors="replace"),
            stderr=out["stderr"].decode(errors="replace"),
            stdout_bytes=len(out["stdout"]), stderr_bytes=len(out["stderr"]))
        self._log(ex.sandbox_id, "exec.exited", ex.exec_id, ex.result.model_dump_json(
            exclude={"stdout", "stderr"}))
        ex.push(ExecOutput("exit", ex.exec_id, result=ex.result))
        ex.done.set()

    def _exec(self, sandbox_id: str, exec_id: str) -> _Exec:
        ex = self._sb(sandbox_id).execs.get(exec_id)
        if ex is None:
            raise errors.NotFound(f"no exec {exec_id}")
        return ex

    async def exec_stream(self, sandbox_id: str, exec_id: str,
                          offsets: tuple[int, int] = (0, 0)) -> AsyncIterator[ExecOutput]:
        """(Offsets are not applied here: the SDK trims what it already has by each item's
        offset.)"""
        ex = self._exec(sandbox_id, exec_id)
        i = 0
        while True:
            while i < len(ex.items):
                item = ex.items[i]
                i += 1
                yield item
                if item.kind in ("exit", "error"):
                    return
            ex.changed.clear()
            await ex.changed.wait()

    async def exec_wait(self, sandbox_id: str, exec_id: str) -> ExecResult:
        ex = self._exec(sandbox_id, exec_id)
        await ex.done.wait()
        assert ex.result is not None
        return ex.result

    async def exec_run(self, sandbox_id: str, spec: ExecSpec) -> ExecResult:
        return await self.exec_wait(sandbox_id, await self.exec_start(sandbox_id, spec))

    async def exec_stdin(self, sandbox_id: str, exec_id: str, data: bytes, eof: bool) -> None:
        ex = self._exec(sandbox_id, exec_id)
        if ex.proc.stdin is None:
            raise errors.BadRequest("stdin not open")
        if data:
            ex.proc.stdin.write(data)
            await ex.proc.stdin.drain()
        if eof:
            ex.proc.stdin.close()

    async def exec_kill(self, sandbox_id: str, exec_id: str, signal_: int) -> None:
        ex = self._exec(sandbox_id, exec_id)
        if ex.proc.returncode is None:
            os.killpg(ex.proc.pid, signal_)

    async def exec_list(self, sandbox_id: str) -> list[ExecInfo]:
        return [ExecInfo(exec_id=e.exec_id, cmd=e.spec.cmd,
                         state="exited" if e.done.is_set() else "running",
                         started_at=e.started_at,
                         exit_code=e.result.exit_code if e.result else None,
                         background=e.spec.background)
                for e in self._sb(sandbox_id).execs.values()]

    async def file_read(self, sandbox_id: str, path: str, max_bytes: int) -> bytes:
        p = self._path(sandbox_id, path)
        if not p.is_file():
            raise errors.NotFound(f"no file {path}")
        return p.read_bytes()[:max_bytes]

    async def file_write(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        p = self._path(sandbox_id, path)
        p.write_bytes(data)
        p.chmod(mode)

    async def file_read_stream(self, sandbox_id: str, path: str, max_bytes: int,
                               offset: int = 0) -> AsyncIterator[bytes]:
        data = (await self.file_read(sandbox_id, path, max_bytes))[offset:]
        for i in range(0, len(data), 65536):
            yield data[i:i + 65536]

    async def file_write_stream(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes],
                                mode: int, max_bytes: int) -> int:
        data = b"".join([c async for c in chunks])
        await self.file_write(sandbox_id, path, data, mode)
        return len(data)

    def _stat(self, p: Path, path: str) -> FileStat:
        st = p.lstat()
        kind = "dir" if p.is_dir() else "symlink" if p.is_symlink() else "file"
        return FileStat(path=path, name=p.name, type=kind, size=st.st_size,
                        mode=st.st_mode & 0o7777, mtime=st.st_mtime, uid=st.st_uid,
                        gid=st.st_gid)

    async def file_stat(self, sandbox_id: str, path: str) -> FileStat:
        p = self._path(sandbox_id, path)
        if not p.exists():
            raise errors.NotFound(f"no file {path}")
        return self._stat(p, path)

    async def file_list(self, sandbox_id: str, path: str) -> list[FileStat]:
        p = self._path(sandbox_id, path)
        if not p.is_dir():
            raise errors.NotFound(f"no dir {path}")
        return [self._stat(c, path.rstrip("/") + "/" + c.name) for c in sorted(p.iterdir())]

    async def file_mkdir(self, sandbox_id: str, path: str, parents: bool) -> None:
        self._path(sandbox_id, path).mkdir(parents=parents, exist_ok=parents)

    async def file_remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        p = self._path(sandbox_id, path)
        if not p.exists():
            raise errors.NotFound(f"no file {path}")
        if p.is_dir():
            if not recursive:
                raise errors.BadRequest("is a directory")
            shutil.rmtree(p)
        else:
            p.unlink()

    async def upload_tar(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes]) -> int:
        dest = self._path(sandbox_id, path)
        dest.mkdir(parents=True, exist_ok=True)
        self.upload_chunks = []
        total = 0
        with tempfile.TemporaryFile() as f:
            async for chunk in chunks:
                self.upload_chunks.append(len(chunk))
                self.upload_first_chunk.set()
                total += len(chunk)
                f.write(chunk)
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r|*") as tf:
                tf.extractall(dest, filter="data")
        return total

    async def download_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        src = self._path(sandbox_id, path)
        if not src.exists():
            raise errors.NotFound(f"no path {path}")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            tf.add(src, arcname=".")
        data = buf.getvalue()
        for i in range(0, len(data), 65536):
            yield data[i:i + 65536]

    async def events(self, sandbox_id: str, after_seq: int, follow: bool
                     ) -> AsyncIterator[Event]:
        if self.event_log is not None:
            async for ev in self.event_log.stream(sandbox_id, after_seq, follow):
                yield ev

    async def record_event(self, sandbox_id: str, kind: str, data: str) -> None:
        self._log(sandbox_id, kind, data=data)

    async def close(self) -> None:
        for sid in list(self.sandboxes):
            await self.delete(sid)


def with_contextless_kill(pgid: int) -> None:
    """Kill anything the command left in its process group (tests must not leak processes)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class ApiStack:
    """Edge(s) + placement + event log + key store + the api app, served by a real uvicorn on
    loopback, or (``serve=False``) called in-process by SDK clients through ASGITransport (the
    stack runs the app's lifespan, as the server would)."""

    def __init__(self, tmp: Path, nodes: tuple[str, ...] = ("n0",), max_sandboxes: int = 1000,
                 per_sandbox_bytes: int = 16 << 20, *, serve: bool = True,
                 leases: bool = False, ledger: bool = False) -> None:
        from rollbox.iam import SQLiteLedger

        self.events = EventLog(tmp / "events.db", per_sandbox_bytes=per_sandbox_bytes)
        self.edges = [FakeEdge(n, tmp / "sb" / n, max_sandboxes, self.events) for n in nodes]
        self.placement = placement_over(self.edges)
        self.keys = KeyStore(tmp / "keys.db")
        self.ledger = SQLiteLedger.of(self.keys) if ledger else None
        self.key_a = self.keys.create("proj-a")
        self.key_b = self.keys.create("proj-b")
        self.admin_key = self.keys.create("ops", admin=True)
        self.leases = SqliteLeaseStore(tmp / "leases.db") if leases else None
        self.app = create_app(self.placement, self.keys, leases=self.leases,
                              ledger=self.ledger, front_doors=FRONT_DOORS)
        self.server = BackgroundServer(self.app) if serve else None
        self.lifespan = None if serve else Lifespan(self.app)
        self.url = ""

    async def poll(self) -> None:
        """A probe round of the placement's watcher now: what it decides from changes at the
        next probe (every second), e.g. a node that refused a create is skipped until then."""
        await poll(self.placement)

    def client(self, api_key: str, **kw: Any) -> rollbox.AsyncClient:
        """An SDK client of this stack: over HTTP to the server, or in-process."""
        if self.server is not None:
            return rollbox.AsyncClient(self.url, api_key, **kw)
        return rollbox.AsyncClient(api_key=api_key, **kw,
                                   transport=ASGITransport(self.app, lifespan=False))

    async def __aenter__(self) -> ApiStack:
        if self.server is not None:
            self.url = await self.server.start()
        elif self.lifespan is not None:
            await self.lifespan.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.server is not None:
                await self.server.stop()
            elif self.lifespan is not None:
                await self.lifespan.__aexit__(*exc)
        finally:
            await self.close()

    async def close(self) -> None:
        """The edges (their sandboxes) and stores; the app is the caller's business."""
        for e in self.edges:
            await e.close()
        self.events.close()
        if self.ledger is not None:
            self.ledger.close()
        self.keys.close()
        if self.leases is not None:
            self.leases.close()
