"""E2B's directory watch (envd's ``WatchDir`` and ``CreateWatcher``/``GetWatcherEvents``) on an
inotify watch inside the sandbox.

Owns: starting the agent's built-in ``rollbox-watch`` tool as a platform process of the sandbox
(``EdgeAPI.platform_exec``: run in the sandbox's own root, container and microVM alike, so the
watched path resolves there and no symlink or magic link below it is followed), parsing its
records (hostile input: the tool runs in the sandbox), turning inotify masks into envd's event
types (as envd's fsnotify reports them: create, write, remove, rename, chmod), a bounded queue of
events between reads, and the barrier a poll (``GetWatcherEvents``) uses so that it returns every
event of the writes that returned before it. The watch ends with the sandbox (the tool is one of
its processes) or when its directory goes. The sync watchers' table (``SyncWatchers``: ids,
caps, and their drop once their sandbox is gone).

Must not touch: the edge's file operations, the agent protocol (the tool is an argv of
EXEC_PLATFORM_TOOL), anything of the sandbox besides reading the events.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollbox import errors
from rollbox.agent.protocol import ExecRequest
from rollbox.compat.e2b import connectrpc as rpc
from rollbox.edge.interface import EdgeAPI, PlatformProcess
from rollbox.hostfs import TMP_PREFIX  # a write's temp file, renamed into place

WATCH_TOOL = "rollbox-watch"  # agent.c: a platform tool built into the agent
RECORD = struct.Struct("<2sIIH")  # b"WE"/b"WS", inotify mask, cookie, path length
QUEUE_MAX = 10_000  # events held between two polls; past it the watch fails (events lost)
MAX_WATCHERS = 4096  # sync watchers (CreateWatcher) held, all sandboxes
MAX_WATCHERS_PER_SANDBOX = 64
GONE_STATES = ("stopping", "dead", "deleted")  # a sandbox's watchers can never be polled again
START_TIMEOUT_S = 30.0
BARRIER_TIMEOUT_S = 10.0

IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
IN_Q_OVERFLOW = 0x4000


def event_types(mask: int) -> list[str]:
    """envd's event types for one inotify event (fsnotify's mapping)."""
    out = []
    if mask & (IN_CREATE | IN_MOVED_TO):
        out.append("EVENT_TYPE_CREATE")
    if mask & IN_MODIFY:
        out.append("EVENT_TYPE_WRITE")
    if mask & (IN_DELETE | IN_DELETE_SELF):
        out.append("EVENT_TYPE_REMOVE")
    if mask & (IN_MOVED_FROM | IN_MOVE_SELF):
        out.append("EVENT_TYPE_RENAME")
    if mask & IN_ATTRIB:
        out.append("EVENT_TYPE_CHMOD")
    return out


class Parser:
    """The tool's byte stream -> ("event", mask, cookie, name) | ("sync", 0, 0, "")."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[str, int, int, str]]:
        self._buf += data
        out = []
        while len(self._buf) >= RECORD.size:
            kind, mask, cookie, n = RECORD.unpack_from(self._buf)
            if kind not in (b"WE", b"WS"):
                raise errors.InfraError("the sandbox's watch sent a malformed record")
            if len(self._buf) < RECORD.size + n:
                break
            name = bytes(self._buf[RECORD.size:RECORD.size + n]).decode(errors="replace")
            del self._buf[:RECORD.size + n]
            out.append(("event" if kind == b"WE" else "sync", mask, cookie, name))
        return out


class Translator:
    """inotify events -> envd's. A file the platform writes (E2B's ``files.write``) is written
    as a temp file renamed over its name: its temp name is never reported, and its arrival is
    the file's create and write (what envd's own write reports, besides the chown's chmod)."""

    def __init__(self) -> None:
        self._tmp_cookies: deque[int] = deque(maxlen=64)

    def events(self, mask: int, cookie: int, name: str) -> list[dict[str, Any]]:
        if posixpath.basename(name).startswith(TMP_PREFIX):
            if mask & IN_MOVED_FROM and cookie:
                self._tmp_cookies.append(cookie)
            return []
        if mask & IN_MOVED_TO and cookie and cookie in self._tmp_cookies:
            self._tmp_cookies.remove(cookie)
            types = ["EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE"]
        else:
            types = event_types(mask)
        return [{"name": name, "type": t} for t in types]


