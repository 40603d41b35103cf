"""btrfs subvolumes and qgroup limits through the kernel's ioctls, and loop devices (x86_64).

Thin wrappers, no state: each call takes paths or descriptors and raises OSError with errno on
failure. The ioctl numbers are computed here from the kernel's ``_IOC`` encoding and the
structure sizes of ``<linux/btrfs.h>`` / ``<linux/loop.h>``; a unit test compiles those headers
and compares. Pool policy (where, how big, which caps) lives in the backend's ``disk`` module.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BTRFS_SUPER_MAGIC = 0x9123683E
BTRFS_IOCTL_MAGIC = 0x94
# The inode number of every subvolume's root directory (BTRFS_FIRST_FREE_OBJECTID).
SUBVOL_ROOT_INO = 256

_IOC_WRITE, _IOC_READ = 1, 2


def _ioc(direction: int, nr: int, size: int, kind: int = BTRFS_IOCTL_MAGIC) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | nr


# Structure sizes from <linux/btrfs.h>.
VOL_ARGS_SIZE = 4096          # struct btrfs_ioctl_vol_args {s64 fd; char name[4088]}
VOL_ARGS_V2_SIZE = 4096       # struct btrfs_ioctl_vol_args_v2
VOL_ARGS_V2_NAME_MAX = 4039   # BTRFS_SUBVOL_NAME_MAX
INO_LOOKUP_SIZE = 4096        # struct btrfs_ioctl_ino_lookup_args {u64 treeid, objectid; name[4080]}
FS_INFO_SIZE = 1024           # struct btrfs_ioctl_fs_info_args
QUOTA_CTL_SIZE = 16           # struct btrfs_ioctl_quota_ctl_args {u64 cmd, status}
QGROUP_CREATE_SIZE = 16       # struct btrfs_ioctl_qgroup_create_args {u64 create, qgroupid}

BTRFS_IOC_SYNC = _ioc(0, 8, 0)
BTRFS_IOC_SUBVOL_CREATE = _ioc(_IOC_WRITE, 14, VOL_ARGS_SIZE)
BTRFS_IOC_SNAP_DESTROY = _ioc(_IOC_WRITE, 15, VOL_ARGS_SIZE)
BTRFS_IOC_INO_LOOKUP = _ioc(_IOC_READ | _IOC_WRITE, 18, INO_LOOKUP_SIZE)
BTRFS_IOC_SNAP_CREATE_V2 = _ioc(_IOC_WRITE, 23, VOL_ARGS_V2_SIZE)
BTRFS_IOC_SUBVOL_CREATE_V2 = _ioc(_IOC_WRITE, 24, VOL_ARGS_V2_SIZE)
BTRFS_IOC_FS_INFO = _ioc(_IOC_READ, 31, FS_INFO_SIZE)
BTRFS_IOC_QUOTA_CTL = _ioc(_IOC_READ | _IOC_WRITE, 40, QUOTA_CTL_SIZE)
BTRFS_IOC_QGROUP_CREATE = _ioc(_IOC_WRITE, 42, QGROUP_CREATE_SIZE)
BTRFS_IOC_SNAP_DESTROY_V2 = _ioc(_IOC_WRITE, 63, VOL_ARGS_V2_SIZE)

BTRFS_SUBVOL_RDONLY = 1 << 1
BTRFS_SUBVOL_QGROUP_INHERIT = 1 << 2
BTRFS_QGROUP_INHERIT_SET_LIMITS = 1 << 0
BTRFS_QGROUP_LIMIT_MAX_RFER = 1 << 0
BTRFS_QUOTA_CTL_ENABLE = 1

# <linux/loop.h>: plain numbers, not _IOC encoded.
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
LOOP_INFO64_SIZE = 232
LOOP_CONFIG_SIZE = 304        # struct loop_config {u32 fd, block_size; loop_info64; u64[8]}


def _name(name: str, limit: int) -> bytes:
    raw = os.fsencode(name)
    if not raw or b"/" in raw or b"\0" in raw or raw in (b".", b"..") or len(raw) > min(limit, 255):
        raise ValueError(f"bad subvolume name {name!r}")
    return raw


def _limit_inherit(max_referenced: int) -> bytearray:
    """A ``struct btrfs_qgroup_inherit`` (no parent qgroups) that sets a referenced-bytes
    limit on the new subvolume's qgroup in the same transaction that creates it."""
    lim = struct.pack("<5Q", BTRFS_QGROUP_LIMIT_MAX_RFER, max_referenced, 0, 0, 0)
    return bytearray(struct.pack("<4Q", BTRFS_QGROUP_INHERIT_SET_LIMITS, 0, 0, 0) + lim)


def _vol_args_v2(fd: int, flags: int, name: bytes, inherit: bytearray | None,
                 keep: list) -> bytearray:
    buf = bytearray(VOL_ARGS_V2_SIZE)
    size, ptr = 0, 0
    if inherit is not None:
        cbuf = (ctypes.c_char * len(inherit)).from_buffer(inherit)
        keep.append(cbuf)  # the kernel reads it through the pointer during the ioctl
        size, ptr = len(inherit), ctypes.addressof(cbuf)
    struct.pack_into("<qQQQQ", buf, 0, fd, 0, flags, size, ptr)
    buf[56:56 + len(name)] = name
    return buf


