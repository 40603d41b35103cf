"""Red team F39: what the host reads back from a guest is hostile. Root in the guest replaces
the platform's busybox (the agent runs it by descriptor, so overwriting the file's contents
is enough) with a program that answers ``tar`` with an archive the attacker crafted: members
climbing out with ``..``, absolute names, a directory symlinked to the host's /tmp with a file
"inside" it, a hard link to /etc/passwd, a device node, a member claiming 64 GiB. Snapshot and
download parse that stream on the host: they end in a typed error or keep only what is safe,
nothing is written outside the capture, and the guest's disk is never mounted by the host.
Root in the guest also overwrites its own writable disk's ext4 superblock: the host still
never mounts it and tears it down."""
from __future__ import annotations

import io
import os
import secrets
import subprocess
import tarfile
from pathlib import Path

import pytest

from rollbox.errors import RollboxError
from rollbox.isolation.syscalls import read_mountinfo
from rollbox.models import ExecSpec, SandboxSpec, SnapshotSpec
from tests.conftest import new_name
from tests.redteam import qemu_jail
from tests.redteam.conftest import BB, Boxes, needs_root, static_helper

pytestmark = needs_root


@pytest.fixture(scope="module")
def evil_busybox() -> bytes:
    return static_helper("evil_busybox")


def crafted_tar(canary: str, climbing: bool) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        def add(info: tarfile.TarInfo, data: bytes = b"") -> None:
            info.size = len(data) if info.isreg() else 0
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)

        add(tarfile.TarInfo("./ok.txt"), b"fine\n")
        if climbing:
            add(tarfile.TarInfo(f"./../../../../../../tmp/{canary}-dotdot"), b"escaped\n")
            add(tarfile.TarInfo(f"/tmp/{canary}-abs"), b"escaped\n")
        link = tarfile.TarInfo("./link")
        link.type, link.linkname = tarfile.SYMTYPE, "/tmp"
        add(link)
        add(tarfile.TarInfo(f"./link/{canary}-vialink"), b"escaped\n")
        hard = tarfile.TarInfo("./passwd")
        hard.type, hard.linkname = tarfile.LNKTYPE, "/etc/passwd"
        add(hard)
        dev = tarfile.TarInfo("./mem")
        dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 1
        add(dev)
    data = bytearray(buf.getvalue().rstrip(b"\0"))
    # Last: a member claiming 64 GiB with a few bytes behind it.
    big = tarfile.TarInfo("./big")
    big.size = 64 << 30
    data += big.tobuf(format=tarfile.GNU_FORMAT) + b"x" * 4096
    return bytes(data)


def host_canaries(canary: str) -> list[str]:
    return [str(p) for p in Path("/tmp").glob(f"{canary}*")] + \
        [str(p) for p in Path("/").glob(f"{canary}*")]


async def hijack_tools(vms: Boxes, sid: str, evil: bytes, tar: bytes) -> None:
    await vms.edge.file_write(sid, "/tmp/.evil.tar", tar, 0o644)
    await vms.edge.file_write(sid, "/tmp/.evil-bb", evil, 0o755)
    r = await vms.run(sid, "cp /proc/1/root/platform/busybox /tmp/.real-bb && "
                      "cat /tmp/.evil-bb > /proc/1/root/platform/busybox && echo hijacked")
    assert r.stdout == "hijacked\n", r  # guest root may: the guest is its own


def no_host_mount_of(sid: str) -> None:
    assert not [m for m, _, src in read_mountinfo() if sid in m or sid in src]
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert sid not in loops, loops


@pytest.mark.microvm_slow
async def test_f39_crafted_snapshot_and_download_tars(vms: Boxes, evil_busybox: bytes,
                                                      names: list[str]) -> None:
    canary = f"rbx-f39-{secrets.token_hex(4)}"
    for climbing in (True, False):
        sid = await vms.make(BB, hardened=False)  # the guest's root with every capability
        pid = qemu_jail.qemu_pids_of(sid)[0]
        await hijack_tools(vms, sid, evil_busybox, crafted_tar(canary, climbing))
        name = new_name(names, "f39")
        try:
            res = await vms.edge.snapshot(sid, SnapshotSpec(name=name, pause=False, scrub=False),
                                          "redteam")
        except RollboxError as exc:
            res = exc  # a typed refusal is a safe outcome
        if isinstance(res, RollboxError):  # refused by the parser, so the attack reached it
            assert "stream" in str(res), res
        no_host_mount_of(sid)
        assert host_canaries(canary) == []
        if not isinstance(res, RollboxError):
            # What was kept is only what is safe: a container sandbox of the new image sees no
            # link into the host, no device, no file under the link.
            box = await vms.edge.create(SandboxSpec(image=name), "redteam")
            r = await vms.edge.exec_wait(box.id, await vms.edge.exec_start(box.id, ExecSpec(
                cmd=f"cat /ok.txt; test -e /mem && echo mem; ls /tmp | grep -c {canary} || true")))
            assert "mem\n" not in r.stdout and r.stdout.rstrip().endswith("0"), r
            await vms.edge.delete(box.id)
        # The file API's download of the same stream: typed error or a tar of safe members.
        got = b""
        try:
            async for chunk in vms.edge.download_tar(sid, "/"):
                got += chunk
                assert len(got) < 64 << 20
        except RollboxError as exc:
            assert "stream" in str(exc), exc
        else:
            with tarfile.open(fileobj=io.BytesIO(got)) as tf:
                for m in tf.getmembers():
                    assert not m.name.startswith("/") and ".." not in m.name.split("/"), m.name
                    assert not (m.ischr() or m.isblk()), m.name
                    assert not (m.islnk() and m.linkname.startswith("/")), m.name
        assert host_canaries(canary) == []
        await vms.edge.delete(sid)
        assert vms.edge.leftovers(sid) == [] and qemu_jail.qemu_pids_of(sid) == []
        assert not os.path.exists(f"/proc/{pid}")


async def test_f39_guest_garbles_its_own_disk(vms: Boxes) -> None:
    sid = await vms.make(BB, hardened=False)  # the guest's root with every capability
    # Root in the guest overwrites its writable disk's superblock (and more) under its own
    # mounted ext4: the guest's kernel may complain; the host never reads it as a filesystem.
    r = await vms.run(sid, "mkdir -p /tmp/sys && mount -t sysfs none /tmp/sys; "
                      "for d in /tmp/sys/block/vd*; do [ \"$(cat $d/serial)\" = rw ] && "
                      "mknod /tmp/rwdev b $(cat $d/dev | tr : ' '); done; "
                      "dd if=/dev/urandom of=/tmp/rwdev bs=1k seek=1 count=64 conv=notrunc "
                      "2>&1; sync; echo done", timeout_s=60)
    assert "done" in r.stdout, r
    no_host_mount_of(sid)
    try:
        await vms.edge.file_list(sid, "/tmp")  # through the guest: whatever it answers
    except RollboxError:
        pass
    no_host_mount_of(sid)
    await vms.edge.delete(sid)
    assert vms.edge.leftovers(sid) == []
