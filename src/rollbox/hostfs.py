"""File operations from the host on a directory tree a sandbox (or a client) wrote.

The agent inside the sandbox is root there and hostile: it plants symlinks, ``..``, FIFOs,
device nodes and huge sparse files, and races renames. So every path is resolved with
``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`` relative to an fd of the root (absolute
symlinks and ``..`` stay inside), the last component is handled with ``dir_fd=`` /
no-follow forms, only regular files are ever opened for I/O, and trees are walked by directory
fds without following links. Nothing here runs a binary or a shell of the sandbox.

Files created here are owned by host ids shifted by the sandbox's uid range; ids read back are
unshifted (ids outside the range show as 65534, like the kernel's overflow id).

Below the backends and the edge, so each uses this one implementation: a container's file API
(``backends.container.files``), the edge's extraction of an uploaded image's tar
(``edge.storage``), the stream plumbing of the agent's file API and snapshots, and the checks
both file APIs apply to hostile input alike (write size, tar entry cap, what counts as a
malformed tar stream).

Owns: this module only. Knows nothing of sandboxes, mounts or the edge; callers hand it a
directory and the uid shift.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import lzma
import os
import posixpath
import secrets
import stat as st
import tarfile
import threading
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from rollbox import errors
from rollbox.errors import DiskFull
from rollbox.isolation.syscalls import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, openat2
from rollbox.models import FileStat

T = TypeVar("T")

RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
MAX_PATH = 4096
ID_RANGE = 65536
OVERFLOW_ID = 65534
MODE_MASK = 0o1777  # never setuid/setgid on anything we create
MAX_DEPTH = 256  # one fd per level while walking; deeper trees are refused
MAX_TAR_META = 1 << 20  # pax / GNU long-name headers are read whole by tarfile
CHUNK = 256 << 10
_EAGAIN_RETRIES = 32
TMP_PREFIX = ".rollbox-tmp-"
# Cap of one streamed file (read_stream / write_stream): memory stays bounded whatever the size,
# the sandbox's disk cap bounds what a write can store anyway.
MAX_STREAM_FILE = 16 << 30
STREAM_CHUNK = 1 << 20
# A file's own extended attributes (FileStat.xattrs, written with a file): the user.*
# namespace only (not user.overlay.*, the overlay's), capped so that every filesystem of a
# writable layer stores them (btrfs keeps them in one metadata node) and a hostile sandbox's
# attributes can not grow an answer.
XATTR_PREFIX = "user."
MAX_XATTRS = 64
MAX_XATTR_NAME = 255
MAX_XATTR_VALUE = 4096
MAX_XATTRS_TOTAL = 8192


# ---- checks both file APIs apply to hostile input alike: this one and the agent's
# (``agent.files``), which imports them from here. Which typed error a bad stream
# becomes is the caller's (a client's bad tar and a guest's differ).

# What tarfile and the decompressors raise on bad data (besides a bare OSError).
MALFORMED_TAR = (tarfile.TarError, EOFError, ValueError, UnicodeError, zlib.error,
                 lzma.LZMAError)


def tar_malformed(exc: BaseException) -> bool:
    """Whether ``exc`` means the tar stream is bad data (not a failing file operation)."""
    if isinstance(exc, MALFORMED_TAR):
        return True
    # decompressors report bad data as a bare OSError
    return isinstance(exc, OSError) and exc.errno is None


def capped_members(tf: tarfile.TarFile, max_entries: int) -> Iterator[tarfile.TarInfo]:
    """The members of ``tf``; ``PayloadTooLarge`` once there are more than ``max_entries``."""
    entries = 0
    for member in tf:
        entries += 1
        if entries > max_entries:
            raise errors.PayloadTooLarge(f"tar has more than {max_entries} entries",
                                         limit=max_entries)
        yield member


def check_write_data(data: object, max_write: int) -> None:
    """A whole-file write's content: bytes, at most ``max_write`` of them."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise errors.BadRequest("file content must be bytes")
    if len(data) > max_write:
        raise errors.PayloadTooLarge(f"{len(data)} bytes is above the "
                                     f"{max_write}-byte write cap",
                                     size=len(data), limit=max_write)


def check_xattrs(xattrs: object) -> dict[str, str]:
    """Validate the extended attributes a caller writes with a file (BadRequest on any bad
    one): a map of ``user.*`` names to text values within the caps above."""
    if not isinstance(xattrs, dict):
        raise errors.BadRequest("xattrs must be a map of names to values")
    if len(xattrs) > MAX_XATTRS:
        raise errors.BadRequest(f"at most {MAX_XATTRS} extended attributes per file",
                                limit=MAX_XATTRS)
    total = 0
    for name, value in xattrs.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise errors.BadRequest("extended attribute names and values must be strings")
        raw = name.encode("utf-8", "surrogateescape")
        if (not name.startswith(XATTR_PREFIX) or name.startswith("user.overlay.")
                or len(name) == len(XATTR_PREFIX) or "\0" in name
                or len(raw) > MAX_XATTR_NAME):
            raise errors.BadRequest(f"invalid extended attribute name {name[:100]!r} (user.*, "
                                    f"at most {MAX_XATTR_NAME} bytes)")
        size = len(value.encode("utf-8", "surrogateescape"))
        if size > MAX_XATTR_VALUE:
            raise errors.BadRequest(f"extended attribute {name[:100]!r} above "
                                    f"{MAX_XATTR_VALUE} bytes", limit=MAX_XATTR_VALUE)
        total += len(raw) + size
    if total > MAX_XATTRS_TOTAL:
        raise errors.BadRequest(f"extended attributes above {MAX_XATTRS_TOTAL} bytes in all",
                                limit=MAX_XATTRS_TOTAL)
    return dict(xattrs)


