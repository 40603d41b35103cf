"""Sandbox file operations through the agent, for sandboxes whose files the host can not touch
(a microVM: the host never mounts a filesystem the guest could write). The same contract and
typed errors as the host-side implementation of containers (``rollbox.hostfs``).

Every operation runs the platform's own busybox applets (``rollbox.agent.tools``), or for
extended attributes the agent's built-in ``rollbox-xattr``, as root in the sandbox's root:
paths resolve there (absolute links and ``..`` stay inside it), nothing of the sandbox's tree
is executed. Everything that comes back is hostile and parsed with caps: ``stat`` records carry
a per-call nonce and are matched to the names asked for, listings are bounded in entries and
bytes, extended attribute records are matched to the names asked for by index and held to the
caps hostfs reads with, tar streams from the sandbox are re-emitted member by member
(only regular files, directories, symlinks and hard links to members already sent; names
without ``..`` or a leading ``/``; sizes, entry counts and header sizes capped; sparse
members, devices and FIFOs dropped), and tar streams to the sandbox are rebuilt the same way
before busybox tar sees them (no device nodes, no setuid bits, no ``..``).

Owns: this mapping of the file API onto applets. Not: running them (``agent.tools``), the
agent, or the sandbox's lifecycle.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import posixpath
import secrets
import stat as st
import struct
import tarfile
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import TypeVar

from rollbox import errors
from rollbox.agent.tools import PlatformTools, ToolResult, errno_of, tool_error
from rollbox.hostfs import (
    TMP_PREFIX,
    ID_RANGE,
    MALFORMED_TAR,
    MAX_PATH,
    MAX_STREAM_FILE,
    MAX_TAR_META,
    MAX_XATTR_NAME,
    MAX_XATTR_VALUE,
    MAX_XATTRS,
    MODE_MASK,
    OVERFLOW_ID,
    XATTR_PREFIX,
    _ChunkReader,
    _ftype,
    _join,
    _kind,
    _QueueWriter,
    _SafeTarInfo,
    _split,
    _Stopped,
    capped_members,
    check_write_data,
    check_xattrs,
    produced,
    tar_malformed,
    xattr_write_error,
)
from rollbox.models import FileStat

T = TypeVar("T")

ARGV_BYTES = 96 << 10  # argv of one applet run stays well below the agent's packet size
MAX_LIST_BYTES = 64 << 20  # a listing's names, all together
MAX_LINK_NAMES = 64 << 20  # names of regular members remembered for hard links (download)
# Top-level directories of the root that are mounts of the sandbox's kernel, not its files.
KERNEL_DIRS = frozenset({"proc", "sys", "dev"})
# Streams: a deadline the consumer's pace can not trip; short operations use the tools' own.
STREAM_TIMEOUT_S = 3600.0
_MTIME_MAX = (1 << 33) - 1
XATTR_FILE_TOOL = "rollbox-xattr"  # agent.c: a platform tool built into the agent
_XATTR_RECORD = struct.Struct("<2sIHH")  # b"XG", index of the path asked for, name, value length
MAX_XATTR_BYTES = 64 << 20  # one run's records, all together
NO_SUCH_TOOL = 127  # an agent older than the tool: its busybox knows no such applet


def _nonce() -> str:
    return "rbx" + secrets.token_hex(6)


def _fmt(nonce: str) -> str:
    """busybox ``stat -c`` format of one record: raw mode (hex), size, uid, gid, mtime, then
    the name (``'name' -> 'target'`` for a link), newline-terminated."""
    return f"{nonce} %f %s %u %g %Y %N"


def _batches(paths: list[str]) -> Iterator[list[str]]:
    """``paths`` in runs whose argv stays below ARGV_BYTES (at least one path each)."""
    batch: list[str] = []
    size = 0
    for p in paths:
        n = len(p.encode("utf-8", "surrogateescape")) + 1
        if batch and size + n >= ARGV_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += n
    if batch:
        yield batch


def _id(v: int) -> int:
    return v if 0 <= v < ID_RANGE else OVERFLOW_ID


def _records(out: bytes, nonce: str, limit: int) -> list[tuple[list[str], str]]:
    """Split ``stat`` output into (fields, name part) records; at most ``limit`` of them."""
    text = out.decode("utf-8", "surrogateescape")
    head = nonce + " "
    if not text:
        return []
    if not text.startswith(head) or not text.endswith("\n"):
        raise errors.InfraError("malformed stat output from the sandbox")
    recs = text[len(head):-1].split("\n" + head)
    if len(recs) > limit:
        raise errors.InfraError("more stat records than names asked for")
    out_recs = []
    for rec in recs:
        fields = rec.split(" ", 5)
        if len(fields) != 6:
            raise errors.InfraError("malformed stat record from the sandbox")
        out_recs.append((fields[:5], fields[5]))
    return out_recs


def _filestat(path: str, fields: list[str], name_part: str) -> FileStat | None:
    """The FileStat of ``path`` from one record, or None if the record is not about it."""
    try:
        mode = int(fields[0], 16)
        size, uid, gid, mtime = (int(f) for f in fields[1:])
    except ValueError:
        raise errors.InfraError("malformed stat record from the sandbox") from None
    if not (0 <= mode < 1 << 32 and 0 <= size < 1 << 63 and 0 <= mtime < 1 << 63):
        raise errors.InfraError("stat record out of range from the sandbox")
    target = None
    if st.S_ISLNK(mode):
        head = f"'{path}' -> '"
        if not (name_part.startswith(head) and name_part.endswith("'")):
            return None
        target = name_part[len(head):-1]
        if len(target) > MAX_PATH:
            raise errors.InfraError("link target too long from the sandbox")
    elif name_part != path:
        return None
    name = posixpath.basename(path) or "/"
    return FileStat(path=path, name=name, type=_ftype(mode),  # type: ignore[arg-type]
                    size=size, mode=st.S_IMODE(mode), mtime=float(mtime), uid=_id(uid),
                    gid=_id(gid), link_target=target)


def parse_xattrs(out: bytes, count: int) -> list[dict[str, str] | None]:
    """``rollbox-xattr get``'s records for ``count`` paths: each path's user.* attributes
    (None: none). Hostile input: a record that is cut, names a path not asked for, or goes past
    hostfs's caps (a name not user.* or user.overlay.*, too long, a value too long, more than
    MAX_XATTRS or a repeat for one path) is an InfraError."""
    got: list[dict[str, str]] = [{} for _ in range(count)]
    pos, end = 0, len(out)
    while pos < end:
        if end - pos < _XATTR_RECORD.size:
            raise errors.InfraError("malformed extended attributes from the sandbox")
        tag, idx, nl, vl = _XATTR_RECORD.unpack_from(out, pos)
        pos += _XATTR_RECORD.size
        if (tag != b"XG" or idx >= count or not 0 < nl <= MAX_XATTR_NAME
                or vl > MAX_XATTR_VALUE or end - pos < nl + vl):
            raise errors.InfraError("malformed extended attributes from the sandbox")
        name = out[pos:pos + nl].decode("utf-8", "surrogateescape")
        value = out[pos + nl:pos + nl + vl].decode("utf-8", "replace")
        pos += nl + vl
        mine = got[idx]
        if (not name.startswith(XATTR_PREFIX) or name == XATTR_PREFIX
                or name.startswith("user.overlay.") or "\0" in name or name in mine
                or len(mine) >= MAX_XATTRS):
            raise errors.InfraError("extended attribute record out of bounds from the sandbox")
        mine[name] = value
    return [g or None for g in got]


class AgentFiles:
    """The file API of one sandbox through platform tools run by its agent."""

    def __init__(self, tools: PlatformTools, *, max_read: int = 256 << 20,
                 max_write: int = 256 << 20, max_upload: int = 2 << 30,
                 max_entries: int = 200_000, max_stream: int = MAX_STREAM_FILE) -> None:
        self.tools = tools
        self.max_read = max_read
        self.max_write = max_write
        self.max_upload = max_upload
        self.max_entries = max_entries
        self.max_stream = max_stream
        self._closed = False

    def close(self) -> None:
        self._closed = True

    def _check(self) -> None:
        if self._closed:
            raise errors.SandboxDead("sandbox file system is closed")

    async def _run(self, argv: list[str], path: str, **kw: object) -> ToolResult:
        self._check()
        res = await self.tools.run(argv, **kw)  # type: ignore[arg-type]
        if not res.ok:
            raise tool_error(res, path, argv[0])
        return res

    # ---- metadata ---------------------------------------------------------------------------

    async def _stat_many(self, paths: list[str], follow: bool = False) -> list[FileStat]:
        """lstat (``follow``: stat) of each path, in order; vanished ones are left out."""
        out: list[FileStat] = []
        for batch in _batches(paths):
            nonce = _nonce()
            argv = ["stat", *(["-L"] if follow else []), "-c", _fmt(nonce), "--", *batch]
            res = await self.tools.run(
                argv, max_stdout=len(batch) * (2 * MAX_PATH + 128),
                overflow=lambda: errors.InfraError("the sandbox sent more stat output than "
                                                   "the names asked for can make"))
            if res.code != 0 and len(batch) == 1:
                raise tool_error(res, batch[0], "stat")
            want = iter(batch)
            for fields, name_part in _records(res.stdout, nonce, len(batch)):
                for path in want:  # records come in argument order; missing ones skipped
                    fs = _filestat(path, fields, name_part)
                    if fs is not None:
                        out.append(fs)
                        break
                else:
                    raise errors.InfraError("stat record for a name not asked for")
        return out

    async def _with_xattrs(self, stats: list[FileStat]) -> list[FileStat]:
        """``stats`` with the user.* attributes of their files and directories (links and
        special files have none, nor ``/``: as hostfs). One ``rollbox-xattr`` run per batch;
        an agent older than the tool gives none."""
        which = [i for i, fs in enumerate(stats) if fs.type in ("file", "dir") and fs.path != "/"]
        out = list(stats)
        done = 0
        for batch in _batches([stats[i].path for i in which]):
            res = await self.tools.run(
                [XATTR_FILE_TOOL, "get", *batch],
                max_stdout=min(MAX_XATTR_BYTES, len(batch) * MAX_XATTRS * (
                    _XATTR_RECORD.size + MAX_XATTR_NAME + MAX_XATTR_VALUE)),
                overflow=lambda: errors.InfraError(
                    f"the sandbox sent more than {MAX_XATTR_BYTES} bytes of extended "
                    "attributes for one listing"))
            if res.code == NO_SUCH_TOOL:
                return out
            if not res.ok:
                raise tool_error(res, batch[0], XATTR_FILE_TOOL)
            for k, attrs in enumerate(parse_xattrs(res.stdout, len(batch))):
                if attrs:
                    i = which[done + k]
                    out[i] = out[i].model_copy(update={"xattrs": attrs})
            done += len(batch)
        return out

    async def _lstat(self, path: str) -> FileStat:
        p = _join(_split(path))
        (fs,) = await self._stat_many([p])
        return fs

    async def stat(self, path: str) -> FileStat:
        """lstat of ``path`` (the last component is not followed; parents are, in-root),
        with its user.* attributes (a file or directory)."""
        self._check()
        return (await self._with_xattrs([await self._lstat(path)]))[0]

    async def list(self, path: str) -> list[FileStat]:
        """Entries of directory ``path`` (a link to it followed in-root), sorted by name, with
        their user.* attributes."""
        self._check()
        return await self._with_xattrs(await self._list(path))

    async def _list(self, path: str) -> list[FileStat]:
        base = _join(_split(path))
        where = base.rstrip("/") + "/"
        res = await self._run(["find", where, "-mindepth", "1", "-maxdepth", "1", "-print0"],
                              base, max_stdout=MAX_LIST_BYTES)
        names = []
        for raw in res.stdout.split(b"\0")[:-1] if res.stdout else []:
            name = raw.decode("utf-8", "surrogateescape")
            rel = name[len(where):] if name.startswith(where) else ""
            if not rel or "/" in rel or rel in (".", ".."):
                raise errors.InfraError("malformed listing from the sandbox")
            names.append(rel)
            if len(names) > self.max_entries:
                raise errors.PayloadTooLarge(f"{base} has more than {self.max_entries} entries",
                                             path=base, limit=self.max_entries)
        if base != "/":
            paths = [f"{base}/{n}" for n in names]
        else:
            paths = [f"/{n}" for n in names]
        out = await self._stat_many(paths)
        out.sort(key=lambda f: f.name)
        return out

    async def entry_names(self, dirs: list[str], max_entries: int
                          ) -> dict[str, set[str] | None]:
        """The entry names of each directory of ``dirs`` (in-root paths), links not followed;
        None where it can not be told (gone, not a directory). At most ``max_entries`` in
        all (PayloadTooLarge past it)."""
        self._check()
        out: dict[str, set[str] | None] = {d: set() for d in dirs}
        total = 0
        for batch in _batches(dirs):
            res = await self.tools.run(["find", *batch, "-mindepth", "1", "-maxdepth", "1",
                                        "-print0"], max_stdout=MAX_LIST_BYTES,
                                       timeout_s=STREAM_TIMEOUT_S)
            seen: set[str] = set()
            asked = set(batch)
            for raw in res.stdout.split(b"\0")[:-1] if res.stdout else []:
                parent, _, name = raw.decode("utf-8", "surrogateescape").rpartition("/")
                parent = parent or "/"
                names = out.get(parent)
                if names is None or parent not in asked or not name or name in (".", ".."):
                    raise errors.InfraError("malformed listing from the sandbox")
                names.add(name)
                seen.add(parent)
                total += 1
                if total > max_entries:
                    raise errors.PayloadTooLarge(f"more than {max_entries} entries",
                                                 limit=max_entries)
            if not res.ok:  # some were not listed: an empty one is then unknown, not empty
                for d in batch:
                    if d not in seen:
                        out[d] = None
        return out

    async def mkdir(self, path: str, parents: bool = False) -> None:
        """Create directory ``path``; with ``parents`` like ``mkdir -p``."""
        self._check()
        parts = _split(path)
        if not parts:
            if parents:
                return
            raise errors.BadRequest("/ already exists", path="/")
        p = _join(parts)
        res = await self.tools.run(["mkdir", *(["-p"] if parents else []), "-m", "755", "--", p])
        if not res.ok:
            err = tool_error(res, p, "mkdir")
            if parents and err.details.get("errno") == errno.EEXIST:
                # mkdir -p met a file on the way (or at the end): not a directory
                raise errors.BadRequest(f"not a directory: {p}", path=p, errno=errno.ENOTDIR)
            raise err

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, link or (empty, or with ``recursive`` any) directory. A link is
        removed, never followed."""
        self._check()
        parts = _split(path)
        if not parts:
            raise errors.BadRequest("refusing to remove /")
        fs = await self._lstat(path)
        if fs.type != "dir":
            argv = ["rm", "-f", "--", fs.path]
        elif recursive:
            argv = ["rm", "-rf", "--", fs.path]
        else:
            argv = ["rmdir", "--", fs.path]
        await self._run(argv, fs.path, timeout_s=STREAM_TIMEOUT_S if recursive else None)

    # ---- read -------------------------------------------------------------------------------

    async def _readable(self, path: str, cap: int) -> tuple[str, int]:
        """The in-root path of the regular file at ``path`` (links followed) and its size,
        checked against ``cap``; FIFOs and devices are refused, never opened."""
        p = _join(_split(path))
        (fs,) = await self._stat_many([p], follow=True)
        if fs.type != "file":
            kind = {"dir": st.S_IFDIR, "symlink": st.S_IFLNK}.get(fs.type, st.S_IFIFO)
            what = _kind(kind) if fs.type != "other" else "not a regular file"
            raise errors.BadRequest(f"cannot read {path}: {what}, not a regular file",
                                    path=path)
        if fs.size > cap:
            raise errors.PayloadTooLarge(f"{path} is {fs.size} bytes, above the {cap}-byte "
                                         "cap", path=path, size=fs.size, limit=cap)
        return p, fs.size

    async def read(self, path: str, max_bytes: int | None = None) -> bytes:
        """Content of the regular file at ``path`` (links followed, in-root)."""
        self._check()
        cap = self.max_read if max_bytes is None else min(max(max_bytes, 0), self.max_read)
        p, size = await self._readable(path, cap)
        res = await self._run(
            ["cat", "--", p], path, max_stdout=cap, timeout_s=60 + size / (1 << 20),
            overflow=lambda: errors.PayloadTooLarge(f"{path} grew above the {cap}-byte cap",
                                                    path=path, limit=cap))
        return res.stdout

    async def read_stream(self, path: str, max_bytes: int | None = None,
                          offset: int = 0) -> AsyncIterator[bytes]:
        """The regular file at ``path`` from byte ``offset`` on (``tail -c +N``) as it
        streams from the sandbox (memory bounded by flow control). A missing file or one
        above the cap fails before any byte."""
        self._check()
        cap = (self.max_stream if max_bytes is None
               else min(max(max_bytes, 0), self.max_stream))
        p, _ = await self._readable(path, cap)
        argv = ["cat", "--", p] if not offset else ["tail", "-c", f"+{offset + 1}", "--", p]

        def end(res: ToolResult) -> None:
            if not res.ok:
                raise tool_error(res, path, argv[0])

        async with contextlib.aclosing(self.tools.stream(
                argv, max_stdout=cap, on_end=end,
                overflow=lambda: errors.PayloadTooLarge(f"{path} grew above the {cap}-byte cap",
                                                        path=path, limit=cap))) as chunks:
            async for chunk in chunks:
                yield chunk

    # ---- write ------------------------------------------------------------------------------

    async def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Atomically replace ``path`` with ``data`` (a symlink there is replaced, not
        followed); missing parents are created."""
        check_write_data(data, self.max_write)
        await self._write(path, bytes(data), mode)

    async def write_stream(self, path: str, chunks: AsyncIterator[bytes], mode: int = 0o644,
                           max_bytes: int | None = None,
                           xattrs: dict[str, str] | None = None) -> int:
        """Like :meth:`write` from a byte stream (memory bounded). The file appears only once
        complete: a stream that fails, goes past ``max_bytes`` or fills the sandbox's disk
        leaves no file and no temp file behind. Returns the bytes written. ``xattrs`` (user.*,
        hostfs.check_xattrs, checked before a byte is pulled) are the new file's, set on its
        temp file before the rename (``rollbox-xattr set``): it appears with them, and a file
        replaced without any keeps none. An agent older than the tool: NotSupported."""
        attrs = check_xattrs(xattrs) if xattrs else {}
        cap = (self.max_stream if max_bytes is None
               else min(max(max_bytes, 0), self.max_stream))
        count = [0]

        async def capped() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                if not isinstance(chunk, (bytes, bytearray, memoryview)):
                    raise errors.BadRequest("upload chunks must be bytes")
                count[0] += len(chunk)
                if count[0] > cap:
                    raise errors.PayloadTooLarge(f"file above the {cap}-byte cap", path=path,
                                                 limit=cap)
                yield bytes(chunk)

        await self._write(path, capped(), mode, attrs)
        return count[0]

    async def _set_xattrs(self, tmp: str, xattrs: dict[str, str], path: str) -> None:
        """Set ``xattrs`` (checked) on the temp file ``tmp`` of a write of ``path``."""
        pairs = [a for name, value in xattrs.items()
                 for a in (name, value.encode("utf-8", "surrogateescape").hex())]
        res = await self.tools.run([XATTR_FILE_TOOL, "set", tmp, *pairs], max_stdout=4096)
        if res.ok:
            return
        if res.code == NO_SUCH_TOOL:
            raise errors.NotSupported("extended attributes on this sandbox's files (its agent "
                                      "predates the tool that sets them)", feature="xattrs")
        mapped = xattr_write_error(errno_of(res.message()), path)
        raise mapped if mapped is not None else tool_error(res, path, XATTR_FILE_TOOL)

    async def _write(self, path: str, content: bytes | AsyncIterator[bytes], mode: int,
                     xattrs: dict[str, str] | None = None) -> None:
        self._check()
        parts = _split(path)
        if not parts:
            raise errors.BadRequest("cannot write to /")
        p = _join(parts)
        parent = _join(parts[:-1])
        if parent != "/" and not isinstance(content, bytes):
            await self.mkdir(parent, parents=True)  # a stream can not be sent twice
        tmp = f"{parent.rstrip('/')}/{TMP_PREFIX}{secrets.token_hex(8)}"
        dd = ["dd", f"of={tmp}", "bs=64k", "status=none"]
        try:
            try:
                await self._run(dd, p, stdin=content, max_stdout=4096,
                                timeout_s=STREAM_TIMEOUT_S)
            except errors.NotFound:
                if parent == "/" or not isinstance(content, bytes):
                    raise
                await self.mkdir(parent, parents=True)  # one run less when it exists
                await self._run(dd, p, stdin=content, max_stdout=4096,
                                timeout_s=STREAM_TIMEOUT_S)
            if mode & MODE_MASK != 0o644:  # what dd made under the agent's umask 022
                await self._run(["chmod", f"{mode & MODE_MASK:o}", "--", tmp], p)
            if xattrs:
                await self._set_xattrs(tmp, xattrs, p)
            res = await self.tools.run(["mv", "-fT", "--", tmp, p])
            if not res.ok:
                if res.message().endswith("is a directory"):
                    raise errors.BadRequest(f"is a directory: {p}", path=p, errno=errno.EISDIR)
                raise tool_error(res, p, "mv")
        except BaseException:
            try:
                await self.tools.run(["rm", "-f", "--", tmp])
            except errors.RollboxError:
                pass
            raise

    # ---- tar --------------------------------------------------------------------------------

    async def upload_tar(self, path: str, chunks: AsyncIterator[bytes], *,
                         links: bool = True) -> int:
        """Extract a tar stream (optionally gz/bz2/xz) into directory ``path`` (created if
        missing). Returns the number of file bytes written. ``links=False`` skips symlinks and
        hard links (grading: copied files must not be able to point anywhere)."""
        self._check()
        parts = _split(path)
        p = _join(parts)
        await self.mkdir(p, parents=True)
        clean = _TarRewrite(self.max_upload, self.max_entries, links=links, upload=True)
        await self._run(["tar", "-x", "--numeric-owner", "-f", "-", "-C", p], p,
                        stdin=_transformed(chunks, clean.rewrite), timeout_s=STREAM_TIMEOUT_S,
                        max_stdout=4096)
        return clean.bytes

    async def download_tar(self, path: str) -> AsyncIterator[bytes]:
        """A tar (PAX) of the file or directory at ``path``, as the host-side implementation
        makes it: a directory's members relative to it, a file as one member named after it;
        symlinks stored as links, FIFOs, sockets and devices left out; at the sandbox's root
        its kernel's mounts (/proc, /sys, /dev) are left out too."""
        self._check()
        parts = _split(path)
        p = _join(parts)
        try:
            (target,) = await self._stat_many([p], follow=True)
            is_dir = target.type == "dir"
        except errors.RollboxError as exc:
            if not isinstance(exc, errors.NotFound) and exc.details.get("errno") not in (
                    errno.ENOTDIR, errno.ELOOP):
                raise
            is_dir = False
        if is_dir:
            members = ["."]
            if p == "/":
                members = [f"./{f.name}" for f in await self._list("/")
                           if f.name not in KERNEL_DIRS]
            argv = ["tar", "-c", "-f", "-", "-C", p, *members]
            single = None
        else:
            fs = await self._lstat(p)  # NotFound if missing
            argv = ["tar", "-c", "-f", "-", "-C", _join(parts[:-1]), parts[-1]]
            single = fs.name
        if len(argv) > 4 and sum(len(a) + 1 for a in argv) > ARGV_BYTES:
            raise errors.PayloadTooLarge("too many entries at the sandbox's root")

        def end(res: ToolResult) -> None:
            if not res.ok:
                raise tool_error(res, p, "tar")

        # The raw stream may carry headers, padding and skipped members beyond the content cap.
        raw_cap = self.max_upload + (self.max_entries + 2) * (2 * MAX_TAR_META // 64 + 2048)
        source = self.tools.stream(argv, max_stdout=raw_cap, on_end=end)
        clean = _TarRewrite(self.max_upload, self.max_entries, links=True, upload=False,
                            single=single)
        async with contextlib.aclosing(_transformed(source, clean.rewrite)) as chunks:
            async for chunk in chunks:
                yield chunk


class _TarRewrite:
    """Reads a hostile tar (from a client, or from the sandbox) member by member and writes a
    clean one: only regular files, directories, symlinks and hard links to members already
    written; no ``..`` or absolute names; modes without setuid/setgid (uploads); ids in range;
    no user/group names; sizes and entry counts capped (sparse members count, and are
    refused, at their full size)."""

    def __init__(self, max_bytes: int, max_entries: int, *, links: bool, upload: bool,
                 single: str | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.links = links
        self.upload = upload
        self.single = single  # a download of one non-directory entry: its only name
        self.bytes = 0
        self.entries = 0
        self._names: set[str] = set()
        self._names_bytes = 0

    def _bad(self, message: str) -> errors.RollboxError:
        # A client's bad tar is its error; a bad tar from the sandbox is the guest's doing.
        return errors.BadRequest(message) if self.upload else errors.InfraError(
            f"the sandbox sent a bad tar stream: {message}")

    def _name(self, raw: str) -> str | None:
        """The clean member name (None: the archive's top directory itself)."""
        if raw.startswith("/") or "\0" in raw:
            raise self._bad(f"tar member has an absolute path: {raw[:200]!r}")
        comps = [c for c in raw.split("/") if c and c != "."]
        if ".." in comps:
            raise self._bad(f"tar member has a '..' component: {raw[:200]!r}")
        name = "/".join(comps)
        if len(name) > MAX_PATH:
            raise self._bad(f"tar member path too long: {raw[:200]!r}")
        if self.single is not None and name != self.single:
            raise self._bad(f"unexpected member {raw[:200]!r}")
        return name or None

    def rewrite(self, src: _ChunkReader, out: _QueueWriter) -> None:
        mode = "r|*" if self.upload else "r|"
        fmt = tarfile.GNU_FORMAT if self.upload else tarfile.PAX_FORMAT  # busybox reads GNU
        try:
            with tarfile.open(fileobj=src, mode=mode,  # type: ignore[call-overload]
                              tarinfo=_SafeTarInfo) as tf, \
                    tarfile.open(fileobj=out, mode="w|",  # type: ignore[call-overload]
                                 format=fmt) as dst:
                for m in capped_members(tf, self.max_entries):
                    self.entries += 1
                    self._member(tf, dst, m)
        except (errors.RollboxError, _Stopped):
            raise
        except (*MALFORMED_TAR, OSError) as exc:
            if tar_malformed(exc):
                raise self._bad(f"malformed tar stream: {exc}") from exc
            raise

    def _member(self, tf: tarfile.TarFile, dst: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        name = self._name(m.name)
        if name is None:
            return
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            return  # device nodes, FIFOs and unknown types are dropped
        if (m.issym() or m.islnk()) and not self.links:
            return
        ti = tarfile.TarInfo(name)
        ti.mode = m.mode & (MODE_MASK if self.upload else 0o7777)
        ti.uid, ti.gid = _id(m.uid), _id(m.gid)
        ti.uname = ti.gname = ""
        ti.mtime = min(max(int(m.mtime), 0), _MTIME_MAX)
        if m.isdir():
            ti.type = tarfile.DIRTYPE
            dst.addfile(ti)
            return
        if m.issym():
            if len(m.linkname) > MAX_PATH or "\0" in m.linkname or not m.linkname:
                raise self._bad(f"bad symlink target in {m.name[:200]!r}")
            ti.type, ti.linkname = tarfile.SYMTYPE, m.linkname  # resolved in-root anyway
            dst.addfile(ti)
            return
        if m.islnk():
            target = self._name(m.linkname) if self.single is None else None
            if not target or target not in self._names:
                return  # only a link to a file already sent keeps its meaning
            ti.type, ti.linkname = tarfile.LNKTYPE, target
            dst.addfile(ti)
            return
        if self.bytes + m.size > self.max_bytes:
            what = "upload" if self.upload else "download"
            raise errors.PayloadTooLarge(f"{what} above the {self.max_bytes}-byte cap",
                                         limit=self.max_bytes)
        if m.issparse():
            # tarfile would expand the holes: a small stream naming a huge file
            raise self._bad(f"sparse tar member {m.name[:200]!r}")
        self.bytes += m.size
        ti.type, ti.size = tarfile.REGTYPE, m.size
        data = tf.extractfile(m)
        assert data is not None
        dst.addfile(ti, data)
        self._names_bytes += len(name)
        if self._names_bytes <= MAX_LINK_NAMES:
            self._names.add(name)


async def _transformed(chunks: AsyncIterator[bytes],
                       work: Callable[[_ChunkReader, _QueueWriter], None],
                       queue_chunks: int = 8) -> AsyncIterator[bytes]:
    """``work(reader, writer)`` in a worker thread, reading ``chunks`` one at a time and
    writing chunks this yields: memory stays bounded both ways. A failure of ``chunks``
    itself is raised as it was."""
    stop = threading.Event()
    reader = _ChunkReader(chunks, asyncio.get_running_loop(), stop)
    try:
        async with contextlib.aclosing(produced(lambda out: work(reader, out), queue_chunks,
                                                source=reader, stop=stop)) as out:
            async for chunk in out:
                yield chunk
    finally:
        await close_source(chunks)


async def close_source(chunks: object) -> None:
    """Close an async generator a worker stopped pulling from (its tool session, say, ends
    now rather than at a later GC)."""
    if isinstance(chunks, AsyncGenerator):
        await chunks.aclose()
