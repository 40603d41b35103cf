"""A sandbox's root filesystem: idmapped read-only layers under overlayfs, with the writable
upper on its capped filesystem, verified before use: a btrfs subvolume of the node's disk pool
(``disk`` tier, bind-mounted; the pool caps it) or a size- and inode-capped tmpfs (``memory``)."""
from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from rollbox.errors import InfraError
from rollbox.isolation import btrfs, syscalls

TMPFS_MAGIC = 0x01021994


def mount_points_under(prefix: Path) -> list[str]:
    """Mount points at or below prefix, deepest first (from /proc/self/mountinfo)."""
    pre = str(prefix).rstrip("/")
    found = {mp for mp, _, _ in syscalls.read_mountinfo()
             if mp == pre or mp.startswith(pre + "/")}
    return sorted(found, key=len, reverse=True)


RUN_TMPFS_SOURCE = "rollbox-run"


def ensure_run_tmpfs(path: Path) -> str:
    """Put ``path`` (the node's run dir) on a tmpfs of its own unless it already is on one.

    Only a directory without state is mounted over (nothing but empty directories and empty
    lock files): one holding state of live sandboxes from an edge that ran on disk stays
    visible (and on disk) so they can still be adopted. Returns "mounted" (by this call),
    "ours" (a run tmpfs an earlier process mounted, e.g. one that crashed), "tmpfs" (on
    someone else's tmpfs, e.g. the host's /run) or "disk" (left on disk)."""
    path.mkdir(parents=True, exist_ok=True)
    if syscalls.statfs_type(path) == TMPFS_MAGIC:
        return "ours" if _is_run_tmpfs(path) else "tmpfs"
    if _holds_state(path):
        return "disk"
    # Small files only (bundles, sockets, pid files, runc state); size is a ceiling, not
    # memory taken. 0711: runc resolves a rootfs below it as the sandbox's host uid.
    syscalls.mount(RUN_TMPFS_SOURCE, path, "tmpfs",
                   syscalls.MS_NOSUID | syscalls.MS_NODEV | syscalls.MS_NOEXEC,
                   "size=1g,nr_inodes=1048576,mode=0711")
    return "mounted"


def release_run_tmpfs(path: Path) -> bool:
    """Unmount the run dir's tmpfs (mounted by :func:`ensure_run_tmpfs`) once it holds no
    state, as the node's layer mounts are released when no sandbox is left; it comes back on
    the next start. A sandbox still alive keeps it busy, so it stays. True if unmounted."""
    try:
        if syscalls.statfs_type(path) != TMPFS_MAGIC or _holds_state(path):
            return False
        syscalls.umount(path)  # not detached: busy means in use
    except OSError:
        return False
    return True


def _is_run_tmpfs(path: Path) -> bool:
    """Whether ``path`` is the mount point of a tmpfs :func:`ensure_run_tmpfs` mounted."""
    return (str(path), "tmpfs", RUN_TMPFS_SOURCE) in syscalls.read_mountinfo()


def _holds_state(path: Path) -> bool:
    """Anything in the run dir beyond empty directories and empty lock files."""
    for entry in path.iterdir():
        if entry.is_symlink() or (any(entry.iterdir()) if entry.is_dir()
                                  else entry.stat().st_size):
            return True
    return False


