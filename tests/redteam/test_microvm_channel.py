"""Red team F40: a guest that floods, garbles or stalls the agent channel, or answers for another
session. A microVM's guest root owns its agent, so everything on the virtio-serial port may be
the attacker's bytes. Two ends are attacked:

- a fake guest end: the test plays QEMU's side of the port (the unix socket the host's
  ``AgentChannel.connect_stream`` connects to) and sends what a hostile guest could: garbage
  instead of SYNC, a frame header claiming gigabytes, output past the limit the host asked for,
  exits of sessions it was never given, nothing at all. The host must end that channel with a
  typed error, without buffering what the guest claims, and other channels must not notice;
- a real guest (``microvm_slow``, and one case in the default tier): root in the guest freezes
  its own agent or kills its kernel; the host answers with typed errors in bounded time, tears
  the VM down completely and the neighbour VM keeps working.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from rollbox.agent import protocol as P
from rollbox.agent.channel import HUNT_MAX, AgentChannel
from rollbox.errors import AgentProtocolError, InfraError, RollboxError

Behaviour = Callable[["FakeGuest", socket.socket], Awaitable[None]]


class FakeGuest:
    """QEMU's end of an agent port, speaking as a guest: answers HELLO with SYNC + READY and
    LIST with no sessions (like a fresh agent), then runs ``behaviour``. Counts what it managed
    to send and whether the host hung up on it."""

    def __init__(self, path: Path, behaviour: Behaviour) -> None:
        self.path = path
        self.behaviour = behaviour
        self.sent = 0
        self.hung_up = asyncio.Event()
        self.requests: list[tuple[int, int, bytes]] = []  # (type, session, payload) received
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(str(path))
        self._srv.listen(1)
        self._srv.setblocking(False)
        self._task: asyncio.Task[None] | None = None
        self._rx = bytearray()

    async def __aenter__(self) -> FakeGuest:
        self._task = asyncio.ensure_future(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await self._task
        self._srv.close()

    async def send(self, conn: socket.socket, data: bytes) -> bool:
        """False once the host closed the connection."""
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(conn, data)
        except (BrokenPipeError, ConnectionResetError):
            self.hung_up.set()
            return False
        self.sent += len(data)
        return True

    async def recv_packet(self, conn: socket.socket) -> tuple[int, int, bytes]:
        loop = asyncio.get_running_loop()
        while True:
            if len(self._rx) >= 4:
                (n,) = P.FRAME_LEN.unpack_from(self._rx)
                if len(self._rx) >= 4 + n:
                    packet = bytes(self._rx[4:4 + n])
                    del self._rx[:4 + n]
                    t, _, sid, payload = P.unpack(packet)
                    self.requests.append((t, sid, payload))
                    return t, sid, payload
            data = await loop.sock_recv(conn, 1 << 16)
            if not data:
                self.hung_up.set()
                raise ConnectionResetError
            self._rx += data

    async def handshake(self, conn: socket.socket) -> None:
        while True:
            t, _, payload = await self.recv_packet(conn)
            if t == P.HELLO:
                nonce = payload[len(P.HELLO_MAGIC):]
                await self.send(conn, P.frame(P.pack(P.SYNC, 0, P.SYNC_MAGIC + nonce))
                                + P.frame(P.pack(P.READY, 0, P.U32.pack(P.PROTOCOL_VERSION))))
            elif t == P.LIST:
                await self.send(conn, P.frame(P.pack(P.SESSIONS, 0, P.U32.pack(0))))
                return

    async def next_exec(self, conn: socket.socket) -> int:
        """The session id of the host's next EXEC (answered STARTED)."""
        while True:
            t, sid, _ = await self.recv_packet(conn)
            if t == P.EXEC:
                await self.send(conn, P.frame(P.pack(P.STARTED, sid, P.I32.pack(100 + sid))))
                return sid

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(self._srv)
        conn.setblocking(False)
        try:
            await self.behaviour(self, conn)
            # then stay silent, and notice when the host hangs up
            while await loop.sock_recv(conn, 1 << 16):
                pass
            self.hung_up.set()
        except (ConnectionResetError, BrokenPipeError):
            self.hung_up.set()
        finally:
            conn.close()


