"""The node's disk pool for writable layers: one btrfs, a subvolume per sandbox capped by a
qgroup limit.

The pool is a sparse file ``<data dir>/disk/pool.img`` formatted once with ``mkfs.btrfs`` and
loop-mounted (autoclear, direct I/O) at ``<data dir>/disk/mnt``, or a btrfs partition the
operator names (``ROLLBOX_DISK_DEVICE``). Quotas are enabled on it; each sandbox's upper lives in
subvolume ``mnt/<sandbox id>`` whose qgroup limits the bytes it references, data and metadata
alike (so inodes are bounded too: ~350 bytes of metadata each). The cap is read back from the
kernel (sysfs) before the subvolume is handed out. The pool comes back after a restart (an
existing loop device of the file is reused, never a second one: two mounts of one btrfs image
would corrupt it) and is unmounted when the node is idle and no sandbox's subvolume is left:
subvolumes whose names start with ``CACHE_PREFIX`` (microVM template disks, and ``vm`` machine
snapshots' disks: ``MACHINE_SNAPSHOT_PREFIX``) are a cache that stays in the pool's file (with
its qgroup caps) and comes back with the next mount.

A fork (``ContainerBackend.fork``) takes one read-only snapshot of the source's subvolume,
named ``FORK_PREFIX`` + a token: the shared lower of its children. Who uses one is kept as
empty files ``<pool dir>/forks/<lower>/<sandbox id>`` (on the data dir, so they outlive the
edge); the lower is deleted when its last user's reference goes (:meth:`unref_lowers`), or
by :meth:`release` when none is left.

Owns the pool and its subvolumes; does not know sandboxes' mounts (``rootfs``) or processes.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rollbox.config import Settings
from rollbox.errors import InfraError
from rollbox.isolation import btrfs, syscalls

log = logging.getLogger(__name__)

MOUNT_FLAGS = syscalls.MS_NOSUID | syscalls.MS_NODEV | syscalls.MS_NOATIME
# discard=async: space freed by a deleted sandbox goes back to the host (holes punched in the
# pool file), so the sparse file only holds what live sandboxes use.
MOUNT_OPTIONS = "discard=async"
# Subvolumes of a cache, not of a sandbox (microVM template disks, backends/microvm/template.py;
# sandbox ids start with the node id): they never keep the pool mounted.
CACHE_PREFIX = "tpl-"
# Disks of ``vm`` machine snapshots (backends/vm/snapshots.py): kept like the cache (they never
# keep the pool mounted), owned by their snapshots, not by the template cache.
MACHINE_SNAPSHOT_PREFIX = CACHE_PREFIX + "snap-"
# A fork's shared read-only lower (a snapshot of the source's subvolume), never a sandbox's.
FORK_PREFIX = "fk-"
# The fork itself holds its new lower under this name until its children hold it.
PENDING_REF = ".fork"


class DiskPool:
    def __init__(self, settings: Settings) -> None:
        self.dir = settings.disk_pool_dir
        self.image = self.dir / "pool.img"
        self.mnt = self.dir / "mnt"
        self.device = settings.disk_pool_device
        self.size_gib = settings.disk_pool_gib
        self._mounted = False  # checked (and quotas enabled) by this object
        self._uuid = ""
        self._lock = threading.Lock()
        self.refs = self.dir / "forks"
        self._refs_lock = threading.Lock()

    # ---- the pool -----------------------------------------------------------------------
    def exists(self) -> bool:
        """Whether the node has a pool (configured device, or the file made by a first use)."""
        return self._mounted or self.device is not None or self.image.exists()

    def ensure(self) -> None:
        """Mount the pool (making it on first use) unless this object has checked it is and it
        still is (one statfs): another process of the node may have released it meanwhile."""
        if self._mounted and syscalls.statfs_type(self.mnt) == btrfs.BTRFS_SUPER_MAGIC:
            return
        self._mounted = False
        with self._locked():
            if not self._mounted:
                try:
                    self._mount()
                except OSError as exc:
                    raise InfraError(f"disk pool at {self.mnt} can not be mounted: {exc}") from exc

    @contextmanager
    def _root(self) -> Iterator[int]:
        """A dir fd of the pool's root for one operation. No descriptor is kept between
        operations: it would keep the pool busy for another process's (or edge's) release."""
        self.ensure()
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        # Thread lock for this process, flock for other processes of the node (CLI + edge).
        with self._lock:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.dir, 0o700)  # sandboxes' data: no host user walks into the pool
            with syscalls.flocked(self.dir / ".lock"):
                yield

    def _mount(self) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        if not self._is_mounted():
            source = str(self.device) if self.device is not None else self._loop_device()
            if source is not None:
                syscalls.mount(source, self.mnt, "btrfs", MOUNT_FLAGS, MOUNT_OPTIONS)
            else:
                with btrfs.loop_attached(self.image) as dev:
                    syscalls.mount(dev, self.mnt, "btrfs", MOUNT_FLAGS, MOUNT_OPTIONS)
        if not self._is_mounted():
            raise InfraError(f"disk pool at {self.mnt} is not a mounted btrfs")
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            btrfs.quota_enable(fd)  # a no-op when enabled
            self._uuid = btrfs.fsid(fd)
        finally:
            os.close(fd)
        if not (Path("/sys/fs/btrfs") / self._uuid / "qgroups").is_dir():
            raise InfraError("disk pool has no quotas (qgroups)")
        self._mounted = True

    def _loop_device(self) -> str | None:
        """A loop device already backing the pool file (its filesystem may still be alive,
        e.g. under sandboxes' bind mounts after the pool's own mount went): reused, so the
        image is never mounted through two devices. None: attach a new one. Makes the file
        on first use."""
        if not self.image.exists():
            self._make_image()
        devs = btrfs.loop_devices_of(self.image)
        return devs[0] if devs else None

    def _make_image(self) -> None:
        size = self.size_gib << 30
        if size <= 0:  # auto: 80% of what the data dir's filesystem has free now (sparse)
            vfs = os.statvfs(self.dir)
            size = max(1 << 30, vfs.f_bavail * vfs.f_frsize * 4 // 5)
        tmp = self.dir / ".pool.img.tmp"
        with open(tmp, "wb") as f:
            f.truncate(size)
        # single profiles: one file on one device, metadata twice would only double writes.
        res = subprocess.run(["mkfs.btrfs", "-q", "-f", "-m", "single", "-d", "single", str(tmp)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise InfraError(f"mkfs.btrfs failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, self.image)

    def _is_mounted(self) -> bool:
        """Whether the pool's own btrfs (the configured device, or a loop device of the pool
        file) is mounted at its mount point."""
        try:
            if syscalls.statfs_type(self.mnt) != btrfs.BTRFS_SUPER_MAGIC:
                return False
        except OSError:
            return False
        sources = ({str(self.device)} if self.device is not None
                   else set(btrfs.loop_devices_of(self.image)))
        mnt = os.path.realpath(self.mnt)
        top = [src for mp, fstype, src in syscalls.read_mountinfo() if mp == mnt]
        return bool(top) and top[-1] in sources

    def release(self) -> bool:
        """Unmount the pool if no sandbox's subvolume is left in it (the node is idle; a
        live sandbox's must stay reachable for the next edge's adopt); cache subvolumes stay
        in the file. The loop device detaches itself. True if unmounted."""
        with self._locked():
            if not self._is_mounted():
                return False
            self._drop_unused_lowers()
            names = self._subvolume_names()
            if any(not n.startswith(CACHE_PREFIX) for n in names):
                return False
            self._drop_stale_qgroups(keep=names)
            self._mounted = False
            try:
                syscalls.umount(self.mnt)  # not detached: busy means in use
            except OSError as exc:
                log.warning("disk pool %s stays mounted: %s", self.mnt, exc)
                return False
        return True

    def _drop_stale_qgroups(self, keep: list[str]) -> None:
        """Every level-0 qgroup but the top level's and those of the subvolumes ``keep``
        (the cache's: their caps are what clones of them get) is stale. This kernel removes
        them itself once their tree is dropped; older ones keep them: removed here (EBUSY:
        not dropped yet, the next release gets it)."""
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            kept = {"0_5"}
            for name in keep:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)
                try:
                    kept.add(f"0_{btrfs.subvol_id(sub)}")
                finally:
                    os.close(sub)
            root = Path("/sys/fs/btrfs") / btrfs.fsid(fd) / "qgroups"
            for qg in root.glob("0_*"):
                if qg.name not in kept:
                    try:
                        btrfs.qgroup_destroy(fd, int(qg.name[2:]))
                    except OSError:
                        pass
        finally:
            os.close(fd)

    def sync(self) -> None:
        """Commit the pool's transaction: deleted subvolumes get dropped and their qgroups
        removed by the kernel's cleaner (otherwise within the 30 s commit interval)."""
        with self._root() as fd:
            fcntl.ioctl(fd, btrfs.BTRFS_IOC_SYNC)

    def used_bytes(self) -> int:
        """Bytes allocated in the pool (data and metadata), as statfs reports them."""
        self.ensure()
        vfs = os.statvfs(self.mnt)
        return (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize

    def qgroups(self) -> list[int]:
        """Subvolume ids that still have a level-0 qgroup (the top level's 5 excluded)."""
        self.ensure()
        root = Path("/sys/fs/btrfs") / self._uuid / "qgroups"
        return sorted(int(p.name[2:]) for p in root.glob("0_*") if p.name != "0_5")

    def _subvolume_names(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.mnt) if not n.startswith(".")]
        except OSError:
            return []

    # ---- subvolumes ---------------------------------------------------------------------
    def path(self, sandbox_id: str) -> Path:
        return self.mnt / sandbox_id

    def create(self, sandbox_id: str, max_bytes: int) -> Path:
        """A new subvolume for ``sandbox_id`` capped at ``max_bytes``, cap verified."""
        try:
            with self._root() as fd:
                btrfs.subvol_create(fd, sandbox_id, max_bytes)
        except OSError as exc:
            raise InfraError(f"writable layer of {sandbox_id} not created: {exc}") from exc
        return self._verified(sandbox_id, max_bytes)

    def clone(self, src_id: str, dst_id: str, max_bytes: int | None = None) -> Path:
        """Snapshot of ``src_id``'s subvolume as ``dst_id`` (extents shared, nothing copied),
        capped at ``max_bytes`` (default: the source's cap), cap verified."""
        try:
            with self._root() as fd:
                src = os.open(self.path(src_id), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                              | os.O_CLOEXEC)
                try:
                    if max_bytes is None:
                        max_bytes = self._cap(src)
                    btrfs.snapshot(src, fd, dst_id, max_bytes)
                finally:
                    os.close(src)
        except OSError as exc:
            raise InfraError(f"writable layer of {src_id} not cloned: {exc}") from exc
        return self._verified(dst_id, max_bytes)

    def rename(self, src_id: str, dst_id: str) -> Path:
        """``src_id``'s subvolume as ``dst_id``'s (a microVM spare's disk handed to the sandbox
        that claimed it; its qgroup and cap go with it, open files stay open)."""
        try:
            with self._root() as fd:
                if os.path.lexists(self.path(dst_id)):
                    raise FileExistsError(errno.EEXIST, "exists already", dst_id)
                os.rename(src_id, dst_id, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            raise InfraError(f"writable layer of {src_id} not renamed: {exc}") from exc
        return self.path(dst_id)

    def _cap(self, fd: int) -> int:
        """The referenced-bytes limit of the subvolume open at ``fd``, as the kernel has it."""
        qg = btrfs.qgroup_dir(self._uuid, btrfs.subvol_id(fd))
        return int((qg / "max_referenced").read_text())

    def referenced(self, sandbox_id: str) -> int | None:
        """Bytes the sandbox's writable layer holds now (its qgroup's referenced count: what
        the cap limits; the kernel updates it at each commit, within seconds); None without a
        subvolume of it here (a memory-tier sandbox, or the pool not mounted)."""
        if not self._uuid:
            return None
        try:
            fd = os.open(self.path(sandbox_id), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                         | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            qg = btrfs.qgroup_dir(self._uuid, btrfs.subvol_id(fd))
            return int((qg / "referenced").read_text())
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def cap(self, sandbox_id: str) -> int:
        self.ensure()
        fd = os.open(self.path(sandbox_id), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                     | os.O_CLOEXEC)
        try:
            return self._cap(fd)
        finally:
            os.close(fd)

    def _verified(self, name: str, max_bytes: int) -> Path:
        """Check that ``name`` is a subvolume of the pool whose qgroup has the cap; on a
        mismatch it is deleted and InfraError raised (never an uncapped layer)."""
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                qg = btrfs.qgroup_dir(self._uuid, btrfs.subvol_id(fd))
                cap = int((qg / "max_referenced").read_text())
                flags = int((qg / "limit_flags").read_text())
            finally:
                os.close(fd)
            if st.st_ino != btrfs.SUBVOL_ROOT_INO or cap != max_bytes \
                    or not flags & btrfs.BTRFS_QGROUP_LIMIT_MAX_RFER:
                raise OSError(errno.EIO, f"cap {cap} (flags {flags}) instead of {max_bytes}")
        except (OSError, ValueError) as exc:
            self.remove(name)
            raise InfraError(f"writable layer {name} is not capped: {exc}") from exc
        return path

    def remove(self, sandbox_id: str) -> list[str]:
        """Delete ``sandbox_id``'s subvolume if there is one; returns what is left. Its qgroup
        goes with the tree once the kernel has dropped it (see :meth:`sync`)."""
        if not self.exists():
            return []
        try:
            with self._root() as fd:
                if not os.path.lexists(self.path(sandbox_id)):
                    return []  # a memory-tier sandbox: one stat, no ioctl
                btrfs.subvol_delete(fd, sandbox_id)
        except FileNotFoundError:
            pass
        except OSError as exc:
            return [f"subvolume {self.path(sandbox_id)}: {exc}"]
        path = self.path(sandbox_id)
        return [str(path)] if os.path.lexists(path) else []

    def leftovers(self, sandbox_id: str) -> list[str]:
        """The sandbox's subvolume if it is still there. An unmounted pool is not mounted for
        this: it is only released with no sandbox's subvolume left (recovery mounts it:
        :meth:`ids`)."""
        if not (self._mounted and syscalls.statfs_type(self.mnt) == btrfs.BTRFS_SUPER_MAGIC) \
                and not self._is_mounted():  # the cheap check first: mountinfo is long
            return []
        path = self.path(sandbox_id)
        return [str(path)] if os.path.lexists(path) else []

    def ids(self) -> set[str]:
        """Names of the subvolumes in the pool (sandbox ids; fork lowers left out)."""
        if not self.exists():
            return set()
        self.ensure()
        return {n for n in self._subvolume_names() if not n.startswith(FORK_PREFIX)}

    # ---- fork lowers ----------------------------------------------------------------------
    def fork_lower(self, src_id: str) -> str:
        """A read-only snapshot of ``src_id``'s subvolume (extents shared, nothing copied):
        the shared lower of a fork's children. Held by :data:`PENDING_REF` until the fork
        has handed it to its children (:meth:`ref`) and dropped that (:meth:`unref`)."""
        name = FORK_PREFIX + secrets.token_hex(8)
        with self._refs_lock, syscalls.flocked(self._refs_lock_file()):
            (self.refs / name).mkdir(parents=True)
            (self.refs / name / PENDING_REF).touch()
        try:
            with self._root() as fd:
                src = os.open(self.path(src_id), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                              | os.O_CLOEXEC)
                try:
                    btrfs.snapshot(src, fd, name, self._cap(src), readonly=True)
                finally:
                    os.close(src)
        except OSError as exc:
            self.unref(name, PENDING_REF)
            raise InfraError(f"writable layer of {src_id} not snapshotted: {exc}") from exc
        return name

    def _refs_lock_file(self) -> Path:
        self.refs.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        return self.refs / ".lock"

    def ref(self, lowers: Sequence[str], sandbox_ids: Sequence[str]) -> None:
        """Each of ``sandbox_ids`` uses each fork lower of ``lowers``: a fork's children all
        at once, under one lock, before any mounts one (InfraError: a lower is gone; none
        referenced then)."""
        with self._refs_lock, syscalls.flocked(self._refs_lock_file()):
            for lower in lowers:
                if not (self.refs / lower).is_dir() or not os.path.lexists(self.path(lower)):
                    raise InfraError(f"fork lower {lower} is gone")
            for lower in lowers:
                for sandbox_id in sandbox_ids:
                    (self.refs / lower / sandbox_id).touch()

    def unref(self, lower: str, sandbox_id: str) -> list[str]:
        """``sandbox_id`` no longer uses ``lower``; the last user's unref deletes it. Returns
        what could not be removed."""
        with self._refs_lock, syscalls.flocked(self._refs_lock_file()):
            return self._unref(lower, sandbox_id)

    def _unref(self, lower: str, sandbox_id: str) -> list[str]:
        d = self.refs / lower
        with contextlib.suppress(FileNotFoundError):
            (d / sandbox_id).unlink()
        try:
            if any(d.iterdir()):
                return []
        except FileNotFoundError:
            pass
        left = self.remove(lower)
        if not left:
            with contextlib.suppress(OSError):
                d.rmdir()
        return left

    def unref_lowers(self, sandbox_id: str) -> list[str]:
        """Drop every fork lower reference of ``sandbox_id`` (its teardown, also of an
        orphan whose state is lost); lowers left without users are deleted."""
        if not self.refs.is_dir():
            return []
        problems: list[str] = []
        with self._refs_lock, syscalls.flocked(self._refs_lock_file()):
            for d in self.refs.iterdir():
                if d.name.startswith(FORK_PREFIX) and os.path.lexists(d / sandbox_id):
                    problems += self._unref(d.name, sandbox_id)
        return problems

    def lower_users(self, lower: str) -> set[str]:
        """The sandboxes (and a fork under way: PENDING_REF) that use ``lower``."""
        try:
            return set(os.listdir(self.refs / lower))
        except FileNotFoundError:
            return set()

    def _drop_unused_lowers(self) -> None:
        """Fork lowers no sandbox uses (their users' teardown was cut short): deleted."""
        for name in self._subvolume_names():
            if name.startswith(FORK_PREFIX) and not self.lower_users(name):
                if not self.remove(name):
                    with contextlib.suppress(OSError):
                        (self.refs / name).rmdir()
