"""What an idle restored microVM costs the host (docs/backends/microvm.md, "Memory"): its guest
idles without a periodic tick (host CPU under TCG), makes no tracefs (thousands of inodes of
slab per VM), and a copy restore (no shared template
RAM: QEMU < 8.2 or ``vm_template_shared_ram`` off) does not load the pages its template's
guest had freed: a template's free memory is zeroed before its save. The first test restores
the session's one template (tests/conftest.py ``vm_template_node``); the copy restore builds a
template of its own (``microvm_slow``)."""
from __future__ import annotations

import asyncio
import collections
import os
from dataclasses import replace
from pathlib import Path

import pytest

from rollbox.backends.microvm import balloon
from rollbox.backends.microvm.backend import MicroVM, qemu_anon_bytes
from rollbox.backends.platform_work import run_shell
from rollbox.config import Settings
from tests.conftest import node_settings
from tests.helpers.vm_template import template_node, template_spec, vm_backend

# Guest RAM of its own a VM restored by copy may hold (python:3.11, 256 MiB; measured with
# and without the template's zeroing: QEMU 7.2 58 / 72 MiB, 10.0.2 60 / 68 MiB).
COPY_RESTORED_MAX_MIB = 64
pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


def resident_pages(pid: int, memory_mib: int) -> set[int]:
    """Guest pfns of which QEMU holds a page of its own: present in its guest RAM mapping
    (the private one of the guest's size; microvm maps guest-physical 0.. there) and neither
    a page of a file (a template mapped copy-on-write: shared until written) nor the shared
    zero page (a read of a page never written maps it)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if hi - lo == memory_mib << 20 and fields[1] == "rw-p":
            break
    else:
        raise AssertionError("no guest RAM mapping in QEMU's maps")
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        f.seek(lo // 4096 * 8)
        entries = memoryview(f.read((hi - lo) // 4096 * 8)).cast("Q")
    own = {i: e & ((1 << 55) - 1) for i, e in enumerate(entries)
           if e >> 63 and not e >> 61 & 1}
    zero_pfn, n = collections.Counter(own.values()).most_common(1)[0]
    return {i for i, pfn in own.items() if n == 1 or pfn != zero_pfn}


async def restored_vm_memory(settings: Settings) -> tuple[int, list[str], str]:
    """One VM restored from the node's template, right after its create: MiB of guest RAM
    QEMU holds of its own, its guest's ``inode_cache`` line of /proc/slabinfo (commands can
    not mount tracefs to look: no CAP_SYS_ADMIN), and its clocksource and tick mode
    (/proc/timer_list)."""
    async with vm_backend(settings) as b:
        spec = template_spec(settings)
        vm: MicroVM = await b.create(f"{settings.node_id}-mem", spec)
        try:
            assert vm.template  # restored
            # host side first: the guest's own commands below dirty pages of their own
            held = len(resident_pages(vm.pid, spec.resources.memory_mib)) >> 8
            code, out = await run_shell(
                vm, "echo inodes: $(grep '^inode_cache ' /proc/slabinfo); "
                "echo clock: $(cat /sys/devices/system/clocksource/clocksource0/"
                "current_clocksource) $(grep -E 'nohz_mode|Tick Device' /proc/timer_list | sort -u)",
                vm.image_env, 60)
            assert code == 0, out
        finally:
            await b.destroy(vm)
        assert b.leftovers(vm.id) == []
    text = out.decode()
    assert "inodes:" in text and "clock:" in text, text
    return held, text.split("inodes:", 1)[1].split("clock:")[0].split(), text.split("clock:")[1]


async def test_a_restored_guest_has_no_tracefs_and_idles_without_ticks(
        vm_template_node: Settings) -> None:
    held, inodes, clock = await restored_vm_memory(vm_template_node)
    # no tracefs made at boot: its ~10k inodes (one per file of each trace event) are most of
    # a guest's generic inode cache
    assert inodes[0] == "inode_cache" and int(inodes[1]) < 3000, inodes
    # shared template RAM (QEMU >= 8.2): what it has not written is the template's page cache
    assert held <= COPY_RESTORED_MAX_MIB, f"{held} MiB of guest RAM of its own"
    # Tickless idle: the TSC kept as clocksource (tsc=reliable: on a loaded host the boot's
    # watchdog fell back to jiffies) and the APIC timer one-shot (+arat): an idle guest's
    # timer fires a few times a second, not 250 (each wakeup is host CPU under TCG; measured
    # ~0.03 host cores per idle VM with periodic ticks, ~0.003 tickless)
    words = clock.split()
    assert words[0] == "tsc", clock
    assert "nohz_mode : 2" in " ".join(words), clock  # NOHZ_MODE_HIGHRES
    assert "Tick Device: mode: 1" in " ".join(words), clock  # one-shot, not periodic


@pytest.mark.microvm_slow
async def test_a_copy_restore_does_not_load_the_templates_free_pages(
        tmp_node_dir: Path) -> None:
    settings = node_settings(tmp_node_dir)
    settings.vm_template_shared_ram = False
    with template_node(settings) as node:
        held, _, _ = await restored_vm_memory(node)
    # The host holds what the guest uses (kernel, slab, initramfs, caches), not the pages
    # it had freed before its template was saved
    assert held <= COPY_RESTORED_MAX_MIB, f"{held} MiB of guest RAM resident"


async def test_a_restored_idle_vm_is_not_squeezed_for_nothing(
        vm_template_node: Settings) -> None:
    """The idle squeezer leaves a VM alone whose QEMU holds less than the squeeze would keep
    plus its minimum gain (balloon.worth_squeezing): a squeeze would free nothing and cost the
    next command its deflate. (A cold-booted VM is squeezed: test_microvm_agent.)"""
    settings = replace(vm_template_node, vm_idle_squeeze_s=1.0)
    async with vm_backend(settings) as b:
        vm: MicroVM = await b.create(f"{settings.node_id}-nosq", template_spec(settings))
        try:
            assert not balloon.worth_squeezing(qemu_anon_bytes(vm.pid), vm.machine.memory_mib)
            await asyncio.sleep(8)  # the squeezer looks every 0.5 s once a VM idled 1 s
            assert not vm.squeezed and not vm.jail.squeeze_marker.exists()
        finally:
            await b.destroy(vm)
        assert b.leftovers(vm.id) == []
