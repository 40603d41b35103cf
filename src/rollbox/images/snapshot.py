"""A writable layer becomes an image layer: snapshots (``pack_diff``) and image builds.

The one path from an overlay upper to a layer: :func:`capture_upper` copies it into a staging
tree (below), :func:`layer_from_capture` scrubs its git repositories and packs it. Snapshots of
containers (the backend's ``capture_writable``), image builds by running commands (the same
``capture_writable``, the builder's :data:`BUILD` content) and :func:`layer_from_upper` all take
it; a microVM's snapshot makes the same staging tree from a tar stream
(:mod:`rollbox.images.snapshot_tar`) and packs it with :func:`layer_from_capture` too.

The capture reads the overlay upper of a live sandbox from the host side. The agent controls
every byte of that tree (symlinks, FIFOs, devices, hard links, sparse files, deep trees,
xattrs), so the copy walks it with directory file descriptors only: every directory is opened
``O_NOFOLLOW|O_DIRECTORY`` relative to its already-open parent and every file
``O_NOFOLLOW|O_NONBLOCK`` relative to its directory, then re-checked with ``fstat`` (same inode,
still a regular file). No path of the upper is ever resolved by name from the root, no link is
followed, nothing of the sandbox is executed, and a tree swapped while the copy runs (``pause``
off) can only change what is copied, never where the host reads or writes. Sizes, entry counts,
depth and path lengths are capped with typed errors. ``mkfs.erofs`` then packs the host-side
staging copy (our own tree: symlinks are stored as symlinks, whiteouts as 0:0 character
devices, opaque directories with ``trusted.overlay.opaque``), so overlayfs reads the new layer
exactly as it read the upper.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollbox.errors import BadRequest, InfraError, PayloadTooLarge, RollboxError
from rollbox.images import git
from rollbox.images.overlay import (
    DROPPED_OVERLAY_XATTRS,
    OPAQUE_XATTR,
    REFUSED_OVERLAY_XATTRS,
    is_whiteout,
    make_whiteout,
    map_id,
    set_opaque,
)
from rollbox.images.scrub import UPPER_CACHE_EXCLUDES, bytecode_dropped, matches
from rollbox.images.store import ImageStore, Progress
from rollbox.isolation import syscalls
from rollbox.isolation.cgroups import (  # noqa: F401 - re-exported: freezing lives with cgroups
    FREEZE_TIMEOUT_S,
    frozen,
    is_frozen,
)
from rollbox.models import GitRepoFacts

# What a snapshot drops by default, and why. "/abs/glob" matches the whole path inside the
# sandbox (fnmatch: "*" also matches "/"), a bare pattern matches any entry's basename.
# Whiteouts are never dropped: a deletion in the sandbox stays a deletion in the snapshot.
SCRUB_RULES: list[tuple[str, str]] = [
    ("/tmp/*", "scratch space; sockets and lock files of processes that will not exist"),
    ("/var/tmp/*", "scratch space"),
    ("/root/.cache", "pip, uv, node-gyp and other per-user download caches"),
    ("/home/*/.cache", "per-user download caches"),
    ("/root/.npm", "npm's download cache (_cacache) and logs"),
    ("/home/*/.npm", "npm's download cache and logs"),
    ("/var/cache/apt/archives/*.deb", "downloaded .deb files, already installed"),
    ("/var/cache/apt/*.bin", "apt's binary package cache, rebuilt by apt"),
    ("/var/lib/apt/lists/*", "package indexes: stale in a day, rebuilt by apt-get update"),
    ("__pycache__", "Python bytecode, rebuilt on import; may hold compiled copies of tests"),
    (".pytest_cache", "pytest's last-run state: reveals which tests ran and failed"),
    ("/var/log/*.log", "logs of the session that built the environment"),
    ("/var/log/apt/*", "apt's logs and terminal transcripts"),
    ("/root/.bash_history", "the building session's shell history"),
    ("/root/.python_history", "the building session's REPL history"),
]
DEFAULT_SCRUB = [pattern for pattern, _why in SCRUB_RULES]

DEFAULT_MAX_BYTES = 4 << 30
DEFAULT_MAX_ENTRIES = 1_000_000
# An image build's layer has no caps of its own (as good as none): its sandbox's disk bounds it.
BUILD_MAX_BYTES = 1 << 40
BUILD_MAX_ENTRIES = 1 << 31
MAX_DEPTH = 256
MAX_PATH = 4000  # below PATH_MAX: mkfs.erofs walks the staging copy by path
MAX_XATTR_BYTES = 64 << 10
_COPY_CHUNK = 1 << 20


@dataclass
class CaptureStats:
    entries: int = 0
    bytes: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    scrubbed: int = 0
    skipped: list[str] = field(default_factory=list)  # sockets, devices (first few)


@dataclass(frozen=True)
class CaptureOptions:
    """How a snapshot copies the writable layer (``Backend.capture_writable``)."""

    pause: bool  # frozen during the copy (a paused sandbox stays so after it)
    scrub: list[str]
    exclude: list[str]
    max_bytes: int
    max_entries: int
    complete_repos: bool  # make repositories of lower layers the upper touches whole
    # Whose writable layer (CONTENTS): "snapshot" (a sandbox's: hostile) or "build" (the image
    # builder's: every xattr but overlay's, library bytecode kept); builds run on the container
    # backend only.
    content: Literal["snapshot", "build"] = "snapshot"


@dataclass
class CaptureResult:
    stats: CaptureStats
    paused_s: float  # how long the sandbox was frozen for the copy (0 if not paused)
    copy_s: float = 0.0  # how long the copy took (frozen or not)


def validate_patterns(patterns: list[str]) -> list[str]:
    for p in patterns:
        if not isinstance(p, str) or not p or "\0" in p or len(p) > 1024:
            raise BadRequest(f"invalid exclude pattern {str(p)[:100]!r}")
    return list(patterns)


def carried_xattr(name: str, size: int = 0) -> bool:
    """Whether a snapshot carries the extended attribute ``name`` (of ``size`` bytes) over:
    user.* up to MAX_XATTR_BYTES. trusted.* is overlay bookkeeping; security.capability and
    ACLs carry host-shifted ids that mean nothing (or too much) in another sandbox."""
    return (name.startswith("user.") and not name.startswith("user.overlay.")
            and size <= MAX_XATTR_BYTES)


@dataclass(frozen=True)
class CaptureContent:
    """What a capture carries beyond the tree and its scrub patterns, by whose writable layer it
    is: a sandbox's (a snapshot: hostile) or the image builder's (its commands are the
    operator's)."""

    all_xattrs: bool  # every xattr but the overlay's private ones; else carried_xattr's
    builder_bytecode: bool  # drop bytecode as scrub.bytecode_dropped says (library's kept)
    # An upper made with redirect_dir/metacopy is not a layer: the error and why (after the
    # path and the xattr's name).
    refused: type[RollboxError]
    refused_why: str


SNAPSHOT = CaptureContent(
    all_xattrs=False, builder_bytecode=False, refused=InfraError,
    refused_why="the sandbox's overlay is not mounted with redirect_dir=off,metacopy=off; its "
                "upper is not a layer")
BUILD = CaptureContent(
    all_xattrs=True, builder_bytecode=True, refused=BadRequest,
    refused_why="the overlay was mounted with redirect_dir/metacopy; its upper is not a "
                "self-contained layer (mount with redirect_dir=off,metacopy=off)")
CONTENTS = {"snapshot": SNAPSHOT, "build": BUILD}  # by CaptureOptions.content


class _Capture:
    """One copy of an upper tree into a staging directory (see the module docstring)."""

    def __init__(self, dest_root: Path, *, id_shift: int, scrub: list[str], exclude: list[str],
                 max_bytes: int, max_entries: int, content: CaptureContent = SNAPSHOT) -> None:
        self.dest_root = str(dest_root)
        self.content = content
        self.id_shift = id_shift
        self.scrub = scrub
        self.exclude = exclude
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.stats = CaptureStats()
        self.inodes: dict[int, str] = {}  # upper inode -> staging path of its first link
        self.dir_times: list[tuple[str, int, int]] = []

    # ---- limits ----
    def _count(self, rel: str) -> None:
        self.stats.entries += 1
        if self.stats.entries > self.max_entries:
            raise PayloadTooLarge(f"the sandbox's changes have more than {self.max_entries} "
                                  "entries", limit=self.max_entries)
        if len(rel.encode("utf-8", "surrogateescape")) > MAX_PATH:
            raise BadRequest(f"path longer than {MAX_PATH} bytes in the sandbox's changes: "
                             f"{rel[:120]!r}...")

    def _add_bytes(self, n: int, rel: str) -> None:
        self.stats.bytes += n
        if self.stats.bytes > self.max_bytes:
            raise PayloadTooLarge(f"the sandbox's changes exceed {self.max_bytes} bytes "
                                  f"(at {rel[:200]!r}; sparse files count at full size)",
                                  limit=self.max_bytes)

    # ---- metadata ----
    def _owner(self, dst: str, st: os.stat_result) -> None:
        os.chown(dst, map_id(st.st_uid, self.id_shift), map_id(st.st_gid, self.id_shift),
                 follow_symlinks=False)

    def _xattrs(self, fd: int, dst: str, rel: str) -> bool:
        """Copy the content's xattrs and the opaque marker from an open fd; True if opaque."""
        opaque = False
        all_xattrs = self.content.all_xattrs
        try:
            names = os.listxattr(fd)
        except OSError:
            return False
        for xname in names:
            if xname in REFUSED_OVERLAY_XATTRS:
                raise self.content.refused(f"{rel} carries {xname}: {self.content.refused_why}")
            if xname == OPAQUE_XATTR or (all_xattrs and xname == "user.overlay.opaque"):
                with contextlib.suppress(OSError):
                    opaque = opaque or os.getxattr(fd, xname) == b"y"
                continue
            if not (carried_xattr(xname) or all_xattrs and not xname.startswith(
                    DROPPED_OVERLAY_XATTRS)):
                continue
            try:
                value = os.getxattr(fd, xname)
            except OSError:
                continue
            if all_xattrs or carried_xattr(xname, len(value)):
                with contextlib.suppress(OSError):
                    os.setxattr(dst, xname, value, follow_symlinks=False)
        return opaque

    # ---- walk ----
    def run(self, upper: Path) -> CaptureStats:
        try:
            fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise InfraError(f"can not open the sandbox's writable layer {upper}: {exc}") from exc
        return self.run_fd(fd)

    def run_fd(self, fd: int) -> CaptureStats:
        """Capture the directory open at ``fd`` (closed here)."""
        try:
            st = os.fstat(fd)
            os.mkdir(self.dest_root, 0o700)
            self._dir_meta(fd, self.dest_root, st, "/")
            self._walk(fd, self.dest_root, "", 0)
        finally:
            os.close(fd)
        for dst, atime, mtime in reversed(self.dir_times):
            os.utime(dst, ns=(atime, mtime), follow_symlinks=False)
        return self.stats

    def _dir_meta(self, fd: int, dst: str, st: os.stat_result, rel: str) -> None:
        self._owner(dst, st)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        if self._xattrs(fd, dst, rel):
            set_opaque(dst)
            self.stats.opaque_dirs += 1
        self.dir_times.append((dst, st.st_atime_ns, st.st_mtime_ns))

    def _walk(self, dfd: int, dst_dir: str, rel_dir: str, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise BadRequest(f"the sandbox's changes nest deeper than {MAX_DEPTH} directories "
                             f"(at {rel_dir[:200]!r})")
        with os.scandir(dfd) as it:
            names = sorted(e.name for e in it)
        for name in names:
            rel = f"{rel_dir}/{name}"
            dst = os.path.join(dst_dir, name)
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we looked (pause off)
            if is_whiteout(st):
                self._count(rel)
                make_whiteout(dst)
                self.stats.whiteouts += 1
                continue
            if (matches(rel, name, self.scrub) or matches(rel, name, self.exclude)
                    or self.content.builder_bytecode and bytecode_dropped(rel, name)):
                self.stats.scrubbed += 1
                continue
            self._count(rel)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                self._copy_dir(dfd, name, dst, rel, st, depth)
            elif stat.S_ISREG(mode):
                self._copy_file(dfd, name, dst, rel, st)
            elif stat.S_ISLNK(mode):
                try:
                    target = os.readlink(name, dir_fd=dfd)
                except OSError:
                    continue
                os.symlink(target, dst)
                self._owner(dst, st)
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
            elif stat.S_ISFIFO(mode):
                os.mkfifo(dst, 0o600)
                self._owner(dst, st)
                os.chmod(dst, stat.S_IMODE(mode))
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
            else:
                # Sockets are runtime state; device nodes other than whiteouts can not be
                # made in a sandbox and are never carried into an image.
                if len(self.stats.skipped) < 20:
                    self.stats.skipped.append(rel)

    def _copy_dir(self, dfd: int, name: str, dst: str, rel: str, st: os.stat_result,
                  depth: int) -> None:
        try:
            cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                return  # swapped while we looked (pause off): not a directory any more
            raise
        try:
            cst = os.fstat(cfd)
            if (cst.st_dev, cst.st_ino) != (st.st_dev, st.st_ino):
                return
            os.mkdir(dst, 0o700)
            self._dir_meta(cfd, dst, cst, rel)
            self._walk(cfd, dst, rel, depth + 1)
        finally:
            os.close(cfd)

    def _copy_file(self, dfd: int, name: str, dst: str, rel: str, st: os.stat_result) -> None:
        if st.st_nlink > 1 and st.st_ino in self.inodes:
            os.link(self.inodes[st.st_ino], dst, follow_symlinks=False)
            return
        try:
            sfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                          | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
                return
            raise
        try:
            fst = os.fstat(sfd)
            if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev,
                                                                              st.st_ino):
                return  # swapped for something else while we looked
            self._add_bytes(fst.st_size, rel)
            ofd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                          | os.O_CLOEXEC, 0o600)
            try:
                remaining = fst.st_size  # a file growing meanwhile is cut at the size we counted
                while remaining > 0:
                    n = os.sendfile(ofd, sfd, None, min(remaining, _COPY_CHUNK))
                    if n == 0:
                        break
                    remaining -= n
                self._owner(dst, fst)
                os.fchmod(ofd, stat.S_IMODE(fst.st_mode))  # after chown: chown drops setuid
                self._xattrs(sfd, dst, rel)
                os.utime(ofd, ns=(fst.st_atime_ns, fst.st_mtime_ns))
            finally:
                os.close(ofd)
        finally:
            os.close(sfd)
        if fst.st_nlink > 1:
            self.inodes[fst.st_ino] = dst


