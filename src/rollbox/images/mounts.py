"""One shared read-only mount per layer per node, at ``<store root>/mnt/<digest>``.

Every sandbox on the node that uses a layer stacks its overlay on the same mount, so the layer
has one page cache. File-backed EROFS needs no loop device: ``mount(2)`` with the file as source.
State lives in the kernel (``/proc/self/mountinfo``), so a restarted process finds its mounts.
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rollbox.errors import InfraError
from rollbox.images.store import ImageStore, is_digest, validate_digest
from rollbox.isolation import syscalls

MOUNT_FLAGS = syscalls.MS_RDONLY | syscalls.MS_NODEV | syscalls.MS_NOSUID


def _unescape_mountinfo(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def read_mountinfo() -> list[tuple[str, str, str]]:
    """(mount point, fstype, source) for every mount in this process's mount namespace."""
    rows = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            lf, rf = left.split(), right.split()
            if len(lf) < 5 or len(rf) < 2:
                continue
            rows.append((_unescape_mountinfo(lf[4]), rf[0], _unescape_mountinfo(rf[1])))
    return rows


class LayerMounts:
    """Mounts layers of ``store`` read-only, once per node; thread-, async- and process-safe."""

    _locks_guard = threading.Lock()
    _locks: dict[str, threading.Lock] = {}

    def __init__(self, store: ImageStore) -> None:
        self.store = store
        self.mnt_dir = store.mnt_dir
        self._verified: dict[str, int] = {}  # digest -> st_dev of its mounted root
        self._lazy: dict[str, int] = {}  # lazy layer -> daemon generation it is mounted on

    def mount_point(self, digest: str) -> Path:
        return self.mnt_dir / validate_digest(digest)

    @contextmanager
    def _locked(self, digest: str) -> Iterator[None]:
        # Thread lock for this process, flock for other processes on the node (CLI + edge).
        with LayerMounts._locks_guard:
            lock = LayerMounts._locks.setdefault(digest, threading.Lock())
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
        for mnt, fstype, source in read_mountinfo():
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
        root = os.path.realpath(self.store.root) + "/"
        out = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                if digest not in line:
                    continue
                fields = line.split()
                mnt = _unescape_mountinfo(fields[4]) if len(fields) > 4 else ""
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
        for mnt, fstype, _source in read_mountinfo():
            parent, name = os.path.split(mnt)
            if parent == base and fstype == "erofs" and is_digest(name):
                out[name] = Path(mnt)
        return out

    def ensure_mounted(self, digest: str) -> Path:
        """Mount the layer if it is not mounted yet; return its read-only mount point."""
        target = self.mount_point(digest)
        # Hot path (every sandbox start): a layer this process saw mounted stays mounted
        # until unmount(); checked with one stat instead of parsing mountinfo.
        dev = self._verified.get(digest)
        if dev is not None:
            try:
                if os.stat(target).st_dev == dev and (
                        digest not in self._lazy or self._lazy_healthy(digest)):
                    return target
            except OSError:
                pass
            self._verified.pop(digest, None)
        path = self._ensure_mounted_slow(digest)
        self._verified[digest] = os.stat(path).st_dev
        return path

    def _lazy_healthy(self, digest: str) -> bool:
        # A lazy layer's mount is good while the daemon generation it was mounted on lives.
        from rollbox.images.lazy.loader import loader_for

        loader = loader_for(self.store)
        state = loader.daemon_state()
        return (state is not None and state.get("generation") == self._lazy[digest]
                and loader.healthy(state))

    def _ensure_mounted_slow(self, digest: str) -> Path:
        lazy_gen = None
        if self.store.is_lazy(digest):
            # Starts/repairs the lazy-loading daemon and fetches the layer's first chunk:
            # a dead store fails here with a typed, retryable error.
            from rollbox.images.lazy.loader import loader_for

            loader = loader_for(self.store)
            layer = loader.ensure_layer_sync(digest)
            lazy_gen = loader.generation()
        else:
            layer = self.store.layer_path(digest)
        target = self.mount_point(digest)
        with self._locked(digest):
            current = self._current(digest)
            if current is not None:
                fstype, source = current
                if fstype == "erofs" and os.path.realpath(source) == os.path.realpath(layer):
                    self._note_lazy(digest, lazy_gen)
                    return target
                if not (fstype == "erofs" and self._stale_lazy_source(source)):
                    raise InfraError(f"{target} has a foreign mount ({fstype} from {source})")
                # Mounted on a crashed lazy daemon's file: replace it unless a sandbox uses it.
                users = self.users(digest)
                if users:
                    raise InfraError(f"layer {digest} is mounted on a crashed lazy-loading "
                                     f"daemon and still used by {len(users)} mount(s); retry "
                                     "once they are gone", digest=digest)
                try:
                    syscalls.umount(target, syscalls.UMOUNT_NOFOLLOW)
                except OSError as exc:
                    raise InfraError(f"cannot unmount stale lazy layer {target}: {exc}") from exc
            target.mkdir(mode=0o755, exist_ok=True)
            try:
                syscalls.mount(str(layer), target, "erofs", MOUNT_FLAGS)
            except OSError as exc:
                raise InfraError(f"cannot mount layer {digest} at {target}: {exc}") from exc
            self._note_lazy(digest, lazy_gen)
            return target

    def _note_lazy(self, digest: str, generation: int | None) -> None:
        if generation is None:
            self._lazy.pop(digest, None)
        else:
            self._lazy[digest] = generation

    def _stale_lazy_source(self, source: str) -> bool:
        lazy_fs = os.path.realpath(self.store.root / "lazy" / "fs") + "/"
        return os.path.normpath(os.path.join(os.getcwd(), source)).startswith(lazy_fs)

    async def ensure_mounted_async(self, digest: str) -> Path:
        return await asyncio.to_thread(self.ensure_mounted, digest)

    def unmount(self, digest: str) -> None:
        """Unmount the layer (no-op if not mounted); InfraError if a sandbox still uses it."""
        target = self.mount_point(digest)
        self._verified.pop(digest, None)
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