@pytest.fixture
def sock_dir() -> AsyncIterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rbx-f40-") as d:
        yield Path(d)


def exited(code: int) -> bytes:
    return P.EXITED_BODY.pack(code, 0, 0, 0, 0, 0, 0, 0)


def true_request(stream_limit: int = 1 << 20) -> P.ExecRequest:
    return P.ExecRequest(argv=["true"], env=[], stream_limit=stream_limit)


async def well_behaved(g: FakeGuest, conn: socket.socket) -> None:
    await g.handshake(conn)
    while True:  # every exec exits 0 at once; pings are answered
        t, sid, _ = await g.recv_packet(conn)
        if t == P.EXEC:
            await g.send(conn, P.frame(P.pack(P.STARTED, sid, P.I32.pack(7)))
                         + P.frame(P.pack(P.EXITED, sid, exited(0))))
        elif t == P.PING:
            await g.send(conn, P.frame(P.pack(P.PONG, sid)))


@contextlib.asynccontextmanager
async def neighbour(sock_dir: Path) -> AsyncIterator[AgentChannel]:
    """A second, well-behaved VM's channel: must keep working whatever the first guest does."""
    async with FakeGuest(sock_dir / "neighbour.sock", well_behaved):
        ch = await AgentChannel.connect_stream(str(sock_dir / "neighbour.sock"), timeout=5)
        try:
            yield ch
        finally:
            ch.close()


async def neighbour_fine(ch: AgentChannel) -> None:
    await ch.ping(timeout=2)
    sess = await ch.exec(true_request())
    assert (await asyncio.wait_for(sess.wait(), 5)).exit_code == 0


async def test_f40_garbage_instead_of_sync_is_dropped_bounded(sock_dir: Path) -> None:
    async def garbage(g: FakeGuest, conn: socket.socket) -> None:
        await g.recv_packet(conn)  # the host's HELLO
        chunk = os.urandom(1 << 20)
        for _ in range(64):  # 64 MiB unless the host hangs up first
            if not await g.send(conn, chunk):
                return

    async with neighbour(sock_dir) as other, FakeGuest(sock_dir / "a.sock", garbage) as g:
        t0 = time.monotonic()
        with pytest.raises(InfraError):
            await AgentChannel.connect_stream(str(sock_dir / "a.sock"), timeout=20)
        assert time.monotonic() - t0 < 20
        await asyncio.wait_for(g.hung_up.wait(), 5)
        # The host stopped reading after its hunt bound, not at the end of what the guest had.
        assert g.sent < HUNT_MAX + (16 << 20), g.sent
        await neighbour_fine(other)


async def test_f40_frame_claiming_gigabytes_ends_the_channel_at_once(sock_dir: Path) -> None:
    async def huge_frame(g: FakeGuest, conn: socket.socket) -> None:
        await g.handshake(conn)
        await g.next_exec(conn)
        # 4 GiB - 1 announced; only a few bytes follow. The host must not wait for (or
        # allocate) the rest.
        await g.send(conn, P.FRAME_LEN.pack(0xFFFFFFFF) + P.pack(P.STDOUT, 1, b"x" * 64))

    async with neighbour(sock_dir) as other, FakeGuest(sock_dir / "a.sock", huge_frame) as g:
        ch = await AgentChannel.connect_stream(str(sock_dir / "a.sock"), timeout=5)
        sess = await ch.exec(true_request())
        with pytest.raises(AgentProtocolError):
            await asyncio.wait_for(sess.wait(), 5)
        assert ch.closed.done()
        with pytest.raises(RollboxError):
            await ch.exec(true_request())  # typed, not a hang
        await asyncio.wait_for(g.hung_up.wait(), 5)
        await neighbour_fine(other)


async def test_f40_garbled_frames_end_the_channel(sock_dir: Path) -> None:
    cases = {
        "short": P.FRAME_LEN.pack(3) + b"abc",  # shorter than a header
        "unknown type": P.frame(P.pack(250, 0, b"?")),
        "truncated exit": P.frame(P.pack(P.EXITED, 1, b"\x00\x01")),
    }
    for name, bad in cases.items():
        async def garble(g: FakeGuest, conn: socket.socket, bad: bytes = bad) -> None:
            await g.handshake(conn)
            await g.next_exec(conn)
            await g.send(conn, bad)

        path = sock_dir / f"{name.replace(' ', '-')}.sock"
        async with FakeGuest(path, garble):
            ch = await AgentChannel.connect_stream(str(path), timeout=5)
            sess = await ch.exec(true_request())
            with pytest.raises(AgentProtocolError):
                await asyncio.wait_for(sess.wait(), 5)
            assert ch.closed.done(), name


