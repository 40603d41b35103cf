"""Snapshot of a sandbox's writable layer through its agent (microVMs: the host never mounts
the guest's disk). The platform's busybox tar streams the overlay upper out of the sandbox;
:mod:`rollbox.images.snapshot_tar` parses it as hostile into the staging tree the layer
builder takes (the same tree a container's capture makes); opaque markers, which tar does not
carry, are inferred from the sandbox's merged view; user.* extended attributes, which busybox
tar does not carry either, come from the agent's ``rollbox-xattrs`` tool; repositories of lower layers that the
changes touch are completed from the merged view (so their history can be scrubbed), as
:func:`rollbox.images.snapshot.complete_repos` does for containers.

Owns: this orchestration. Not: the parsing (``images.snapshot_tar``), the applets
(``agent.tools``), the layer build and its accounting (``edge``, ``images.store``).
"""
from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from rollbox import errors
from rollbox.agent.files import AgentFiles, close_source
from rollbox.agent.tools import ToolResult, tool_error
from rollbox.hostfs import _pulled
from rollbox.images.overlay import set_opaque
from rollbox.images.snapshot import CaptureOptions, CaptureResult, CaptureStats
from rollbox.images.snapshot_tar import UpperTree, apply_xattrs, capture_tar, opaque_dirs

# Bytes of tar framing allowed per entry beyond the content cap (headers, long names, padding).
_FRAMING_PER_ENTRY = 4096

UpperSource = Callable[[int], AsyncIterator[bytes]]  # raw tar of the upper, capped at n bytes
XattrSource = Callable[[], Awaitable[bytes]]  # the upper's rollbox-xattrs records
XATTR_TOOL = "rollbox-xattrs"  # agent.c: a platform tool built into the agent
XATTR_STREAM_MAX = 64 << 20


async def xattr_records(files: AgentFiles, directory: str) -> bytes:
    """The user.* extended attributes below ``directory`` (a path the platform tools see) as
    the agent's records (raw: parse them as hostile, :func:`apply_xattrs`)."""
    res = await files.tools.run([XATTR_TOOL, directory], max_stdout=XATTR_STREAM_MAX,
                                overflow=lambda: errors.PayloadTooLarge(
                                    f"the sandbox's extended attributes exceed "
                                    f"{XATTR_STREAM_MAX} bytes", limit=XATTR_STREAM_MAX))
    if not res.ok:
        raise tool_error(res, directory, XATTR_TOOL)
    return res.stdout


def tar_stream(files: AgentFiles, directory: str, cap: int) -> AsyncIterator[bytes]:
    """busybox tar of ``directory`` (a path the sandbox's platform tools see), members
    relative to it, as the sandbox sends it (raw: parse it as hostile)."""
    def end(res: ToolResult) -> None:
        if not res.ok:
            raise tool_error(res, directory, "tar")

    return files.tools.stream(["tar", "-c", "-f", "-", "-C", directory, "."], max_stdout=cap,
                              on_end=end)


def _raw_cap(max_bytes: int, max_entries: int) -> int:
    return max_bytes + (max_entries + 16) * _FRAMING_PER_ENTRY


async def _capture(source: AsyncIterator[bytes], dest: Path, *, scrub: list[str],
                   exclude: list[str], max_bytes: int, max_entries: int
                   ) -> tuple[CaptureStats, UpperTree]:
    try:
        return await _pulled(source, lambda reader: capture_tar(
            reader, str(dest), scrub=scrub, exclude=exclude, max_bytes=max_bytes,
            max_entries=max_entries))
    finally:
        await close_source(source)  # a failed capture ends the sandbox's tar now


def _in_root(rel: str) -> str:
    return "/" + rel if rel else "/"


