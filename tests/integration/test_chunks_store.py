"""Chunk store push/pull against real back-ends: a local dir, a 'shared' POSIX dir and a real
S3-compatible server (moto, subprocess on loopback) with a bucket made by the fixture."""
from __future__ import annotations

import os
import random
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollbox.errors import ChunkCorrupt, ChunkMissing, InfraError, StoreUnreachable
from rollbox.images import chunks
from rollbox.images.sources import build_from_directory
from rollbox.images.store import ImageStore
from rollbox.images.stores.loopback_s3 import free_port, loopback_s3

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mkfs.erofs") is None,
                                reason="needs root and mkfs.erofs")
CHUNK = 64 * 1024


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with loopback_s3("rollbox-test") as endpoint:
        yield endpoint


@pytest.fixture(params=["dir", "posix", "s3", "s3-zstd"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    kind = request.param
    if kind == "dir":
        yield f"dir://{tmp_path}/chunks"
    elif kind == "posix":
        yield f"posix://{tmp_path}/shared?compression=zstd"
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        # A fresh prefix per test: the bucket outlives tests in this module.
        prefix = f"t{os.urandom(4).hex()}"
        comp = "zstd" if kind == "s3-zstd" else "none"
        yield f"s3://rollbox-test/{prefix}?endpoint={endpoint}&compression={comp}"


def make_layer(store: ImageStore, tmp: Path, name: str, seed: bytes) -> str:
    """A small EROFS image: random (incompressible) data, zeros and text, ~900 KiB."""
    src = tmp / f"src-{name.replace(':', '-')}"
    (src / "etc").mkdir(parents=True)
    (src / "etc/hello").write_text("hello " * 1000)
    (src / "zeros").write_bytes(bytes(200_000))
    (src / "random").write_bytes(random.Random(7).randbytes(600_000) + seed)
    os.utime(src, (1_700_000_000, 1_700_000_000))
    image = build_from_directory(store, src, name)
    return image.layers[0]


def tmp_is_empty(store: ImageStore) -> bool:
    return not any(store.tmp_dir.iterdir())


async def test_round_trip_dedupe_and_refs(store_url: str, tmp_path: Path) -> None:
    a = ImageStore(tmp_path / "node-a")
    b = ImageStore(tmp_path / "node-b")
    layer = make_layer(a, tmp_path, "app:1", b"one")
    dst = chunks.open_store(store_url)
    try:
        manifests = await chunks.push_image(a, "app:1", dst, chunk_size=CHUNK)
        assert [m.layer for m in manifests] == [layer]
        m = manifests[0]
        assert m.size == a.layer_path(layer).stat().st_size
        assert sum(c.size for c in m.chunks) == m.size
        first = chunks.TRANSFERS[-1]
        assert first.direction == "push" and first.chunks_transferred > 0
        # zero chunks repeat inside the layer: stored once
        assert len({c.digest for c in m.chunks}) < len(m.chunks)
        if "zstd" in store_url:
            assert any(c.compression == "zstd" and c.stored_size < c.size for c in m.chunks)
            assert first.bytes_transferred < m.size
        written = dst.stats.bytes_written

        # dedupe: pushing again uploads nothing
        await chunks.push_image(a, "app:1", dst, chunk_size=CHUNK)
        assert dst.stats.bytes_written == written
        assert chunks.TRANSFERS[-1].chunks_transferred == 0

        # a second version sharing most content uploads only the chunks that changed
        layer2 = make_layer(a, tmp_path, "app:2", b"two")
        assert layer2 != layer
        await chunks.push_image(a, "app:2", dst, chunk_size=CHUNK)
        second = chunks.TRANSFERS[-1]
        assert 0 < second.chunks_transferred < second.chunks // 2

        # pull on another node: byte-identical layer, ref tagged with the same config
        image, stats = await chunks.pull_image(dst, "app:1", b)
        assert b.layer_path(layer).read_bytes() == a.layer_path(layer).read_bytes()
        assert b.resolve("app:1").layers == [layer]
        assert b.resolve("app:1").config == a.resolve("app:1").config
        assert stats[0].bytes_logical == m.size and stats[0].chunks == len(m.chunks)
        assert tmp_is_empty(b)
        assert chunks.load_manifest(b, layer) == m
        # pulled-layer metrics are logged for `rollbox image stats`
        assert "pull" in (b.logs_dir / "transfers.jsonl").read_text()

        # lazy pull: refs + manifests only
        c = ImageStore(tmp_path / "node-c")
        image, stats = await chunks.pull_image(dst, "app:2", c, lazy=True)
        assert image.layers == [layer2] and stats == []
        assert not c.has_layer(layer2) and chunks.load_manifest(c, layer2) is not None
    finally:
        await dst.close()


async def test_missing_chunk_is_typed_retryable_and_writes_nothing(store_url: str,
                                                                   tmp_path: Path) -> None:
    a = ImageStore(tmp_path / "node-a")
    b = ImageStore(tmp_path / "node-b")
    layer = make_layer(a, tmp_path, "app:1", b"x")
    dst = chunks.open_store(store_url)
    try:
        m = await chunks.push_layer(a, layer, dst, chunk_size=CHUNK)
        victim = m.chunks[-1]
        await _delete(dst, chunks.chunk_key(victim.digest, victim.compression))
        with pytest.raises(ChunkMissing) as info:
            await dst.get_chunk(victim)
        assert info.value.retryable and isinstance(info.value, InfraError)
        with pytest.raises(ChunkMissing):
            await chunks.pull_layer(dst, layer, b)
        assert not b.has_layer(layer) and tmp_is_empty(b)
        # a re-push notices the hole and repairs it
        await chunks.push_layer(a, layer, dst, chunk_size=CHUNK)
        await chunks.pull_layer(dst, layer, b)
        assert b.layer_path(layer).read_bytes() == a.layer_path(layer).read_bytes()
    finally:
        await dst.close()


async def test_corrupt_chunk_is_typed_and_writes_nothing(store_url: str, tmp_path: Path) -> None:
    a = ImageStore(tmp_path / "node-a")
    b = ImageStore(tmp_path / "node-b")
    layer = make_layer(a, tmp_path, "app:1", b"y")
    dst = chunks.open_store(store_url)
    try:
        m = await chunks.push_layer(a, layer, dst, chunk_size=CHUNK)
        victim = next(c for c in m.chunks if c.compression == "none")
        key = chunks.chunk_key(victim.digest, victim.compression)
        good = await dst._call(dst._get, key)  # type: ignore[attr-defined]
        flipped = bytes([good[0] ^ 0xFF]) + good[1:]
        await dst._call(dst._put, key, flipped)  # type: ignore[attr-defined]
        with pytest.raises(ChunkCorrupt) as info:
            await dst.get_chunk(victim)
        assert info.value.retryable
        with pytest.raises(ChunkCorrupt):
            await chunks.pull_layer(dst, layer, b)
        assert not b.has_layer(layer) and tmp_is_empty(b)
        assert not list(b.layers_dir.iterdir())
        # a truncated zstd frame is corrupt too, not a crash
        zc = next((c for c in m.chunks if c.compression == "zstd"), None)
        if zc is not None:
            zkey = chunks.chunk_key(zc.digest, zc.compression)
            data = await dst._call(dst._get, zkey)  # type: ignore[attr-defined]
            await dst._call(dst._put, zkey, data[: len(data) // 2])  # type: ignore[attr-defined]
            with pytest.raises(ChunkCorrupt):
                await dst.get_chunk(zc)
    finally:
        await dst.close()


async def test_unreachable_s3_is_typed_retryable(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "x")
    dst = chunks.open_store(f"s3://rollbox-test/p?endpoint=http://127.0.0.1:{port}&attempts=1"
                            "&connect_timeout=1")
    ref = chunks.ChunkRef("sha256-" + "ab" * 32, 10, 10, "none")
    try:
        for call in (dst.get_chunk(ref), dst.has_chunk(ref.digest), dst.get_manifest(ref.digest),
                     dst.put_chunk(ref, b"0123456789")):
            with pytest.raises(StoreUnreachable) as info:
                await call
            assert info.value.retryable and info.value.code == "store_unreachable"
        b = ImageStore(tmp_path / "node-b")
        with pytest.raises(StoreUnreachable):
            await chunks.pull_layer(dst, ref.digest, b)
        assert tmp_is_empty(b)
    finally:
        await dst.close()


async def test_missing_bucket_and_gone_dir_are_unreachable(s3_endpoint: str,
                                                           tmp_path: Path) -> None:
    dst = chunks.open_store(f"s3://no-such-bucket/p?endpoint={s3_endpoint}")
    ref = chunks.ChunkRef("sha256-" + "cd" * 32, 10, 10, "none")
    try:
        with pytest.raises(StoreUnreachable):
            await dst.get_chunk(ref)
    finally:
        await dst.close()
    root = tmp_path / "gone"
    fstore = chunks.open_store(f"posix://{root}")
    shutil.rmtree(root)
    with pytest.raises(StoreUnreachable):
        await fstore.get_chunk(ref)


async def _delete(store: chunks.ChunkStore, key: str) -> None:
    if isinstance(store, chunks.FileChunkStore):
        (store.root / key).unlink()
    else:
        assert isinstance(store, chunks.S3ChunkStore)
        store._client.delete_object(Bucket=store.bucket, Key=store._key(key))


async def test_repeated_chunks_move_once(tmp_path: Path) -> None:
    a = ImageStore(tmp_path / "node-a")
    b = ImageStore(tmp_path / "node-b")
    layer = make_layer(a, tmp_path, "app:1", b"z")
    dst = chunks.open_store(f"dir://{tmp_path}/chunks")
    m = await chunks.push_layer(a, layer, dst, chunk_size=CHUNK)
    unique = {c.digest for c in m.chunks}
    assert len(unique) < len(m.chunks)
    assert dst.stats.chunks_written == len(unique)
    stats = await chunks.pull_layer(dst, layer, b)
    assert stats.chunks_transferred == len(unique) == dst.stats.chunks_read
    assert b.layer_path(layer).read_bytes() == a.layer_path(layer).read_bytes()