async def test_f40_output_flood_past_the_limit(sock_dir: Path) -> None:
    async def flood(g: FakeGuest, conn: socket.socket) -> None:
        await g.handshake(conn)
        sid = await g.next_exec(conn)
        chunk = P.frame(P.pack(P.STDOUT, sid, b"y" * P.CHUNK))
        for _ in range(1024):  # 64 MiB for a session that asked for at most 1 MiB
            if not await g.send(conn, chunk):
                return

    async with neighbour(sock_dir) as other, FakeGuest(sock_dir / "a.sock", flood) as g:
        ch = await AgentChannel.connect_stream(str(sock_dir / "a.sock"), timeout=5)
        sess = await ch.exec(true_request(stream_limit=1 << 20))
        got = 0
        with pytest.raises(AgentProtocolError):
            async for kind, data in sess.events():
                if kind == "stdout":
                    got += len(data)
        assert got <= 1 << 20  # nothing past the limit reached the consumer
        await asyncio.wait_for(g.hung_up.wait(), 5)
        assert g.sent < 48 << 20, g.sent  # cut off, not drained to the end
        await neighbour_fine(other)


async def test_f40_answers_for_another_session(sock_dir: Path) -> None:
    forged, checked = asyncio.Event(), asyncio.Event()

    async def impersonate(g: FakeGuest, conn: socket.socket) -> None:
        await g.handshake(conn)
        await g.next_exec(conn)
        b = await g.next_exec(conn)
        # An exit for b reported under a session id the host never used, and stdout for a
        # session that does not exist: neither may reach a or b.
        await g.send(conn, P.frame(P.pack(P.EXITED, b + 1000, exited(0)))
                     + P.frame(P.pack(P.STDOUT, b + 1001, b"forged output")))
        forged.set()
        await checked.wait()
        # Then a flood of exits for unknown sessions: held only up to a bound.
        for k in range(64):
            batch = b"".join(P.frame(P.pack(P.EXITED, 10_000 + 256 * k + i, exited(0)))
                             for i in range(256))
            if not await g.send(conn, batch):
                return

    async with FakeGuest(sock_dir / "a.sock", impersonate) as g:
        ch = await AgentChannel.connect_stream(str(sock_dir / "a.sock"), timeout=5)
        sa = await ch.exec(true_request())
        sb = await ch.exec(true_request())
        await asyncio.wait_for(forged.wait(), 5)
        await asyncio.sleep(0.2)
        # The forged exit and output went to no running session of the host.
        assert not sa.done and not sb.done and not ch.closed.done()
        checked.set()
        with pytest.raises(AgentProtocolError):  # 16,384 unknown exits: past the bound
            await asyncio.wait_for(sa.wait(), 10)
        await asyncio.wait_for(g.hung_up.wait(), 5)


async def test_f40_silent_guest_is_a_typed_timeout(sock_dir: Path) -> None:
    async def stall_after_ready(g: FakeGuest, conn: socket.socket) -> None:
        await g.handshake(conn)  # then never answers anything

    async def never_syncs(g: FakeGuest, conn: socket.socket) -> None:
        return  # reads nothing, sends nothing

    async with neighbour(sock_dir) as other:
        async with FakeGuest(sock_dir / "a.sock", stall_after_ready):
            ch = await AgentChannel.connect_stream(str(sock_dir / "a.sock"), timeout=5)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await ch.ping(timeout=1)
            assert time.monotonic() - t0 < 3
            ch.close()
        async with FakeGuest(sock_dir / "b.sock", never_syncs):
            t0 = time.monotonic()
            with pytest.raises(InfraError):
                await AgentChannel.connect_stream(str(sock_dir / "b.sock"), timeout=2)
            assert time.monotonic() - t0 < 4
        await neighbour_fine(other)
