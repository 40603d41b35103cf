"""Commands survive an edge restart: a new edge rebuilds them from its journal and the agent
(in-process edges; tests/integration/test_exec_restart_server.py kills a real server)."""
from __future__ import annotations

import asyncio

import pytest

from rollbox.edge.edge import Edge
from rollbox.errors import ExecIndeterminate, IdempotencyConflict
from rollbox.models import ExecSpec, SandboxSpec

MIB = 1 << 20


async def _stream(edge: Edge, sid: str, eid: str, offsets: tuple[int, int] = (0, 0)):  # noqa: ANN202
    out, result = [], None
    async for item in edge.exec_stream(sid, eid, offsets):
        if item.kind == "stdout":
            out.append((item.offset, item.data))
        elif item.kind == "exit":
            result = item.result
    return out, result


async def test_commands_are_rebuilt_after_an_edge_restart(restarts) -> None:  # noqa: ANN001
    e1 = await restarts.start()
    sb = (await e1.create(SandboxSpec(image="busybox:test"), "t")).id
    before = await e1.exec_start(sb, ExecSpec(cmd="echo before", idempotency_key="k-before"))
    assert (await e1.exec_wait(sb, before)).stdout == "before\n"
    exits = await e1.exec_start(sb, ExecSpec(cmd="echo a; sleep 0.4; echo b >&2; exit 3"))
    big = await e1.exec_start(sb, ExecSpec(
        cmd="sleep 0.3; head -c 10000000 /dev/zero | tr '\\0' y; echo end"))
    long = await e1.exec_start(sb, ExecSpec(cmd="echo l1; sleep 2.5; echo l2; exit 4",
                                            background=True, idempotency_key="k-long"))
    await asyncio.sleep(0.15)
    await restarts.stop()  # the edge goes away mid-stream; sandboxes keep running
    await asyncio.sleep(1.0)  # `exits` and `big` end while no edge is up

    e2 = await restarts.start()
    infos = {i.exec_id: i for i in await e2.exec_list(sb)}
    assert set(infos) == {before, exits, big, long}
    assert infos[long].state == "running" and infos[long].background
    assert (infos[exits].state, infos[exits].exit_code) == ("exited", 3)
    assert (infos[big].stdout_bytes, infos[exits].stderr_bytes) == (10_000_004, 2)

    r = await e2.exec_wait(sb, exits)
    assert (r.exit_code, r.stdout, r.stderr) == (3, "a\n", "b\n")
    assert r.stdout_truncated_bytes == 0
    r = await e2.exec_wait(sb, big)
    assert r.exit_code == 0 and r.stdout_bytes == 10_000_004
    assert r.stdout_truncated_bytes == 10_000_004 - MIB  # only the last 1 MiB survives
    assert r.stdout == (f"[... {10_000_004 - MIB} bytes lost to a server restart ...]\n"
                        + "y" * (MIB - 4) + "end\n")
    assert (await e2.exec_wait(sb, before)).stdout == "before\n"  # from the journal

    # re-attach the running one where the client stopped (it had "l1\n")
    out, result = await asyncio.wait_for(_stream(e2, sb, long, (3, 0)), 10)
    assert out == [(3, b"l2\n")] and result is not None and result.exit_code == 4
    out, _ = await _stream(e2, sb, long)
    assert b"".join(d for _, d in out) == b"l1\nl2\n"

    # the exit of every command is logged exactly once, also across the restart
    evs = await restarts.events.read(sb, 0, 100000)
    exited = [e.exec_id for e in evs if e.kind == "exec.exited"]
    assert sorted(exited) == sorted([before, exits, big, long])

    # idempotency keys survive the restart
    assert await e2.exec_start(sb, ExecSpec(cmd="echo l1; sleep 2.5; echo l2; exit 4",
                                            background=True, idempotency_key="k-long")) == long
    with pytest.raises(IdempotencyConflict):
        await e2.exec_start(sb, ExecSpec(cmd="echo other", idempotency_key="k-before"))
    fresh = await e2.exec_start(sb, ExecSpec(cmd="echo new"))
    assert fresh not in (before, exits, big, long)
    assert (await e2.exec_wait(sb, fresh)).stdout == "new\n"
    assert not await e2.live[sb].box.channel.sessions()  # every exit collected


