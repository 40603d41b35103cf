"""An edge restart re-adopts its running sandboxes and reports lost ones as dead."""
from __future__ import annotations

import pytest

from rollbox.edge.edge import Edge
from rollbox.errors import SandboxDead
from rollbox.events.store import EventLog
from rollbox.isolation import cgroups
from rollbox.models import ExecSpec, SandboxSpec
from tests.conftest import node_settings


async def test_restart_readopts_and_reports_lost(tmp_node_dir) -> None:  # noqa: ANN001
    settings = node_settings(tmp_node_dir)
    events = EventLog(tmp_node_dir / "events.db")
    e1 = Edge(settings, events)
    await e1.start()
    keep = await e1.create(SandboxSpec(image="busybox:test"), "t")
    lose = await e1.create(SandboxSpec(image="busybox:test"), "t")
    eid = await e1.exec_start(keep.id, ExecSpec(cmd="echo before > /tmp/state"))
    await e1.exec_wait(keep.id, eid)
    v2_lost = e1.live[lose.id].box.v2_cgroup
    await e1.close(destroy=False)  # the edge goes away; sandboxes keep running
    cgroups.kill(v2_lost)  # one sandbox dies while no edge watches
    assert await cgroups.wait_empty(v2_lost)

    e2 = Edge(settings, events)
    await e2.start()
    try:
        assert (await e2.get(keep.id)).state == "running"
        eid = await e2.exec_start(keep.id, ExecSpec(cmd="cat /tmp/state"))
        assert (await e2.exec_wait(keep.id, eid)).stdout == "before\n"
        info = await e2.get(lose.id)
        assert info.state == "dead" and info.dead_reason
        with pytest.raises(SandboxDead):
            await e2.exec_start(lose.id, ExecSpec(cmd="true"))
        assert e2.leftovers(lose.id) == []
        await e2.delete(keep.id)
        assert e2.leftovers(keep.id) == []
    finally:
        await e2.close(destroy=True)
        events.close()
