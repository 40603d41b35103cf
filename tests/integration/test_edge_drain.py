"""Edge.drain (releasing a burst node, rollbox.cluster.burst): a draining edge refuses creates
(CapacityExceeded, reason draining) and reports no room and ``draining``, its sandboxes run on;
undrained it creates again. A burst node's reports say ``burst`` (ROLLBOX_NODE_BURST)."""
from __future__ import annotations

import pytest

from rollbox import errors
from rollbox.models import ExecSpec, SandboxSpec

pytestmark = pytest.mark.root


@pytest.fixture
def edge_settings() -> dict:
    return {"node_burst": True}


async def test_drain_refuses_creates_and_keeps_sandboxes(edge) -> None:  # noqa: ANN001
    a = await edge.create(SandboxSpec(image="busybox:test"), "p")
    r = await edge.report()
    assert r.burst and not r.draining and r.free["sandboxes"] > 0
    edge.drain(True)
    with pytest.raises(errors.CapacityExceeded) as exc:
        await edge.create(SandboxSpec(image="busybox:test"), "p")
    assert exc.value.details["reason"] == "draining"
    r = await edge.report()
    assert r.draining and all(v == 0 for v in r.free.values()) and r.sandboxes_total == 1
    eid = await edge.exec_start(a.id, ExecSpec(cmd=["true"]))
    assert (await edge.exec_wait(a.id, eid)).exit_code == 0
    edge.drain(False)
    b = await edge.create(SandboxSpec(image="busybox:test"), "p")
    assert not (await edge.report()).draining
    for sid in (a.id, b.id):
        await edge.delete(sid)