async def test_idempotency_key_dedupes_concurrent_and_later_retries(edge) -> None:  # noqa: ANN001
    sb = (await edge.create(SandboxSpec(image="busybox:test"))).id
    spec = ExecSpec(cmd="echo x >> /tmp/runs; cat /tmp/runs", idempotency_key="once")
    ids = await asyncio.gather(*(edge.exec_start(sb, spec) for _ in range(4)))
    assert len(set(ids)) == 1
    assert (await edge.exec_wait(sb, ids[0])).stdout == "x\n"  # ran once
    assert await edge.exec_start(sb, spec) == ids[0]
    with pytest.raises(IdempotencyConflict):
        await edge.exec_start(sb, spec.model_copy(update={"env": {"A": "1"}}))
    other = await edge.exec_start(sb, spec.model_copy(update={"idempotency_key": "twice"}))
    assert other != ids[0] and (await edge.exec_wait(sb, other)).stdout == "x\nx\n"


async def test_a_command_the_agent_lost_is_indeterminate(restarts) -> None:  # noqa: ANN001
    e1 = await restarts.start()
    sb = (await e1.create(SandboxSpec(image="busybox:test"), "t")).id
    eid = await e1.exec_start(sb, ExecSpec(cmd="sleep 0.2"))
    # the agent forgets it (as its retention bound would) before any edge collects it
    agent_id = e1.live[sb].sessions[eid].agent_session.id
    await restarts.stop()
    await asyncio.sleep(0.5)
    from rollbox.agent.channel import AgentChannel
    sock = restarts.settings.run_dir / "sandboxes" / sb / "agent.sock"
    ch = await AgentChannel.connect(str(sock))
    ch.collect(agent_id)
    await ch.ping()
    ch.close()
    e2 = await restarts.start()
    with pytest.raises(ExecIndeterminate):
        await e2.exec_wait(sb, eid)


async def test_a_pty_command_survives_an_edge_restart(restarts) -> None:  # noqa: ANN001
    """A terminal's session is re-adopted like any command: its output replayed from an offset,
    its stdin and resize work on the new edge's channel, its exit is reported once."""
    from rollbox.models import PtySize

    e1 = await restarts.start()
    sb = (await e1.create(SandboxSpec(image="busybox:test"), "t")).id
    eid = await e1.exec_start(sb, ExecSpec(cmd=["sh"], pty=PtySize(cols=90, rows=20),
                                           timeout_s=60, background=True))
    await e1.exec_stdin(sb, eid, b"stty size; echo mark\n", False)
    async with asyncio.timeout(10):
        while b"mark\r\n" not in b"".join(d for _, d in (await _head(e1, sb, eid))):
            await asyncio.sleep(0.05)
    have = sum(len(d) for _, d in await _head(e1, sb, eid))
    await restarts.stop()
    e2 = await restarts.start()
    (info,) = [i for i in await e2.exec_list(sb) if i.exec_id == eid]
    assert info.state == "running" and info.pty
    await e2.exec_resize(sb, eid, 132, 43)
    await e2.exec_stdin(sb, eid, b"stty size; exit 6\n", False)
    out, result = await asyncio.wait_for(_stream(e2, sb, eid, (have, 0)), 20)
    assert out and out[0][0] == have  # nothing before the offset again
    text = b"".join(d for _, d in out)
    assert b"43 132\r\n" in text and b"20 90" not in text, text
    assert result is not None and result.exit_code == 6


async def _head(edge: Edge, sid: str, eid: str) -> list[tuple[int, bytes]]:
    """The stdout a running command has produced so far (without waiting for its end)."""
    out: list[tuple[int, bytes]] = []
    stream = edge.exec_stream(sid, eid)
    try:
        while True:
            try:
                async with asyncio.timeout(0.3):
                    item = await anext(stream)
            except TimeoutError:
                return out
            if item.kind == "stdout":
                out.append((item.offset, item.data))
            elif item.kind in ("exit", "error"):
                return out
    finally:
        await stream.aclose()
