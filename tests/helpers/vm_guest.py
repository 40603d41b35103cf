"""A tiny guest for tests of the microVM plumbing (QEMU, jail, QMP, disks) that do not need
the agent: the guest kernel (``make guest``'s ``build/guest/vmlinux``, else extracted here from
the Debian kernel deb ``make guest`` unpacked, whose modules it also takes) and a busybox initramfs whose /init loads the virtio modules and
writes one line ``READY <serials of its disks>`` to the agent's port, or nothing at all when
the kernel command line says ``rollbox.test=silent`` (a guest that never answers)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm.backend import MicroVMBackend
from rollbox.images.store import ImageStore
from rollbox.isolation.userns import UidSlots
from rollbox.config import Settings
from tests.conftest import have_image, node_settings



def real_guest_marks(*images: str) -> list[pytest.MarkDecorator]:
    """A test module's marks for booting the real guest (``make guest``) as root with
    ``images`` built: skipped, with the reason, where one of them is missing."""
    marks = [pytest.mark.root,
             pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
             pytest.mark.skipif(not Settings().vm_initrd.is_file(),
                                reason="no guest (make guest)")]
    return marks + [pytest.mark.skipif(not have_image(i), reason=f"{i} not built")
                    for i in images]


def full_vm_marks(*images: str) -> list[pytest.MarkDecorator]:
    """The marks of a test module booting the full-VM guest (``make vmguest``) as root with
    ``images`` built: skipped, with the reason, where one is missing."""
    return [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
            pytest.mark.skipif(not Settings().vm_full_initrd.is_file(),
                               reason="no full-VM guest (make vmguest)")] + [
        pytest.mark.skipif(not have_image(i), reason=f"{i} not built") for i in images]


MODULES = ["drivers/virtio/virtio_ring.ko", "drivers/virtio/virtio.ko",
           "drivers/virtio/virtio_mmio.ko", "drivers/char/virtio_console.ko",
           "drivers/block/virtio_blk.ko", "drivers/virtio/virtio_balloon.ko"]

INIT = """#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
for m in virtio_ring virtio virtio_mmio virtio_console virtio_blk virtio_balloon; do
  $B insmod /lib/modules/$m.ko
done
if $B grep -q rollbox.test=silent /proc/cmdline; then
  while true; do $B sleep 1000; done
