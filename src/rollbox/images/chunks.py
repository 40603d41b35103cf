"""Push and pull of image layers through a chunk store (:mod:`rollbox.images.stores`).

:func:`push_layer` cuts a layer file into chunks (:func:`~rollbox.images.stores.base.
chunk_layer`) and uploads those the store lacks, then the layer's manifest; :func:`pull_layer`
fetches all of them (the full-pull baseline), verifies each and the whole file and hands it to
the image store; the lazy loader (``rollbox.images.lazy``) reads single chunks instead. Layer
manifests a node pulled are kept under ``<image store root>/manifests``.

The store types and :func:`~rollbox.images.stores.open_store` are re-exported here: callers of
push/pull name one module.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollbox.errors import ChunkCorrupt, InfraError
from rollbox.images.names import validate_digest
from rollbox.images.store import Image, ImageStore
from rollbox.images.stores import (
    FileChunkStore,
    PosixChunkStore,
    S3ChunkStore,
    default_store_url,
    open_store,
)
from rollbox.images.stores.base import (
    COMPRESSIONS,
    DEFAULT_CHUNK_SIZE,
    ChunkRef,
    ChunkStore,
    LayerManifest,
    StoreStats,
    chunk_key,
    chunk_layer,
    decode_chunk,
    encode_chunk,
)

Progress = Callable[[str], None]

# Parallel chunk transfers per push/pull (each holds one chunk in memory).
DEFAULT_CONCURRENCY = 16


# ---- push / pull ---------------------------------------------------------------------------

@dataclass
class TransferStats:
    """Bytes and chunks moved for one layer by push_layer or pull_layer."""

    layer: str
    direction: str  # "push" | "pull"
    store: str
    chunks: int = 0
    chunks_transferred: int = 0  # uploaded / downloaded (the rest were present)
    bytes_logical: int = 0  # layer size
    bytes_transferred: int = 0  # stored bytes over the wire
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Every transfer of this process, newest last (read by `rollbox image stats` / the bench).
TRANSFERS: list[TransferStats] = []


def _record(store: ImageStore | None, stats: TransferStats) -> None:
    TRANSFERS.append(stats)
    del TRANSFERS[:-1000]
    if store is None:
        return
    try:
        with open(store.logs_dir / "transfers.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), **stats.to_dict()}) + "\n")
    except OSError:
        pass  # metrics are best effort


async def push_layer(store: ImageStore, layer: str, dst: ChunkStore, *,
                     chunk_size: int = DEFAULT_CHUNK_SIZE, compression: str | None = None,
                     progress: Progress | None = None,
                     concurrency: int = DEFAULT_CONCURRENCY) -> LayerManifest:
    """Upload a layer's chunks that ``dst`` lacks, then its manifest (last, so a manifest is
    never visible before its chunks). Idempotent; a second push uploads no chunk."""
    path = store.layer_path(layer)
    compression = compression or dst.compression
    stats = TransferStats(layer, "push", dst.url)
    t0 = time.monotonic()
    if await dst.has_manifest(layer):
        m = await dst.get_manifest(layer)
        if m.chunk_size == chunk_size and all(c.compression in ("none", compression)
                                              for c in m.chunks):
            # Present: still make sure its chunks are (a manifest is written last, but a
            # store may have been pruned).
            present = await asyncio.gather(*(dst.has_chunk(c.digest, c.compression)
                                              for c in m.chunks))
            if all(present):
                stats.chunks, stats.bytes_logical = len(m.chunks), m.size
                stats.seconds = time.monotonic() - t0
                _record(store, stats)
                if progress:
                    progress(f"{layer[:19]}: already in {dst.url}")
                return m
    size = path.stat().st_size
    refs: list[ChunkRef] = []
    sem = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task[None]] = set()
    uploaded: list[int] = []

    seen: set[tuple[str, str]] = set()  # a layer repeats chunks (zeros): upload once

    async def upload(ref: ChunkRef, stored: bytes) -> None:
        try:
            key = (ref.digest, ref.compression)
            if key in seen:
                return
            seen.add(key)
            if not await dst.has_chunk(ref.digest, ref.compression):
                await dst.put_chunk(ref, stored)
                uploaded.append(ref.stored_size)
        finally:
            sem.release()

    it = chunk_layer(path, chunk_size, compression)
    try:
        while True:
            await sem.acquire()
            item = await asyncio.to_thread(next, it, None)
            if item is None:
                sem.release()
                break
            ref, stored = item
            refs.append(ref)
            task = asyncio.create_task(upload(ref, stored))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            failed = [t for t in list(tasks) if t.done() and t.exception()]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
            if progress and len(refs) % 64 == 0:
                progress(f"{layer[:19]}: {len(refs) * chunk_size / 2**20:.0f}/"
                         f"{size / 2**20:.0f} MiB")
        if tasks:
            await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        it.close()
    m = LayerManifest(layer=layer, size=size, chunk_size=chunk_size, chunks=refs)
    await dst.put_manifest(m)
    stats.chunks, stats.bytes_logical = len(refs), size
    stats.chunks_transferred, stats.bytes_transferred = len(uploaded), sum(uploaded)
    stats.seconds = time.monotonic() - t0
    _record(store, stats)
    if progress:
        progress(f"{layer[:19]}: pushed {len(uploaded)}/{len(refs)} chunks, "
                 f"{stats.bytes_transferred / 2**20:.1f} MiB")
    return m


async def pull_layer(src: ChunkStore, layer: str, store: ImageStore,
                     progress: Progress | None = None, *,
                     concurrency: int = DEFAULT_CONCURRENCY) -> TransferStats:
    """Fetch every chunk of ``layer``, verify each and the whole file, add it to ``store``.

    The full-pull baseline of the lazy loader. Nothing reaches ``store.layers_dir`` unless the
    assembled file hashes to ``layer``; on any error the staging file is removed."""
    validate_digest(layer)
    stats = TransferStats(layer, "pull", src.url)
    t0 = time.monotonic()
    if store.has_layer(layer):
        stats.seconds = time.monotonic() - t0
        _record(store, stats)
        return stats
    m = await src.get_manifest(layer)
    stats.chunks, stats.bytes_logical = len(m.chunks), m.size
    tmp = store.tmp_dir / f"pull-{os.getpid()}-{os.urandom(4).hex()}.erofs"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    hasher = hashlib.sha256()
    ready: dict[int, bytes] = {}
    next_hash = 0
    sem = asyncio.Semaphore(concurrency)

    # Chunks a layer holds more than once (runs of zeros) are fetched once.
    counts = collections.Counter(c.digest for c in m.chunks)
    repeated: dict[str, asyncio.Future[bytes]] = {}

    async def get(ref: ChunkRef) -> bytes:
        if counts[ref.digest] < 2:
            return await src.get_chunk(ref)
        fut = repeated.get(ref.digest)
        if fut is None:
            fut = repeated[ref.digest] = asyncio.get_running_loop().create_future()
            try:
                raw = await src.get_chunk(ref)
            except BaseException as exc:
                fut.set_exception(exc)
                fut.exception()  # retrieved: the raise below reports it
                raise
            stats.chunks_transferred += 1
            stats.bytes_transferred += ref.stored_size
            fut.set_result(raw)
            return raw
        return await asyncio.shield(fut)

    async def fetch(i: int, ref: ChunkRef) -> None:
        nonlocal next_hash
        async with sem:
            raw = await get(ref)
            await asyncio.to_thread(os.pwrite, fd, raw, i * m.chunk_size)
            if counts[ref.digest] < 2:
                stats.chunks_transferred += 1
                stats.bytes_transferred += ref.stored_size
            # Hash in file order as chunks complete (bounded by the semaphore's window).
            ready[i] = raw
            while next_hash in ready:
                hasher.update(ready.pop(next_hash))
                next_hash += 1
            if progress and i % 64 == 0:
                progress(f"{layer[:19]}: chunk {i}/{len(m.chunks)}")

    try:
        os.ftruncate(fd, m.size)
        # Chunks finish out of order: launching them in batches bounds the chunks waiting in
        # `ready` for an earlier one to be hashed.
        batch = max(1, concurrency * 4)
        for start in range(0, len(m.chunks), batch):
            await asyncio.gather(*(fetch(i, m.chunks[i])
                                   for i in range(start, min(len(m.chunks), start + batch))))
        if "sha256-" + hasher.hexdigest() != layer:
            raise ChunkCorrupt(f"layer {layer} assembled from {src.url} hashes to "
                               f"sha256-{hasher.hexdigest()}", layer=layer, store=src.url)
        await asyncio.to_thread(os.fsync, fd)
        os.close(fd)
        fd = -1
        await asyncio.to_thread(store.install_verified_layer, tmp, layer,
                                source=f"pull:{src.url}")
    finally:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
    stats.seconds = time.monotonic() - t0
    _record(store, stats)
    if progress:
        progress(f"{layer[:19]}: pulled {stats.bytes_transferred / 2**20:.1f} MiB")
    return stats


async def push_image(store: ImageStore, name: str, dst: ChunkStore, *,
                     chunk_size: int = DEFAULT_CHUNK_SIZE, compression: str | None = None,
                     progress: Progress | None = None) -> list[LayerManifest]:
    """Push every layer of ``name``, then its ref (last: a ref never names a missing layer)."""
    image = store.resolve(name)
    manifests = [await push_layer(store, d, dst, chunk_size=chunk_size, compression=compression,
                                  progress=progress) for d in image.layers]
    await dst.put_ref(Image(name=name if not name.startswith("sha256-") else image.name,
                            layers=list(image.layers), config=image.config,
                            created=image.created))
    return manifests


def local_manifest_dir(store: ImageStore) -> Path:
    """Where pulled manifests are kept on the node (for the lazy loader)."""
    d = store.root / "manifests"
    d.mkdir(parents=True, exist_ok=True)
    return d


def save_manifest(store: ImageStore, m: LayerManifest) -> Path:
    path = local_manifest_dir(store) / f"{m.layer}.json"
    tmp = path.parent / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}"
    tmp.write_bytes(m.to_json())
    os.rename(tmp, path)
    return path


def load_manifest(store: ImageStore, layer: str) -> LayerManifest | None:
    try:
        return LayerManifest.from_json(
            (local_manifest_dir(store) / f"{validate_digest(layer)}.json").read_bytes())
    except FileNotFoundError:
        return None


async def pull_image(src: ChunkStore, name: str, store: ImageStore, *, lazy: bool = False,
                     progress: Progress | None = None) -> tuple[Image, list[TransferStats]]:
    """Fetch ``name``'s ref and layer manifests (saved under ``store.root/manifests``); unless
    ``lazy``, also every layer's bytes, then tag ``name`` locally. With ``lazy`` the ref is
    returned untagged: the layer files are not local, so tagging is the lazy loader's job."""
    image = await src.get_ref(name)
    stats: list[TransferStats] = []
    for layer in image.layers:
        m = await src.get_manifest(layer)
        await asyncio.to_thread(save_manifest, store, m)
        if not lazy:
            stats.append(await pull_layer(src, layer, store, progress))
    if not lazy:
        store.tag(image.name, image.layers, image.config)
    return image, stats


__all__ = [
    "COMPRESSIONS",
    "DEFAULT_CHUNK_SIZE",
    "TRANSFERS",
    "ChunkRef",
    "ChunkStore",
    "FileChunkStore",
    "InfraError",
    "LayerManifest",
    "PosixChunkStore",
    "S3ChunkStore",
    "StoreStats",
    "TransferStats",
    "chunk_key",
    "chunk_layer",
    "decode_chunk",
    "default_store_url",
    "encode_chunk",
    "load_manifest",
    "open_store",
    "pull_image",
    "pull_layer",
    "push_image",
    "push_layer",
    "save_manifest",
]
