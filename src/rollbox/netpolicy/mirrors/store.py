"""Content-addressed blob store of a mirror: files named by their sha256, verified before they
are kept, evicted least-recently-used past a byte bound.

A blob being fetched can be read while it arrives (many sandboxes asking for the same wheel at
once share one upstream download, and each gets bytes before the download ends, so pip's read
timeout does not fire). Readers never get the last byte of an unverified download: a hash
mismatch leaves every client with a truncated body, never a complete wrong file.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from rollbox.errors import HashMismatch, InfraError, RollboxError, UpstreamTooLarge

log = logging.getLogger(__name__)

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 256 * 1024

# Writes the body into ``sink`` chunk by chunk; may raise a RollboxError for upstream faults.
# ``expect_size`` is called once with the announced size (None when unknown).
Producer = Callable[[Callable[[bytes], Awaitable[None]], Callable[[int | None], None]],
                    Awaitable[None]]


class Fetch:
    """One in-flight download into ``tmp/``; readers follow it with pread on a dup'd fd."""

    def __init__(self, sha256: str, fd: int, part: Path) -> None:
        self.sha256 = sha256
        self.fd = fd
        self.part = part
        self.written = 0
        self.size: int | None = None
        self.done = False
        self.error: RollboxError | None = None
        self.cond = asyncio.Condition()
        self.task: asyncio.Task[None] | None = None

    async def _progress(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    async def wait_ready(self, min_bytes: int, timeout: float) -> None:
        """Until the fetch ended or ``min_bytes`` arrived (or ``timeout``): small files are then
        verified before any header goes out, so a failure gets a clean status code."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout), self.cond:
                await self.cond.wait_for(lambda: self.done or self.written >= min_bytes)
        if self.done and self.error is not None:
            raise self.error


class BlobStore:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.blobs = root / "blobs"
        self.tmp = root / "tmp"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        for stale in self.tmp.iterdir():  # downloads cut by a crash: never verified
            stale.unlink(missing_ok=True)
        self._lru: OrderedDict[str, int] = OrderedDict()
        found: list[tuple[int, str, int]] = []
        for sub in self.blobs.iterdir():
            for f in sub.iterdir():
                if SHA256_RE.match(f.name):
                    st = f.stat()
                    found.append((st.st_mtime_ns, f.name, st.st_size))
        for _, sha, size in sorted(found):  # mtime is the persisted use order
            self._lru[sha] = size
        self._last_use_ns = max((t for t, _, _ in found), default=0)
        self.total = sum(self._lru.values())
        self._fetches: dict[str, Fetch] = {}

    def _path(self, sha256: str) -> Path:
        return self.blobs / sha256[:2] / sha256

    def __contains__(self, sha256: str) -> bool:
        return sha256 in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def open(self, sha256: str) -> int | None:
        """An fd on the cached blob (marked used), or None. Open before replying, so eviction
        in between cannot cut a response."""
        if sha256 not in self._lru:
            return None
        path = self._path(sha256)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # removed behind our back
            self.total -= self._lru.pop(sha256)
            return None
        self._lru.move_to_end(sha256)
        with contextlib.suppress(OSError):
            self._mark_used(fd)
        return fd

    def _mark_used(self, target: int | Path) -> None:
        # The kernel's file clock ticks per jiffy: two uses within one tick would tie and reload
        # in name order, so each use gets a stamp strictly after the one before.
        self._last_use_ns = max(time.time_ns(), self._last_use_ns + 1)
        os.utime(target, ns=(self._last_use_ns, self._last_use_ns))

    def fetch(self, sha256: str, producer: Producer) -> Fetch:
        """The download of ``sha256`` in flight, started with ``producer`` if there is none."""
        if not SHA256_RE.match(sha256):
            raise ValueError(f"not a sha256: {sha256!r}")
        f = self._fetches.get(sha256)
        if f is not None:
            return f
        part = self.tmp / f"{sha256}.{secrets.token_hex(4)}.part"
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        f = Fetch(sha256, fd, part)
        self._fetches[sha256] = f
        # Not tied to the first client's request: a client that hangs up does not waste the
        # download for the others.
        f.task = asyncio.create_task(self._run(f, producer), name=f"mirror-fetch-{sha256[:12]}")
        return f

    async def _run(self, f: Fetch, producer: Producer) -> None:
        digest = hashlib.sha256()

        def expect_size(size: int | None) -> None:
            if size is not None and size > self.max_bytes:
                raise UpstreamTooLarge(f"{size} bytes do not fit the {self.max_bytes}-byte cache")
            f.size = size

        async def sink(chunk: bytes) -> None:
            if f.written + len(chunk) > self.max_bytes:
                raise UpstreamTooLarge(f"more than the {self.max_bytes}-byte cache")
            digest.update(chunk)
            os.pwrite(f.fd, chunk, f.written)
            f.written += len(chunk)
            await f._progress()

        try:
            await producer(sink, expect_size)
            if digest.hexdigest() != f.sha256:
                raise HashMismatch("upstream file does not match its index hash",
                                   expected=f.sha256, got=digest.hexdigest())
            final = self._path(f.sha256)
            final.parent.mkdir(exist_ok=True)
            os.rename(f.part, final)
            with contextlib.suppress(OSError):
                self._mark_used(final)
            self._lru[f.sha256] = f.written
            self.total += f.written
            self._evict(keep=f.sha256)
        except asyncio.CancelledError:
            f.error = InfraError("mirror shutting down")
            raise
        except RollboxError as exc:
            f.error = exc
            log.warning("mirror fetch %s failed: %s", f.sha256, exc)
        except Exception as exc:
            f.error = InfraError(f"fetch failed: {exc!r}")
            log.exception("mirror fetch %s failed", f.sha256)
        finally:
            if f.error is not None:
                with contextlib.suppress(FileNotFoundError):
                    f.part.unlink()
            os.close(f.fd)
            f.fd = -1
            f.done = True
            del self._fetches[f.sha256]
            # Wake readers without waiting for the lock holder (shutdown must not hang).
            with contextlib.suppress(RuntimeError):
                await f._progress()

    def _evict(self, keep: str) -> None:
        while self.total > self.max_bytes and len(self._lru) > 1:
            sha, size = next(iter(self._lru.items()))
            if sha == keep:
                self._lru.move_to_end(sha)
                continue
            del self._lru[sha]
            self.total -= size
            with contextlib.suppress(FileNotFoundError):
                self._path(sha).unlink()
            log.info("mirror evicted %s (%d bytes)", sha, size)

    async def follow(self, f: Fetch) -> AsyncIterator[bytes]:
        """The bytes of an in-flight fetch as they arrive, the last one only once verified."""
        if f.done:
            if f.error is not None:
                raise f.error
            fd = self.open(f.sha256)
            if fd is None:
                raise InfraError("blob evicted right after its download")
            async for chunk in read_fd(fd):
                yield chunk
            return
        fd = os.dup(f.fd)
        try:
            sent = 0
            while True:
                async with f.cond:
                    await f.cond.wait_for(lambda s=sent: f.done or f.written - 1 > s)
                if f.done and f.error is not None:
                    raise f.error
                limit = f.written if f.done else f.written - 1
                while sent < limit:
                    chunk = os.pread(fd, min(CHUNK, limit - sent), sent)
                    if not chunk:
                        raise InfraError("blob shrank while being read")
                    sent += len(chunk)
                    yield chunk
                if f.done:
                    return
        finally:
            os.close(fd)

    async def aclose(self) -> None:
        tasks = [f.task for f in self._fetches.values() if f.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def read_fd(fd: int) -> AsyncIterator[bytes]:
    """Chunks of an open file, closing it at the end (or when the client goes away)."""
    try:
        offset = 0
        while True:
            chunk = os.pread(fd, CHUNK, offset)
            if not chunk:
                return
            offset += len(chunk)
            yield chunk
    finally:
        os.close(fd)