def xattr_write_error(err: int | None, path: str) -> errors.BadRequest | None:
    """The client's error when setting a checked attribute on ``path`` failed with errno
    ``err`` because of the sandbox's filesystem (None: any other failure). Both file APIs."""
    if err in (errno.ENOTSUP, errno.EOPNOTSUPP):
        return errors.BadRequest(f"the sandbox's filesystem stores no extended attributes: "
                                 f"{path}", path=path)
    if err in (errno.E2BIG, errno.ENOSPC, errno.ERANGE):
        return errors.BadRequest(f"extended attributes too large for {path}", path=path)
    return None


def _set_xattrs(fd: int, xattrs: dict[str, str], path: str) -> None:
    for name, value in xattrs.items():
        try:
            os.setxattr(fd, name, value.encode("utf-8", "surrogateescape"))
        except OSError as exc:
            mapped = xattr_write_error(exc.errno, path)
            if mapped is not None:
                raise mapped from None
            raise


def _read_xattrs(dfd: int, name: str) -> dict[str, str] | None:
    """The user.* attributes of entry ``name`` of directory fd ``dfd`` (not followed if a
    link; the fd is already resolved in-root), capped as written; None if it has none."""
    where = f"/proc/self/fd/{dfd}/{name}"
    try:
        names = os.listxattr(where, follow_symlinks=False)
    except OSError:
        return None  # vanished, or a filesystem without them
    out: dict[str, str] = {}
    wanted = [n for n in names if n.startswith(XATTR_PREFIX)
              and not n.startswith("user.overlay.") and len(n) <= MAX_XATTR_NAME]
    for n in wanted[:MAX_XATTRS]:  # a hostile file's many attributes cost at most this many
        try:
            raw = os.getxattr(where, n, follow_symlinks=False)
        except OSError:
            continue
        if len(raw) > MAX_XATTR_VALUE:
            continue
        out[n] = raw.decode("utf-8", "replace")
    return out or None


class _Stopped(Exception):
    """The consumer of a streaming transfer went away."""


def _os_error(exc: OSError, path: str) -> errors.RollboxError:
    """Map an OSError met while handling sandbox ``path`` to a typed rollbox error."""
    e = exc.errno
    if e == errno.ENOENT:
        return errors.NotFound(f"no such file or directory: {path}", path=path)
    if e in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(path=path)
    messages = {
        errno.ENOTDIR: "not a directory",
        errno.EISDIR: "is a directory",
        errno.EEXIST: "already exists",
        errno.ENOTEMPTY: "directory not empty",
        errno.ELOOP: "too many levels of symbolic links",
        errno.ENAMETOOLONG: "path too long",
        errno.EXDEV: "path leads outside the sandbox",
        errno.EMLINK: "too many links",
        errno.EINVAL: "invalid path or operation",
        errno.EPERM: "operation not permitted",
        errno.EACCES: "permission denied",
        errno.EROFS: "read-only file system",
        errno.ETXTBSY: "text file busy",
    }
    if e in messages:
        return errors.BadRequest(f"{messages[e]}: {path}", path=path, errno=e)
    return errors.InfraError(f"file operation failed on {path}: {exc.strerror}", path=path,
                             errno=e)


