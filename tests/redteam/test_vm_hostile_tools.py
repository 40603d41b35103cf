"""Red team F39/F40 on a real microVM: the guest's root replaces the platform's own busybox.

Inside a VM the guest's root owns the guest: it reaches the initramfs through /proc/1/root and
overwrites /platform/busybox in place (the agent runs it by descriptor, so its new content is
what runs). From then on every platform tool the host runs answers with whatever the guest
chose; here a crafted tar (a link to /etc, then a member through it) and an endless flood. The
host must treat both as the hostile input they are: typed errors, nothing written outside the
snapshot's staging dir, no image made, memory and time bounded, the edge and other sandboxes
unaffected, and the sandbox still deletable with a verified teardown."""
from __future__ import annotations

import asyncio
import io
import os
import struct
import tarfile
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.config import REPO_ROOT
from rollbox.models import ExecSpec, Resources, SandboxSpec, SnapshotSpec
from tests.conftest import have_image, new_name
from tests.redteam.conftest import create_flags

pytestmark = [
    pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(not (REPO_ROOT / "build/guest/manifest.json").exists()
                       or not have_image("busybox:test"), reason="no guest or busybox:test")]
CANARY = Path("/etc/passwd")


def tiny_elf(payload: bytes, loop: bool = False) -> bytes:
    """A static x86-64 ELF writing ``payload`` to stdout once (or forever), then exit 0: what
    a guest's root can put in place of any binary."""
    base, hdr = 0x400000, 64 + 56
    code = bytearray(b"\xb8\x01\x00\x00\x00\xbf\x01\x00\x00\x00")  # write(1, ...)
    lea = len(code)
    code += b"\x48\x8d\x35\0\0\0\0" + b"\xba" + struct.pack("<I", len(payload)) + b"\x0f\x05"
    if loop:
        code += b"\xeb" + struct.pack("<b", -(len(code) + 2))
    else:
        code += b"\xb8\x3c\x00\x00\x00\x31\xff\x0f\x05"  # exit(0)
    code[lea + 3:lea + 7] = struct.pack("<i", len(code) - (lea + 7))
    body = bytes(code) + payload
    size = hdr + len(body)
    ehdr = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + struct.pack(
        "<HHIQQQIHHHHHH", 2, 62, 1, base + hdr, 64, 0, 0, 64, 56, 1, 0, 0, 0)
    return ehdr + struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, size, size, 0x1000) + body


def crafted_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, kind, link, data in ((".", tarfile.DIRTYPE, "", None),
                                       ("l", tarfile.SYMTYPE, "/etc", None),
                                       ("l/passwd", tarfile.REGTYPE, "", b"owned\n")):
            ti = tarfile.TarInfo(name)
            ti.type, ti.linkname = kind, link
            ti.size = len(data) if data else 0
            tf.addfile(ti, io.BytesIO(data) if data else None)
    return buf.getvalue()


async def sh(edge, sid: str, cmd: str) -> None:  # noqa: ANN001
    res = await edge.exec_wait(sid, await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=60)))
    assert res.exit_code == 0, (cmd, res)


async def test_guest_replaced_platform_busybox(edge, names: list[str]) -> None:  # noqa: ANN001
    before = CANARY.read_bytes()
    other = await edge.create(SandboxSpec(image="busybox:test"), "p")
    with create_flags(edge, "microvm", hardened=False):  # the guest's root, every capability
        vm = await edge.create(SandboxSpec(image="busybox:test", backend="microvm",
                                           resources=Resources(cpus=1, memory_mib=256,
                                                               disk_mib=64)), "p")
    staging = edge.store.tmp_dir
    staged_before = set(os.listdir(staging)) if staging.is_dir() else set()
    await edge.file_write(vm.id, "/tmp/evil", tiny_elf(crafted_tar()), 0o755)
    await edge.file_write(vm.id, "/tmp/flood", tiny_elf(b"\0" * 4096, loop=True), 0o755)
    # the guest's root: out of the chroot through PID 1's root, over the platform's busybox
    await sh(edge, vm.id, "cat /tmp/evil > /proc/1/root/platform/busybox")
    name = new_name(names)
    with pytest.raises(errors.InfraError):
        await asyncio.wait_for(edge.snapshot(vm.id, SnapshotSpec(name=name), "p"), 120)
    assert not edge.store.exists(name)
    with pytest.raises(errors.InfraError):  # the stat record is a tar: malformed
        await asyncio.wait_for(edge.file_read(vm.id, "/etc/hostname", 1 << 20), 60)
    with pytest.raises(errors.InfraError):
        await asyncio.wait_for(edge.file_list(vm.id, "/"), 60)
    # a flood: every tool answers with endless output, killed at its cap
    await sh(edge, vm.id, "cat /tmp/flood > /proc/1/root/platform/busybox")
    with pytest.raises((errors.InfraError, errors.PayloadTooLarge)):
        await asyncio.wait_for(edge.file_stat(vm.id, "/etc/passwd"), 60)
    with pytest.raises((errors.InfraError, errors.PayloadTooLarge)):
        chunks = [c async for c in edge.download_tar(vm.id, "/tmp")]
        del chunks
    assert CANARY.read_bytes() == before
    assert (set(os.listdir(staging)) if staging.is_dir() else set()) == staged_before
    # the edge and the other sandbox are fine; the VM is deleted with a verified teardown
    await sh(edge, other.id, "true")
    await edge.delete(vm.id)
    assert edge.leftovers(vm.id) == []
    await edge.delete(other.id)
