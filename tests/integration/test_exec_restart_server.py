"""Commands survive ``kill -9`` of a real ``rollbox serve`` process: calls made through the SDK
before the kill return the right result after the restart (exit codes, output within the 1 MiB
the agent retains, truncation reported), idempotency keys hold across it, and a call whose
outcome can't be re-checked is indeterminate, not a plain connection error."""
from __future__ import annotations

import asyncio

import pytest

from rollbox import errors
from rollbox.edge.edge import Edge
from rollbox.embedded import ServerProcess
from rollbox.events.store import EventLog
from rollbox.sdk import AsyncClient
from rollbox.sdk._async import AsyncSandbox
from tests.conftest import node_settings

MIB = 1 << 20
BIG = 10_000_000 + 4  # 10 MB of "y" + "end\n"


async def _until(pred, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


async def test_commands_survive_kill_9_of_the_server(tmp_node_dir) -> None:  # noqa: ANN001
    settings = node_settings(tmp_node_dir)
    srv = ServerProcess(settings)
    srv.start()
    client = AsyncClient(srv.url, srv.key, reconnect_s=60)
    impatient = AsyncClient(srv.url, srv.key, reconnect_s=1.0)
    fresh = AsyncClient(srv.url, srv.key, reconnect_s=0.5)
    try:
        sb = await client.create("busybox:test")
        once = await sb.exec("echo x >> /tmp/once; cat /tmp/once", idempotency_key="run-once")
        assert once.stdout == "x\n"
        bg = await sb.exec_background("echo bg0; sleep 2.5; echo bg; exit 5")
        long_out: list[str] = []
        big_out: list[str] = []
        down = asyncio.create_task(sb.exec("echo a; sleep 0.8; echo b >&2; exit 3"))
        big = asyncio.create_task(sb.exec(  # writes 10 MB while the server is down
            "sleep 0.8; head -c 10000000 /dev/zero | tr '\\0' y; echo end",
            on_stdout=big_out.append))
        long = asyncio.create_task(sb.exec("echo l1; sleep 5; echo l2; exit 4",
                                           on_stdout=long_out.append))
        await _until(lambda: long_out == ["l1\n"])  # mid-stream
        await asyncio.sleep(0.2)  # `down` started too (its first line is out)

        srv.kill()
        await asyncio.sleep(2.5)  # `down`, `big` and `bg` end while no server is up
        assert not (down.done() or big.done() or long.done())  # the SDK is still retrying
        srv.start()
        assert not long.done()  # still running: re-attached to live output

        r = await asyncio.wait_for(down, 30)
        assert (r.exit_code, r.stdout, r.stderr) == (3, "a\n", "b\n")
        r = await asyncio.wait_for(long, 30)
        assert r.exit_code == 4 and "".join(long_out) == "l1\nl2\n"  # every byte once
        assert r.stdout == "l1\nl2\n"
        r = await asyncio.wait_for(big, 30)
        assert r.exit_code == 0 and r.stdout_bytes == BIG
        assert r.stdout_truncated_bytes == BIG - MIB  # the agent keeps the last 1 MiB
        assert "".join(big_out) == "y" * (MIB - 4) + "end\n"  # replayed once, gap skipped
        assert (await bg.wait()).exit_code == 5
        assert [c.data for c in [c async for c in bg.attach()]] == [b"bg0\nbg\n"]

        procs = {p.exec_id: p for p in await sb.processes()}
        assert len(procs) == 5 and all(p.state == "exited" for p in procs.values())
        assert procs[bg.exec_id].background and procs[bg.exec_id].exit_code == 5
        # each command's exit is in the event log exactly once, across the restart
        exited = [e.exec_id for e in await sb.events() if e.kind == "exec.exited"]
        assert sorted(exited) == sorted(procs)

        # the idempotency key survived: the recorded command, not a second run
        again = await sb.exec("echo x >> /tmp/once; cat /tmp/once", idempotency_key="run-once")
        assert (again.exec_id, again.stdout) == (once.exec_id, "x\n")
        with pytest.raises(errors.IdempotencyConflict):
            await sb.exec("echo other", idempotency_key="run-once")

        # the server stays down past the SDK's window: a call that may have run is
        # indeterminate, a call that never reached the server is unreachable
        isb = await impatient.get(sb.id)
        pending = asyncio.create_task(isb.exec("sleep 1; echo late >> /tmp/late; cat /tmp/late",
                                               idempotency_key="late"))
        await asyncio.sleep(0.3)
        srv.kill()
        with pytest.raises(errors.ExecIndeterminate) as info:
            await asyncio.wait_for(pending, 10)
        assert info.value.details["idempotency_key"] == "late"
        with pytest.raises(errors.ServerUnreachable):
            await AsyncSandbox(fresh, sb.info).exec("true")  # no lookup: the server is down
        srv.start()
        # re-checking with the key gives the real outcome: it ran once
        r = await isb.exec("sleep 1; echo late >> /tmp/late; cat /tmp/late",
                           idempotency_key="late")
        assert (r.exit_code, r.stdout) == (0, "late\n")
        await sb.delete()
    finally:
        for c in (client, impatient, fresh):
            await c.close()
        srv.stop()
        # whatever a failure left: the node's edge re-adopts and removes it
        events = EventLog(settings.data_dir / "events.db")
        edge = Edge(settings, events)
        await edge.start()
        await edge.close(destroy=True)
        events.close()
        srv.reap_orphans()  # the agents that in-process edge killed too

