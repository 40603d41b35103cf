"""Red team: the node's shared mask filesystem (backends/container/masks.py) and /dev/shm.

A sandbox's /sys, and on the native runtime its masked directories (/proc/acpi, a hidden
directory), are binds of ONE read-only tmpfs of the node instead of a tmpfs each; /dev/shm is
a directory of the sandbox's /dev tmpfs on the native runtime (launcher.py ``_as_subdir``).
Attacked here from inside: a root with every capability and no seccomp filter (the
unhardened twin) can not make the shared superblock writable (it belongs to the host's user
namespace): even after it clears its own bind's read-only flag nothing it writes lands, and a
second sandbox sees the mask as it was made. /dev/shm keeps what a tmpfs of its own gave: mode
1777, its 64 MiB limit, noexec, and every page charged to the sandbox's memory cgroup.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from rollbox.isolation import cgroups, syscalls
from tests.redteam.conftest import BB, Boxes, container_only, needs_root

pytestmark = needs_root

WHY = "the mask filesystem and /dev/shm are container mounts (a guest's root owns its own)"
SKELETON = ["/sys", "/sys/devices", "/sys/devices/system", "/sys/devices/system/cpu",
            "/sys/devices/system/cpu/online", "/sys/devices/system/cpu/possible",
            "/sys/devices/system/cpu/present"]


def _mask(boxes: Boxes):  # noqa: ANN202 - the container backend's NodeMask
    return boxes.edge.backends["container"].mask


@container_only(WHY)
async def test_the_shared_mask_stays_read_only_for_a_root_with_every_capability(
        boxes: Boxes) -> None:
    mask = _mask(boxes)
    host_dev = os.stat(mask.path).st_dev
    twin = await boxes.make(BB, hardened=False)  # every capability, no seccomp, no masks
    r = await boxes.run(twin, "stat -c %d /sys; "
                        "mount -o remount,rw /sys 2>/dev/null; echo sb=$?; "
                        "mount -o remount,bind,rw /sys 2>/dev/null; echo bind=$?; "
                        "grep ' /sys ' /proc/self/mountinfo | cut -d' ' -f6; "
                        "touch /sys/planted 2>&1; echo w=$?; mkdir /sys/d 2>/dev/null; "
                        "echo d=$?; chmod 777 /sys 2>/dev/null; echo c=$?; "
                        "mknod /sys/n p 2>/dev/null; echo n=$?")
    out = r.stdout.split("\n")
    assert int(out[0]) == host_dev, r  # the node's one mask, not a tmpfs of its own
    assert out[1] != "sb=0", r  # its superblock is the host's: no remount of it
    # layer 1: its bind's read-only flag is locked (copied from the host's mount into the
    # sandbox's less privileged namespace), so even this root can not clear it
    assert out[2] != "bind=0" and out[3].split(",")[0] == "ro", r
    assert "Read-only file system" in out[4] and out[5] != "w=0", r
    assert len(out) >= 9 and not any(x.endswith("=0") for x in out[6:9]), r
    # a second sandbox, and the host, see the mask as it was made
    other = await boxes.make(BB)
    r = await boxes.run(other, "stat -c %d /sys; find /sys | sort")
    lines = r.stdout.split()
    assert int(lines[0]) == host_dev and lines[1:] == SKELETON, r
    assert mask.problems() == []


@container_only(WHY)
async def test_the_masks_superblock_alone_refuses_writes(boxes: Boxes, tmp_path: Path) -> None:
    """Layer 2 on its own: a bind of the mask whose own read-only flag is cleared (by the
    host's root, who may) still takes no write: the superblock is read-only."""
    mask = _mask(boxes)
    await boxes.make(BB)  # the mask is made for the first sandbox (prepare_run_dir)
    target = tmp_path / "rw-bind"
    target.mkdir()
    syscalls.mount(str(mask.path), target, None, syscalls.MS_BIND)
    try:
        # its own read-only flag cleared (the host's namespace: not locked; mountinfo and
        # statvfs show the superblock's read-only either way)
        syscalls.mount(None, target, None, syscalls.MS_REMOUNT | syscalls.MS_BIND)
        with pytest.raises(OSError) as err:
            (target / "empty" / "planted").write_text("x")
        assert err.value.errno == errno.EROFS
    finally:
        syscalls.umount(target)
    assert mask.problems() == []


@container_only(WHY)
async def test_a_masked_dir_is_the_shared_mask_on_the_native_runtime(boxes: Boxes) -> None:
    """/proc/acpi and a hidden directory: empty and read-only; on the native runtime binds of
    the node's mask (same device as the host's), on runc a tmpfs each (runc refuses mounts
    into /proc but its own masks)."""
    host_dev = os.stat(_mask(boxes).path).st_dev
    sid = await boxes.make(BB, hidden=("/task/tests",))
    await boxes.edge.file_write(sid, "/task/tests/secret.py", b"ANSWER = 42\n", 0o644)
    r = await boxes.run(sid, "for d in /proc/acpi /task/tests; do stat -c %d $d; "
                        "ls -A $d; echo ls=$?; done; cat /task/tests/secret.py 2>/dev/null "
                        "| grep -c ANSWER")
    # listable and empty (the mask: Landlock alone would refuse the listing), the file hidden
    acpi_dev, acpi_ls, tests_dev, tests_ls, found = r.stdout.split()
    assert acpi_ls == "ls=0" and tests_ls == "ls=0" and found == "0", r
    native = boxes.edge.settings.runtime == "native"
    assert (int(acpi_dev) == host_dev) == native and (int(tests_dev) == host_dev) == native, r


@container_only(WHY)
async def test_dev_shm_keeps_its_limit_mode_noexec_and_memory_cgroup(boxes: Boxes) -> None:
    sid = await boxes.make(BB, memory_mib=256)
    parent = boxes.edge.settings.cgroup_parent
    r = await boxes.run(sid, "stat -c %a /dev/shm; cp /bin/busybox /dev/shm/bb && "
                        "/dev/shm/bb true 2>/dev/null; echo x=$?; rm /dev/shm/bb")
    mode, exe = r.stdout.split()
    assert mode == "1777" and exe != "x=0", r  # writable by all, sticky; nothing runs from it
    before = cgroups.memory_bytes(parent, sid)
    r = await boxes.run(sid, "dd if=/dev/zero of=/dev/shm/a bs=1M count=32 2>/dev/null; "
                        "echo a=$?")
    assert r.stdout == "a=0\n", r
    after = cgroups.memory_bytes(parent, sid)
    assert before is not None and after is not None and after - before >= 30 << 20
    r = await boxes.run(sid, "dd if=/dev/zero of=/dev/shm/b bs=1M count=64 2>&1 | grep -i space; "
                        "du -sm /dev/shm | cut -f1")
    assert "No space left on device" in r.stdout, r
    assert int(r.stdout.split()[-1]) <= 64, r  # the 64 MiB limit, shared by a and b
