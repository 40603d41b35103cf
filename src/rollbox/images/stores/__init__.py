"""Chunk stores: where layers are pushed to and pulled (or lazily read) from, by URL.

One module per back-end, all of them :class:`~rollbox.images.stores.base.ObjectStore` (the
:class:`~rollbox.images.stores.base.ChunkStore` protocol, key layout and chunk encoding)::

    dir:///var/lib/rollbox/chunks                 local directory (embedded default; local.py)
    posix:///mnt/shared/rollbox                   shared POSIX filesystem (NFS, 3FS, ...; posix.py)
    s3://bucket/prefix?endpoint=http://127.0.0.1:9000&latency_ms=2&compression=zstd   (s3.py)

Above the store (refs are its :class:`~rollbox.images.store.Image`), below push/pull
(:mod:`rollbox.images.chunks`) and the lazy daemon. Also ``loopback_s3`` (a moto S3 server on
127.0.0.1 for tests and ``rollbox bench images``).
"""
from __future__ import annotations

import urllib.parse
from pathlib import Path

from rollbox.config import Settings
from rollbox.errors import BadRequest
from rollbox.images.stores.base import ChunkStore
from rollbox.images.stores.local import FileChunkStore
from rollbox.images.stores.posix import PosixChunkStore
from rollbox.images.stores.s3 import S3ChunkStore

__all__ = ["ChunkStore", "FileChunkStore", "PosixChunkStore", "S3ChunkStore",
           "default_store_url", "open_store"]


def default_store_url(settings: Settings | None = None) -> str:
    """The node's ``chunk_store`` (``ROLLBOX_CHUNK_STORE``), else the embedded default
    ``dir://<data_dir>/chunks``."""
    s = settings or Settings()
    return s.chunk_store or f"dir://{s.data_dir / 'chunks'}"


def open_store(url: str | None = None) -> ChunkStore:
    """Open a chunk store by URL (see the package docstring); None = :func:`default_store_url`.

    Query parameters for every scheme: ``compression=none|zstd`` (default for pushes),
    ``latency_ms=N`` (injected per-request delay, for benchmarks). S3 also takes ``endpoint``,
    ``region``, ``threads``, ``attempts``, ``connect_timeout``; credentials come from the usual
    boto3 sources (environment, config files)."""
    url = url or default_store_url()
    if url.startswith("/"):
        url = "dir://" + url
    parsed = urllib.parse.urlsplit(url)
    q = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query).items()}
    try:
        compression = q.pop("compression", "none")
        latency_ms = float(q.pop("latency_ms", "0"))
        if parsed.scheme in ("dir", "posix"):
            if parsed.netloc or not parsed.path.startswith("/"):
                raise BadRequest(f"chunk store URL {url!r}: expected {parsed.scheme}:///abs/path")
            if q:
                raise BadRequest(f"chunk store URL {url!r}: unknown parameters {sorted(q)}")
            cls = PosixChunkStore if parsed.scheme == "posix" else FileChunkStore
            return cls(url, Path(parsed.path), compression=compression, latency_ms=latency_ms)
        if parsed.scheme == "s3":
            if not parsed.netloc:
                raise BadRequest(f"chunk store URL {url!r}: no bucket")
            known = {"endpoint", "region", "threads", "attempts", "connect_timeout"}
            if set(q) - known:
                raise BadRequest(f"chunk store URL {url!r}: unknown parameters "
                                 f"{sorted(set(q) - known)}")
            return S3ChunkStore(url, parsed.netloc, parsed.path, endpoint=q.get("endpoint"),
                                region=q.get("region"), compression=compression,
                                latency_ms=latency_ms, threads=int(q.get("threads", "32")),
                                attempts=int(q.get("attempts", "3")),
                                connect_timeout=float(q.get("connect_timeout", "3")))
    except ValueError as exc:
        raise BadRequest(f"chunk store URL {url!r}: {exc}") from exc
    raise BadRequest(f"chunk store URL {url!r}: scheme must be dir://, posix:// or s3://")

