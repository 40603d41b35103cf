"""Snapshots of sandboxes whose writable layer the host can not read directly (a microVM: the
host never mounts the guest's disk): the overlay upper arrives as a tar stream made inside the
sandbox, and becomes the same staging tree :func:`rollbox.images.snapshot.capture_upper` makes
from a container's upper, for the same layer builder.

The stream is hostile (the guest's root may have replaced the agent and its tools): it is read
member by member with the snapshot's caps (bytes at full size, entries, depth, path length,
pax/long-name headers), names without ``..`` or a leading ``/``, every member's parent a
directory this capture made (never a link: nothing is written through a link of the stream),
no duplicates, hard links only to regular files already captured, sparse members refused.
Whiteouts (0:0 character devices) are kept, other devices and sockets skipped, FIFOs kept.

busybox tar carries no xattrs: user.* ones come in a second stream (the agent's
``rollbox-xattrs`` records, :func:`apply_xattrs`), set on what the capture made, with the
caps of a container's snapshot (:func:`rollbox.images.snapshot.carried_xattr`), never
through a link. An opaque directory's marker does not survive the stream either;
:func:`opaque_dirs` infers the markers from the sandbox's merged view instead (a directory of
the upper shows no entry of a lower layer anywhere below it: marking it opaque changes nothing
the sandbox saw, and hides what it deleted and re-created).

Owns: this parsing and inference. Not: how the stream is made (``rollbox.agent.snapshot``),
the layer build (``images.store``), scrub rules (``images.snapshot``).
"""
from __future__ import annotations

import os
import stat
import struct
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO

from rollbox.errors import BadRequest, InfraError, PayloadTooLarge
from rollbox.images.overlay import ID_RANGE, NOBODY, make_whiteout
from rollbox.images.scrub import matches
from rollbox.images.snapshot import MAX_DEPTH, MAX_PATH, CaptureStats, carried_xattr
from rollbox.isolation.syscalls import (
    RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2,
)

MAX_TAR_META = 1 << 20
_CHUNK = 1 << 20