def _split(path: str) -> list[str]:
    """Validate a caller's absolute sandbox path and return its normalised components."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise errors.BadRequest(f"path must be absolute: {path!r}")
    if "\0" in path:
        raise errors.BadRequest("path contains a NUL byte")
    if len(path) > MAX_PATH:
        raise errors.BadRequest("path too long")
    # Lexical clean-up only; symlinks and ".." left in are resolved in-root by the kernel.
    norm = posixpath.normpath(path)
    return [c for c in norm.split("/") if c and c != "."]


def _join(parts: list[str]) -> str:
    return "/" + "/".join(parts)


def _ftype(mode: int) -> str:
    if st.S_ISREG(mode):
        return "file"
    if st.S_ISDIR(mode):
        return "dir"
    if st.S_ISLNK(mode):
        return "symlink"
    return "other"


def _kind(mode: int) -> str:
    if st.S_ISFIFO(mode):
        return "a FIFO"
    if st.S_ISCHR(mode) or st.S_ISBLK(mode):
        return "a device node"
    if st.S_ISSOCK(mode):
        return "a socket"
    if st.S_ISDIR(mode):
        return "a directory"
    if st.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class _SafeTarInfo(tarfile.TarInfo):
    """tarfile reads pax and GNU long-name payloads into memory whole: cap them."""

    def _proc_pax(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        if self.size > MAX_TAR_META:
            raise errors.BadRequest("tar pax header too large")
        return super()._proc_pax(tarfile)  # type: ignore[misc]

    def _proc_gnulong(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        if self.size > MAX_TAR_META:
            raise errors.BadRequest("tar long-name header too large")
        return super()._proc_gnulong(tarfile)  # type: ignore[misc]


class _ChunkReader:
    """File-like ``read(n)`` over an async chunk iterator, pulled from a worker thread.

    Only one chunk is in flight at a time, so memory stays bounded whatever the tar's size.
    """

    def __init__(self, chunks: AsyncIterator[bytes], loop: asyncio.AbstractEventLoop,
                 stop: threading.Event) -> None:
        self._it = chunks.__aiter__()
        self._loop = loop
        self._stop = stop
        self._buf = memoryview(b"")
        self._eof = False
        self.source_error: BaseException | None = None
        self.received = 0

    def _next(self) -> bytes | None:
        fut = asyncio.run_coroutine_threadsafe(self._anext(), self._loop)
        while True:
            if self._stop.is_set():
                fut.cancel()
                raise _Stopped()
            try:
                return fut.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                continue

    async def _anext(self) -> bytes | None:
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            return None

    def read(self, n: int = -1) -> bytes:
        while not self._buf and not self._eof:
            try:
                chunk = self._next()
            except _Stopped:
                raise
            except BaseException as exc:  # the source failed (client went away...)
                self.source_error = exc
                raise _Stopped() from exc
            if chunk is None:
                self._eof = True
            elif chunk:
                if not isinstance(chunk, (bytes, bytearray, memoryview)):
                    raise errors.BadRequest("upload chunks must be bytes")
                self.received += len(chunk)
                self._buf = memoryview(bytes(chunk))
        if n is None or n < 0:
            n = len(self._buf)
        out = bytes(self._buf[:n])
        self._buf = self._buf[n:]
        return out


class _QueueWriter:
    """File-like ``write`` that coalesces tar output into chunks and hands them to the event
    loop through a bounded asyncio queue (the worker blocks while the consumer is slow)."""

    def __init__(self, queue: asyncio.Queue[bytes | BaseException | None],
                 loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        self._q = queue
        self._loop = loop
        self._stop = stop
        self._buf = bytearray()

    def put(self, item: bytes | BaseException | None) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._q.put(item), self._loop)
        while True:
            if self._stop.is_set():
                fut.cancel()
                raise _Stopped()
            try:
                fut.result(timeout=0.5)
                return
            except concurrent.futures.TimeoutError:
                continue

    def write(self, data: bytes) -> int:
        self._buf += data
        if len(self._buf) >= CHUNK:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self._buf:
            out, self._buf = bytes(self._buf), bytearray()
            self.put(out)


class _FixedSizeReader:
    """Reads exactly ``size`` bytes from ``fd`` for a tar member: stops at ``size`` if the file
    grew, pads with zeros if it shrank (the agent may race us; the archive stays well formed)."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self._left = size
        self._short = False

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > self._left:
            n = self._left
        if n <= 0:
            return b""
        out = bytearray()
        while len(out) < n and not self._short:
            data = os.read(self._fd, n - len(out))
            if not data:
                self._short = True
            out += data
        out += bytes(n - len(out))
        self._left -= n
        return bytes(out)


