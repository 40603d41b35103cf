"""A node with the CPU classes off (``ROLLBOX_CPU_QOS=0``): a batch sandbox runs in the normal
class (cpu.idle 0, normal weight, SCHED_OTHER), the node says so in its facts, and a bad qos
name is still refused. The classes on are tests/redteam/test_cpu_qos.py's."""
from __future__ import annotations

import os

import pytest

from rollbox.errors import BadRequest
from rollbox.isolation import qos
from rollbox.models import SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


@pytest.fixture
def edge_settings() -> dict:
    return {"cpu_qos": False}


async def test_batch_in_the_normal_class_when_off(edge) -> None:  # noqa: ANN001
    cap = (await edge.capacity())["backends"]["container"]
    assert cap["facts"]["cpu_qos"] is False
    info = await edge.create(SandboxSpec(image="busybox:test"), "t")
    assert info.qos == "batch"
    path, v2 = qos.cpu_dir(edge.settings.cgroup_parent, info.id)
    if (path / "cpu.idle").exists():
        assert (path / "cpu.idle").read_text().strip() == "0"
    weight = path / ("cpu.weight" if v2 else "cpu.shares")
    assert int(weight.read_text()) == (100 if v2 else 1024)
    pid = edge.live[info.id].box.agent_pid
    assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    with pytest.raises(BadRequest, match="qos"):
        await edge.backends["container"].create(
            f"{edge.settings.node_id}-qosbad",
            edge._spec_of(info.model_copy(update={"qos": "urgent"}), {}))
