"""A layer as a plain local file (VM disks): a lazy layer is pulled whole, verified, into the
store; a chunk store that lacks a chunk fails typed and retryable, leaving the layer lazy."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rollbox.errors import ChunkMissing
from rollbox.images import chunks
from rollbox.images.layer_files import local_layer_file
from rollbox.images.lazy.loader import LazyLoader
from rollbox.images.store import ImageStore


def lazy_layer(store: ImageStore, tmp: Path, url: str) -> tuple[str, bytes]:
    src = tmp / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(os.urandom(300_000))
    layer = store.add_layer_from_dir(src, source="test")
    asyncio.run(chunks.push_layer(store, layer, chunks.open_store(url), chunk_size=64 << 10))
    data = store.layer_path(layer).read_bytes()
    (store.layers_dir / f"{layer}.erofs").unlink()
    LazyLoader(store).register(layer, url)
    return layer, data


def test_a_lazy_layer_becomes_a_local_file(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    layer, data = lazy_layer(store, tmp_path, f"dir://{tmp_path}/chunks")
    assert store.is_lazy(layer)
    path = asyncio.run(local_layer_file(store, layer))
    assert path == store.layers_dir / f"{layer}.erofs" and path.read_bytes() == data
    assert not store.is_lazy(layer) and store.has_layer(layer)
    assert asyncio.run(local_layer_file(store, layer)) == path  # local now: nothing pulled


def test_a_missing_chunk_fails_typed_and_leaves_the_layer_lazy(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    layer, _data = lazy_layer(store, tmp_path, f"dir://{tmp_path}/chunks")
    m = chunks.load_manifest(store, layer)
    assert m is not None
    (tmp_path / "chunks" / chunks.chunk_key(m.chunks[1].digest, "none")).unlink()
    with pytest.raises(ChunkMissing) as err:
        asyncio.run(local_layer_file(store, layer))
    assert err.value.retryable
    assert store.is_lazy(layer) and not store.has_layer(layer)
    assert list(store.tmp_dir.iterdir()) == []
