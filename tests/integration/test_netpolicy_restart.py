"""An edge restart re-adopts a networked sandbox with its policy still enforced: denied stays
denied, allowed (IP rules and addresses learned through the gate before the restart) still
works, the gate answers again and set_network still works; a sandbox whose link vanished while
the edge was down is torn down and reported dead, with nothing left on the host."""
from __future__ import annotations

import subprocess

import pytest

from rollbox.edge.edge import Edge
from rollbox.errors import SandboxDead
from rollbox.events.store import EventLog
from rollbox.models import ExecSpec, NetworkPolicy, SandboxSpec
from rollbox.netpolicy import bpf, link, sandbox_net
from tests.conftest import needs_python, node_settings
from tests.integration.test_netpolicy_targets import (  # noqa: F401 - fixtures
    CONNECT,
    FakeInternet,
    FakeUpstream,
    internet,
    upstream,
)

pytestmark = [needs_python]
RESOLVE = """
import socket, sys
for name in sys.argv[1:]:
    try:
        print(name, socket.gethostbyname(name))
    except OSError:
        print(name, 'refused')
"""


async def run(edge: Edge, sid: str, cmd: list[str]) -> str:
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=20))
    res = await edge.exec_wait(sid, eid)
    return (res.stdout + res.stderr).strip()


async def connect(edge: Edge, sid: str, ip: str, port: int = 8080) -> str:
    return await run(edge, sid, ["python3", "-c", CONNECT, ip, str(port)])


async def test_restart_keeps_policy_enforced(tmp_node_dir, internet: FakeInternet,  # noqa: F811
                                             upstream: FakeUpstream) -> None:  # noqa: F811
    learned, allowed, denied = internet.ips[0], internet.ips[1], internet.ips[2]
    settings = node_settings(tmp_node_dir)
    events = EventLog(tmp_node_dir / "events.db")
    e1 = Edge(settings, events)
    await e1.start()
    e2: Edge | None = None
    try:
        rules = ["allowed.example:8080", f"{allowed}:8080"]
        keep = (await e1.create(SandboxSpec(image="python:3.11",
                                            network=NetworkPolicy(allow=rules)), "t")).id
        lose = (await e1.create(SandboxSpec(image="python:3.11",
                                            network=NetworkPolicy(allow=rules)), "t")).id
        internet.route_from(keep)
        assert await run(e1, keep, ["python3", "-c", RESOLVE, "allowed.example"]) == \
            f"allowed.example {learned}"
        assert await connect(e1, keep, learned) == "ok hi"
        v2_lost = e1.live[lose].box.v2_cgroup
        await e1.close(destroy=False)  # sandboxes keep running, their filters stay attached
        subprocess.run(["ip", "link", "del", link.link_name(lose)], check=True)

        e2 = Edge(settings, events)
        await e2.start()
        assert (await e2.get(keep)).state == "running"
        assert await connect(e2, keep, denied) == "err 1"
        assert await connect(e2, keep, allowed) == "ok hi"
        assert await connect(e2, keep, learned) == "ok hi"  # learned before, not asked again
        assert await run(e2, keep, ["python3", "-c", RESOLVE, "allowed.example",
                                    "secret.example"]) == \
            f"allowed.example {learned}\nsecret.example refused"
        assert "secret.example" not in upstream.names()
        await e2.set_network(keep, NetworkPolicy(allow=[f"{denied}:8080"]))
        assert await connect(e2, keep, denied) == "ok hi"
        assert await connect(e2, keep, allowed) == "err 1"
        assert await connect(e2, keep, learned) == "err 1"

        # The sandbox whose link vanished: not adopted half-open, reported dead, cleaned up.
        info = await e2.get(lose)
        assert info.state == "dead" and info.dead_reason, info
        with pytest.raises(SandboxDead):
            await e2.exec_start(lose, ExecSpec(cmd="true"))
        assert e2.leftovers(lose) == []
        assert not v2_lost.exists()

        await e2.delete(keep)
        assert e2.leftovers(keep) == []
        assert bpf.objects_of(sandbox_net.bpf_tag(keep)) == []
    finally:
        if e2 is not None:
            await e2.close(destroy=True)
        else:
            await e1.close(destroy=True)
        events.close()
