"""A microVM's disks: its EROFS layers (read-only) and its writable ext4 disk.

Layers are the image store's plain EROFS files (``rollbox.images.layer_files``: a lazy layer
is pulled whole into the store first), handed to QEMU read-only as virtio-blk; the guest mounts
them.

The writable disk is a sparse file ``rw.img`` of exactly the sandbox's ``disk_mib`` in its
own subvolume ``<id>`` of the node's btrfs disk pool (``backends/container/disk.py``), so a
template's disk is cloned by snapshot/reflink and the qgroup bounds what the file can ever
take on the host (twice the cap plus metadata: copy-on-write rewrites may briefly reference
more than the file's size). A spare QEMU's disk, opened by QEMU when it started, gets a fork's
content in place (:meth:`VmDisks.fill_rw`: FICLONE into the same inode, so the descriptor QEMU
holds reads the fork's extents; the kernel drops the file's page cache, and later writes are
copy-on-write, the fork's file untouched). The host formats it (``mkfs.ext4`` on the fresh, never-booted
file) and never mounts it: once a guest has had it, its content is the guest's, read only
through the agent or a userspace parser.

Owns the disk files; does not know QEMU or the jail.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
from pathlib import Path

from rollbox.backends.container.disk import DiskPool
from rollbox.errors import InfraError
from rollbox.images.layer_files import local_layer_file
from rollbox.images.store import ImageStore

RW_NAME = "rw.img"
FICLONE = 0x40049409  # ioctl: the whole of a file's extents shared into another (btrfs reflink)
QGROUP_SLACK = 64 << 20


def qgroup_cap(disk_bytes: int) -> int:
    return 2 * disk_bytes + QGROUP_SLACK


class VmDisks:
    def __init__(self, pool: DiskPool, store: ImageStore) -> None:
        self.pool = pool
        self.store = store

    async def layer_files(self, digests: list[str]) -> list[Path]:
        """Local EROFS files of the layers, pulling lazy ones whole first (NotFound for an
        unknown layer)."""
        return [await local_layer_file(self.store, digest) for digest in digests]

    def rw_path(self, sandbox_id: str) -> Path:
        return self.pool.path(sandbox_id) / RW_NAME

    def create_rw(self, sandbox_id: str, disk_bytes: int, owner_uid: int) -> Path:
        """A fresh ext4 disk of ``disk_bytes`` for the sandbox, owned by its QEMU's uid."""
        subvol = self.pool.create(sandbox_id, qgroup_cap(disk_bytes))
        path = subvol / RW_NAME
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, disk_bytes)
            finally:
                os.close(fd)
            res = subprocess.run(
                ["mkfs.ext4", "-q", "-F", "-m", "0", "-L", "rollbox-rw",
                 "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", str(path)],
                capture_output=True, text=True, timeout=60)
            if res.returncode != 0:
                raise InfraError(f"mkfs.ext4 of {sandbox_id}'s disk failed: "
                                 f"{res.stderr.strip()[-300:]}")
            os.chown(path, owner_uid, owner_uid)
        except BaseException:
            self.pool.remove(sandbox_id)
            raise
        return path

    def clone_rw(self, src_id: str, dst_id: str, owner_uid: int) -> Path:
        """A copy-on-write clone of ``src_id``'s disk as ``dst_id``'s (template restore,
        fork): the subvolume is snapshotted, nothing copied. The source VM must be stopped
        or saved for the copy to be consistent."""
        self.pool.clone(src_id, dst_id)
        path = self.rw_path(dst_id)
        try:
            os.chown(path, owner_uid, owner_uid)
        except BaseException:
            self.pool.remove(dst_id)
            raise
        return path

    def fill_rw(self, src_id: str, dst_id: str) -> None:
        """``dst_id``'s disk file (the same inode: a running QEMU's descriptor on it sees the
        change) made a copy-on-write clone of ``src_id``'s by FICLONE: nothing copied, the
        destination's page cache dropped by the kernel, later writes to either side their own.
        The sizes must be equal (QEMU sized its virtio disk at start); InfraError otherwise,
        or if the kernel refuses (the destination unchanged then)."""
        src = dst = -1
        try:
            src = os.open(self.rw_path(src_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            dst = os.open(self.rw_path(dst_id), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            have, want = os.fstat(dst).st_size, os.fstat(src).st_size
            if have != want:
                raise InfraError(f"disk of {dst_id} is {have} bytes, the fork's {want}: not "
                                 "filled", sandbox_id=dst_id)
            fcntl.ioctl(dst, FICLONE, src)
        except OSError as exc:
            raise InfraError(f"disk of {dst_id} not filled from {src_id}: {exc}",
                             sandbox_id=dst_id) from exc
        finally:
            for fd in (src, dst):
                if fd >= 0:
                    os.close(fd)

    def remove_rw(self, sandbox_id: str) -> list[str]:
        return self.pool.remove(sandbox_id)

    def leftovers(self, sandbox_id: str) -> list[str]:
        return self.pool.leftovers(sandbox_id)

    async def create_rw_async(self, sandbox_id: str, disk_bytes: int, owner_uid: int) -> Path:
        return await asyncio.to_thread(self.create_rw, sandbox_id, disk_bytes, owner_uid)
