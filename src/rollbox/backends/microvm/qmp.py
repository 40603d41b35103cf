"""A small asyncio QMP client (QEMU Machine Protocol) for one VM's monitor socket.

QMP is JSON objects, one per line: a greeting, then ``qmp_capabilities``, then commands, each
answered by ``{"return": ...}`` or ``{"error": ...}`` carrying the command's ``id``;
asynchronous ``{"event": ...}`` lines come in between. QEMU is jailed but runs guest-facing
device emulation, so its answers are parsed as hostile: lines are capped, non-objects refused,
and a connection is used for one operation batch (connect, commands, close) under the VM's
lock; the monitor's listening socket accepts one client at a time.

``getfd`` passes a descriptor with SCM_RIGHTS (restore/save with ``spawn=deny``: QEMU can not
``exec:`` a helper, so migration streams go through an fd the edge opened).

Owns the wire protocol; does not decide when a VM is stopped or squeezed (``backend.py``,
``balloon.py``).
"""
from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from rollbox.errors import InfraError

MAX_LINE = 1 << 20
MAX_EVENTS = 256


class QMPError(InfraError):
    """QEMU refused a command (its ``error.class`` and ``desc`` in the message)."""


class QMP:
    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout
        self.events: list[dict[str, Any]] = []
        self._buf = b""
        self._next_id = 0

    @classmethod
    async def connect(cls, path: str | Path, timeout: float = 10.0) -> QMP:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, str(path))
            q = cls(sock, timeout)
            greeting = await q._read()
            for _ in range(MAX_EVENTS):  # an event QEMU queued as this client connected
                if "event" not in greeting:
                    break
                greeting = await q._read()
            if "QMP" not in greeting:
                # the keys only (QEMU's words are guest-influenced): what came instead
                raise InfraError(f"QMP: no greeting (got keys {sorted(greeting)[:5]})")
            await q.execute("qmp_capabilities")
            return q
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            raise InfraError(f"QMP at {Path(path).name} unreachable: {exc!r}") from exc
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    async def _read(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                raise InfraError("QMP: line too long")
            async with asyncio.timeout(self.timeout):
                chunk = await loop.sock_recv(self.sock, 65536)
            if not chunk:
                raise InfraError("QMP: connection closed")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            msg = json.loads(line)
        except ValueError as exc:
            raise InfraError("QMP: malformed answer") from exc
        if not isinstance(msg, dict):
            raise InfraError("QMP: malformed answer")
        return msg

    async def execute(self, command: str, arguments: dict[str, Any] | None = None, *,
                      fd: int | None = None) -> Any:
        """Run one command; returns its ``return`` value, raises QMPError on ``error``."""
        self._next_id += 1
        ident = f"rb{self._next_id}"
        msg: dict[str, Any] = {"execute": command, "id": ident}
        if arguments:
            msg["arguments"] = arguments
        data = json.dumps(msg).encode() + b"\n"
        loop = asyncio.get_running_loop()
        if fd is None:
            async with asyncio.timeout(self.timeout):
                await loop.sock_sendall(self.sock, data)
        else:
            await self._send_with_fd(data, fd)
        while True:
            answer = await self._read()
            if "event" in answer:
                if len(self.events) < MAX_EVENTS:
                    self.events.append(answer)
                continue
            if answer.get("id") != ident:
                continue  # an answer to nobody (a guest-driven QEMU could send anything)
            if "error" in answer:
                err = answer["error"] if isinstance(answer["error"], dict) else {}
                raise QMPError(f"QMP {command}: {str(err.get('class'))[:100]}: "
                               f"{str(err.get('desc'))[:500]}")
            return answer.get("return")

    async def _send_with_fd(self, data: bytes, fd: int) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def try_send() -> None:
            if fut.done():
                return
            try:
                socket.send_fds(self.sock, [data], [fd])
            except BlockingIOError:
                return
            except OSError as exc:
                fut.set_exception(exc)
                return
            fut.set_result(None)

        loop.add_writer(self.sock.fileno(), try_send)
        try:
            async with asyncio.timeout(self.timeout):
                await fut
        finally:
            loop.remove_writer(self.sock.fileno())

    # ---- the commands rollbox uses ------------------------------------------------------
    async def status(self) -> str:
        ret = await self.execute("query-status")
        return str(ret.get("status", "")) if isinstance(ret, dict) else ""

    async def stop(self) -> None:
        await self.execute("stop")

    async def cont(self) -> None:
        await self.execute("cont")

    async def quit(self) -> None:
        try:
            await self.execute("quit")
        except InfraError:
            pass  # QEMU may close the socket before answering

    async def balloon(self, target_bytes: int) -> None:
        """Set the guest's memory target (the balloon inflates to reach it)."""
        await self.execute("balloon", {"value": int(target_bytes)})

    async def query_balloon(self) -> int:
        """The guest's current memory size in bytes as the balloon driver reports it."""
        ret = await self.execute("query-balloon")
        return int(ret.get("actual", 0)) if isinstance(ret, dict) else 0

    async def getfd(self, fd: int, name: str) -> None:
        await self.execute("getfd", {"fdname": name}, fd=fd)

    async def migrate(self, uri: str) -> None:
        await self.execute("migrate", {"uri": uri})

    async def migrate_incoming(self, uri: str) -> None:
        await self.execute("migrate-incoming", {"uri": uri})

    async def ignore_shared_ram(self) -> None:
        """Migrations leave out RAM that is a shared named file (a template's RAM file: the
        stream carries the devices; both the save and the restore set it)."""
        await self.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "x-ignore-shared", "state": True}]})

    async def query_migrate(self) -> dict[str, Any]:
        ret = await self.execute("query-migrate")
        return ret if isinstance(ret, dict) else {}


@asynccontextmanager
async def session(path: str | Path, timeout: float = 10.0) -> AsyncIterator[QMP]:
    """One QMP connection for a batch of commands."""
    async with connected(await QMP.connect(path, timeout)) as q:
        yield q


@asynccontextmanager
async def connected(q: QMP) -> AsyncIterator[QMP]:
    """A batch on a connection made earlier (a spare QEMU's), closed at the end."""
    try:
        yield q
    finally:
        q.close()