class SandboxFS:
    """File API of one sandbox, on its merged root directory, from the host side.

    Sync methods are thread-safe (each call uses its own fds; the root fd is refcounted so
    close() never pulls it from under a running call); ``a*`` wrappers run them in a thread.
    """

    def __init__(self, root: Path, uid_shift: int, *, max_read: int = 256 << 20,
                 max_write: int = 256 << 20, max_upload: int = 2 << 30,
                 max_entries: int = 200_000, max_stream: int = MAX_STREAM_FILE) -> None:
        if uid_shift < 0 or uid_shift % ID_RANGE:
            raise ValueError(f"uid_shift must be a non-negative multiple of {ID_RANGE}")
        self.root = Path(root)
        self.uid_shift = uid_shift
        self.max_read = max_read
        self.max_write = max_write
        self.max_upload = max_upload
        self.max_entries = max_entries
        self.max_stream = max_stream
        self._root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._users == 0:
                _close(self._root_fd)

    def __enter__(self) -> SandboxFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _use(self) -> Iterator[int]:
        with self._lock:
            if self._closed:
                raise errors.SandboxDead("sandbox file system is closed")
            self._users += 1
        try:
            yield self._root_fd
        finally:
            with self._lock:
                self._users -= 1
                if self._closed and self._users == 0:
                    _close(self._root_fd)

    # ---- resolution -----------------------------------------------------------------------

    def _open(self, rfd: int, parts: list[str], flags: int, mode: int = 0) -> int:
        """openat2 in-root; retries EAGAIN (the kernel's answer to a concurrent rename)."""
        rel = "/".join(parts) or "."
        for _ in range(_EAGAIN_RETRIES):
            try:
                return openat2(rfd, rel, flags | os.O_CLOEXEC, mode, RESOLVE)
            except BlockingIOError:
                continue
        raise errors.InfraError(f"path kept changing while resolving {_join(parts)}",
                                path=_join(parts))

    def _open_dir(self, rfd: int, parts: list[str]) -> int:
        return self._open(rfd, parts, os.O_PATH | os.O_DIRECTORY)

    def _ensure_dir(self, rfd: int, parts: list[str], mode: int = 0o755, uid: int = 0,
                    gid: int = 0, create: bool = True) -> int:
        """O_PATH fd of directory ``parts``; creates missing ones (mkdir -p) when ``create``."""
        try:
            return self._open_dir(rfd, parts)
        except FileNotFoundError:
            if not create:
                raise
        fd = os.dup(rfd)
        try:
            for i in range(len(parts)):
                try:
                    nfd = self._open_dir(rfd, parts[: i + 1])
                except FileNotFoundError:
                    try:
                        os.mkdir(parts[i], mode & MODE_MASK, dir_fd=fd)
                        os.chown(parts[i], self._hid(uid), self._hid(gid), dir_fd=fd,
                                 follow_symlinks=False)
                    except FileExistsError:
                        pass  # a dangling symlink or a racing creator: re-resolve below
                    nfd = self._open_dir(rfd, parts[: i + 1])
                _close(fd)
                fd = nfd
            return fd
        except BaseException:
            _close(fd)
            raise

    def _hid(self, sid: int) -> int:
        """Host id of sandbox id ``sid`` (out-of-range ids map to sandbox root)."""
        return self.uid_shift + (sid if 0 <= sid < ID_RANGE else 0)

    def _sid(self, hid: int) -> int:
        sid = hid - self.uid_shift
        return sid if 0 <= sid < ID_RANGE else OVERFLOW_ID

    @staticmethod
    def _check_id(v: int, what: str) -> None:
        if not isinstance(v, int) or not 0 <= v < ID_RANGE:
            raise errors.BadRequest(f"{what} must be in 0..{ID_RANGE - 1}")

    def _filestat(self, path: str, name: str, s: os.stat_result,
                  link_target: str | None = None, dfd: int | None = None) -> FileStat:
        """``dfd``: the directory fd ``name`` is in, to read its user.* attributes from (files
        and directories only: links carry none)."""
        xattrs = (_read_xattrs(dfd, name)
                  if dfd is not None and (st.S_ISREG(s.st_mode) or st.S_ISDIR(s.st_mode))
                  else None)
        return FileStat(path=path, name=name, type=_ftype(s.st_mode),  # type: ignore[arg-type]
                        size=s.st_size, mode=st.S_IMODE(s.st_mode), mtime=s.st_mtime,
                        uid=self._sid(s.st_uid), gid=self._sid(s.st_gid),
                        link_target=link_target, xattrs=xattrs)

    # ---- read / write ---------------------------------------------------------------------

    def read(self, path: str, max_bytes: int | None = None) -> bytes:
        """Content of the regular file at ``path`` (links followed, in-root)."""
        cap = self.max_read if max_bytes is None else min(max(max_bytes, 0), self.max_read)
        with self._use() as rfd:
            fd = self._open_read(rfd, path, cap)
            try:
                out = bytearray()
                while len(out) <= cap:
                    data = os.read(fd, min(CHUNK, cap + 1 - len(out)))
                    if not data:
                        break
                    out += data
            except OSError as exc:
                raise _os_error(exc, path) from exc
            finally:
                _close(fd)
        if len(out) > cap:
            raise errors.PayloadTooLarge(f"{path} grew above the {cap}-byte cap", path=path,
                                         limit=cap)
        return bytes(out)

    async def read_stream(self, path: str, max_bytes: int | None = None,
                          offset: int = 0) -> AsyncIterator[bytes]:
        """The regular file at ``path`` from byte ``offset`` on, in chunks of at most 1 MiB,
        read in a worker thread one chunk at a time (memory stays bounded whatever the file's
        size). A missing file or one above the cap (the whole file's size) fails on the first
        step, before any byte is produced."""
        cap = (self.max_stream if max_bytes is None
               else min(max(max_bytes, 0), self.max_stream))
        with self._use() as rfd:
            fd = await asyncio.to_thread(self._open_read, rfd, path, cap)
            try:
                total = offset
                if offset:
                    os.lseek(fd, offset, os.SEEK_SET)
                while True:
                    try:
                        data = await asyncio.to_thread(os.read, fd,
                                                       min(STREAM_CHUNK, cap + 1 - total))
                    except OSError as exc:
                        raise _os_error(exc, path) from exc
                    if not data:
                        return
                    total += len(data)
                    if total > cap:
                        raise errors.PayloadTooLarge(f"{path} grew above the {cap}-byte cap",
                                                     path=path, limit=cap)
                    yield data
            finally:
                _close(fd)

    def _open_read(self, rfd: int, path: str, cap: int) -> int:
        """A read fd of the regular file at ``path`` (links followed, in-root), checked against
        ``cap``; FIFOs and devices are refused, never opened."""
        parts = _split(path)
        try:
            pfd = self._open(rfd, parts, os.O_PATH)
            try:
                s = os.fstat(pfd)
                if not st.S_ISREG(s.st_mode):
                    raise errors.BadRequest(
                        f"cannot read {path}: {_kind(s.st_mode)}, not a regular file",
                        path=path)
                if s.st_size > cap:
                    raise errors.PayloadTooLarge(
                        f"{path} is {s.st_size} bytes, above the {cap}-byte cap",
                        path=path, size=s.st_size, limit=cap)
                # Reopen the very inode we checked; a device or FIFO is never opened.
                return os.open(f"/proc/self/fd/{pfd}",
                               os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            finally:
                _close(pfd)
        except OSError as exc:
            raise _os_error(exc, path) from exc

    def write(self, path: str, data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0,
              parents: bool = True, xattrs: dict[str, str] | None = None) -> None:
        """Atomically replace ``path`` with ``data`` (a symlink there is replaced, not
        followed); missing parents are created when ``parents``. ``xattrs`` (user.*, see
        :func:`check_xattrs`) are the new file's, set before it appears: a file replaced keeps
        none of the old one's."""
        check_write_data(data, self.max_write)
        self._write(path, lambda fd: _write_all(fd, data), mode, uid, gid, parents, xattrs)

    async def write_stream(self, path: str, chunks: AsyncIterator[bytes], mode: int = 0o644,
                           uid: int = 0, gid: int = 0, parents: bool = True,
                           max_bytes: int | None = None,
                           xattrs: dict[str, str] | None = None) -> int:
        """Like :meth:`write` from a byte stream, pulled one chunk at a time by a worker thread
        (memory stays bounded). The file appears only once complete: a stream that fails, goes
        past ``max_bytes`` or fills the sandbox's disk leaves no file and no temp file behind.
        Returns the bytes written."""
        cap = (self.max_stream if max_bytes is None
               else min(max(max_bytes, 0), self.max_stream))

        def work(reader: _ChunkReader) -> int:
            def fill(fd: int) -> None:
                while data := reader.read():
                    if reader.received > cap:
                        raise errors.PayloadTooLarge(f"file above the {cap}-byte cap",
                                                     path=path, limit=cap)
                    _write_all(fd, data)

            self._write(path, fill, mode, uid, gid, parents, xattrs)
            return reader.received

        if xattrs:
            check_xattrs(xattrs)  # before a byte of the stream is pulled

        return await _pulled(chunks, work)

    def _write(self, path: str, fill: Callable[[int], object], mode: int, uid: int, gid: int,
               parents: bool, xattrs: dict[str, str] | None = None) -> None:
        parts = _split(path)
        if not parts:
            raise errors.BadRequest("cannot write to /")
        self._check_id(uid, "uid")
        self._check_id(gid, "gid")
        attrs = check_xattrs(xattrs) if xattrs else {}
        with self._use() as rfd:
            try:
                dfd = self._ensure_dir(rfd, parts[:-1], uid=0, gid=0, create=parents)
                try:
                    self._put_file(dfd, parts[-1], fill, mode, uid, gid, None, attrs, path)
                finally:
                    _close(dfd)
            except OSError as exc:
                raise _os_error(exc, path) from exc

    def _put_file(self, dfd: int, name: str, fill: Callable[[int], object], mode: int,
                  uid: int, gid: int, mtime: float | None,
                  xattrs: dict[str, str] | None = None, path: str = "") -> None:
        """Write a temp file in ``dfd`` through ``fill`` (with ``xattrs``, validated), then
        rename it over ``name``."""
        tmp = TMP_PREFIX + secrets.token_hex(8)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dfd)
        try:
            try:
                fill(fd)
                if xattrs:
                    _set_xattrs(fd, xattrs, path or name)
                os.fchown(fd, self._hid(uid), self._hid(gid))
                os.fchmod(fd, mode & MODE_MASK)  # after chown, which would clear suid anyway
                if mtime is not None:
                    os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)
            # rename() replaces a file or symlink at ``name`` and fails on a directory.
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise

    # ---- metadata ---------------------------------------------------------------------------

    def stat(self, path: str) -> FileStat:
        """lstat of ``path`` (the last component is not followed; parents are, in-root)."""
        parts = _split(path)
        with self._use() as rfd:
            try:
                if not parts:
                    return self._filestat("/", "/", os.fstat(rfd))
                dfd = self._open_dir(rfd, parts[:-1])
                try:
                    s = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
                    target = os.readlink(parts[-1], dir_fd=dfd) if st.S_ISLNK(s.st_mode) else None
                    return self._filestat(_join(parts), parts[-1], s, target, dfd)
                finally:
                    _close(dfd)
            except OSError as exc:
                raise _os_error(exc, path) from exc

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except errors.NotFound:
            return False
        except errors.BadRequest as exc:
            if exc.details.get("errno") in (errno.ENOTDIR, errno.ELOOP):
                return False
            raise
        return True

    def list(self, path: str) -> list[FileStat]:
        """Entries of directory ``path`` (links to it followed in-root), sorted by name."""
        parts = _split(path)
        base = _join(parts)
        out: list[FileStat] = []
        with self._use() as rfd:
            try:
                fd = self._open(rfd, parts, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    with os.scandir(fd) as it:
                        for entry in it:
                            if len(out) >= self.max_entries:
                                raise errors.PayloadTooLarge(
                                    f"{base} has more than {self.max_entries} entries",
                                    path=base, limit=self.max_entries)
                            try:
                                s = entry.stat(follow_symlinks=False)
                                target = (os.readlink(entry.name, dir_fd=fd)
                                          if st.S_ISLNK(s.st_mode) else None)
                            except FileNotFoundError:
                                continue  # vanished meanwhile
                            out.append(self._filestat(posixpath.join(base, entry.name),
                                                      entry.name, s, target, fd))
                finally:
                    _close(fd)
            except OSError as exc:
                raise _os_error(exc, path) from exc
        out.sort(key=lambda f: f.name)
        return out

    def mkdir(self, path: str, parents: bool = False, mode: int = 0o755, uid: int = 0,
              gid: int = 0) -> None:
        """Create directory ``path``; with ``parents`` like ``mkdir -p`` (no error if it is
        already a directory)."""
        parts = _split(path)
        self._check_id(uid, "uid")
        self._check_id(gid, "gid")
        with self._use() as rfd:
            try:
                if parents:
                    _close(self._ensure_dir(rfd, parts, mode, uid, gid))
                    return
                if not parts:
                    raise errors.BadRequest("/ already exists", path="/")
                dfd = self._open_dir(rfd, parts[:-1])
                try:
                    os.mkdir(parts[-1], mode & MODE_MASK, dir_fd=dfd)
                    os.chown(parts[-1], self._hid(uid), self._hid(gid), dir_fd=dfd,
                             follow_symlinks=False)
                finally:
                    _close(dfd)
            except OSError as exc:
                raise _os_error(exc, path) from exc

    def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, link or (empty, or with ``recursive`` any) directory. Never follows
        symlinks below ``path``: a link is removed, not its target."""
        parts = _split(path)
        if not parts:
            raise errors.BadRequest("refusing to remove /")
        with self._use() as rfd:
            try:
                dfd = self._open_dir(rfd, parts[:-1])
                try:
                    name = parts[-1]
                    s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if not st.S_ISDIR(s.st_mode):
                        os.unlink(name, dir_fd=dfd)
                    elif recursive:
                        self._rmtree(dfd, name)
                    else:
                        os.rmdir(name, dir_fd=dfd)
                finally:
                    _close(dfd)
            except OSError as exc:
                raise _os_error(exc, path) from exc

    def _rmtree(self, parent_fd: int, name: str) -> None:
        """fd-based rmtree; iterative, one fd per level, directories opened O_NOFOLLOW."""
        # stack of (fd of dir, remaining child dir names, name of dir in its parent)
        stack: list[tuple[int, list[str], str]] = []
        try:
            stack.append((self._open_child_dir(parent_fd, name), [], name))
            self._clear_dir(stack[-1])
            while stack:
                fd, subdirs, dname = stack[-1]
                if subdirs:
                    child = subdirs.pop()
                    if len(stack) >= MAX_DEPTH:
                        raise errors.BadRequest(f"directory tree deeper than {MAX_DEPTH}")
                    try:
                        cfd = self._open_child_dir(fd, child)
                    except OSError as exc:
                        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                            raise
                        try:
                            os.unlink(child, dir_fd=fd)  # replaced by a file meanwhile
                        except FileNotFoundError:
                            pass
                        continue
                    stack.append((cfd, [], child))
                    self._clear_dir(stack[-1])
                    continue
                stack.pop()
                _close(fd)
                pfd = stack[-1][0] if stack else parent_fd
                try:
                    os.rmdir(dname, dir_fd=pfd)
                except FileNotFoundError:
                    pass
        finally:
            for fd, _, _ in stack:
                _close(fd)

    @staticmethod
    def _open_child_dir(dfd: int, name: str) -> int:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=dfd)

    @staticmethod
    def _clear_dir(frame: tuple[int, list[str], str]) -> None:
        """Unlink every non-directory in the frame's dir; collect subdirectories."""
        fd, subdirs, _ = frame
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    else:
                        os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass

    # ---- tar upload -------------------------------------------------------------------------

    async def upload_tar(self, path: str, chunks: AsyncIterator[bytes], *,
                         links: bool = True) -> int:
        """Extract a tar stream (optionally gz/bz2/xz) into directory ``path`` (created if
        missing). Returns the number of file bytes written. ``links=False`` skips symlinks and
        hard links (grading: copied files must not be able to point anywhere)."""
        parts = _split(path)
        return await _pulled(chunks, lambda reader: self._extract(parts, reader, links))

    def _extract(self, parts: list[str], reader: _ChunkReader, links: bool = True) -> int:
        with self._use() as rfd:
            try:
                _close(self._ensure_dir(rfd, parts))
            except OSError as exc:
                raise _os_error(exc, _join(parts)) from exc
            written = 0
            try:
                with tarfile.open(fileobj=reader, mode="r|*",  # type: ignore[call-overload]
                                  tarinfo=_SafeTarInfo) as tf:
                    for member in capped_members(tf, self.max_entries):
                        if not links and (member.issym() or member.islnk()):
                            continue
                        written += self._extract_member(rfd, parts, tf, member, written)
            except (errors.RollboxError, _Stopped):
                raise
            except (*MALFORMED_TAR, OSError) as exc:
                if tar_malformed(exc):
                    raise errors.BadRequest(f"malformed tar stream: {exc}") from exc
                assert isinstance(exc, OSError)
                raise _os_error(exc, _join(parts)) from exc
            return written

    @staticmethod
    def _member_parts(name: str) -> list[str]:
        if name.startswith("/") or "\0" in name:
            raise errors.BadRequest(f"tar member has an absolute path: {name!r}")
        comps = [c for c in name.split("/") if c and c != "."]
        if ".." in comps:
            raise errors.BadRequest(f"tar member has a '..' component: {name!r}")
        return comps

    def _extract_member(self, rfd: int, base: list[str], tf: tarfile.TarFile,
                        m: tarfile.TarInfo, written: int) -> int:
        rel = self._member_parts(m.name)
        if not rel and not m.isdir():
            raise errors.BadRequest(f"tar member without a name: {m.name!r}")
        full = base + rel
        where = _join(full)
        if len(where) > MAX_PATH:
            raise errors.BadRequest(f"tar member path too long: {m.name[:200]!r}")
        uid = m.uid if 0 <= m.uid < ID_RANGE else 0
        gid = m.gid if 0 <= m.gid < ID_RANGE else 0
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            return 0  # device nodes, FIFOs and unknown types are skipped
        try:
            if m.isdir():
                if rel:
                    self._extract_dir(rfd, full, m.mode, uid, gid)
                return 0
            dfd = self._ensure_dir(rfd, full[:-1])
            try:
                name = full[-1]
                if m.isreg():
                    if written + m.size > self.max_upload:
                        raise errors.PayloadTooLarge(
                            f"upload above the {self.max_upload}-byte cap",
                            limit=self.max_upload)
                    src = tf.extractfile(m)
                    assert src is not None
                    self._put_file(dfd, name, lambda fd: _copy(src, fd, m.size), m.mode, uid,
                                   gid, float(m.mtime))
                    return m.size
                tmp = TMP_PREFIX + secrets.token_hex(8)
                if m.issym():
                    if len(m.linkname) > MAX_PATH or "\0" in m.linkname:
                        raise errors.BadRequest(f"bad symlink target in {m.name!r}")
                    # Stored verbatim: any later resolution of it is in-root anyway.
                    os.symlink(m.linkname, tmp, dir_fd=dfd)
                else:
                    lparts = base + self._member_parts(m.linkname)
                    if len(lparts) == len(base):
                        raise errors.BadRequest(f"bad hard link target in {m.name!r}")
                    sfd = self._open_dir(rfd, lparts[:-1])
                    try:
                        os.link(lparts[-1], tmp, src_dir_fd=sfd, dst_dir_fd=dfd,
                                follow_symlinks=False)
                    finally:
                        _close(sfd)
                try:
                    if m.issym():
                        os.chown(tmp, self._hid(uid), self._hid(gid), dir_fd=dfd,
                                 follow_symlinks=False)
                    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=dfd)
                    except OSError:
                        pass
                    raise
                return 0
            finally:
                _close(dfd)
        except OSError as exc:
            raise _os_error(exc, where) from exc

    def _extract_dir(self, rfd: int, full: list[str], mode: int, uid: int, gid: int) -> None:
        pfd = self._ensure_dir(rfd, full[:-1])
        try:
            name = full[-1]
            try:
                s = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if not st.S_ISDIR(s.st_mode):
                    os.unlink(name, dir_fd=pfd)  # tar semantics: the dir replaces it
                    raise FileNotFoundError
            except FileNotFoundError:
                try:
                    os.mkdir(name, 0o700, dir_fd=pfd)
                except FileExistsError:
                    pass
            fd = self._open_child_dir(pfd, name)
            try:
                os.fchown(fd, self._hid(uid), self._hid(gid))
                os.fchmod(fd, mode & MODE_MASK)
            finally:
                os.close(fd)
        finally:
            _close(pfd)

    # ---- tar download -----------------------------------------------------------------------

    async def download_tar(self, path: str, queue_chunks: int = 8) -> AsyncIterator[bytes]:
        """Stream a tar (PAX) of the file or directory at ``path``. A directory's members are
        relative to it (so ``upload_tar(dst, download_tar(src))`` copies a tree); a file gives
        one member named after it. Symlinks are stored as links, never followed; FIFOs,
        sockets and devices are skipped; ids are unshifted. Memory stays bounded: the worker
        blocks while ``queue_chunks`` chunks of 256 KiB wait for the consumer."""
        parts = _split(path)
        # aclosing: a consumer that stops early stops the worker now, not at a later GC
        async with contextlib.aclosing(produced(lambda out: self._archive(parts, out),
                                                queue_chunks)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _archive(self, parts: list[str], out: _QueueWriter) -> None:
        where = _join(parts)
        with self._use() as rfd:
            fd = -1
            try:
                # A directory (even through a link, resolved in-root) is archived by content;
                # anything else, including a dangling or looping link, as the entry itself.
                try:
                    fd = self._open(rfd, parts, os.O_RDONLY | os.O_DIRECTORY)
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP) or not parts:
                        raise
                    fd = self._open(rfd, parts[:-1], os.O_RDONLY | os.O_DIRECTORY)
                    os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)  # NotFound if missing
                    single = True
                else:
                    single = False
                with tarfile.open(fileobj=out, mode="w|",  # type: ignore[call-overload]
                                  format=tarfile.PAX_FORMAT) as tf:
                    budget = [self.max_upload, self.max_entries]
                    if single:
                        self._archive_entry(tf, fd, parts[-1], parts[-1], budget)
                    else:
                        top, fd = fd, -1
                        self._archive_tree(tf, top, budget)
            except OSError as exc:
                raise _os_error(exc, where) from exc
            finally:
                if fd >= 0:
                    _close(fd)

    def _archive_tree(self, tf: tarfile.TarFile, top_fd: int, budget: list[int]) -> None:
        """Walk from ``top_fd`` (which this takes ownership of) by dir fds, depth first."""
        # stack of (dir fd, archive prefix, remaining names)
        stack: list[tuple[int, str, list[str]]] = []
        try:
            stack.append((top_fd, "", []))
            stack[-1][2].extend(self._names(top_fd, budget))
            while stack:
                fd, prefix, names = stack[-1]
                if not names:
                    stack.pop()
                    _close(fd)
                    continue
                name = names.pop()
                arc = prefix + name
                is_dir = self._archive_entry(tf, fd, name, arc, budget)
                if is_dir:
                    if len(stack) >= MAX_DEPTH:
                        raise errors.BadRequest(f"directory tree deeper than {MAX_DEPTH}")
                    try:
                        cfd = self._open_child_dir(fd, name)
                    except OSError as exc:
                        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                            continue  # swapped meanwhile; its header is already written
                        raise
                    stack.append((cfd, arc + "/", []))
                    stack[-1][2].extend(self._names(cfd, budget))
        finally:
            for fd, _, _ in stack:
                _close(fd)

    def _names(self, fd: int, budget: list[int]) -> list[str]:
        names: list[str] = []
        with os.scandir(fd) as it:
            for entry in it:
                budget[1] -= 1
                if budget[1] < 0:
                    raise errors.PayloadTooLarge(f"more than {self.max_entries} entries",
                                                 limit=self.max_entries)
                names.append(entry.name)
        names.sort(reverse=True)  # popped from the end: archive in name order
        return names

    def _archive_entry(self, tf: tarfile.TarFile, dfd: int, name: str, arc: str,
                       budget: list[int]) -> bool:
        """Add ``name`` in ``dfd`` as ``arc``; returns True when it is a directory to descend."""
        try:
            s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        ti = tarfile.TarInfo(arc)
        ti.mode = st.S_IMODE(s.st_mode)
        ti.mtime = int(s.st_mtime)
        ti.uid, ti.gid = self._sid(s.st_uid), self._sid(s.st_gid)
        ti.uname = ti.gname = ""
        if st.S_ISDIR(s.st_mode):
            ti.type = tarfile.DIRTYPE
            tf.addfile(ti)
            return True
        if st.S_ISLNK(s.st_mode):
            try:
                ti.linkname = os.readlink(name, dir_fd=dfd)
            except (FileNotFoundError, OSError):
                return False
            ti.type = tarfile.SYMTYPE
            tf.addfile(ti)
            return False
        if not st.S_ISREG(s.st_mode):
            return False  # FIFOs, sockets, devices are never opened
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                         | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP):
                return False  # replaced by a link meanwhile
            raise
        try:
            fs = os.fstat(fd)
            if not st.S_ISREG(fs.st_mode):
                return False
            budget[0] -= fs.st_size
            if budget[0] < 0:
                raise errors.PayloadTooLarge(f"download above the {self.max_upload}-byte cap",
                                             limit=self.max_upload)
            ti.size = fs.st_size
            ti.type = tarfile.REGTYPE
            tf.addfile(ti, _FixedSizeReader(fd, fs.st_size))  # type: ignore[arg-type]
        finally:
            os.close(fd)
        return False

    # ---- async wrappers ----------------------------------------------------------------------

    async def aread(self, path: str, max_bytes: int | None = None) -> bytes:
        return await asyncio.to_thread(self.read, path, max_bytes)

    async def awrite(self, path: str, data: bytes, mode: int = 0o644, uid: int = 0,
                     gid: int = 0, parents: bool = True,
                     xattrs: dict[str, str] | None = None) -> None:
        await asyncio.to_thread(self.write, path, data, mode, uid, gid, parents, xattrs)

    async def astat(self, path: str) -> FileStat:
        return await asyncio.to_thread(self.stat, path)

    async def alist(self, path: str) -> list[FileStat]:
        return await asyncio.to_thread(self.list, path)

    async def amkdir(self, path: str, parents: bool = False, mode: int = 0o755, uid: int = 0,
                     gid: int = 0) -> None:
        await asyncio.to_thread(self.mkdir, path, parents, mode, uid, gid)

    async def aremove(self, path: str, recursive: bool = False) -> None:
        await asyncio.to_thread(self.remove, path, recursive)

    async def aexists(self, path: str) -> bool:
        return await asyncio.to_thread(self.exists, path)


