"""The real agent over its stream transport (a SOCK_STREAM listener as fd 3: the framing and
HELLO/SYNC handshake a microVM's virtio port uses), driven by AgentChannel.connect_stream:
exec, stdin, timeouts, re-attach after a dropped connection, resync after garbage, and the
platform tool by descriptor. No VM here (tests/integration/test_guest_vm.py boots one).
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollbox.agent import protocol as P
from rollbox.agent.channel import AgentChannel, SpawnError
from rollbox.errors import InfraError
from tests.integration.test_agent_channel import (  # noqa: F401 - fixtures
    ENV,
    Agent,
    agent_binary,
    collect,
    connected,
    pytestmark,
    run,
    started_agent,
)

BUSYBOX = Path("/bin/busybox")


@pytest.fixture
def stream_agent(agent_binary: Path, tmp_path: Path) -> Iterator[Agent]:  # noqa: F811
    with started_agent(agent_binary, tmp_path, socket.SOCK_STREAM, tool=BUSYBOX) as a:
        yield a


@pytest.fixture
async def channel(stream_agent: Agent) -> AsyncIterator[AgentChannel]:
    async with connected(stream_agent, stream=True) as ch:
        yield ch


async def test_exec_stdin_and_timeout_over_the_stream(channel: AgentChannel) -> None:
    assert channel.stream
    r = await run(channel, ["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.stdout, r.stderr, r.exited.exit_code) == (b"out\n", b"err\n", 3)

    sess = await channel.exec(P.ExecRequest(argv=["sha256sum"], env=ENV, stdin=True))
    data = bytes(range(256)) * 4096  # 1 MiB: many frames, past the stdin window
    await sess.write_stdin(data)
    await sess.close_stdin()
    r = await asyncio.wait_for(collect(sess), 30)
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()

    r = await run(channel, ["sleep", "30"], timeout_ms=300)
    assert r.exited.timed_out and r.exited.signal == 9


async def test_big_output_arrives_whole_in_order(channel: AgentChannel) -> None:
    # 3 MiB through frames of at most CHUNK: partial writes on both sides keep the framing.
    r = await run(channel, ["sh", "-c", "seq 1 400000"])
    assert r.stdout == b"".join(b"%d\n" % i for i in range(1, 400001))


async def test_an_abandoned_session_holds_no_stdin_write_or_signal_of_a_stalled_agent(
        stream_agent: Agent, channel: AgentChannel) -> None:
    """An agent that stops reading its stream (a guest's root can stop its agent): stdin writes
    and signals wait for it like any backpressure, until the host gives up on the session
    (``abandon``, the edge's at deadline + grace); then each fails with that error at once, and
    the channel stays usable for the other sessions once the agent reads again."""
    sess = await channel.exec(P.ExecRequest(argv=["sleep", "30"], env=ENV, stdin=True))
    os.kill(stream_agent.proc.pid, signal.SIGSTOP)
    try:
        # past the socket's buffers: the last chunks wait in the channel's queue
        writer = asyncio.ensure_future(sess.write_stdin(b"x" * P.STDIN_WINDOW))
        killer = asyncio.ensure_future(sess.kill())  # queued behind them
        await asyncio.sleep(0.5)
        assert not writer.done() and not killer.done()
        sess.abandon(InfraError("unresponsive agent"))
        async with asyncio.timeout(2):
            for waiting in (writer, killer, sess.wait(), sess.close_stdin()):
                with pytest.raises(InfraError, match="unresponsive agent"):
                    await waiting
    finally:
        os.kill(stream_agent.proc.pid, signal.SIGCONT)
    assert not channel.busy()
    async with asyncio.timeout(30):
        r = await run(channel, ["echo", "after"])
    assert r.stdout == b"after\n"


# Was flaky (session 11): output the old connection missed counted as dropped, so the agent
# sent a TAIL at exit that duplicated what the replay had given back.
async def test_reattach_after_the_connection_drops_mid_output(stream_agent: Agent) -> None:
    path = str(stream_agent.sock_path)
    ch = await AgentChannel.connect_stream(path, timeout=5)
    # Output keeps flowing while the connection goes away: the old connection is cut with
    # frames in flight; the new one must resync and rebuild the session from its ring.
    sess = await ch.exec(P.ExecRequest(
        argv=["sh", "-c", "for i in $(seq 1 3000); do echo line $i; done; sleep 0.5; echo end"],
        env=ENV, tail_limit=P.RETAIN_LIMIT), collect=False)
    first = await asyncio.wait_for(sess.events().__anext__(), 5)
    assert first[0] == "stdout"
    ch.close()
    ch2 = await AgentChannel.connect_stream(path, timeout=5)
    try:
        out = await reattach(ch2, sess.id)
        assert out == b"".join(b"line %d\n" % i for i in range(1, 3001)) + b"end\n"
    finally:
        ch2.close()


async def reattach(ch: AgentChannel, session_id: int) -> bytes:
    """Adopt a session an earlier connection started and read it to a clean exit: all its
    output (replayed from the start, then live), which a test compares whole."""
    assert session_id in ch.agent_sessions
    again = ch.adopt(session_id, collect=False)
    out = bytearray()
    async for kind, value in again.events():
        if kind == "exited":
            assert value.exit_code == 0
            break
        out += value
    assert again.start_offsets == [0, 0]
    again.collect()
    return bytes(out)


async def test_garbage_then_hello_resyncs_and_a_repeated_hello_is_ignored(
        stream_agent: Agent) -> None:
    loop = asyncio.get_running_loop()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.setblocking(False)
    await loop.sock_connect(raw, str(stream_agent.sock_path))
    nonce = b"\x07" * P.NONCE_LEN
    # Before any HELLO the agent only looks for the magic: bytes of a frame that was cut off
    # and plain garbage are skipped; the same HELLO twice is one connection.
    await loop.sock_sendall(raw, P.frame(P.pack(P.PING, 5))[:6] + b"\xff" * 5000
                            + P.hello(nonce) + P.hello(nonce) + P.frame(P.pack(P.PING, 9)))
    got = bytearray()
    while got.count(P.SYNC_MAGIC) < 1 or P.frame(P.pack(P.PONG, 9)) not in got:
        got += await asyncio.wait_for(loop.sock_recv(raw, 65536), 5)
    assert got.count(P.SYNC_MAGIC + nonce) == 1
    assert got.startswith(P.frame(P.pack(P.SYNC, 0, P.SYNC_MAGIC + nonce)))
    # A bad frame length after the handshake: the agent drops the connection (a socket is
    # closed; the guest's port, which it can not close, goes back to scanning for HELLO).
    await loop.sock_sendall(raw, P.FRAME_LEN.pack(0xFFFFFFF0) + b"\x00" * 64)
    while await asyncio.wait_for(loop.sock_recv(raw, 65536), 5):
        pass
    raw.close()
    assert b"bad frame length" in stream_agent.log.read_bytes()
    async with connected(stream_agent, stream=True) as ch:
        assert (await run(ch, ["true"])).exited.exit_code == 0


async def test_platform_tool_runs_busybox_by_descriptor(channel: AgentChannel) -> None:
    # argv[0] is the applet; PATH is empty, so nothing is looked up in the tree.
    async def tool(argv: list[str]) -> bytes:
        sess = await channel.exec(P.ExecRequest(argv=argv, env=[], platform_tool=True))
        return (await asyncio.wait_for(collect(sess), 10)).stdout

    assert await tool(["echo", "from", "busybox"]) == b"from busybox\n"
    assert await tool(["sh", "-c", "echo $0"]) == b"sh\n"
    with pytest.raises(SpawnError, match="exclude each other"):
        await channel.exec(P.ExecRequest(argv=["true"], env=[], platform_tool=True,
                                         platform_shell=True))


async def test_boot_info_of_a_container_agent_reports_no_boot_steps(
        channel: AgentChannel) -> None:
    info = await channel.boot_info()
    assert info.errno == 0 and info.error == ""
    assert info.init_ns == info.mounts_ns == 0 and info.ready_ns > 0
    assert info.now_ns >= info.ready_ns
