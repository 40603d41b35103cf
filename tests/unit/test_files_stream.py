"""SandboxFS streamed single files (read_stream / write_stream): atomic, capped, bounded
memory, typed disk-full at a tmpfs cap (needs root: files are chowned to shifted ids)."""
from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.errors import DiskFull
from rollbox.hostfs import STREAM_CHUNK, SandboxFS
from rollbox.isolation import syscalls
from tests.unit.conftest import SHIFT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")


async def chunks(n: int, size: int = 64 << 10, fill: int = 0x61) -> AsyncIterator[bytes]:
    for i in range(n):
        yield bytes([fill + i % 26]) * size
        await asyncio.sleep(0)


async def test_write_stream_round_trip_atomic_and_owned(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    fs.write("/w/f", b"old")
    gate = asyncio.Event()
    seen_old: list[bytes] = []

    async def slow() -> AsyncIterator[bytes]:
        yield b"a" * 1000
        # Mid-stream the old content is still in place: the new file appears only at the end.
        seen_old.append((root / "w/f").read_bytes())
        gate.set()
        yield b"b" * 1000

    n = await fs.write_stream("/w/f", slow(), mode=0o4750, uid=7, gid=8)
    assert gate.is_set() and seen_old == [b"old"]
    assert n == 2000 and (root / "w/f").read_bytes() == b"a" * 1000 + b"b" * 1000
    s = (root / "w/f").stat()
    assert (s.st_uid, s.st_gid) == (SHIFT + 7, SHIFT + 8)
    assert stat.S_IMODE(s.st_mode) == 0o750  # never setuid
    assert os.listdir(root / "w") == ["f"]
    got = [c async for c in fs.read_stream("/w/f")]
    assert b"".join(got) == b"a" * 1000 + b"b" * 1000
    # Empty stream: an empty file.
    assert await fs.write_stream("/w/empty", chunks(0)) == 0
    assert (root / "w/empty").read_bytes() == b""
    assert [c async for c in fs.read_stream("/w/empty")] == []


async def test_read_stream_is_chunked_and_capped(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    (root / "big").write_bytes(b"z" * (3 * STREAM_CHUNK + 5))
    sizes = [len(c) async for c in fs.read_stream("/big")]
    assert max(sizes) <= STREAM_CHUNK and sum(sizes) == 3 * STREAM_CHUNK + 5
    with pytest.raises(errors.PayloadTooLarge):
        async for _ in fs.read_stream("/big", max_bytes=100):
            raise AssertionError("no byte before the cap check")
    with pytest.raises(errors.NotFound):
        async for _ in fs.read_stream("/missing"):
            pass
    os.mkfifo(root / "fifo")
    with pytest.raises(errors.BadRequest, match="FIFO"):
        async for _ in fs.read_stream("/fifo"):
            pass


async def test_write_stream_cap_and_source_failure_leave_nothing(
        box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    with pytest.raises(errors.PayloadTooLarge):
        await fs.write_stream("/capped", chunks(10, 1000), max_bytes=5000)

    class Broken(Exception):
        pass

    async def broken() -> AsyncIterator[bytes]:
        yield b"x" * 1000
        raise Broken("client went away")

    with pytest.raises(Broken):
        await fs.write_stream("/broken", broken())
    with pytest.raises(errors.BadRequest):
        await fs.write_stream("relative", chunks(1))
    assert os.listdir(root) == []  # no file, no temp file


async def test_write_stream_disk_full_is_typed_and_clean() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="rbx-stream-full-"))
    mounted = False
    try:
        syscalls.mount("tmpfs", tmp, "tmpfs", 0, "size=1m")
        mounted = True
        with SandboxFS(tmp, SHIFT) as fs:
            fs.write("/keep", b"kept")
            with pytest.raises(DiskFull) as ei:
                await fs.write_stream("/keep", chunks(64))  # 4 MiB into a 1 MiB tmpfs
            assert ei.value.details["reason"] == "disk_full"
            assert os.listdir(tmp) == ["keep"] and (tmp / "keep").read_bytes() == b"kept"
            assert os.statvfs(tmp).f_bfree == os.statvfs(tmp).f_blocks - 1  # space given back
    finally:
        if mounted:
            syscalls.umount(tmp, syscalls.MNT_DETACH)
        shutil.rmtree(tmp)


async def test_download_closed_early_stops_its_worker(box: tuple[SandboxFS, Path]) -> None:
    """A consumer that closes the stream after one chunk ends the worker at once (it held the
    root fd: the sandbox's mounts stay busy until it ends)."""
    fs, root = box
    (root / "big").write_bytes(os.urandom(8 << 20))
    gen = fs.download_tar("/")
    await anext(gen)
    assert fs._users == 1
    await gen.aclose()
    assert fs._users == 0