async def _own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in a thread of its own, not the loop's default executor. For stream workers,
    which block until this loop feeds or drains them: held in the shared executor, as many of
    them as it has threads (cpu_count + 4) starve the ``to_thread`` calls of the other ends
    they wait for (a grade copy's reads) and every other ``to_thread`` user with them."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(exc: BaseException | None, value: T | None) -> None:
        if not fut.done():  # the awaiting task may have been cancelled meanwhile
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)  # type: ignore[arg-type]

    def run() -> None:
        try:
            value, exc = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            value, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, exc, value)

    threading.Thread(target=run, name="rollbox-stream-worker", daemon=True).start()
    return await fut


async def produced(work: Callable[[_QueueWriter], None], queue_chunks: int = 8, *,
                   source: _ChunkReader | None = None,
                   stop: threading.Event | None = None) -> AsyncIterator[bytes]:
    """What ``work(writer)`` writes, run in a worker thread, as chunks of at most 256 KiB: the
    worker blocks while ``queue_chunks`` wait for the consumer (memory stays bounded). With
    ``source`` (a reader ``work`` pulls from, sharing ``stop``), a failure of that source is
    raised as it was."""
    loop = asyncio.get_running_loop()
    stop = stop if stop is not None else threading.Event()
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(queue_chunks)
    writer = _QueueWriter(queue, loop, stop)

    def run() -> None:
        try:
            work(writer)
            writer.flush()
            writer.put(None)
        except _Stopped:
            if source is not None and source.source_error is not None:
                with contextlib.suppress(_Stopped):
                    writer.put(source.source_error)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            with contextlib.suppress(_Stopped):
                writer.put(exc)

    worker = asyncio.ensure_future(_own_thread(run))
    try:
        while True:
            item = await queue.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        # Unblock a worker waiting on a full queue, then wait for it (it exits promptly).
        while not queue.empty():
            queue.get_nowait()
        await asyncio.shield(worker)


async def _pulled(chunks: AsyncIterator[bytes], work: Callable[[_ChunkReader], T]) -> T:
    """Run ``work`` in a worker thread on a reader that pulls ``chunks`` one at a time from
    this loop; a failure of the stream itself is raised as it was."""
    stop = threading.Event()
    reader = _ChunkReader(chunks, asyncio.get_running_loop(), stop)
    try:
        return await _own_thread(lambda: work(reader))
    except _Stopped:
        if reader.source_error is not None:
            raise reader.source_error from None
        raise errors.InfraError("upload aborted") from None
    finally:
        stop.set()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view[:CHUNK])
        view = view[n:]


def _copy(src: Any, fd: int, size: int) -> None:
    left = size
    while left > 0:
        data = src.read(min(CHUNK, left))
        if not data:
            raise tarfile.ReadError("unexpected end of data")
        _write_all(fd, data)
        left -= len(data)
