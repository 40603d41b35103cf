"""The node's one mask filesystem: a small read-only tmpfs shared by every container sandbox.

Every superblock registers a memcg-aware shrinker, and every memory cgroup on the host carries
a ``shrinker_info`` sized by the highest shrinker id ever registered, so a superblock per
sandbox makes each sandbox's memory cgroup bigger for every sandbox on the node (the
quadratic term of ``docs/benchmarks.md``, "Density"). The masks need no superblock of their own:
a sandbox's ``/sys`` and its masked directories (``/proc/acpi``, a hidden directory) are binds
of this one filesystem, made once per node at ``<run dir>/mask`` and read-only at the
superblock (remounted ``ro`` by the host's root before any sandbox sees it). The superblock
belongs to the host's user namespace, so no sandbox's root can remount it writable, whatever
it does to its own bind (``mount -o remount,bind,rw`` clears a bind's flag, not the
superblock's): nothing one sandbox writes there can reach another.

Content (fixed, checked when a mount left by an earlier process is reused):
``empty/`` (the masked directories' and a ``/sys`` without CPU view's source) and
``sys/devices/system/cpu/{online,possible,present}`` (empty files: the mount points of the
sandbox's CPU view, ``cpuview.CPU_SYS_FILES``, bound over them by the runtime).

Owns: that mount and its dir. Must not touch: a sandbox's tree or mounts (the runtime binds
it), the run dir's own tmpfs (rootfs.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

from rollbox.backends.container.cpuview import CPU_SYS_FILES
from rollbox.errors import InfraError
from rollbox.isolation import syscalls

log = logging.getLogger(__name__)

_ENSURE_LOCK = threading.Lock()  # the flock below is per open file, not per thread

MASK_SOURCE = "rollbox-mask"
FLAGS = syscalls.MS_NOSUID | syscalls.MS_NODEV | syscalls.MS_NOEXEC
DATA = "size=4k,nr_inodes=16,mode=0555"
CPU_DIR = "sys/devices/system/cpu"
# (path below the mask root, is a directory), parents first
LAYOUT: tuple[tuple[str, bool], ...] = (
    ("empty", True), ("sys", True), ("sys/devices", True), ("sys/devices/system", True),
    (CPU_DIR, True), *((f"{CPU_DIR}/{name}", False) for name in CPU_SYS_FILES))


class NodeMask:
    """The mask tmpfs of a node at ``path`` (``<run dir>/mask``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dev: int | None = None  # its st_dev once ensured

    def ready(self) -> None:
        """Before each sandbox's start: one stat that it is still the mask :meth:`ensure`
        checked (another process of the node, e.g. an image build, may have taken it down
        in between); otherwise :meth:`ensure` again."""
        try:
            if self.dev is not None and os.stat(self.empty).st_dev == self.dev \
                    and os.stat(self.path).st_dev == self.dev:
                return
        except FileNotFoundError:
            pass
        self.ensure()

    @property
    def empty(self) -> Path:
        """An empty read-only directory: the source of every masked directory."""
        return self.path / "empty"

    @property
    def sys(self) -> Path:
        """A sandbox's ``/sys``: the CPU view's mount points and nothing else."""
        return self.path / "sys"

    def mounted(self) -> bool:
        return (str(self.path), "tmpfs", MASK_SOURCE) in syscalls.read_mountinfo()

    def problems(self, root: Path | None = None) -> list[str]:
        """What differs from a mask with exactly :data:`LAYOUT`, read-only at its superblock
        (empty: none); of the mask at ``root`` (default: :attr:`path`)."""
        root = root or self.path
        if "ro" not in _super_options(root):  # a read-only bind of a writable one is no mask
            return ["superblock not read-only"]
        want = {name: is_dir for name, is_dir in LAYOUT}
        found: dict[str, bool] = {}
        for top, dirs, files in os.walk(root):
            rel = os.path.relpath(top, root)
            for name in dirs + files:
                p = os.path.join(top, name)
                st = os.lstat(p)
                key = os.path.normpath(os.path.join(rel, name))
                found[key] = is_dir = os.path.isdir(p) and not os.path.islink(p)
                if st.st_uid != 0 or (st.st_size and not is_dir) or st.st_mode & 0o7222:
                    return [f"{key}: owner {st.st_uid}, size {st.st_size}, "
                            f"mode {st.st_mode:o}"]
        return [] if found == want else [f"content {sorted(found)}"]

    def ensure(self) -> str:
        """Mount it unless a sound one is there: "found" (an earlier process's, e.g. before a
        restart: sandboxes it started bind it), or "made" (a stale or altered one is detached
        first). InfraError if something else is mounted at the path.

        One process of the node at a time (an flock on the run dir: the edge and an image
        build share it), and the new mask appears at :attr:`path` only finished and read-only:
        it is made at a staging dir no launcher binds, cloned detached and moved into place,
        so no sandbox can bind it while it is still writable."""
        self.path.mkdir(mode=0o755, parents=True, exist_ok=True)
        with _ENSURE_LOCK, _flock(self.path.parent):
            return self._ensure()

    def _ensure(self) -> str:
        stale = self.mounted()
        if stale:
            if not self.problems():
                self.dev = os.stat(self.path).st_dev
                return "found"
        elif os.path.ismount(self.path):
            raise InfraError(f"{self.path} is a mount point that is not rollbox's mask")
        staging = self.path.parent / f".mask-new-{os.getpid()}-{secrets.token_hex(4)}"
        staging.mkdir(mode=0o700)
        try:
            syscalls.mount(MASK_SOURCE, staging, "tmpfs", FLAGS, DATA)
            try:
                fill(staging)
                syscalls.mount(MASK_SOURCE, staging, "tmpfs",
                               syscalls.MS_REMOUNT | syscalls.MS_RDONLY | FLAGS, DATA)
                left = self.problems(staging)
                if left:
                    raise InfraError(f"mask at {staging}: {left}")
                tree = syscalls.open_tree(syscalls.AT_FDCWD, staging,
                                          syscalls.OPEN_TREE_CLONE | syscalls.OPEN_TREE_CLOEXEC)
            finally:
                syscalls.umount(staging, syscalls.MNT_DETACH)
        finally:
            staging.rmdir()
        try:
            if stale:
                syscalls.umount(self.path, syscalls.MNT_DETACH)
            syscalls.move_mount(tree, "", syscalls.AT_FDCWD, self.path,
                                syscalls.MOVE_MOUNT_F_EMPTY_PATH)
        finally:
            os.close(tree)
        self.dev = os.stat(self.path).st_dev
        return "made"

    def release(self) -> None:
        """Take it down and remove its dir (when no sandbox of the node is left: a live
        one's binds would not mind, its mount namespace holds the superblock, but its next
        boot would make a new mask)."""
        self.dev = None
        if self.mounted():
            syscalls.umount(self.path, syscalls.MNT_DETACH)
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:  # something else put there: left, named
            log.warning("mask dir %s not removed: %s", self.path, exc)


def fill(root: Path) -> None:
    """Make :data:`LAYOUT` under the empty dir ``root``, with the modes a sound mask has."""
    for name, is_dir in LAYOUT:
        p = root / name
        if is_dir:
            p.mkdir(mode=0o555)
        else:
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444))
        os.chmod(p, 0o555 if is_dir else 0o444)  # whatever the umask


@contextlib.contextmanager
def _flock(directory: Path) -> Iterator[None]:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


def _super_options(mount_point: Path) -> set[str]:
    """The superblock options of the topmost mount at ``mount_point`` (mountinfo's field
    after " - fstype source"), empty if nothing is mounted there."""
    want, opts = str(mount_point), ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            lf, rf = left.split(), right.split()
            if len(lf) >= 5 and len(rf) >= 3 and syscalls.unescape_mountinfo(lf[4]) == want:
                opts = rf[2]  # later lines are mounted on top
    return set(opts.split(",")) if opts else set()