def capture_upper(upper: Path, dest_root: Path, *, id_shift: int, scrub: list[str],
                  exclude: list[str], max_bytes: int = DEFAULT_MAX_BYTES,
                  max_entries: int = DEFAULT_MAX_ENTRIES,
                  content: CaptureContent = SNAPSHOT) -> CaptureStats:
    """Copy the overlay upper ``upper`` into the new directory ``dest_root`` (overlay format),
    minus ``scrub`` and ``exclude`` patterns, with sandbox-shifted ids mapped back to the
    image's (root = 0). Never follows a link of the upper; caps with typed errors."""
    return _Capture(dest_root, id_shift=id_shift, scrub=scrub, exclude=exclude,
                    max_bytes=max_bytes, max_entries=max_entries, content=content).run(upper)


def layer_from_capture(store: ImageStore, root: Path, *, source: str, scratch: Path,
                       keep_git_history: bool, progress: Progress | None = None,
                       ) -> tuple[str, list[GitRepoFacts]]:
    """Pack the staging tree ``root`` of a capture into a layer of ``store``: its git
    repositories keep only what HEAD reaches unless ``keep_git_history`` (``scratch``: a
    private directory on the store's filesystem). Returns (digest, the repositories)."""
    repos = git.process_tree(root, keep_history=keep_git_history, scratch=scratch)
    digest = store.add_layer_from_dir(root, source=source, progress=progress, git_repos=repos)
    return digest, repos


