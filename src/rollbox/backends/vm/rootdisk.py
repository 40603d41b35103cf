"""The root disk of a disk image guest (docs/backends/vm.md, "Two kinds of guest", 2): a
per-sandbox qcow2 overlay over the node's read-only base disk image.

- The base is a VM disk image of ``rollbox.images.vmdisk`` (raw ext4, root-owned, no write
  permission for anyone): checked before a sandbox gets it (:meth:`RootDisks.verified`: the
  manifest's name, format and size, the file root's and not writable, its sha256 against the
  manifest; the hash once per file identity and backend, a 1.5 GiB disk hashes in seconds).
  QEMU gets it bound read-only at :data:`BASE_IMG` and opens it read-only: the host's copy is
  never written (three layers: the bind, the file's mode, QEMU's ``read-only=on``).
- The overlay is a NEW, empty qcow2 made by the host (``qemu-img create -f qcow2``, no
  backing file in its header) in the sandbox's own subvolume of the node's disk pool, bound
  writable at :data:`ROOT_QCOW2`. The backing chain is given to QEMU explicitly
  (:func:`blockdev_args`: the overlay's ``backing=`` is the base's node), so a header's
  backing name is never read, and the host never opens the overlay after the guest had it
  (red team F39): the teardown removes the subvolume with the file.
- Size: the overlay's virtual size is the base's (the guest's filesystem is the base's; it
  can not grow it), and what it can take on the host is bounded by the subvolume's qgroup,
  as a microVM's writable disk (``qgroup_cap`` of min(``disk_mib``, the base's size)): past
  it QEMU's writes fail and the guest gets I/O errors (``werror=report``), the host's disk
  is never filled.

Owns the overlay file and the base's checks; does not start QEMU or know the jail.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm.disks import qgroup_cap
from rollbox.config import Settings
from rollbox.errors import InfraError
from rollbox.images.vmdisk import VmDisk, resolve_vm_disk, verify_vm_disk

BASE_IMG = "/vm/base.img"
ROOT_QCOW2 = "/vm/root.qcow2"
OVERLAY_NAME = "root.qcow2"
ROOT_SERIAL = "root"
INIT_RE = re.compile(r"/[A-Za-z0-9._+/-]{1,200}")  # goes on the kernel command line


def blockdev_args() -> list[str]:
    """QEMU's root disk: the base read-only, the overlay over it with the base as its backing
    node (explicit: the overlay's header names no backing file, and none would be used), one
    virtio-blk-pci of serial ``root``; write errors reported to the guest (a full qgroup is
    the guest's I/O error, never a stopped VM)."""
    return [
        "-blockdev", f"driver=file,filename={BASE_IMG},node-name=basefile,read-only=on",
        "-blockdev", "driver=raw,file=basefile,node-name=base,read-only=on",
        "-blockdev", f"driver=file,filename={ROOT_QCOW2},node-name=rootfile,discard=unmap",
        "-blockdev", "driver=qcow2,file=rootfile,backing=base,node-name=root,discard=unmap",
        "-device", f"virtio-blk-pci,drive=root,serial={ROOT_SERIAL},werror=report,"
                   "rerror=report",
    ]


def overlay_cap(disk: VmDisk, disk_bytes: int) -> int:
    """New data a sandbox's overlay may hold: its disk quota, at most the base's size."""
    return min(disk_bytes, disk.bytes)


class RootDisks:
    """The VM disk images a backend boots, checked, and the overlays it makes of them."""

    def __init__(self, settings: Settings, pool: DiskPool) -> None:
        self.settings = settings
        self.pool = pool
        self._lock = threading.Lock()
        # name -> identity of the disk file whose sha256 matched its manifest
        self._verified: dict[str, tuple[int, int, int, int, str]] = {}

    def resolve(self, name: str) -> VmDisk:
        """The disk image ``name`` with its manifest checked (NotFound, InfraError); not
        hashed (see :meth:`verified`)."""
        disk = resolve_vm_disk(self.settings.vm_disks_dir, name)
        if not INIT_RE.fullmatch(disk.init) or "/../" in disk.init + "/":
            raise InfraError(f"VM disk image {name!r}: init {disk.init!r} is not an absolute "
                             "path of [A-Za-z0-9._+/-]", image=name)
        st = disk.disk.stat()
        if st.st_uid != 0 or st.st_mode & 0o222:
            raise InfraError(f"VM disk image {name!r}: {disk.disk} must be root's and not "
                             f"writable (mode {st.st_mode & 0o777:o}, uid {st.st_uid})",
                             image=name)
        return disk

    def verified(self, name: str) -> VmDisk:
        """:meth:`resolve`, and the disk's sha256 checked against its manifest the first time
        this backend sees this file (same inode, size and mtime later: not hashed again)."""
        disk = self.resolve(name)  # NotFound: not built here
        st = disk.disk.stat()
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, str(disk.manifest["sha256"]))
        with self._lock:
            if self._verified.get(name) == ident:
                return disk
        verify_vm_disk(disk)
        with self._lock:
            self._verified[name] = ident
        return disk

    def qemu_img(self) -> str:
        beside = Path(self.settings.qemu_binary).with_name("qemu-img")
        found = str(beside) if beside.is_file() else shutil.which("qemu-img")
        if found is None:
            raise InfraError("qemu-img not found (beside QEMU or on PATH)")
        return found

    def overlay_path(self, sandbox_id: str) -> Path:
        """Where the sandbox's overlay is (its subvolume's ``root.qcow2``)."""
        return self.pool.path(sandbox_id) / OVERLAY_NAME

    def create_overlay(self, sandbox_id: str, disk: VmDisk, disk_bytes: int,
                       owner_uid: int) -> Path:
        """A new empty qcow2 of the base's size in the sandbox's own subvolume (capped at
        ``qgroup_cap(overlay_cap)``), owned by its QEMU's uid."""
        self.pool.create(sandbox_id, qgroup_cap(overlay_cap(disk, disk_bytes)))
        path = self.overlay_path(sandbox_id)
        try:
            res = subprocess.run(
                [self.qemu_img(), "create", "-q", "-f", "qcow2", str(path), str(disk.bytes)],
                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            if res.returncode != 0:
                raise InfraError(f"qemu-img create of {sandbox_id}'s root overlay failed: "
                                 f"{res.stderr.strip()[-300:]}", sandbox_id=sandbox_id)
            os.chown(path, owner_uid, owner_uid)
            os.chmod(path, 0o600)
        except BaseException:
            self.pool.remove(sandbox_id)
            raise
        return path

    def clone_overlay(self, src_id: str, dst_id: str, owner_uid: int) -> Path:
        """A copy-on-write clone of subvolume ``src_id`` (a saved machine's, whose overlay a
        guest wrote) as ``dst_id``'s, its overlay owned by ``dst_id``'s QEMU uid. Nothing of
        the file is read: it is handed to the jailed QEMU as it is."""
        self.pool.clone(src_id, dst_id)
        path = self.overlay_path(dst_id)
        try:
            os.chown(path, owner_uid, owner_uid, follow_symlinks=False)
        except BaseException:
            self.pool.remove(dst_id)
            raise
        return path
