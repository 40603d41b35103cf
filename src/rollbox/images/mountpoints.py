"""The layer mount points of an image store, ``<store root>/mnt/<digest>``, as the kernel has
them: what is mounted there, which other mounts stack on a layer, unmounting one.

Below the store (its gc unmounts a layer before it deletes the file) and below
:class:`rollbox.images.mounts.LayerMounts`, which mounts layers on these points. State lives in
the kernel (``/proc/self/mountinfo``), so a restarted process finds its mounts. Owns the locks
every process of the node takes on the points (``mnt/.lock``, ``mnt/.use.lock``). Must not
mount anything nor know where a layer's file comes from (local, lazy).
"""
from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rollbox.errors import InfraError
from rollbox.images.names import is_digest, validate_digest
from rollbox.isolation import syscalls

MOUNT_FLAGS = syscalls.MS_RDONLY | syscalls.MS_NODEV | syscalls.MS_NOSUID


class LayerMountPoints:
    """The mount points under ``mnt_dir`` of the store at ``store_root``; thread-, async- and
    process-safe."""

    _locks_guard = threading.Lock()
    _locks: dict[str, threading.Lock] = {}

    def __init__(self, mnt_dir: Path, store_root: Path) -> None:
        self.mnt_dir = mnt_dir
        self.store_root = store_root

    def mount_point(self, digest: str) -> Path:
        return self.mnt_dir / validate_digest(digest)

    @contextmanager
    def _locked(self, digest: str) -> Iterator[None]:
        # Thread lock for this process, flock for other processes on the node (CLI + edge).
        with LayerMountPoints._locks_guard:
            lock = LayerMountPoints._locks.setdefault(digest, threading.Lock())
        with lock, syscalls.flocked(self.mnt_dir / ".lock"):
            yield

    @contextmanager
    def in_use(self) -> Iterator[None]:
        """Held while a caller mounts layers and clones them (a sandbox's rootfs): until the
        clones exist nothing marks the layers as used (``users``), so another process of the
        node (an idle edge, a test run's sweep) could unmount one in between and the clone
        would fail or see an empty directory. Shared among users; ``unmount`` needs it
        exclusively and counts a layer busy while anyone holds it."""
        self.mnt_dir.mkdir(parents=True, exist_ok=True)
        with syscalls.flocked(self.mnt_dir / ".use.lock", shared=True):
            yield

    def _current(self, digest: str) -> tuple[str, str] | None:
        """(fstype, source) of what is mounted at the digest's mount point, if anything."""
        target = os.path.realpath(self.mount_point(digest))
        found = None
        for mnt, fstype, source in syscalls.read_mountinfo():
            if mnt == target:
                found = (fstype, source)  # the last one is the top of the stack
        return found

    def users(self, digest: str) -> list[str]:
        """Other mounts that name this layer (overlays stacked on it, idmapped clones).

        The kernel does not refuse to unmount a layer under a live overlay (overlayfs keeps a
        private clone), so this is how a layer in use is recognised. Mounts in other mount
        namespaces are not visible here: callers pass what they know to ``gc(keep=...)``.
        """
        own = os.path.realpath(self.mount_point(digest))
        root = os.path.realpath(self.store_root) + "/"
        out = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                if digest not in line:
                    continue
                fields = line.split()
                mnt = syscalls.unescape_mountinfo(fields[4]) if len(fields) > 4 else ""
                # Only mounts made from this store (its layer file, lazy file or mount point):
                # the same layer of another store (a test's private one) is not a user.
                if mnt == own or root not in line:
                    continue
                out.append(mnt)
        return out

    def is_mounted(self, digest: str) -> bool:
        return self._current(digest) is not None

    def mounted(self) -> dict[str, Path]:
        base = os.path.realpath(self.mnt_dir)
        out = {}
        for mnt, fstype, _source in syscalls.read_mountinfo():
            parent, name = os.path.split(mnt)
            if parent == base and fstype == "erofs" and is_digest(name):
                out[name] = Path(mnt)
        return out

    def unmount(self, digest: str) -> None:
        """Unmount the layer (no-op if not mounted); InfraError if a sandbox still uses it."""
        target = self.mount_point(digest)
        with self._locked(digest):
            use_fd = os.open(self.mnt_dir / ".use.lock",
                             os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(use_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(use_fd)
                raise InfraError(f"layer {digest} may be in use: a rootfs is being composed",
                                 digest=digest) from None
            try:
                self._unmount_locked(digest, target)
            finally:
                os.close(use_fd)

    def _unmount_locked(self, digest: str, target: Path) -> None:
        users = self.users(digest)
        if users and self._current(digest) is not None:
            raise InfraError(f"layer {digest} is in use at {target} by {users[:3]}",
                             digest=digest)
        while self._current(digest) is not None:
            try:
                syscalls.umount(target, syscalls.UMOUNT_NOFOLLOW)
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    raise InfraError(f"layer {digest} is in use at {target}",
                                     digest=digest) from exc
                if exc.errno == errno.EINVAL:
                    break
                raise InfraError(f"cannot unmount {target}: {exc}") from exc
        try:
            target.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EBUSY):
                raise

    def unmount_all(self) -> list[str]:
        """Unmount every layer mount of this store; returns the digests still busy."""
        busy = []
        for digest in self.mounted():
            try:
                self.unmount(digest)
            except InfraError:
                busy.append(digest)
        return busy
