"""QEMU's command line for microVMs: fixed jail paths only, equal for equal machines."""
from __future__ import annotations

import pytest

from rollbox.backends.microvm import qemu


def test_equal_machines_have_equal_command_lines_with_jail_paths_only() -> None:
    m = qemu.MachineSpec(cpus=1, memory_mib=512, layers=2, tsc_khz=2_000_000)
    a, b = qemu.argv(m), qemu.argv(qemu.MachineSpec(**m.__dict__))
    assert a == b
    paths = [p for arg in a for p in arg.replace(",", "=").split("=") if p.startswith("/")]
    assert set(paths) == {"/usr/bin/qemu-system-x86_64", qemu.KERNEL, qemu.INITRD,
                          qemu.layer_path(0), qemu.layer_path(1), qemu.RW_DISK}
    assert qemu.argv(qemu.MachineSpec(cpus=1, memory_mib=1024, layers=2)) != a


def test_command_line_has_the_hardening_and_devices() -> None:
    argv = qemu.argv(qemu.MachineSpec(cpus=2, memory_mib=256, layers=1, tsc_khz=2_245_780))
    joined = " ".join(argv)
    assert "-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny" \
        in joined
    for flag in ("-nodefaults", "-no-user-config", "-nographic", "-no-reboot"):
        assert flag in argv
    assert argv[argv.index("-M") + 1].startswith("microvm,rtc=on")
    assert "virtio-balloon-device,free-page-reporting=on" in joined
    assert f"name={qemu.AGENT_PORT}" in joined and f"fd={qemu.AGENT_FD}" in joined
    assert "readonly=on" in argv[argv.index("-drive") + 1]  # layer0 read-only
    assert argv[argv.index("-smp") + 1] == "2" and argv[argv.index("-m") + 1] == "256"
    cmdline = argv[argv.index("-append") + 1].split()
    assert "tsc_early_khz=2245780" in cmdline and f"lpj={2_245_780 * 1000 // 250}" in cmdline
    assert "tsc=reliable" in cmdline  # no fallback to jiffies on a loaded host (tickless idle)
    assert "rollbox.layers=1" in cmdline and "rollbox.rw=1" in cmdline
    assert argv[argv.index("-accel") + 1].startswith("tcg,tb-size=")
    # the guest CPU: x86-64-v2 for the guest's userspace, not `max` (slower boot and exec)
    cpu = argv[argv.index("-cpu") + 1].split(",")
    assert cpu[0] == "qemu64" and {"+ssse3", "+sse4.1", "+sse4.2", "+popcnt"} <= set(cpu)
    assert {"cryptomgr.notests", "noreplace-smp", "init_on_alloc=0"} <= set(cmdline)
    assert "-incoming" not in argv
    assert qemu.argv(qemu.MachineSpec(cpus=1, memory_mib=256, layers=0, incoming=True))[-2:] \
        == ["-incoming", "defer"]
    # free-page reporting goes off only when asked (the benchmark's comparison)
    quiet = qemu.argv(qemu.MachineSpec(cpus=1, memory_mib=256, layers=1,
                                       free_page_reporting=False))
    assert "virtio-balloon-device,free-page-reporting=off,deflate-on-oom=on" in quiet


def test_serve_prints_each_backend_and_the_microvm_accelerator() -> None:
    from rollbox.embedded import backend_lines

    cap = {"backends": {
        "container": {"offered": True, "facts": {"runtime": "runc"}},
        "microvm": {"offered": True, "facts": {"accel": "tcg", "accel_reason": "probe"}}}}
    assert backend_lines(cap) == ["backend container: offered",
                                  "backend microvm: accelerator tcg (probe)"]
    cap["backends"]["microvm"] = {"offered": False, "reason": "no guest"}
    assert backend_lines(cap)[1] == "backend microvm: not offered (no guest)"


def test_template_ram_is_a_file_shared_by_the_build_and_private_read_only_in_clones() -> None:
    base = qemu.MachineSpec(cpus=1, memory_mib=256, layers=1)
    assert "memory-backend" not in " ".join(qemu.argv(base))  # anonymous RAM by default
    build = qemu.argv(qemu.MachineSpec(**{**base.__dict__, "ram": qemu.RAM_SHARED}))
    clone = qemu.argv(qemu.MachineSpec(**{**base.__dict__, "ram": qemu.RAM_CLONE}))
    for argv in (build, clone):
        assert argv[argv.index("-M") + 1].endswith(",memory-backend=ram")
        backend = argv[argv.index("-object") + 1].split(",")
        assert backend[:4] == ["memory-backend-file", "id=ram", "size=256M",
                               f"mem-path={qemu.RAM_FILE}"]
    assert "share=on" in build[build.index("-object") + 1].split(",")
    # a clone: a private copy-on-write mapping of a file QEMU opens read-only
    assert clone[clone.index("-object") + 1].split(",")[4:] == [
        "share=off", "readonly=on", "rom=off"]
    try:
        qemu.argv(qemu.MachineSpec(**{**base.__dict__, "ram": "anything"}))
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown RAM kind was accepted")


def test_qemu_versions_that_map_a_read_only_file_private() -> None:
    assert qemu.version_tuple("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)") == (10, 0)
    assert qemu.version_tuple("QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7)") == (7, 2)
    assert qemu.version_tuple("") == (0, 0) and qemu.version_tuple("garbage") == (0, 0)
    assert (8, 2) <= qemu.version_tuple("QEMU emulator version 8.2.0") == (8, 2)
    assert qemu.version_tuple("QEMU emulator version 8.1.5") < qemu.PRIVATE_FILE_RAM_SINCE
    assert not qemu.private_file_ram("/nonexistent/qemu")


def test_firmware_is_qboot_from_qemu_8(monkeypatch: pytest.MonkeyPatch) -> None:
    """qboot loads the PVH kernel itself (bookworm-backports' SeaBIOS microvm build, which comes
    with QEMU 10, does not); 7.2 keeps its default, which boots faster."""
    spec = qemu.MachineSpec(cpus=1, memory_mib=256, layers=1)
    for text, want in (("QEMU emulator version 10.0.2 (Debian)", ["-bios", "qboot.rom"]),
                       ("QEMU emulator version 8.2.0", ["-bios", "qboot.rom"]),
                       ("QEMU emulator version 7.2.22 (Debian)", []), ("", [])):
        monkeypatch.setattr(qemu, "version", lambda binary, text=text: text)
        argv = qemu.argv(spec, "/usr/bin/qemu-system-x86_64")
        got = argv[argv.index("-bios"):argv.index("-bios") + 2] if "-bios" in argv else []
        assert got == want, text
