"""The stream transport of AgentChannel against a scripted peer (a socketpair standing in for
a guest's agent): handshake, frames split anywhere, and every kind of hostile input, each
closing the channel with AgentProtocolError or SandboxDead and never more than bounded memory.
The real agent on both ends is in tests/integration/test_agent_stream.py and test_guest_vm.py.
"""
from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from rollbox.agent import channel as C
from rollbox.agent import protocol as P
from rollbox.agent.channel import AgentChannel
from rollbox.errors import AgentProtocolError, SandboxDead


@dataclass
class Peer:
    """The guest's end: reads what the channel sends, writes whatever a test wants."""

    sock: socket.socket
    buf: bytearray

    async def read_frame(self) -> bytes:
        loop = asyncio.get_running_loop()
        while True:
            if len(self.buf) >= 4:
                n = P.FRAME_LEN.unpack_from(self.buf)[0]
                if len(self.buf) >= 4 + n:
                    pkt = bytes(self.buf[4:4 + n])
                    del self.buf[:4 + n]
                    return pkt
            data = await loop.sock_recv(self.sock, 65536)
            assert data, "channel closed"
            self.buf += data

    async def write(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def handshake(self, stale: bytes = b"") -> None:
        """Answer the channel's HELLO as the agent does: SYNC, READY, then SESSIONS."""
        hello = await self.read_frame()
        msg, _, _, payload = P.unpack(hello)
        assert msg == P.HELLO and payload[:16] == P.HELLO_MAGIC
        nonce = payload[16:]
        await self.write(stale + P.frame(P.pack(P.SYNC, 0, P.SYNC_MAGIC + nonce))
                         + P.frame(P.pack(P.READY, 0, P.U32.pack(P.PROTOCOL_VERSION))))
        listing = await self.read_frame()
        assert P.unpack(listing)[0] == P.LIST
        await self.write(P.frame(P.pack(P.SESSIONS, 0, P.U32.pack(0))))


async def open_pair(peer_script=None) -> tuple[AgentChannel, Peer]:  # noqa: ANN001
    """A connected channel over a socketpair whose far end completed the handshake."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    peer = Peer(b, bytearray())

    async def connect() -> AgentChannel:
        # connect_stream opens its own socket; build the same object on our half instead.
        ch = AgentChannel(a, stream_nonce=b"\x01" * P.NONCE_LEN)
        await ch._send_raw(P.hello(b"\x01" * P.NONCE_LEN))
        await asyncio.wait_for(asyncio.shield(ch._ready), 5)
        await asyncio.wait_for(ch.sessions(), 5)
        return ch

    task = asyncio.ensure_future(connect())
    await (peer_script(peer) if peer_script else peer.handshake())
    return await asyncio.wait_for(task, 5), peer


@pytest.fixture
async def pair() -> AsyncIterator[tuple[AgentChannel, Peer]]:
    ch, peer = await open_pair()
    try:
        yield ch, peer
    finally:
        ch.close()
        peer.sock.close()


async def closed_with(ch: AgentChannel) -> BaseException | None:
    return await asyncio.wait_for(asyncio.shield(ch.closed), 5)


async def start(ch: AgentChannel, peer: Peer, req: P.ExecRequest | None = None):  # noqa: ANN201
    """exec() answered STARTED by the peer; returns (session, its id)."""
    task = asyncio.ensure_future(ch.exec(req or P.ExecRequest(argv=["x"], env=[])))
    pkt = await peer.read_frame()
    msg, _, sid, _ = P.unpack(pkt)
    assert msg == P.EXEC
    await peer.write(P.frame(P.pack(P.STARTED, sid, P.I32.pack(42))))
    return await asyncio.wait_for(task, 5), sid


def exited(sid: int, code: int = 0, oom: int = 0) -> bytes:
    body = P.EXITED_BODY.pack(code, 0, 0, oom, 3, 0, 0, 0)
    return P.frame(P.pack(P.EXITED, sid, body))


async def test_stale_bytes_before_sync_are_skipped_and_frames_split_anywhere() -> None:
    async def script(peer: Peer) -> None:
        # An earlier connection's half frame and garbage precede this connection's SYNC.
        await peer.handshake(stale=b"\xff\xff\x00" + P.frame(P.pack(P.STDOUT, 9, b"old"))[:7])

    ch, peer = await open_pair(script)
    try:
        sess, sid = await start(ch, peer)
        data = P.frame(P.pack(P.STDOUT, sid, b"hello ")) + P.frame(P.pack(P.STDOUT, sid, b"vm"))
        data += exited(sid, 7, oom=2)
        for i in range(len(data)):  # one byte per write: every split point of every frame
            await peer.write(data[i:i + 1])
            await asyncio.sleep(0)
        out = [e async for e in sess.events()]
        assert b"".join(v for k, v in out if k == "stdout") == b"hello vm"
        assert out[-1][0] == "exited" and out[-1][1].exit_code == 7
        assert out[-1][1].oom_kills == 2
        assert not ch.closed.done()
    finally:
        ch.close()
        peer.sock.close()


async def test_no_sync_within_the_hunt_bound_is_a_protocol_error(monkeypatch) -> None:
    monkeypatch.setattr(C, "HUNT_MAX", 64 << 10)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    ch = AgentChannel(a, stream_nonce=b"\x02" * P.NONCE_LEN)
    try:
        # A SYNC with another connection's nonce does not count.
        b.send(P.frame(P.pack(P.SYNC, 0, P.SYNC_MAGIC + b"\x03" * P.NONCE_LEN)))
        loop = asyncio.get_running_loop()
        for _ in range(40):
            await loop.sock_sendall(b, b"\x00" * 4096)
            if ch.closed.done():
                break
        err = await closed_with(ch)
        assert isinstance(err, AgentProtocolError) and "no SYNC" in err.message
        assert len(ch._rx) < P.NONCE_LEN + len(P.SYNC_MAGIC)  # nothing but a possible prefix
    finally:
        ch.close()
        b.close()


@pytest.mark.parametrize("length", [0, 3, P.HEADER.size - 1, P.MAX_PACKET + 1, 0xFFFFFFFF])
async def test_a_frame_length_out_of_bounds_closes_the_channel(pair, length: int) -> None:
    ch, peer = pair
    sess, _ = await start(ch, peer)
    await peer.write(P.FRAME_LEN.pack(length) + b"\x00" * 16)
    err = await closed_with(ch)
    assert isinstance(err, AgentProtocolError) and f"frame of {length} bytes" in err.message
    with pytest.raises(AgentProtocolError):
        await sess.wait()  # the session learns why, too


async def test_a_frame_that_does_not_decode_closes_the_channel(pair) -> None:
    ch, peer = pair
    sess, sid = await start(ch, peer)
    await peer.write(P.frame(P.pack(P.EXITED, sid, b"\x01\x02")))  # EXITED of 2 bytes
    err = await closed_with(ch)
    assert isinstance(err, AgentProtocolError) and "malformed" in err.message
    with pytest.raises(AgentProtocolError):
        await sess.wait()


async def test_an_unknown_message_type_closes_the_channel(pair) -> None:
    ch, peer = pair
    await peer.write(P.frame(P.pack(200, 0, b"")))
    assert isinstance(await closed_with(ch), AgentProtocolError)


async def test_a_frame_cut_off_by_the_end_of_the_stream_is_a_dead_sandbox(pair) -> None:
    ch, peer = pair
    sess, sid = await start(ch, peer)
    await peer.write(P.frame(P.pack(P.STDOUT, sid, b"x" * 100))[:50])
    peer.sock.close()
    assert isinstance(await closed_with(ch), SandboxDead)
    with pytest.raises(SandboxDead):
        await sess.wait()


async def test_output_past_the_stream_limit_is_a_flood(pair) -> None:
    ch, peer = pair
    sess, sid = await start(ch, peer, P.ExecRequest(argv=["x"], env=[], stream_limit=100_000))
    chunk = P.frame(P.pack(P.STDOUT, sid, b"y" * 60_000))
    await peer.write(chunk)  # 60,000: within the limit
    await asyncio.sleep(0.05)
    assert not ch.closed.done()
    await peer.write(chunk)  # 120,000 > 100,000: the agent never sends that
    err = await closed_with(ch)
    assert isinstance(err, AgentProtocolError) and "more stdout" in err.message
    # What was queued for the session stays bounded by the limit it asked for.
    queued = 0
    while not sess._queue.empty():
        item = sess._queue.get_nowait()
        if isinstance(item, tuple) and item[0] == "stdout":
            queued += len(item[1])
    assert queued <= 100_000


async def test_tails_past_their_bound_are_a_flood(pair) -> None:
    ch, peer = pair
    _, sid = await start(ch, peer)
    for _ in range(2):
        await peer.write(P.frame(P.pack(P.TAIL_STDERR, sid, b"t" * 40_000)))
    err = await closed_with(ch)
    assert isinstance(err, AgentProtocolError) and "tail_stderr" in err.message


async def test_exits_of_sessions_nobody_started_are_bounded(pair, monkeypatch) -> None:
    monkeypatch.setattr(C, "UNCLAIMED_EXITS_MAX", 100)
    ch, peer = pair
    await peer.write(b"".join(exited(1000 + i) for i in range(100)))
    await asyncio.sleep(0.05)
    assert not ch.closed.done() and len(ch.unclaimed_exits) == 100
    await peer.write(exited(5000))
    err = await closed_with(ch)
    assert isinstance(err, AgentProtocolError) and "unknown exits" in err.message


async def test_output_for_unknown_sessions_is_dropped_not_kept(pair) -> None:
    ch, peer = pair
    await peer.write(b"".join(P.frame(P.pack(P.STDOUT, 777, b"z" * 60_000)) for _ in range(50)))
    _, sid = await start(ch, peer)  # the channel still works, and kept none of it
    assert not ch.closed.done() and sid != 777
    assert len(ch._rx) < P.MAX_PACKET + 4


async def test_a_repeated_sync_is_ignored(pair) -> None:
    ch, peer = pair
    await peer.write(P.frame(P.pack(P.SYNC, 0, P.SYNC_MAGIC + b"\x01" * P.NONCE_LEN))
                     + P.frame(P.pack(P.READY, 0, P.U32.pack(P.PROTOCOL_VERSION))))
    sess, sid = await start(ch, peer)
    await peer.write(exited(sid, 3))
    assert (await sess.wait()).exit_code == 3


async def test_partial_writes_of_a_big_request_keep_the_stream_framed(pair) -> None:
    ch, peer = pair
    sess, sid = await start(ch, peer, P.ExecRequest(argv=["cat"], env=[], stdin=True))
    data = bytes(range(256)) * 1024  # the whole window: four frames, more than one send
    writer = asyncio.ensure_future(sess.write_stdin(data[:P.STDIN_WINDOW]))
    got = bytearray()
    while len(got) < P.STDIN_WINDOW:
        msg, _, fsid, payload = P.unpack(await peer.read_frame())
        assert msg == P.STDIN and fsid == sid and len(payload) <= P.CHUNK
        got += payload
    await writer
    assert bytes(got) == data[:P.STDIN_WINDOW]


async def test_descriptors_are_refused_on_a_stream(pair) -> None:
    from rollbox.errors import BadRequest
    ch, _ = pair
    with pytest.raises(BadRequest):
        await ch.exec(P.ExecRequest(argv=["x"], env=[]), cgroup_fd=0)


async def test_results_of_platform_commands(pair) -> None:
    ch, peer = pair
    task = asyncio.ensure_future(ch.set_hostname("clone-1"))
    msg, _, token, payload = P.unpack(await peer.read_frame())
    assert msg == P.SET_HOSTNAME and payload == b"clone-1"
    await peer.write(P.frame(P.pack(P.RESULT, token, P.I32.pack(1) + b"sethostname: nope")))
    from rollbox.errors import InfraError
    with pytest.raises(InfraError, match="sethostname: nope"):
        await task
    task = asyncio.ensure_future(ch.boot_info())
    msg, _, token, _ = P.unpack(await peer.read_frame())
    assert msg == P.BOOT_INFO_REQ
    await peer.write(P.frame(P.pack(P.BOOT_INFO_REPLY, token,
                                    P.BOOT_INFO.pack(0, 1, 2, 3, 4, 5, 6) + b"")))
    info = await task
    assert (info.init_ns, info.ready_ns, info.error) == (1, 5, "")


def exited_totals(sid: int, out_total: int, out_dropped: int) -> bytes:
    body = P.EXITED_BODY.pack(0, 0, 0, 0, out_total, 0, out_dropped, 0)
    return P.frame(P.pack(P.EXITED, sid, body))


async def test_an_adopted_session_yields_each_byte_once_by_offset(pair) -> None:
    # Re-attach after a dropped connection: the agent counted as dropped what the old
    # connection missed (and sends TAIL), but the replay gave it back; live output sent before
    # REPLAY_END is covered by the replay. Every byte is yielded exactly once, in order.
    ch, peer = pair
    sess = ch.adopt(4242, collect=False)
    msg, _, sid, payload = P.unpack(await peer.read_frame())
    assert (msg, sid, P.OFFSETS.unpack(payload)) == (P.REPLAY, 4242, (0, 0))
    await peer.write(
        P.frame(P.pack(P.STDOUT, sid, b"cd"))  # live, sent before the agent read REPLAY
        + P.frame(P.pack(P.REPLAY_OUT, sid, P.U64.pack(0) + b"abcd"))
        + P.frame(P.pack(P.REPLAY_END, sid, P.OFFSETS.pack(4, 0)))
        + P.frame(P.pack(P.STDOUT, sid, b"ef"))
        + P.frame(P.pack(P.TAIL_STDOUT, sid, b"abcdef"))
        + exited_totals(sid, 6, 4))
    out = [e async for e in sess.events()]
    assert [k for k, _ in out] == ["replay_stdout", "stdout", "exited"]
    assert b"".join(v for k, v in out[:-1]) == b"abcdef"
    assert sess.start_offsets == [0, 0]


async def test_a_session_that_missed_bytes_gets_the_tail(pair) -> None:
    ch, peer = pair
    sess, sid = await start(ch, peer)
    await peer.write(P.frame(P.pack(P.STDOUT, sid, b"ab"))
                     + P.frame(P.pack(P.TAIL_STDOUT, sid, b"xy"))
                     + P.frame(P.pack(P.TAIL_STDOUT, sid, b"z"))
                     + exited_totals(sid, 10, 8))
    out = [e async for e in sess.events()]
    assert [(k, v) for k, v in out[:-1]] == [("stdout", b"ab"), ("tail_stdout", b"xyz")]
    assert out[-1][0] == "exited" and out[-1][1].stdout_dropped == 8
