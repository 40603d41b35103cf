"""SandboxFS tar upload/download: round trips, id shifting, caps, malformed input and bounded
memory on large streams (needs root: files are chowned to shifted host ids)."""
from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.hostfs import SandboxFS
from tests.unit.conftest import SHIFT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")



def make_tar(members: list[tuple[tarfile.TarInfo, bytes | None]], gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            else:
                tf.addfile(ti)
    return buf.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, **kw: object) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


async def chunked(data: bytes, size: int = 7777) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


async def collect(it: AsyncIterator[bytes]) -> bytes:
    return b"".join([c async for c in it])


async def test_upload_extracts_with_shifted_ids_and_masked_modes(
        box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    data = make_tar([
        (entry("pkg", tarfile.DIRTYPE, mode=0o750, uid=7, gid=8), None),
        (entry("pkg/run.sh", mode=0o4755, uid=1000, gid=1000, mtime=1_600_000_000), b"#!/bin/sh\n"),
        (entry("pkg/big-id", mode=0o644, uid=100_000, gid=2_000_000), b"z"),
        (entry("pkg/link", tarfile.SYMTYPE, linkname="run.sh"), None),
        (entry("pkg/hard", tarfile.LNKTYPE, linkname="pkg/run.sh"), None),
        (entry("pkg/fifo", tarfile.FIFOTYPE), None),
        (entry("pkg/dev", tarfile.CHRTYPE, devmajor=1, devminor=3), None),
        (entry("./nested/deeper/file", mode=0o600), b"deep"),
    ])
    n = await fs.upload_tar("/dst", chunked(data))
    assert n == len(b"#!/bin/sh\n") + 1 + 4
    run = (root / "dst/pkg/run.sh").stat()
    assert (run.st_uid, run.st_gid) == (SHIFT + 1000, SHIFT + 1000)
    assert stat.S_IMODE(run.st_mode) == 0o755  # setuid stripped
    assert run.st_mtime == 1_600_000_000
    big = (root / "dst/pkg/big-id").stat()
    assert (big.st_uid, big.st_gid) == (SHIFT, SHIFT)  # out-of-range ids -> sandbox root
    d = (root / "dst/pkg").stat()
    assert (d.st_uid, d.st_gid, stat.S_IMODE(d.st_mode)) == (SHIFT + 7, SHIFT + 8, 0o750)
    assert os.readlink(root / "dst/pkg/link") == "run.sh"
    assert (root / "dst/pkg/hard").stat().st_ino == run.st_ino
    assert not (root / "dst/pkg/fifo").exists() and not (root / "dst/pkg/dev").exists()
    assert (root / "dst/nested/deeper/file").read_bytes() == b"deep"
    assert not [p for p in (root / "dst").rglob(".rollbox-tmp-*")]


async def test_upload_gzip_and_overwrite(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    (root / "dst").mkdir()
    (root / "dst/a").write_bytes(b"old")
    os.symlink("/etc/passwd", root / "dst/b")
    data = make_tar([(entry("a"), b"new-a"), (entry("b"), b"new-b")], gz=True)
    assert await fs.upload_tar("/dst", chunked(data, 100)) == 10
    assert (root / "dst/a").read_bytes() == b"new-a"
    assert not (root / "dst/b").is_symlink() and (root / "dst/b").read_bytes() == b"new-b"


@pytest.mark.parametrize("blob", [b"this is not a tar at all" * 100, b"", gzip.compress(b"x" * 10)])
async def test_malformed_tar_is_bad_request(box: tuple[SandboxFS, Path], blob: bytes) -> None:
    fs, _ = box
    with pytest.raises(errors.BadRequest):
        await fs.upload_tar("/dst", chunked(blob))


async def test_truncated_tar_is_bad_request(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    data = make_tar([(entry("f"), b"x" * 100_000)])
    with pytest.raises(errors.BadRequest):
        await fs.upload_tar("/dst", chunked(data[:50_000]))
    assert not [p for p in (root / "dst").iterdir() if p.name.startswith(".rollbox-tmp-")]


async def test_upload_caps(box: tuple[SandboxFS, Path]) -> None:
    _, root = box
    small = SandboxFS(root, SHIFT, max_upload=1000, max_entries=5)
    try:
        with pytest.raises(errors.PayloadTooLarge):
            await small.upload_tar("/a", chunked(make_tar([(entry("f"), b"x" * 1001)])))
        with pytest.raises(errors.PayloadTooLarge):
            await small.upload_tar("/b", chunked(make_tar(
                [(entry(f"f{i}"), b"") for i in range(6)])))
        huge_pax = entry("p", pax_headers={"comment": "x" * (2 << 20)})
        with pytest.raises(errors.BadRequest, match="pax"):
            await small.upload_tar("/c", chunked(make_tar([(huge_pax, b"")])))
    finally:
        small.close()


async def test_upload_source_error_propagates(box: tuple[SandboxFS, Path]) -> None:
    fs, _ = box
    data = make_tar([(entry("f"), b"x" * 100_000)])

    async def broken() -> AsyncIterator[bytes]:
        yield data[:20_000]
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        await fs.upload_tar("/dst", broken())


async def test_download_round_trip(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    fs.write("/src/a.txt", b"A" * 1000, uid=1000, gid=1001, mode=0o600)
    fs.write("/src/sub/b.bin", os.urandom(300_000))
    fs.mkdir("/src/empty")
    os.symlink("../a.txt", root / "src/sub/rel")
    os.chown(root / "src/sub/rel", SHIFT + 5, SHIFT + 5, follow_symlinks=False)
    blob = await collect(fs.download_tar("/src"))
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        members = {m.name: m for m in tf}
        assert set(members) == {"a.txt", "empty", "sub", "sub/b.bin", "sub/rel"}
        a = members["a.txt"]
        assert (a.uid, a.gid, a.mode, a.size) == (1000, 1001, 0o600, 1000)
        assert members["sub/rel"].issym() and members["sub/rel"].linkname == "../a.txt"
        assert members["sub/rel"].uid == 5
    await fs.upload_tar("/copy", chunked(blob, 65536))
    for rel in ("a.txt", "sub/b.bin"):
        assert (root / "copy" / rel).read_bytes() == (root / "src" / rel).read_bytes()
    assert (root / "copy/a.txt").stat().st_uid == SHIFT + 1000
    # a single file downloads as one member named after it
    blob = await collect(fs.download_tar("/src/a.txt"))
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        assert [(m.name, m.size) for m in tf] == [("a.txt", 1000)]
    with pytest.raises(errors.NotFound):
        await collect(fs.download_tar("/nope"))


async def test_download_cap_is_typed(box: tuple[SandboxFS, Path]) -> None:
    _, root = box
    (root / "d").mkdir()
    (root / "d/f").write_bytes(b"x" * 5000)
    small = SandboxFS(root, SHIFT, max_upload=4000)
    try:
        with pytest.raises(errors.PayloadTooLarge):
            await collect(small.download_tar("/d"))
    finally:
        small.close()


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(120)
async def test_upload_200mb_streams_with_bounded_memory(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    size = 200 << 20
    block = os.urandom(1 << 20)
    peak = [0]

    async def stream() -> AsyncIterator[bytes]:
        ti = tarfile.TarInfo("big.bin")
        ti.size = size
        yield ti.tobuf(format=tarfile.PAX_FORMAT)
        for _ in range(size // len(block)):
            peak[0] = max(peak[0], rss_kib())
            yield block
        yield bytes(1024)  # end-of-archive blocks (size is a multiple of 512)

    before = rss_kib()
    assert await fs.upload_tar("/up", stream()) == size
    assert (root / "up/big.bin").stat().st_size == size
    growth_mib = (peak[0] - before) / 1024
    assert growth_mib < 64, f"RSS grew by {growth_mib:.0f} MiB for a 200 MiB upload"


@pytest.mark.timeout(120)
async def test_download_bounded_memory_and_early_close(box: tuple[SandboxFS, Path]) -> None:
    fs, root = box
    (root / "big").mkdir()
    with open(root / "big/f", "wb") as f:
        f.truncate(150 << 20)  # sparse, read back as zeros
    before = rss_kib()
    peak = 0
    total = 0
    async for chunk in fs.download_tar("/big"):
        total += len(chunk)
        peak = max(peak, rss_kib())
    assert total >= 150 << 20
    assert (peak - before) / 1024 < 64
    # Abandoning the stream early stops the worker promptly (aclose waits for it).
    gen = fs.download_tar("/big")
    await gen.__anext__()
    t0 = time.monotonic()
    await gen.aclose()  # type: ignore[attr-defined]
    assert time.monotonic() - t0 < 5
    # fs can still be closed cleanly (root fd refcount went back to 0)
    fs.close()
    with pytest.raises(errors.SandboxDead):
        fs.read("/big/f")