class InotifyWatch:
    """One watch: the tool's process, its events queued (bounded) until read."""

    def __init__(self, sid: str, path: str, recursive: bool, include_entry: bool,
                 on_end: Callable[[InotifyWatch], None] | None = None) -> None:
        """``on_end``: called once when the tool's process has ended (the sandbox went, or
        the directory), not when :meth:`close` ends it."""
        self.sid, self.path, self.recursive, self.include_entry = sid, path, recursive, include_entry
        self._on_end = on_end
        self._proc: PlatformProcess | None = None
        self._reader: asyncio.Task[None] | None = None
        self._events: deque[dict[str, Any]] = deque()
        self._changed = asyncio.Event()
        self._syncs = 0
        self._ended: BaseException | None = None
        self._done = False

    async def start(self, edge: EdgeAPI) -> None:
        argv = [WATCH_TOOL, *(["-r"] if self.recursive else []), self.path]
        req = ExecRequest(argv=argv, env=[], cwd="/", stdin=True, stream_limit=1 << 62,
                          tail_limit=0, platform_tool=True, tool_in_sandbox=True)
        self._proc = await edge.platform_exec(self.sid, req)
        self._reader = asyncio.create_task(self._read(self._proc))
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await self._wait(lambda: self._syncs >= 1)
        except BaseException:
            await self.close()
            raise
        if self._done and self._ended is not None:
            await self.close()
            raise self._ended

    async def _wait(self, ready: Any) -> None:
        while not ready() and not self._done:
            self._changed.clear()
            await self._changed.wait()

    def _push(self, ev: dict[str, Any]) -> None:
        if len(self._events) >= QUEUE_MAX:
            self._ended = rpc.ConnectError(
                "resource_exhausted", f"more than {QUEUE_MAX} unread watch events: events lost")
            self._done = True
            return
        self._events.append(ev)

    async def _read(self, proc: PlatformProcess) -> None:
        parser, tr, stderr = Parser(), Translator(), b""
        try:
            async for kind, payload in proc.events():
                if kind == "stdout":
                    for rec, mask, cookie, name in parser.feed(bytes(payload)):
                        if rec == "sync":
                            self._syncs += 1
                        elif mask & IN_Q_OVERFLOW:
                            self._ended = rpc.ConnectError(
                                "resource_exhausted", "the sandbox's watch queue overflowed: "
                                "events lost")
                            self._done = True
                        else:
                            for ev in tr.events(mask, cookie, name):
                                self._push(ev)
                        if self._done:
                            return
                        self._changed.set()
                elif kind == "stderr":
                    stderr = (stderr + bytes(payload))[-500:]
                elif kind == "exited":
                    if payload.exit_code != 0 and self._syncs == 0:
                        text = stderr.decode(errors="replace").strip()
                        self._ended = errors.NotFound(text or f"can not watch {self.path}")
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the watch ends with the reason
            self._ended = exc
        finally:
            self._done = True
            self._changed.set()
        if self._on_end is not None:
            self._on_end(self)

    async def poll(self) -> list[dict[str, Any]]:
        """Every event so far, including those of writes that returned before this call (a
        barrier through the tool: it drains inotify's queue before it answers)."""
        if not self._done and self._proc is not None:
            want = self._syncs + 1
            with contextlib.suppress(errors.RollboxError):
                await self._proc.write_stdin(b"s")
                async with asyncio.timeout(BARRIER_TIMEOUT_S):
                    await self._wait(lambda: self._syncs >= want)
        if isinstance(self._ended, rpc.ConnectError):  # events were lost: say so at once
            self._events.clear()
            raise self._ended
        out = list(self._events)
        self._events.clear()
        if not out and self._done and self._ended is not None:
            raise self._ended
        return out

    async def stream(self) -> AsyncIterator[list[dict[str, Any]]]:
        """Events as they arrive, in batches; ends when the watch does (its directory went,
        or the sandbox), raising what ended it."""
        while True:
            if isinstance(self._ended, rpc.ConnectError):
                raise self._ended
            if self._events:
                out = list(self._events)
                self._events.clear()
                yield out
                continue
            if self._done:
                if self._ended is not None and not isinstance(self._ended, errors.NotFound):
                    raise self._ended
                return
            self._changed.clear()
            await self._changed.wait()

    async def close(self) -> None:
        if self._proc is not None and not self._done:
            with contextlib.suppress(errors.RollboxError, OSError):
                await self._proc.kill()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        self._done = True


class SyncWatchers:
    """envd's sync watchers (``CreateWatcher`` / ``GetWatcherEvents`` / ``RemoveWatcher``):
    watcher id -> watch, at most ``MAX_WATCHERS`` in all and ``MAX_WATCHERS_PER_SANDBOX`` per
    sandbox (past either the oldest goes). When a watch's tool ends and its sandbox is gone
    (deleted by any path: E2B's kill, rollbox's API, its TTL; or dead), every watcher of that
    sandbox goes at once, its queued events too, instead of lingering until the caps push it
    out: none can be polled again. A watcher whose directory went stays (its sandbox's client
    can still poll and remove it). ``edge_for``: the edge of a sandbox id (``Placement.edge_for``)."""

    def __init__(self, edge_for: Callable[[str], EdgeAPI]) -> None:
        self._edge_for = edge_for
        self._watches: dict[str, InotifyWatch] = {}
        self._checks: set[asyncio.Task[None]] = set()  # _drop_if_gone runs, held until done

    def ids_of(self, sid: str) -> list[str]:
        return [wid for wid, w in self._watches.items() if w.sid == sid]

    async def add(self, w: InotifyWatch, edge: EdgeAPI) -> str:
        """Start ``w`` (made with ``on_end=self.ended``) and hold it; its new id."""
        mine = self.ids_of(w.sid)
        for wid in mine[:max(0, len(mine) - MAX_WATCHERS_PER_SANDBOX + 1)]:
            await self.remove(wid)  # the oldest a client never removed
        while len(self._watches) >= MAX_WATCHERS:
            await self.remove(next(iter(self._watches)))
        await w.start(edge)
        wid = f"w{time.monotonic_ns():x}"
        self._watches[wid] = w
        return wid

    def get(self, sid: str, wid: str) -> InotifyWatch:
        w = self._watches.get(wid)
        if w is None or w.sid != sid:
            raise rpc.ConnectError("not_found", f"watcher {wid!r} not found")
        return w

    async def remove(self, wid: str) -> None:
        w = self._watches.pop(wid, None)
        if w is not None:
            await w.close()

    def ended(self, w: InotifyWatch) -> None:
        """A watch's tool ended (its ``on_end``): check its sandbox in the background."""
        task = asyncio.get_running_loop().create_task(self._drop_if_gone(w.sid))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _drop_if_gone(self, sid: str) -> None:
        try:
            gone = (await self._edge_for(sid).get(sid)).state in GONE_STATES
        except errors.NotFound:
            gone = True
        except errors.RollboxError:  # not known now: left to the caps
            return
        if gone:
            for wid in self.ids_of(sid):
                await self.remove(wid)