def remove_flat_dir(path: Path) -> None:
    """Remove a platform-owned directory whose entries are files and empty directories (a
    sandbox dir after its mounts are gone, its run dir, runc's state dir): one syscall per
    entry instead of shutil.rmtree's descriptor walk. Anything deeper falls back to rmtree."""
    try:
        with os.scandir(path) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    os.rmdir(e.path)
                else:
                    os.unlink(e.path)
        os.rmdir(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


class Rootfs:
    """Mount layout under ``<sandbox dir>``: ``l<i>`` lowers, ``rw`` (tmpfs or bind mount of a
    subvolume), ``merged``."""

    def __init__(self, sandbox_dir: Path) -> None:
        self.dir = sandbox_dir
        self.rw = sandbox_dir / "rw"
        self.upper = self.rw / "upper"
        self.work = self.rw / "work"
        self.merged = sandbox_dir / "merged"

    def compose(self, layer_mounts: list[Path], userns_fd: int, host_uid: int,
                disk_mib: int, inodes: int, subvolume: Path | None = None,
                upper_lowers: Sequence[tuple[Path, int]] = ()) -> None:
        """layer_mounts lowest first (base first). subvolume: the disk tier's capped subvolume
        (the pool verified its cap); None: a tmpfs of disk_mib and inodes. upper_lowers: a
        fork's frozen writable layers (lowest first), each (dir, the user namespace fd that
        shifts its owners to this sandbox's uids), above the image's layers."""
        self.dir.mkdir(parents=True, exist_ok=True)
        step = "writable layer"  # named in the error: which mount failed
        try:
            if subvolume is not None:
                self._bind_upper(subvolume, host_uid)
            else:
                self._mount_upper(host_uid, disk_mib, inodes)
            lowers = []
            for i, src in enumerate(layer_mounts):
                step = f"layer {src}"
                target = self.dir / f"l{i}"
                target.mkdir(exist_ok=True)
                self._idmapped_bind(src, target, userns_fd)
                lowers.append(str(target))
            for src, shift_fd in upper_lowers:
                step = "fork lower"
                target = self.dir / f"l{len(lowers)}"
                target.mkdir(exist_ok=True)
                self._idmapped_bind(src, target, shift_fd)
                lowers.append(str(target))
            step = "overlay"
            self.merged.mkdir(exist_ok=True)
            opts = (f"lowerdir={':'.join(reversed(lowers))},upperdir={self.upper},"
                    f"workdir={self.work},redirect_dir=off,metacopy=off")
            # redirect_dir=off: a renamed lower dir is copied up whole, so the upper stays a
            # self-contained layer for pack_diff.
            syscalls.mount("overlay", self.merged, "overlay", syscalls.MS_NOSUID, opts)
        except OSError as exc:
            self.teardown()
            raise InfraError(f"rootfs composition failed ({step}): {exc}") from exc

    def _mount_upper(self, host_uid: int, disk_mib: int, inodes: int) -> None:
        self.rw.mkdir(exist_ok=True)
        syscalls.mount("rollbox-rw", self.rw, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV,
                       f"size={disk_mib}m,nr_inodes={inodes},mode=0700")
        # A mount that failed silently would leave the upper on the host disk; refuse that.
        if syscalls.statfs_type(self.rw) != TMPFS_MAGIC or os.stat(self.rw).st_dev == os.stat(self.dir).st_dev:
            raise OSError("writable layer is not on its capped tmpfs")
        vfs = os.statvfs(self.rw)
        if vfs.f_blocks * vfs.f_frsize > (disk_mib << 20) + (1 << 20):
            raise OSError("writable layer cap not applied")
        self._make_upper(host_uid)

    def _bind_upper(self, subvolume: Path, host_uid: int) -> None:
        self.rw.mkdir(exist_ok=True)
        syscalls.mount(str(subvolume), self.rw, None, syscalls.MS_BIND)
        # The same check as the tmpfs': a bind that did not happen leaves rw on the host disk.
        st = os.stat(self.rw)
        if (syscalls.statfs_type(self.rw) != btrfs.BTRFS_SUPER_MAGIC
                or st.st_ino != btrfs.SUBVOL_ROOT_INO
                or st.st_dev != os.stat(subvolume).st_dev):
            raise OSError("writable layer is not on its capped subvolume")
        os.chmod(self.rw, 0o700)
        self._make_upper(host_uid)

    def _make_upper(self, host_uid: int) -> None:
        self.upper.mkdir(mode=0o755)
        self.work.mkdir(mode=0o700)
        os.chown(self.upper, host_uid, host_uid)
        os.chmod(self.upper, 0o755)

    @staticmethod
    def _idmapped_bind(src: Path, target: Path, userns_fd: int) -> None:
        fd = syscalls.open_tree(syscalls.AT_FDCWD, src,
                                syscalls.OPEN_TREE_CLONE | syscalls.OPEN_TREE_CLOEXEC)
        try:
            syscalls.mount_setattr(fd, "", syscalls.AT_EMPTY_PATH,
                                   syscalls.MOUNT_ATTR_IDMAP | syscalls.MOUNT_ATTR_RDONLY
                                   | syscalls.MOUNT_ATTR_NODEV | syscalls.MOUNT_ATTR_NOSUID,
                                   userns_fd=userns_fd)
            syscalls.move_mount(fd, "", syscalls.AT_FDCWD, target,
                                syscalls.MOVE_MOUNT_F_EMPTY_PATH)
        finally:
            os.close(fd)

    def _known_mounts(self) -> list[Path]:
        try:
            # A plain listing: pathlib's glob compiles a pattern matcher on every call.
            names = os.listdir(self.dir)
        except FileNotFoundError:
            names = []
        lowers = sorted(self.dir / n for n in names if n[:1] == "l" and n[1:].isdigit())
        return [self.merged, *lowers, self.rw]

    def teardown(self) -> list[str]:
        """Unmount everything of the sandbox, verify, remove its dir; return what is left.

        Only the sandbox's own mount points are touched and checked (one stat each), so the
        cost does not grow with the number of mounts on the node."""
        for mp in self._known_mounts():
            try:
                syscalls.umount(mp, syscalls.MNT_DETACH)
            except OSError:
                pass
        left = [str(mp) for mp in self._known_mounts() if os.path.ismount(mp)]
        if not left:
            remove_flat_dir(self.dir)
            if self.dir.exists():
                left.append(str(self.dir))
        return left
