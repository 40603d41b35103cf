"""The full VM's QEMU command line (rollbox.backends.vm.machine): issue 16's devices (q35, VGA,
USB tablet bound to the display, virtio-serial agent port, a balloon with free-page reporting)
and what it must never have: a VNC or monitor listener (a viewer is a socketpair handed over by
QMP; QMP is an inherited descriptor), a host path other than the jail's fixed ones, a template
RAM file."""
from __future__ import annotations

import pytest

from rollbox.backends.microvm import qemu
from rollbox.backends.vm import display, machine, rootdisk


def spec(**kw: object) -> qemu.MachineSpec:
    return qemu.MachineSpec(**{"cpus": 1, "memory_mib": 256, "layers": 1, **kw})  # type: ignore[arg-type]


def test_q35_devices_and_no_listener() -> None:
    argv = machine.argv(spec())
    joined = " ".join(argv)
    assert argv[argv.index("-M") + 1].startswith("q35")
    assert argv[argv.index("-vnc") + 1] == "none" and argv.count("-vnc") == 1
    assert argv[argv.index("-display") + 1] == "none"
    for listener in ("-monitor", "-qmp", "-spice", "unix:", "tcp:", "telnet", "websocket",
                     "path=", "host=", "port="):
        assert listener not in joined, listener
    chardevs = [argv[i + 1] for i, a in enumerate(argv) if a == "-chardev"]
    assert len(chardevs) == 3  # console, QMP and the agent: each an inherited descriptor
    assert all(c.startswith("socket,") and ",fd=" in c for c in chardevs), chardevs
    assert f"VGA,id={display.DISPLAY_ID}" in argv
    assert f"usb-tablet,bus=usb.0,display={display.DISPLAY_ID}" in argv
    assert "virtio-balloon-pci,free-page-reporting=on" in joined
    assert f"name={qemu.AGENT_PORT}" in joined and f"fd={qemu.AGENT_FD}" in joined
    assert "-sandbox" in argv and "-nodefaults" in argv and "-no-user-config" in argv
    assert machine.argv(spec()) == argv  # equal specs, equal argvs


def test_only_the_jails_fixed_paths() -> None:
    for s in (spec(), spec(layers=0, rw_disk=False, root_disk="tinydisk:1", init="/sbin/init")):
        argv = machine.argv(s)
        host_side = argv[:argv.index("-append")] + argv[argv.index("-append") + 2:]
        paths = {p for arg in host_side for p in arg.replace(",", "=").split("=")
                 if p.startswith("/")}  # (the kernel command line's are the guest's)
        allowed = {"/usr/bin/qemu-system-x86_64", qemu.KERNEL, qemu.INITRD,
                   qemu.layer_path(0), qemu.RW_DISK, rootdisk.BASE_IMG, rootdisk.ROOT_QCOW2}
        assert paths <= allowed, paths - allowed
        if s.root_disk:
            assert {rootdisk.BASE_IMG, rootdisk.ROOT_QCOW2} <= paths
            assert qemu.RW_DISK not in paths


def test_a_template_ram_file_is_refused() -> None:
    with pytest.raises(ValueError, match="anonymous RAM"):
        machine.argv(spec(ram=qemu.RAM_CLONE))