def layer_from_upper(store: ImageStore, upper_dir: Path, *, exclude: list[str] | None = None,
                     source: str, id_shift: int = 0,
                     progress: Progress | None = None, keep_git_history: bool = False,
                     merged: Path | None = None) -> str:
    """Turn an overlayfs upper directory into a layer as the image builder does (its caches,
    scrub.UPPER_CACHE_EXCLUDES, and ``exclude`` patterns left out; BUILD content): the
    descriptor-based capture and :func:`layer_from_capture`. The upper is never changed (it
    may belong to a live sandbox); whiteouts always survive. ``id_shift``: host uid/gid of the
    sandbox's root, mapped back to 0 in the layer. Git repositories made in the sandbox keep
    only what HEAD reaches unless ``keep_git_history``; with ``merged`` (the sandbox's overlay
    view), a repository of a lower layer that the upper changed is taken whole from it and
    scrubbed too (:func:`complete_repos`)."""
    upper_dir = Path(upper_dir)
    if not upper_dir.is_dir():
        raise BadRequest(f"upper dir {upper_dir} is not a directory")
    staging = store.staging_dir("upper")
    root = staging / "rootfs"
    try:
        if progress:
            progress(f"copying {upper_dir}")
        stats = capture_upper(upper_dir, root, id_shift=id_shift, scrub=UPPER_CACHE_EXCLUDES,
                              exclude=list(exclude or []), max_bytes=BUILD_MAX_BYTES,
                              max_entries=BUILD_MAX_ENTRIES, content=BUILD)
        if merged is not None and not keep_git_history:
            complete_repos(merged, root, id_shift=id_shift,
                           max_bytes=BUILD_MAX_BYTES - stats.bytes,
                           max_entries=BUILD_MAX_ENTRIES)
        return layer_from_capture(store, root, source=source, scratch=staging,
                                  keep_git_history=keep_git_history, progress=progress)[0]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---- git history (red-team E36) ------------------------------------------------------------