def subvol_create(parent_fd: int, name: str, max_referenced: int) -> None:
    """Create subvolume ``name`` in the directory ``parent_fd`` with its qgroup limited to
    ``max_referenced`` bytes (quotas must be enabled)."""
    keep: list = []
    args = _vol_args_v2(0, BTRFS_SUBVOL_QGROUP_INHERIT, _name(name, VOL_ARGS_V2_NAME_MAX),
                        _limit_inherit(max_referenced), keep)
    fcntl.ioctl(parent_fd, BTRFS_IOC_SUBVOL_CREATE_V2, args)


def snapshot(src_fd: int, parent_fd: int, name: str, max_referenced: int,
             readonly: bool = False) -> None:
    """Snapshot of the subvolume open at ``src_fd`` as ``name`` in ``parent_fd``, sharing
    every extent (no data copied), its qgroup limited to ``max_referenced``; ``readonly``:
    nothing can change it afterwards (a fork's shared lower)."""
    keep: list = []
    flags = BTRFS_SUBVOL_QGROUP_INHERIT | (BTRFS_SUBVOL_RDONLY if readonly else 0)
    args = _vol_args_v2(src_fd, flags, _name(name, VOL_ARGS_V2_NAME_MAX),
                        _limit_inherit(max_referenced), keep)
    fcntl.ioctl(parent_fd, BTRFS_IOC_SNAP_CREATE_V2, args)


def subvol_delete(parent_fd: int, name: str) -> None:
    """Delete subvolume ``name`` of ``parent_fd`` with all its content (the kernel drops the
    tree in the background; the name is gone when this returns)."""
    args = bytearray(VOL_ARGS_SIZE)
    raw = _name(name, 4087)
    args[8:8 + len(raw)] = raw
    fcntl.ioctl(parent_fd, BTRFS_IOC_SNAP_DESTROY, args)


def subvol_id(fd: int) -> int:
    """The subvolume (tree) id of the subvolume that ``fd`` lies in."""
    args = bytearray(INO_LOOKUP_SIZE)
    struct.pack_into("<QQ", args, 0, 0, SUBVOL_ROOT_INO)
    fcntl.ioctl(fd, BTRFS_IOC_INO_LOOKUP, args)
    return struct.unpack_from("<Q", args, 0)[0]


def fsid(fd: int) -> str:
    """The filesystem's UUID as sysfs names it (``/sys/fs/btrfs/<fsid>``)."""
    args = bytearray(FS_INFO_SIZE)
    fcntl.ioctl(fd, BTRFS_IOC_FS_INFO, args)
    raw = bytes(args[16:32]).hex()
    return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def quota_enable(fd: int) -> None:
    fcntl.ioctl(fd, BTRFS_IOC_QUOTA_CTL, bytearray(struct.pack("<QQ", BTRFS_QUOTA_CTL_ENABLE, 0)))


def qgroup_destroy(fd: int, qgroupid: int) -> None:
    """Remove qgroup ``qgroupid`` (level 0: ``0/<subvolume id>``); EBUSY while its subvolume
    is not fully dropped yet."""
    fcntl.ioctl(fd, BTRFS_IOC_QGROUP_CREATE, bytearray(struct.pack("<QQ", 0, qgroupid)))


def qgroup_dir(fs_uuid: str, subvolid: int) -> Path:
    """The kernel's sysfs view of qgroup ``0/<subvolid>`` (limits and usage, read-only)."""
    return Path("/sys/fs/btrfs") / fs_uuid / "qgroups" / f"0_{subvolid}"


@contextmanager
def loop_attached(backing: str | os.PathLike[str]) -> Iterator[str]:
    """Attach ``backing`` to a free loop device with autoclear and direct I/O (no second page
    cache of the file on the host); yields the device path. Mount it inside the block: with
    autoclear the device detaches itself at the last close when nothing mounted it, and when
    its filesystem is unmounted later."""
    file_fd = os.open(backing, os.O_RDWR | os.O_CLOEXEC)
    ctl = -1
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        for _ in range(16):  # another process may take the free device first
            dev = f"/dev/loop{fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)}"
            dev_fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            try:
                config = bytearray(LOOP_CONFIG_SIZE)
                # loop_config: fd, block_size, then loop_info64 whose lo_flags is at 52.
                struct.pack_into("<II", config, 0, file_fd, 4096)
                struct.pack_into("<I", config, 8 + 52, LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO)
                try:
                    fcntl.ioctl(dev_fd, LOOP_CONFIGURE, config)
                except OSError as exc:
                    if exc.errno == errno.EBUSY:
                        continue  # taken meanwhile
                    raise
                yield dev
                return
            finally:
                os.close(dev_fd)
        raise OSError(errno.EBUSY, "no free loop device")
    finally:
        if ctl >= 0:
            os.close(ctl)
        os.close(file_fd)


def loop_devices_of(backing: str | os.PathLike[str]) -> list[str]:
    """Loop devices attached to the file at ``backing`` (as sysfs names their backing file)."""
    want = os.path.realpath(backing)
    out = []
    for block in Path("/sys/block").glob("loop*"):
        try:
            name = (block / "loop" / "backing_file").read_text().rstrip("\n")
        except OSError:
            continue  # not attached
        if name == want:
            out.append(f"/dev/{block.name}")
    return out
