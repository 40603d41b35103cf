"""Chunk encoding, manifests and store URLs (no I/O beyond temp dirs)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollbox.errors import ERRORS_BY_CODE, BadRequest, ChunkCorrupt, InfraError
from rollbox.images import chunks


def test_encode_decode_and_verification() -> None:
    raw = bytes(100_000)
    ref, stored = chunks.encode_chunk(raw, "zstd")
    assert ref.compression == "zstd" and ref.stored_size == len(stored) < 1000
    assert chunks.decode_chunk(ref, stored) == raw
    noise = os.urandom(5000)
    ref2, stored2 = chunks.encode_chunk(noise, "zstd")  # does not shrink: stored plain
    assert ref2.compression == "none" and stored2 == noise
    with pytest.raises(ChunkCorrupt):
        chunks.decode_chunk(ref2, noise[:-1] + bytes([noise[-1] ^ 1]))  # never the same byte
    with pytest.raises(ChunkCorrupt):  # a frame that inflates beyond the ref's size
        chunks.decode_chunk(chunks.ChunkRef(ref.digest, 10, ref.stored_size, "zstd"), stored)
    with pytest.raises(BadRequest):
        chunks.encode_chunk(raw, "lz4")


def test_chunk_layer_and_manifest_json(tmp_path: Path) -> None:
    f = tmp_path / "layer"
    f.write_bytes(os.urandom(10_000) + bytes(10_000))
    refs = [r for r, _ in chunks.chunk_layer(f, 4096, "zstd")]
    assert [r.size for r in refs] == [4096] * 4 + [20_000 - 4 * 4096]
    m = chunks.LayerManifest("sha256-" + "a" * 64, 20_000, 4096, refs)
    assert chunks.LayerManifest.from_json(m.to_json()) == m
    assert list(m.chunk_range(0, 1)) == [0]
    assert list(m.chunk_range(4095, 2)) == [0, 1]
    assert list(m.chunk_range(19_999, 100)) == [4]
    assert list(m.chunk_range(20_000, 10)) == []
    bad = chunks.LayerManifest(m.layer, 20_001, 4096, refs)
    with pytest.raises(ChunkCorrupt):
        chunks.LayerManifest.from_json(bad.to_json())
    with pytest.raises(ChunkCorrupt):
        chunks.LayerManifest.from_json(b"{not json")


def test_store_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = chunks.open_store(f"dir://{tmp_path}/c?compression=zstd&latency_ms=2")
    assert isinstance(s, chunks.FileChunkStore) and s.compression == "zstd"
    assert s.latency_s == 0.002 and not s.shared
    assert chunks.open_store(f"posix://{tmp_path}/p").shared  # type: ignore[attr-defined]
    assert chunks.open_store(str(tmp_path / "plain")).url.startswith("dir://")
    monkeypatch.setenv("ROLLBOX_CHUNK_STORE", f"dir://{tmp_path}/env")
    assert chunks.default_store_url() == f"dir://{tmp_path}/env"
    for bad in ("ftp://x/y", "dir://host/path", "dir:///x?bogus=1", "s3:///nobucket",
                "dir:///x?latency_ms=abc", "s3://b/p?nope=1"):
        with pytest.raises(BadRequest):
            chunks.open_store(bad)


def test_errors_are_retryable_and_round_trip() -> None:
    for code in ("chunk_missing", "chunk_corrupt", "store_unreachable"):
        cls = ERRORS_BY_CODE[code]
        assert issubclass(cls, InfraError) and cls.retryable