def complete_repos(merged: Path, root: Path, *, id_shift: int, max_bytes: int = DEFAULT_MAX_BYTES,
                   max_entries: int = DEFAULT_MAX_ENTRIES) -> list[str]:
    """Make every repository the capture in ``root`` touches whole, so it can be scrubbed:
    where the sandbox's view (``merged``, its overlay mount on the host) has a repository at a
    directory of the capture, that directory is replaced by a copy of the whole repository
    from the view (the same fd-only walk), marked opaque so the lower layers' copy stays
    hidden. Run with the sandbox frozen: the capture's directories are real directories of
    the upper, so the view's path to each is the sandbox's own; one not frozen may have
    swapped a directory for a link meanwhile, so a path of the view is only followed if no
    component of it is a link. Returns the paths completed."""
    done = []
    view = os.open(merged, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for dirpath, dirnames, _files in os.walk(root):
            rel = os.path.relpath(dirpath, root)
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
            if rel == ".":
                continue
            fd = _open_beneath(view, rel)  # a sandbox not frozen may have swapped in a link
            if fd is None:
                continue
            if not git.is_git_dir_at(fd):
                os.close(fd)
                continue
            dirnames[:] = []
            tmp = Path(dirpath).with_name(Path(dirpath).name + ".rollbox-repo")
            _Capture(tmp, id_shift=id_shift, scrub=[], exclude=[], max_bytes=max_bytes,
                     max_entries=max_entries).run_fd(fd)
            shutil.rmtree(dirpath)
            os.rename(tmp, dirpath)
            set_opaque(dirpath)
            done.append("/" + rel)
    finally:
        os.close(view)
    return done


def _open_beneath(dirfd: int, rel: str) -> int | None:
    """The directory ``rel`` below ``dirfd`` if no component of it is a link (None if not)."""
    try:
        return syscalls.openat2(dirfd, rel, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,
                                resolve=syscalls.RESOLVE_BENEATH | syscalls.RESOLVE_NO_SYMLINKS
                                | syscalls.RESOLVE_NO_MAGICLINKS)
    except OSError:
        return None




# ---- push targets --------------------------------------------------------------------------

def allowed_push_url(url: str, node_default: str, also_allowed: Iterable[str]) -> str:
    """The chunk store a snapshot may be pushed to: ``default`` (the node's store), that
    store's URL, or one the operator listed (``also_allowed``: the node's
    ``snapshot_push_stores``, ``$ROLLBOX_SNAPSHOT_PUSH_STORES``). Any other URL is refused: a
    caller-chosen ``dir://`` path would let an API caller write files anywhere on the host, an
    ``s3://...?endpoint=`` any address."""
    if url == "default":
        return node_default
    allowed = {node_default, *also_allowed}
    if url not in allowed:
        raise BadRequest(f"push target {url[:200]!r} is not allowed on this node (allowed: "
                         "'default', the node's chunk store, $ROLLBOX_SNAPSHOT_PUSH_STORES)")
    return url