class _CappedTarInfo(tarfile.TarInfo):
    """tarfile reads pax and GNU long-name payloads into memory whole: cap them."""

    def _proc_pax(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        if self.size > MAX_TAR_META:
            raise InfraError("the sandbox's snapshot stream has a pax header too large")
        return super()._proc_pax(tarfile)  # type: ignore[misc]

    def _proc_gnulong(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        if self.size > MAX_TAR_META:
            raise InfraError("the sandbox's snapshot stream has a long-name header too large")
        return super()._proc_gnulong(tarfile)  # type: ignore[misc]


@dataclass
class UpperTree:
    """What the stream said the upper holds: each directory's entry names (whiteouts and
    scrubbed entries included: they hide lower entries all the same), by path ("" = root)."""

    dirs: dict[str, set[str]] = field(default_factory=dict)
    captured: set[str] = field(default_factory=set)  # directories present in the staging tree
    scrubbed: set[str] = field(default_factory=set)  # directories left out (scrub, exclude)


def _bad(message: str) -> InfraError:
    return InfraError(f"the sandbox sent a bad snapshot stream: {message}")


def _id(v: int) -> int:
    return v if 0 <= v < ID_RANGE else NOBODY


class _TarCapture:
    def __init__(self, dest_root: str, *, scrub: list[str], exclude: list[str], max_bytes: int,
                 max_entries: int) -> None:
        self.dest_root = dest_root
        self.scrub = scrub
        self.exclude = exclude
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.stats = CaptureStats()
        self.tree = UpperTree()
        self.kinds: dict[str, str] = {"": "dir"}  # captured path -> "dir" | "file" | "other"
        self.dropped: set[str] = set()  # scrubbed directories: their members go too
        self.seen: set[str] = set()
        self.dir_times: list[tuple[str, int]] = []
        self.raw_entries = 0

    def _name(self, raw: str) -> str:
        if raw.startswith("/") or "\0" in raw:
            raise _bad(f"absolute member name {raw[:200]!r}")
        comps = [c for c in raw.split("/") if c and c != "."]
        if ".." in comps:
            raise _bad(f"member name with '..': {raw[:200]!r}")
        if len(comps) > MAX_DEPTH:
            raise BadRequest(f"the sandbox's changes nest deeper than {MAX_DEPTH} directories")
        rel = "/".join(comps)
        if len(rel.encode("utf-8", "surrogateescape")) + 1 > MAX_PATH:
            raise BadRequest(f"path longer than {MAX_PATH} bytes in the sandbox's changes: "
                             f"{rel[:120]!r}...")
        return rel

    def _dst(self, rel: str) -> str:
        return os.path.join(self.dest_root, rel) if rel else self.dest_root

    def run(self, src: IO[bytes]) -> tuple[CaptureStats, UpperTree]:
        os.mkdir(self.dest_root, 0o700)
        self.tree.dirs[""] = set()
        self.tree.captured.add("")
        try:
            with tarfile.open(fileobj=src, mode="r|",  # type: ignore[call-overload]
                              tarinfo=_CappedTarInfo) as tf:
                for m in tf:
                    self.raw_entries += 1
                    if self.raw_entries > self.max_entries + 1:
                        raise PayloadTooLarge(f"the sandbox's changes have more than "
                                              f"{self.max_entries} entries",
                                              limit=self.max_entries)
                    self._member(tf, m)
        except (tarfile.TarError, EOFError, ValueError, UnicodeError) as exc:
            raise _bad(f"malformed tar: {exc}") from exc
        for dst, mtime in reversed(self.dir_times):
            os.utime(dst, (mtime, mtime), follow_symlinks=False)
        return self.stats, self.tree

    def _meta(self, dst: str, m: tarfile.TarInfo, link: bool = False) -> None:
        os.chown(dst, _id(m.uid), _id(m.gid), follow_symlinks=False)
        if not link:
            os.chmod(dst, stat.S_IMODE(m.mode) & 0o7777)  # after chown: chown drops setuid

    def _member(self, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        rel = self._name(m.name)
        if rel in self.seen:
            raise _bad(f"duplicate member {rel[:200]!r}")
        self.seen.add(rel)
        parent, _, name = rel.rpartition("/")
        if rel == "":
            if not m.isdir():
                raise _bad("the top of the stream is not a directory")
            self._meta(self.dest_root, m)
            self.dir_times.append((self.dest_root, _mtime(m)))
            return
        if parent in self.dropped or any(parent.startswith(d + "/") for d in self.dropped
                                         if d):
            return
        if self.kinds.get(parent) != "dir":
            # Its parent is not a directory captured here (a link, a file, a gap): writing it
            # would follow whatever the sandbox put there.
            raise _bad(f"member {rel[:200]!r} is not below a directory of the stream")
        self.tree.dirs[parent].add(name)
        whiteout = m.ischr() and m.devmajor == 0 and m.devminor == 0
        if not whiteout and (matches("/" + rel, name, self.scrub)
                             or matches("/" + rel, name, self.exclude)):
            self.stats.scrubbed += 1
            if m.isdir():
                self.dropped.add(rel)
                self.tree.scrubbed.add(rel)
            return
        self.stats.entries += 1
        if self.stats.entries > self.max_entries:
            raise PayloadTooLarge(f"the sandbox's changes have more than {self.max_entries} "
                                  "entries", limit=self.max_entries)
        dst = self._dst(rel)
        if whiteout:
            make_whiteout(dst)
            self.stats.whiteouts += 1
            self.kinds[rel] = "other"
        elif m.isdir():
            os.mkdir(dst, 0o700)
            self._meta(dst, m)
            self.dir_times.append((dst, _mtime(m)))
            self.kinds[rel] = "dir"
            self.tree.dirs[rel] = set()
            self.tree.captured.add(rel)
        elif m.issym():
            if not m.linkname or len(m.linkname) > MAX_PATH or "\0" in m.linkname:
                raise _bad(f"bad link target in {rel[:200]!r}")
            os.symlink(m.linkname, dst)
            self._meta(dst, m, link=True)
            os.utime(dst, (_mtime(m), _mtime(m)), follow_symlinks=False)
            self.kinds[rel] = "other"
        elif m.islnk():
            target = self._name(m.linkname)
            if self.kinds.get(target) != "file":
                raise _bad(f"hard link {rel[:200]!r} to a member that is not a captured file")
            os.link(self._dst(target), dst, follow_symlinks=False)
            self.kinds[rel] = "file"
        elif m.isreg():
            if m.issparse():
                raise _bad(f"sparse member {rel[:200]!r}")
            self.stats.bytes += m.size
            if self.stats.bytes > self.max_bytes:
                raise PayloadTooLarge(f"the sandbox's changes exceed {self.max_bytes} bytes "
                                      f"(at {rel[:200]!r}; sparse files count at full size)",
                                      limit=self.max_bytes)
            self._copy(tf, m, dst)
            self.kinds[rel] = "file"
        elif m.isfifo():
            os.mkfifo(dst, 0o600)
            self._meta(dst, m)
            os.utime(dst, (_mtime(m), _mtime(m)), follow_symlinks=False)
            self.kinds[rel] = "other"
        else:
            # Device nodes other than whiteouts can not be made in a sandbox and are never
            # carried into an image; unknown types likewise.
            if len(self.stats.skipped) < 20:
                self.stats.skipped.append("/" + rel)

    def _copy(self, tf: tarfile.TarFile, m: tarfile.TarInfo, dst: str) -> None:
        src = tf.extractfile(m)
        assert src is not None
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            left = m.size
            while left > 0:
                data = src.read(min(_CHUNK, left))
                if not data:
                    raise _bad("truncated member data")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                left -= len(data)
            os.fchown(fd, _id(m.uid), _id(m.gid))
            os.fchmod(fd, stat.S_IMODE(m.mode) & 0o7777)
            os.utime(fd, (_mtime(m), _mtime(m)))
        finally:
            os.close(fd)


def _mtime(m: tarfile.TarInfo) -> int:
    return min(max(int(m.mtime), 0), (1 << 33) - 1)


def capture_tar(src: IO[bytes], dest_root: str, *, scrub: list[str], exclude: list[str],
                max_bytes: int, max_entries: int) -> tuple[CaptureStats, UpperTree]:
    """Build the staging tree ``dest_root`` (a new directory) from the tar ``src`` of an
    overlay upper (members relative to it, the top as ``.``), minus ``scrub`` and ``exclude``
    patterns, with the snapshot's caps. Reads ``src`` sequentially (a pipe is fine)."""
    return _TarCapture(dest_root, scrub=scrub, exclude=exclude, max_bytes=max_bytes,
                       max_entries=max_entries).run(src)


def opaque_dirs(tree: UpperTree, merged: dict[str, set[str] | None]) -> set[str]:
    """The captured directories to mark opaque: each top-most one below which the sandbox's
    merged view (``merged[dir]``: its entry names, None if unknown) shows nothing but the
    upper's own entries. Such a directory hides every lower entry whether or not it is
    marked; marking it keeps hidden what the sandbox deleted there (``rm -rf d; mkdir d``)."""
    can: dict[str, bool] = dict.fromkeys(tree.scrubbed, False)  # what is left out is unknown
    for d in sorted(tree.dirs, key=lambda p: -p.count("/") - (1 if p else 0)):
        names = merged.get(d)
        ok = names is not None and names <= tree.dirs[d]
        if ok:
            prefix = d + "/" if d else ""
            ok = all(can.get(prefix + n, True) for n in tree.dirs[d])
        can[d] = ok
    out = set()
    for d in tree.captured:
        if can.get(d):
            parent = d.rpartition("/")[0] if d else None
            if parent is None or not can.get(parent, False):
                out.add(d)
    return out


def dirs_to_list(tree: UpperTree) -> Iterable[str]:
    """The upper's directories whose merged listing :func:`opaque_dirs` needs."""
    return sorted(tree.dirs)


_XATTR_HEAD = struct.Struct("<2sHHI")  # "XA", path, name and value lengths


def apply_xattrs(records: bytes, dest_root: str, max_records: int) -> int:
    """Set the user.* attributes of the sandbox's ``rollbox-xattrs`` records (hostile) on the
    staging tree at ``dest_root``; returns how many were set. A record whose path the capture
    did not make (scrubbed, excluded, changed meanwhile), is not a regular file or directory,
    or leads through a link, is skipped; a malformed stream is an InfraError."""
    root = os.open(dest_root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return _apply_xattrs(memoryview(records), root, max_records)
    finally:
        os.close(root)


def _apply_xattrs(data: memoryview, root: int, max_records: int) -> int:
    off = count = applied = 0
    while off < len(data):
        if len(data) - off < _XATTR_HEAD.size:
            raise _bad("truncated extended attribute record")
        magic, plen, nlen, vlen = _XATTR_HEAD.unpack_from(data, off)
        off += _XATTR_HEAD.size
        if magic != b"XA" or off + plen + nlen + vlen > len(data):
            raise _bad("malformed extended attribute record")
        raw_path = bytes(data[off:off + plen])
        name = bytes(data[off + plen:off + plen + nlen]).decode("utf-8", "surrogateescape")
        value = bytes(data[off + plen + nlen:off + plen + nlen + vlen])
        off += plen + nlen + vlen
        count += 1
        if count > max_records:
            raise PayloadTooLarge(f"the sandbox's changes carry more than {max_records} "
                                  "extended attributes", limit=max_records)
        comps = raw_path.decode("utf-8", "surrogateescape").split("/") if raw_path else []
        if (not carried_xattr(name, vlen) or "\0" in name or b"\0" in raw_path
                or any(c in ("", ".", "..") for c in comps) or len(comps) > MAX_DEPTH):
            continue
        try:
            fd = openat2(root, "/".join(comps) or ".",
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, 0,
                         RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
        except OSError:
            continue
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
                os.setxattr(fd, name, value)
                applied += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return applied
