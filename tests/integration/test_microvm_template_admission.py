"""A template's build VM is counted by the node's admission: it runs inside the create that
asked for the template first, under that create's ticket (the same cpus and memory: the
template's key is the create's machine), and a create cancelled during the build tears the
build VM down before its ticket goes back. Nothing of a build runs outside admission."""
from __future__ import annotations

import asyncio
import os

import pytest

from rollbox.backends.microvm.template import BUILD_PREFIX
from rollbox.models import Resources, SandboxSpec
from tests.helpers.vm_guest import real_guest_marks

pytestmark = real_guest_marks("busybox:test")


@pytest.fixture
def edge_settings() -> dict:
    return {"vm_templates": True, "vm_accel": "tcg"}


def build_vms(edge) -> list[str]:  # noqa: ANN001
    return sorted(edge.backends["microvm"].host_sandbox_ids(BUILD_PREFIX))


async def test_a_build_vm_runs_under_its_creates_ticket(edge) -> None:  # noqa: ANN001
    cap = edge.capacity()["backends"]["microvm"]
    if not cap["offered"]:
        pytest.skip(f"this node offers no microVMs: {cap['reason']}")
    adm = edge.admission
    released: list[list[str]] = []
    release = adm.release

    def recording_release(ticket):  # noqa: ANN001, ANN202
        released.append(build_vms(edge))  # what of a build still runs when it goes back
        release(ticket)

    adm.release = recording_release  # type: ignore[method-assign]
    spec = SandboxSpec(image="busybox:test", backend="microvm",
                       resources=Resources(cpus=1, memory_mib=256, disk_mib=64))
    create = asyncio.ensure_future(edge.create(spec, "t"))
    for _ in range(1200):  # the build VM's jail appears
        if build_vms(edge) or create.done():
            break
        await asyncio.sleep(0.05)
    builds = build_vms(edge)
    assert builds and not create.done(), "no template build seen"
    # the build VM is the create's: its ticket holds the VM's memory and CPUs meanwhile
    assert (adm.total.sandboxes, adm.total.memory_mib, adm.total.cpus) == (1, 256, 1)
    create.cancel()
    try:
        info = await create
    except asyncio.CancelledError:
        pass
    else:  # the create went on: delete it (nothing may leak), and say so
        await edge.delete(info.id)
        pytest.xfail("known bug, open: a cancellation of a create during its template build "
                     "is sometimes lost (about 1 run in 8; one cause, 3.11's wait_for meeting "
                     "the jailer's exit, fixed; another remains) and the create finishes")
    assert released == [[]]  # the ticket went back once the build VM was gone
    assert build_vms(edge) == [] and adm.total.sandboxes == 0
    assert [edge.backends["microvm"].leftovers(b) for b in builds] == [[]] * len(builds)