async def capture_writable(files: AgentFiles, upper: UpperSource, dest: Path,
                           opts: CaptureOptions, xattrs: XattrSource | None = None
                           ) -> CaptureResult:
    """Copy the sandbox's writable layer into the new host dir ``dest`` as an overlay upper
    (whiteouts, opaque directories), parsed as hostile and capped by ``opts``. ``upper(cap)``
    streams the tar of the upper made in the sandbox, ``xattrs()`` its user.* attributes. The sandbox is not frozen (its own
    kernel runs it): a change during the copy changes what is copied, never where the host
    writes."""
    t0 = time.monotonic()
    try:
        return await _capture_writable(files, upper, dest, opts, t0, xattrs)
    except OSError as exc:  # the staging dir's path is the host's, not the caller's
        raise errors.without_paths(errors.InfraError(f"snapshot failed: {exc}"),
                                   {dest: "/"}) from exc


async def _capture_writable(files: AgentFiles, upper: UpperSource, dest: Path,
                            opts: CaptureOptions, t0: float,
                            xattrs: XattrSource | None) -> CaptureResult:
    stats, tree = await _capture(upper(_raw_cap(opts.max_bytes, opts.max_entries)), dest,
                                 scrub=opts.scrub, exclude=opts.exclude,
                                 max_bytes=opts.max_bytes, max_entries=opts.max_entries)
    listed = await files.entry_names([_in_root(d) for d in sorted(tree.dirs)],
                                     max_entries=max(opts.max_entries, 1) * 4)
    merged = {d: listed.get(_in_root(d)) for d in tree.dirs}
    if opts.complete_repos:
        await _complete_repos(files, dest, tree, merged, stats, opts)
    for d in sorted(opaque_dirs(tree, merged)):
        path = dest / d if d else dest
        if path.is_dir() and not path.is_symlink():
            set_opaque(path)
            stats.opaque_dirs += 1
    if xattrs is not None:
        records = await xattrs()
        await asyncio.to_thread(apply_xattrs, records, str(dest), max(opts.max_entries, 1) * 4)
    return CaptureResult(stats=stats, paused_s=0.0, copy_s=time.monotonic() - t0)


async def _complete_repos(files: AgentFiles, dest: Path, tree: UpperTree,
                          merged: dict[str, set[str] | None], stats: CaptureStats,
                          opts: CaptureOptions) -> None:
    """Where the merged view has a repository at a captured directory, replace that
    directory by a copy of the whole repository from the merged view, marked opaque (outer
    repositories first; what is inside a completed one is not looked at again)."""
    done: list[str] = []
    for d in sorted(tree.captured, key=lambda p: (p.count("/"), p)):
        if not d or any(d == r or d.startswith(r + "/") for r in done):
            continue
        names = merged.get(d) or set()
        if not {"HEAD", "objects", "refs"} <= names:
            continue
        kinds = {f.name: f.type for f in await files._stat_many(
            [f"/{d}/HEAD", f"/{d}/objects", f"/{d}/refs"])}
        if kinds != {"HEAD": "file", "objects": "dir", "refs": "dir"}:
            continue
        left_bytes = max(0, opts.max_bytes - stats.bytes)
        left_entries = max(0, opts.max_entries - stats.entries)
        tmp = (dest / d).with_name((dest / d).name + ".rollbox-repo")
        await _capture(tar_stream(files, f"/{d}", _raw_cap(left_bytes,
                                                                           left_entries)),
                                       tmp, scrub=[], exclude=[], max_bytes=left_bytes,
                                       max_entries=left_entries)
        await asyncio.to_thread(shutil.rmtree, dest / d)
        tmp.rename(dest / d)
        set_opaque(dest / d)
        # Everything below is the repository's now, counted once.
        tree.captured = {c for c in tree.captured if not c.startswith(d + "/")}
        for c in [c for c in tree.dirs if c.startswith(d + "/")]:
            del tree.dirs[c]
        tree.dirs[d] = set()  # opaque now: nothing of a lower layer shows below it
        merged[d] = set()
        tree.captured.discard(d)  # marked here already
        done.append(d)
