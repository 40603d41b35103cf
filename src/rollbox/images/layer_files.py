"""A layer as a plain local file of the store, for VM disks: QEMU gets the layer's EROFS file
read-only (virtio-blk; the host page cache holds one copy for every VM of a layer) and must
read a local file, never the lazy loader's FUSE mount, which could stall a vCPU on a fetch.

A lazy layer is pulled whole from the chunk store its lazy record names (every chunk and the
whole file verified, :func:`rollbox.images.chunks.pull_layer`); from then on the store has its
file and it is not lazy any more (a full pull wins).
"""
from __future__ import annotations

from pathlib import Path

from rollbox.errors import InfraError
from rollbox.images.chunks import open_store, pull_layer
from rollbox.images.lazy.paths import read_record
from rollbox.images.store import ImageStore


async def local_layer_file(store: ImageStore, digest: str) -> Path:
    """The layer's EROFS file in ``store``, pulling a lazy layer whole first; NotFound for a
    layer the store does not have, a typed retryable error if its chunk store fails."""
    if store.is_lazy(digest):
        record = read_record(store.root, digest) or {}
        src = open_store(record.get("store"))
        try:
            await pull_layer(src, digest, store)
        except OSError as exc:
            raise InfraError(f"layer {digest} could not be pulled as a local file: {exc}",
                             digest=digest) from exc
        finally:
            await src.close()
    return store.layer_path(digest)
