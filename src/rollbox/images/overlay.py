"""The overlayfs format of a layer tree: whiteouts (0:0 character devices), opaque directories
(``trusted.overlay.opaque=y``), the overlay's private xattrs, merging one layer tree over
another, and the id mapping from a sandbox's shifted ids back to the image's.

mkfs.erofs keeps whiteouts and opaque markers, so a tree in this format stacks under overlayfs
as is. A leaf of :mod:`rollbox.images`: used by the sources, snapshots, squash and the agent's
snapshot of a microVM; imports nothing of rollbox.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

OPAQUE_XATTR = "trusted.overlay.opaque"
# Consecutive layers smaller than this (extracted) are merged into one EROFS layer.
SMALL_LAYER_BYTES = 16 * 2**20
# Overlay xattrs that only make sense inside the upper's own overlay mount.
DROPPED_OVERLAY_XATTRS = ("trusted.overlay.", "user.overlay.")
REFUSED_OVERLAY_XATTRS = {"trusted.overlay.redirect", "trusted.overlay.metacopy",
                          "user.overlay.redirect", "user.overlay.metacopy"}
ID_RANGE = 65536  # ids of one sandbox: its host uid/gid shift + [0, ID_RANGE)
NOBODY = 65534


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def make_whiteout(path: Path | str) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def is_opaque(path: Path | str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def set_opaque(path: Path | str) -> None:
    os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)


def clear_opaque(path: Path | str) -> None:
    try:
        os.removexattr(path, OPAQUE_XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno != errno.ENODATA:
            raise


def remove_entry(path: Path) -> None:
    st = lstat_or_none(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def lstat_or_none(path: Path | str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def map_id(value: int, shift: int) -> int:
    """A host uid/gid of a sandbox whose root is ``shift`` as the image's id (outside its
    range: nobody)."""
    if shift <= 0:
        return value
    if shift <= value < shift + ID_RANGE:
        return value - shift
    return NOBODY


# ---- merging layers ------------------------------------------------------------------------

def _copy_dir_meta(src: Path, dst: Path) -> None:
    st = os.lstat(src)
    os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    for name in os.listxattr(src, follow_symlinks=False):
        if name == OPAQUE_XATTR:
            continue
        os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False),
                    follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def merge_layer_dir(group: Path, layer: Path, *, keep_whiteouts: bool) -> None:
    """Apply overlay-format ``layer`` on top of ``group`` (both staging dirs), consuming it.

    ``keep_whiteouts``: other layers lie below ``group``, so its whiteouts and opaque markers
    must survive the merge to keep hiding their files.
    """
    for name in os.listdir(layer):
        src, dst = layer / name, group / name
        sst, dst_st = os.lstat(src), lstat_or_none(dst)
        if is_whiteout(sst):
            if dst_st is not None:
                remove_entry(dst)
            if keep_whiteouts:
                os.rename(src, dst)
            continue
        if stat.S_ISDIR(sst.st_mode):
            opaque = is_opaque(src)
            if dst_st is not None and stat.S_ISDIR(dst_st.st_mode) and not opaque:
                merge_layer_dir(dst, src, keep_whiteouts=keep_whiteouts)
                _copy_dir_meta(src, dst)
                continue
            if dst_st is not None:
                remove_entry(dst)
            os.rename(src, dst)
            if keep_whiteouts and dst_st is not None and not stat.S_ISDIR(dst_st.st_mode):
                # The group's file or whiteout hid everything below at this path: so must
                # the directory that replaces it.
                set_opaque(dst)
            elif not keep_whiteouts:
                clear_opaque(dst)
            continue
        if dst_st is not None:
            remove_entry(dst)
        os.rename(src, dst)


def strip_overlay_markers(root: Path) -> None:
    """Drop whiteouts and opaque markers from a bottom layer (nothing below to hide)."""
    for dirpath, dirnames, filenames in os.walk(root):
        clear_opaque(dirpath)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if is_whiteout(os.lstat(path)):
                os.unlink(path)
