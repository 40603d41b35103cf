"""KSM on real restored microVMs (backends/microvm/ksm.py): two clones of the session's one
template have mergeable guest RAM and, with the node's ksmd running, come to share pages
(PSS of their guest RAM well below its RSS); a node with ``vm_ksm`` off gives its VMs guest
RAM that is not mergeable. Waits for ksmd passes: ``microvm_slow``."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from rollbox.backends.microvm import ksm
from rollbox.backends.microvm.backend import MicroVM
from rollbox.config import Settings
from tests.helpers.vm_template import template_spec, vm_backend

pytestmark = [pytest.mark.root, pytest.mark.microvm_slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
              pytest.mark.skipif(not (ksm.SYSFS / "run").is_file(), reason="no KSM here")]


def guest_ram(vm: MicroVM) -> dict[str, object]:
    """The guest RAM mapping of the VM's QEMU: its flags, RSS and PSS (KiB)."""
    size = vm.machine.memory_mib << 10
    cur: dict[str, object] | None = None
    for line in Path(f"/proc/{vm.pid}/smaps").read_text().splitlines():
        f = line.split()
        if "-" in f[0] and not f[0].endswith(":"):
            a, b = (int(x, 16) for x in f[0].split("-"))
            if cur is not None:
                break
            cur = {} if (b - a) >> 10 == size and len(f) == 5 else None
        elif cur is not None and f[0] in ("Rss:", "Pss:"):
            cur[f[0].rstrip(":")] = int(f[1])
        elif cur is not None and f[0] == "VmFlags:":
            cur["flags"] = f[1:]
    assert cur is not None, "no guest RAM mapping"
    return cur


KNOBS = ("pages_to_scan", "sleep_millisecs", "run")


@pytest.fixture
def host_ksm_restored() -> Iterator[None]:
    """The host's ksmd as it was before the test: enabling KSM is node-wide and outlives the
    backend, and a test must not leave every later process of the machine merged."""
    before = {k: (ksm.SYSFS / k).read_text().strip() for k in KNOBS}
    try:
        yield
    finally:
        if before["run"] != "1":
            (ksm.SYSFS / "run").write_text("2")  # unmerge what the test's VMs shared
        for k in KNOBS:
            (ksm.SYSFS / k).write_text(before[k])


@pytest.mark.usefixtures("host_ksm_restored")
async def test_clones_share_pages_with_ksm_and_not_without(vm_template_node: Settings) -> None:
    settings = replace(vm_template_node, vm_ksm=True)  # off by default (a side channel)
    async with vm_backend(settings) as b:
        assert b.capacity().facts["ksm"] == "on"
        spec = template_spec(settings)
        vms = await asyncio.gather(*(b.create(f"{settings.node_id}-k{i}", spec)
                                     for i in range(2)))
        try:
            assert all(vm.template for vm in vms)
            assert all("mg" in guest_ram(vm)["flags"] for vm in vms)  # type: ignore[operator]
            deadline = time.monotonic() + 120
            while True:
                ram = [guest_ram(vm) for vm in vms]
                if all(r["Pss"] < 0.8 * r["Rss"] for r in ram):  # type: ignore[operator]
                    break
                assert time.monotonic() < deadline, f"no pages merged: {ram}"
                await asyncio.sleep(3)
        finally:
            for vm in vms:
                await b.destroy(vm)
    off = replace(settings, vm_ksm=False, vm_templates=False)
    async with vm_backend(off) as b:
        assert b.capacity().facts["ksm"] == "off"
        vm = await b.create(f"{settings.node_id}-k-off", template_spec(off))
        try:
            assert "mg" not in guest_ram(vm)["flags"]  # type: ignore[operator]
        finally:
            await b.destroy(vm)
        assert b.leftovers(f"{settings.node_id}-k-off") == []