fi
n=0
while [ ! -e /sys/class/virtio-ports ] && [ $n -lt 100 ]; do $B sleep 0.05; n=$((n+1)); done
port=/dev/$($B grep -l org.rollbox.agent /sys/class/virtio-ports/*/name | $B cut -d/ -f5)
serials=""
for f in /sys/block/vd*/serial; do serials="$serials $($B cat $f)"; done
echo "READY $serials" > $port
while true; do $B sleep 1000; done
"""


def _cpio_entry(out, name: str, mode: int, data: bytes, ino: int) -> None:  # noqa: ANN001
    name_b = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name_b), 0)
    out.write(("070701" + "".join(f"{v:08X}" for v in fields)).encode() + name_b)
    out.write(b"\0" * (-(110 + len(name_b)) % 4))
    out.write(data + b"\0" * (-len(data) % 4))


def write_cpio(root: Path, dst: Path) -> None:
    """A newc cpio of the tree at ``root`` (regular files, dirs, symlinks), owned by root."""
    ino = 1
    with open(dst, "wb") as out:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel = os.path.relpath(dirpath, root)
            if rel != ".":
                ino += 1
                _cpio_entry(out, rel, stat.S_IFDIR | 0o755, b"", ino)
            for fn in sorted(filenames):
                p = Path(dirpath) / fn
                r = os.path.normpath(os.path.join(rel, fn))
                st = p.lstat()
                ino += 1
                if stat.S_ISLNK(st.st_mode):
                    _cpio_entry(out, r, stat.S_IFLNK | 0o777, os.readlink(p).encode(), ino)
                else:
                    _cpio_entry(out, r, stat.S_IFREG | (st.st_mode & 0o7777), p.read_bytes(),
                                ino)
        _cpio_entry(out, "TRAILER!!!", 0, b"", ino + 1)


def unpacked_kernel(guest_build: Path) -> tuple[Path, str] | None:
    """(tree, release) of the kernel deb ``make guest`` unpacked into ``guest_build``'s cache
    (named by its manifest), or None before ``make guest``."""
    try:
        deb = json.loads((guest_build / "manifest.json").read_text())["deb"]
    except (OSError, ValueError, KeyError):
        return None
    tree = guest_build / "cache" / Path(deb).stem
    mods = tree / "lib" / "modules"
    release = next((p.name for p in mods.iterdir()), None) if mods.is_dir() else None
    return (tree, release) if release else None


def extract_vmlinux(vmlinuz: Path, dst: Path) -> None:
    """The ELF vmlinux inside a bzImage (its payload; LZ4 in Debian's cloud kernel)."""
    data = vmlinuz.read_bytes()
    setup_sects = data[0x1F1] or 4
    offset, length = struct.unpack_from("<II", data, 0x248)
    start = (setup_sects + 1) * 512 + offset
    payload = data[start:start + length]
    tool = {b"\x02\x21\x4c\x18": ["lz4", "-d", "-c"], b"\x28\xb5\x2f\xfd": ["zstd", "-d", "-c"],
            b"\xfd7zX": ["xz", "-d", "-c"]}.get(payload[:4])
    if tool is None:
        raise RuntimeError(f"unknown kernel payload {payload[:4].hex()}")
    # The payload ends with the decompressed size, which lz4 reports as trailing garbage:
    # the exit status says nothing, the ELF header does.
    out = subprocess.run(tool, input=payload, capture_output=True).stdout
    if out[:4] != b"\x7fELF":
        raise RuntimeError("kernel payload is not an ELF")
    dst.write_bytes(out)


def build_test_guest(dest: Path, guest_build: Path, init: str = INIT,
                     modules: list[str] = MODULES) -> tuple[Path, Path] | None:
    """(kernel, initramfs) of the test guest under ``dest``; None if no kernel is at hand.
    init/modules: another /init script and the modules it loads (from /lib/modules)."""
    unpacked = unpacked_kernel(guest_build)
    if unpacked is None or shutil.which("busybox") is None:
        return None
    deb_tree, release = unpacked
    dest.mkdir(parents=True, exist_ok=True)
    kernel = guest_build / "vmlinux"
    if not kernel.is_file():
        kernel = dest / "vmlinux"
        if not kernel.exists():
            vmlinuz = deb_tree / "boot" / f"vmlinuz-{release}"
            extract_vmlinux(vmlinuz, dest / "vmlinux.tmp")
            os.replace(dest / "vmlinux.tmp", kernel)
    tree = dest / "initramfs"
    shutil.rmtree(tree, ignore_errors=True)
    for d in ("bin", "lib/modules", "dev", "proc", "sys", "tmp"):
        (tree / d).mkdir(parents=True)
    shutil.copy(shutil.which("busybox"), tree / "bin" / "busybox")  # type: ignore[arg-type]
    for m in modules:
        shutil.copy(deb_tree / "lib" / "modules" / release / "kernel" / m,
                    tree / "lib" / "modules" / Path(m).name)
    (tree / "init").write_text(init)
    (tree / "init").chmod(0o755)
    initrd = dest / "initramfs.cpio"
    write_cpio(tree, initrd)
    return kernel, initrd


def guest_or_skip(dest: Path, guest_build: Path, **kw: Any) -> tuple[Path, Path]:
    """``build_test_guest``, or skip the test when no kernel is at hand."""
    built = build_test_guest(dest, guest_build, **kw)
    if built is None:
        pytest.skip("no guest kernel at hand (run `make guest`)")
    return built


@asynccontextmanager
async def started_guest_backend(tmp_node_dir: Path, guest: tuple[Path, Path],
                                connect_agent: Callable[[str, float], Awaitable[Any]],
                                backend_cls: type[MicroVMBackend] = MicroVMBackend,
                                ) -> AsyncIterator[MicroVMBackend]:
    """A started microVM backend (TCG) of the test node booting the test guest, whose agent
    channel is ``connect_agent``'s stand-in; its node resources released afterwards."""
    settings = node_settings(tmp_node_dir)
    settings.vm_kernel, settings.vm_initrd = guest
    settings.vm_accel = "tcg"
    slots = UidSlots(settings.uid_base, settings.uid_slots)
    pool = DiskPool(settings)
    b = backend_cls(settings, slots, ImageStore(settings.images_dir), pool,
                    connect_agent=connect_agent)
    await b.start()
    try:
        yield b
    finally:
        b.release_node_resources()
        pool.release()
        slots.close()


async def agent_run(vm: Any, argv: list[str], timeout_ms: int = 60_000, backend: Any = None,
                    path: str = "PATH=/usr/local/bin:/usr/bin:/bin") -> tuple[int, bytes]:
    """(exit code, stdout + stderr) of ``argv`` run through a VM's agent channel, with
    ``backend.prepare_exec`` first when given (as the edge does before every exec)."""
    from rollbox.agent.protocol import ExecRequest

    if backend is not None:
        await backend.prepare_exec(vm)
    session = await vm.channel.exec(ExecRequest(argv=argv, env=[path], timeout_ms=timeout_ms))
    out = b""
    code = -1
    async for kind, payload in session.events():
        if kind in ("stdout", "stderr"):
            out += payload
        elif kind == "exited":
            code = payload.exit_code
    return code, out


@asynccontextmanager
async def full_vm_template_backend(settings: Settings) -> AsyncIterator[Any]:
    """A started "vm" backend of ``settings`` that makes a template of every guest it boots
    (TCG, no idle squeeze, steps logged to the data dir), stopped at the end with no
    template left."""
    from rollbox.backends.vm.backend import VMBackend

    settings.vm_accel = "tcg"
    settings.vm_idle_squeeze_s = 0
    settings.vm_full_templates = "all"
    settings.vm_step_log = settings.data_dir / "steps.jsonl"
    pool = DiskPool(settings)
    b = VMBackend(settings, UidSlots(settings.uid_base, settings.uid_slots),
                  ImageStore(settings.images_dir), pool)
    try:
        await b.start()
        yield b
    finally:
        left = b.machine_templates.clear()
        b.release_node_resources()
        pool.release()
        assert left == []
