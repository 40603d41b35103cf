"""The agent keeps each session's last bytes per stream and its exit until the edge collects
them, so a restarted edge (a new connection) rebuilds sessions from it: real agent binary as a
host subprocess (fixtures of test_agent_channel)."""
from __future__ import annotations

import asyncio

from rollbox.agent import protocol as P
from rollbox.agent.channel import AgentChannel
from rollbox.agent.channel import Session
from tests.integration.test_agent_channel import (  # noqa: F401 - fixtures
    ENV, Agent, Result, agent, agent_binary, pytestmark,
)

MIB = 1 << 20


async def collect(sess: Session) -> Result:
    """Output (replayed, then live) and the exit of a session."""
    parts: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    async for kind, value in sess.events():
        if kind == "exited":
            return Result(b"".join(parts["stdout"]), b"".join(parts["stderr"]), b"", b"", value)
        parts[kind.removeprefix("replay_").removeprefix("tail_")].append(value)
    raise AssertionError("events ended without exited")


async def _exited(ch: AgentChannel, ids: set[int], timeout: float = 20) -> dict[int, P.SessionEntry]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        entries = {e.id: e for e in await ch.sessions() if e.id in ids}
        if all(e.exited for e in entries.values()) and len(entries) == len(ids):
            return entries
        assert asyncio.get_running_loop().time() < deadline, entries
        await asyncio.sleep(0.05)


async def test_sessions_outlive_the_connection_and_replay_their_retained_output(
    agent: Agent,  # noqa: F811 - the fixture
) -> None:
    ch1 = await AgentChannel.connect(str(agent.sock_path))
    req = dict(env=ENV, tail_limit=P.RETAIN_LIMIT)
    done = await ch1.exec(P.ExecRequest(
        argv=["sh", "-c", "echo a1; echo e1 >&2; sleep 0.3; echo a2; exit 5"], **req),
        collect=False)
    big = await ch1.exec(P.ExecRequest(  # 20 MB written while no edge is connected
        argv=["sh", "-c", "sleep 0.2; head -c 20000000 /dev/zero | tr '\\0' y; echo end"], **req),
        collect=False)
    slow = await ch1.exec(P.ExecRequest(argv=["sh", "-c", "echo c1; sleep 1.5; echo c2"], **req),
                          collect=False)
    await asyncio.sleep(0.05)
    ch1.close()  # the edge goes away mid-stream

    probe = await AgentChannel.connect(str(agent.sock_path))
    entries = await _exited(probe, {done.id, big.id})  # the writer never blocked
    probe.close()
    assert agent.anon_kib() < 4 * 1024  # 20 MB went through a 1 MiB ring, not into memory
    assert (entries[done.id].exit_code, entries[done.id].stdout_total) == (5, 6)
    assert entries[big.id].stdout_total == 20_000_004
    assert entries[big.id].stdout_retained == P.RETAIN_LIMIT

    ch2 = await AgentChannel.connect(str(agent.sock_path))
    try:
        assert ch2.agent_sessions[slow.id].exited is False
        assert ch2.agent_sessions[done.id].exited is True
        r = await asyncio.wait_for(collect(ch2.adopt(done.id, collect=False)), 5)
        assert (r.stdout, r.stderr, r.exited.exit_code) == (b"a1\na2\n", b"e1\n", 5)
        sess = ch2.adopt(big.id, collect=False)
        r = await asyncio.wait_for(collect(sess), 5)
        assert len(r.stdout) == P.RETAIN_LIMIT and r.stdout == b"y" * (P.RETAIN_LIMIT - 4) + b"end\n"
        assert sess.start_offsets[0] == 20_000_004 - P.RETAIN_LIMIT  # 18.9 MB truncated
        assert r.exited.stdout_total == 20_000_004
        sess_slow = ch2.adopt(slow.id, collect=False)
        r = await asyncio.wait_for(collect(sess_slow), 5)
        assert (r.stdout, r.exited.exit_code) == (b"c1\nc2\n", 0)  # replayed, then live
        # not collected: still there for another edge; collected: gone
        assert {e.id for e in await ch2.sessions()} == {done.id, big.id, slow.id}
        for s in (done, big, slow):
            ch2._post(P.pack(P.COLLECT, s.id))
        assert await ch2.sessions() == []
        unknown = ch2.adopt(424242)
        try:
            await asyncio.wait_for(unknown.wait(), 5)
            raise AssertionError("an unknown session must fail")
        except Exception as exc:  # noqa: BLE001
            assert "no session" in str(exc)
    finally:
        ch2.close()


async def test_uncollected_exits_are_bounded(agent: Agent) -> None:  # noqa: F811
    """A sandbox can't grow the agent by leaving exits uncollected: past 16 MiB of rings the
    oldest exited sessions are dropped."""
    ch = await AgentChannel.connect(str(agent.sock_path))
    try:
        ids = []
        for _ in range(20):  # 1 MiB ring each
            s = await ch.exec(P.ExecRequest(argv=["head", "-c", str(MIB), "/dev/zero"], env=ENV,
                                            tail_limit=P.RETAIN_LIMIT), collect=False)
            await asyncio.wait_for(s.wait(), 10)
            ids.append(s.id)
        left = [e.id for e in await ch.sessions()]
        assert sorted(left) == sorted(ids[-16:])  # the 4 oldest went first
        assert agent.anon_kib() < 20 * 1024
        assert b"exit never collected" in agent.log.read_bytes()
        for sid in left:
            ch.collect(sid)
        assert await ch.sessions() == []
        assert agent.anon_kib() < 1024  # collected rings went back to the kernel
    finally:
        ch.close()


async def test_all_rings_together_are_bounded(agent: Agent) -> None:  # noqa: F811
    """Running commands can't grow the agent without bound either: past 64 MiB of rings in
    all, a ring stops growing (it keeps fewer bytes; the rest counts as truncated)."""
    ch = await AgentChannel.connect(str(agent.sock_path))
    try:
        sessions = [await ch.exec(P.ExecRequest(
            argv=["sh", "-c", "head -c 16777216 /dev/zero; sleep 30"], env=ENV,
            tail_limit=16 * MIB)) for _ in range(5)]  # 80 MiB of rings wanted
        ids = {s.id for s in sessions}
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            entries = [e for e in await ch.sessions() if e.id in ids]
            if all(e.stdout_total == 16 * MIB for e in entries):
                break
            assert asyncio.get_running_loop().time() < deadline, entries
            await asyncio.sleep(0.05)
        retained = sum(e.stdout_retained for e in entries)
        assert 48 * MIB <= retained <= 64 * MIB
        assert any(e.stdout_retained < e.stdout_total for e in entries)
        assert agent.anon_kib() < 72 * 1024
        for s in sessions:
            await s.kill()
        for s in sessions:
            await asyncio.wait_for(s.wait(), 10)
        assert await ch.sessions() == []  # after the COLLECTs the exits sent
        assert agent.anon_kib() < 1024
    finally:
        ch.close()
