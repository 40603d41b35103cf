"""A template's build VM is counted by the node's admission: it runs inside the create that
asked for the template first, under that create's ticket (the same cpus and memory: the
template's key is the create's machine), and a create cancelled during the build tears the
build VM down before its ticket goes back. Nothing of a build runs outside admission, and a
cancelled create stays cancelled wherever the cancel meets its build."""
from __future__ import annotations

import asyncio

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
    cap = (await edge.capacity())["backends"]["microvm"]
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
    with pytest.raises(asyncio.CancelledError):
        await create
    assert released == [[]]  # the ticket went back once the build VM was gone
    assert build_vms(edge) == [] and adm.total.sandboxes == 0
    assert [edge.backends["microvm"].leftovers(b) for b in builds] == [[]] * len(builds)



async def test_a_create_cancelled_anywhere_in_its_build_stays_cancelled(edge) -> None:  # noqa: ANN001
    """Cancels at points of the build VM's start (its jail dir made, the jailer running, QEMU
    started, QEMU booting): each create ends cancelled, and nothing of its build VM is left
    then, nor once a step still running would have made it. The race this guards needs a
    loaded node (about 1 run in 8 of the test above in CI): a cancel met the jailer while it
    joined the VM's cgroups, the teardown found the v2 one empty, the jailer then started QEMU
    in it, the teardown failed (cgroups busy), that InfraError replaced the cancellation, the
    build looked failed and the create booted cold and finished (QEMU outlived it)."""
    cap = (await edge.capacity())["backends"]["microvm"]
    if not cap["offered"]:
        pytest.skip(f"this node offers no microVMs: {cap['reason']}")
    backend = edge.backends["microvm"]

    def jail_has(name: str):  # noqa: ANN202
        return lambda: any((backend.run_root / b / name).exists() for b in build_vms(edge))

    points = [("jail dir made", lambda: bool(build_vms(edge)), 0.0),
              ("jailer running", jail_has("qemu.log"), 0.0),  # its log is opened just before
              ("QEMU started", jail_has("pid"), 0.0),
              ("QEMU booting", jail_has("pid"), 0.3)]
    spec = SandboxSpec(image="busybox:test", backend="microvm",
                       resources=Resources(cpus=1, memory_mib=256, disk_mib=64))
    for point, reached, delay_s in points:
        create = asyncio.ensure_future(edge.create(spec, "t"))
        for _ in range(20000):
            if reached() or create.done():
                break
            await asyncio.sleep(0.001)
        builds = build_vms(edge)
        assert builds and not create.done(), f"{point}: no template build seen"
        await asyncio.sleep(delay_s)
        create.cancel()
        with pytest.raises(asyncio.CancelledError):
            await create
        assert build_vms(edge) == [] and edge.admission.total.sandboxes == 0, point
        assert [backend.leftovers(b) for b in builds] == [[]] * len(builds), point
        await asyncio.sleep(0.5)  # a jailer left running would have started QEMU by now
        assert [backend.leftovers(b) for b in builds] == [[]] * len(builds), point
    assert backend.templates.cache.templates() == []  # nothing built, nothing half-kept
