"""Content-addressed chunk store for EROFS layers: push, pull and the store back-ends.

A layer file (``<digest>.erofs``) is cut into fixed-size chunks; each chunk is stored once under
the SHA-256 of its *uncompressed* bytes, optionally zstd-compressed. A :class:`LayerManifest`
lists a layer's chunks in file order, so any byte range of the layer maps to chunk indices
(``offset // chunk_size``) — the lazy loader (``rollbox.images.lazy``) reads single chunks through
:meth:`ChunkStore.get_chunk`; :func:`pull_layer` fetches all of them (the full-pull baseline).

Store layout, the same for every back-end (keys relative to the store's root/prefix)::

    chunks/<hex[:2]>/<hex>        chunk, stored uncompressed
    chunks/<hex[:2]>/<hex>.zst    chunk, zstd frame (content size in the header)
    manifests/<layer>.json        LayerManifest
    refs/<quoted name>.json       named image: {"name", "layers", "config", "created"}

URLs (:func:`open_store`)::

    dir:///var/lib/rollbox/chunks                 local directory (embedded default)
    posix:///mnt/shared/rollbox                   shared POSIX filesystem (NFS, 3FS, ...)
    s3://bucket/prefix?endpoint=http://127.0.0.1:9000&latency_ms=2&compression=zstd

Every object is written under a unique temporary name and renamed (files) or PUT whole (S3),
so readers never see a partial object and concurrent writers of the same content need no lock:
objects are immutable and content-addressed (refs: last writer wins). Every chunk read is
verified against its digest; a failure is a typed, retryable :class:`~rollbox.errors.InfraError`.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import json
import os
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rollbox.config import Settings
from rollbox.errors import (
    BadRequest,
    ChunkCorrupt,
    ChunkMissing,
    InfraError,
    NotFound,
    StoreUnreachable,
)
from rollbox.images.store import Image, ImageStore, validate_digest, validate_name

Progress = Callable[[str], None]

# Chosen from `rollbox bench images` (see docs/images.md, "Chunk size").
DEFAULT_CHUNK_SIZE = 1 << 20
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 64 << 20
COMPRESSIONS = ("none", "zstd")
ZSTD_LEVEL = 3
# Parallel chunk transfers per push/pull (each holds one chunk in memory).
DEFAULT_CONCURRENCY = 16


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a layer file."""

    digest: str  # "sha256-<hex>" of the uncompressed bytes
    size: int  # uncompressed length (the last chunk may be short)
    stored_size: int  # bytes in the store
    compression: str  # "none" | "zstd"


@dataclass
class LayerManifest:
    """A layer file as an ordered list of chunks; chunk i covers [i*chunk_size, ...)."""

    layer: str  # "sha256-<hex of the .erofs file>", as in ImageStore
    size: int
    chunk_size: int
    chunks: list[ChunkRef] = field(default_factory=list)

    def to_json(self) -> bytes:
        return json.dumps({"layer": self.layer, "size": self.size, "chunk_size": self.chunk_size,
                           "chunks": [asdict(c) for c in self.chunks]},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LayerManifest:
        try:
            raw = json.loads(data)
            m = cls(layer=validate_digest(str(raw["layer"])), size=int(raw["size"]),
                    chunk_size=int(raw["chunk_size"]),
                    chunks=[ChunkRef(digest=validate_digest(str(c["digest"])),
                                     size=int(c["size"]), stored_size=int(c["stored_size"]),
                                     compression=str(c["compression"]))
                            for c in raw["chunks"]])
        except (ValueError, KeyError, TypeError, BadRequest) as exc:
            raise ChunkCorrupt(f"malformed layer manifest: {exc}") from exc
        m.check()
        return m

    def check(self) -> None:
        """ChunkCorrupt unless the chunks tile exactly [0, size) in chunk_size steps."""
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ChunkCorrupt(f"manifest of {self.layer}: bad chunk_size {self.chunk_size}")
        expected = -(-self.size // self.chunk_size)
        if len(self.chunks) != expected:
            raise ChunkCorrupt(f"manifest of {self.layer}: {len(self.chunks)} chunks for "
                               f"{self.size} bytes (expected {expected})")
        for i, c in enumerate(self.chunks):
            want = min(self.chunk_size, self.size - i * self.chunk_size)
            if c.size != want or c.compression not in COMPRESSIONS or c.stored_size < 0:
                raise ChunkCorrupt(f"manifest of {self.layer}: bad chunk {i}: {c}")

    def chunk_range(self, offset: int, length: int) -> range:
        """Indices of the chunks holding bytes [offset, offset+length) (clamped to the file)."""
        end = min(self.size, offset + length)
        if length <= 0 or offset >= end:
            return range(0)
        return range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1)


@dataclass
class StoreStats:
    """Traffic of one ChunkStore object (all layers)."""

    requests: int = 0
    bytes_read: int = 0  # stored bytes fetched
    bytes_written: int = 0  # stored bytes uploaded
    chunks_read: int = 0
    chunks_written: int = 0


@runtime_checkable
class ChunkStore(Protocol):
    url: str
    compression: str  # default compression for pushes into this store
    stats: StoreStats

    async def get_chunk(self, ref: ChunkRef) -> bytes: ...
    async def put_chunk(self, ref: ChunkRef, stored: bytes) -> None: ...
    async def has_chunk(self, digest: str, compression: str = "none") -> bool: ...
    async def get_manifest(self, layer: str) -> LayerManifest: ...
    async def put_manifest(self, m: LayerManifest) -> None: ...
    async def has_manifest(self, layer: str) -> bool: ...
    async def get_ref(self, name: str) -> Image: ...
    async def put_ref(self, image: Image) -> None: ...
    async def close(self) -> None: ...


# ---- chunk encoding ------------------------------------------------------------------------

def _sha256(data: bytes) -> str:
    return "sha256-" + hashlib.sha256(data).hexdigest()


def encode_chunk(raw: bytes, compression: str) -> tuple[ChunkRef, bytes]:
    """(ref, stored bytes). zstd falls back to "none" for a chunk it does not shrink."""
    if compression not in COMPRESSIONS:
        raise BadRequest(f"unknown compression {compression!r} (expected one of {COMPRESSIONS})")
    digest = _sha256(raw)
    if compression == "zstd":
        import zstandard

        packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw)
        if len(packed) < len(raw):
            return ChunkRef(digest, len(raw), len(packed), "zstd"), packed
    return ChunkRef(digest, len(raw), len(raw), "none"), raw


def decode_chunk(ref: ChunkRef, stored: bytes, where: str = "") -> bytes:
    """The chunk's uncompressed bytes, verified against ``ref``; ChunkCorrupt otherwise."""
    if ref.compression == "zstd":
        import zstandard

        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=ref.size)
        except zstandard.ZstdError as exc:
            raise ChunkCorrupt(f"chunk {ref.digest} does not decompress{where}: {exc}",
                               digest=ref.digest) from exc
    elif ref.compression == "none":
        raw = stored
    else:
        raise ChunkCorrupt(f"chunk {ref.digest}: unknown compression {ref.compression!r}",
                           digest=ref.digest)
    if len(raw) != ref.size or _sha256(raw) != ref.digest:
        raise ChunkCorrupt(f"chunk {ref.digest} fails verification{where} "
                           f"({len(raw)} bytes, expected {ref.size})", digest=ref.digest)
    return raw


def chunk_key(digest: str, compression: str) -> str:
    hexpart = validate_digest(digest)[len("sha256-"):]
    return f"chunks/{hexpart[:2]}/{hexpart}" + (".zst" if compression == "zstd" else "")


def manifest_key(layer: str) -> str:
    return f"manifests/{validate_digest(layer)}.json"


def trace_key(layer: str) -> str:
    return f"traces/{validate_digest(layer)}.json"


# A chunk-read trace (prefetch list) longer than this is cut: it is a hint, not data.
MAX_TRACE = 1 << 16


def _parse_trace(data: bytes) -> list[int] | None:
    try:
        raw = json.loads(data)
    except ValueError:
        return None
    if not isinstance(raw, list):
        return None
    return [i for i in raw[:MAX_TRACE] if isinstance(i, int) and i >= 0]


def ref_key(name: str) -> str:
    return "refs/" + urllib.parse.quote(validate_name(name), safe="") + ".json"


def chunk_layer(path: Path, chunk_size: int = DEFAULT_CHUNK_SIZE,
                compression: str = "none") -> Iterator[tuple[ChunkRef, bytes]]:
    """Cut a layer file into chunks: (ref, stored bytes) in file order."""
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise BadRequest(f"chunk size {chunk_size} outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
    with open(path, "rb") as f:
        while raw := f.read(chunk_size):
            yield encode_chunk(raw, compression)


# ---- back-ends -----------------------------------------------------------------------------

class _ObjectStore:
    """ChunkStore on top of four blob primitives (get/put/has/delete of a key)."""

    # get_chunk returns only bytes that decode_chunk verified against the ref's SHA-256:
    # callers (the lazy daemon) need not hash them again.
    verifies_chunks = True
    url: str
    compression: str
    latency_s: float

    def __init__(self, url: str, compression: str, latency_ms: float) -> None:
        if compression not in COMPRESSIONS:
            raise BadRequest(f"unknown compression {compression!r}")
        self.url = url
        self.compression = compression
        self.latency_s = latency_ms / 1000.0
        self.stats = StoreStats()

    # primitives, run in a worker thread; _get raises KeyError for a missing key
    def _get(self, key: str) -> bytes: raise NotImplementedError
    def _put(self, key: str, data: bytes) -> None: raise NotImplementedError
    def _has(self, key: str) -> bool: raise NotImplementedError

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.stats.requests += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)  # injected round trip (benchmarks)
        return await self._run(fn, *args)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def get_chunk(self, ref: ChunkRef) -> bytes:
        key = chunk_key(ref.digest, ref.compression)
        where = f" (from {self.url})"

        def get_verified() -> tuple[int, bytes]:
            # Decompress + hash in the worker thread too: ~0.6 ms per MiB of SHA-256 on the
            # event loop would serialise every concurrent fetch behind it.
            stored = self._get(key)
            return len(stored), decode_chunk(ref, stored, where)

        try:
            stored_size, raw = await self._call(get_verified)
        except KeyError:
            raise ChunkMissing(f"chunk {ref.digest} is missing from {self.url}",
                               digest=ref.digest, store=self.url) from None
        self.stats.bytes_read += stored_size
        self.stats.chunks_read += 1
        return raw

    async def put_chunk(self, ref: ChunkRef, stored: bytes) -> None:
        if len(stored) != ref.stored_size:
            raise BadRequest(f"chunk {ref.digest}: {len(stored)} bytes, ref says "
                             f"{ref.stored_size}")
        await self._call(self._put, chunk_key(ref.digest, ref.compression), stored)
        self.stats.bytes_written += len(stored)
        self.stats.chunks_written += 1

    async def has_chunk(self, digest: str, compression: str = "none") -> bool:
        return bool(await self._call(self._has, chunk_key(digest, compression)))

    async def get_manifest(self, layer: str) -> LayerManifest:
        try:
            data = await self._call(self._get, manifest_key(layer))
        except KeyError:
            raise NotFound(f"layer {layer} has no manifest in {self.url} (not pushed?)",
                           layer=layer, store=self.url) from None
        m = LayerManifest.from_json(data)
        if m.layer != layer:
            raise ChunkCorrupt(f"manifest for {layer} in {self.url} names {m.layer}")
        return m

    async def put_manifest(self, m: LayerManifest) -> None:
        m.check()
        await self._call(self._put, manifest_key(m.layer), m.to_json())

    async def has_manifest(self, layer: str) -> bool:
        return bool(await self._call(self._has, manifest_key(layer)))

    # Chunk-read traces (optional, not in the ChunkStore protocol): the order in which a
    # layer's first use on some node read its chunks, which a cold node replays as prefetch.
    # Only a hint: indices, never bytes (every prefetched chunk is verified like any other).
    async def get_trace(self, layer: str) -> list[int] | None:
        try:
            return _parse_trace(await self._call(self._get, trace_key(layer)))
        except KeyError:
            return None

    async def put_trace(self, layer: str, trace: list[int]) -> None:
        await self._call(self._put, trace_key(layer), json.dumps(trace[:MAX_TRACE]).encode())

    async def get_ref(self, name: str) -> Image:
        try:
            data = await self._call(self._get, ref_key(name))
        except KeyError:
            raise NotFound(f"image {name!r} is not in {self.url}", image=name,
                           store=self.url) from None
        try:
            return Image.from_dict(json.loads(data))
        except (ValueError, KeyError, TypeError) as exc:
            raise ChunkCorrupt(f"malformed image ref {name!r} in {self.url}: {exc}") from exc

    async def put_ref(self, image: Image) -> None:
        await self._call(self._put, ref_key(image.name), json.dumps(image.to_dict()).encode())

    async def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


class FileChunkStore(_ObjectStore):
    """A directory tree: local (``dir://``) or a shared POSIX filesystem (``posix://``).

    Writes go to a temp name unique per host and process, then ``rename`` (atomic on POSIX and
    on NFS within one directory); no locks, no reliance on O_EXCL or mtime across clients. On a
    shared filesystem the file and its directory are fsynced before the rename returns, so other
    nodes that see the name see the whole content."""

    def __init__(self, url: str, root: Path, *, shared: bool, compression: str = "none",
                 latency_ms: float = 0.0) -> None:
        super().__init__(url, compression, latency_ms)
        self.root = root
        self.shared = shared
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnreachable(f"chunk store {url}: {exc}", store=url) from exc
        self._tag = f"{socket.gethostname()}.{os.getpid()}"

    def _path(self, key: str) -> Path:
        return self.root / key

    def _get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            if not self.root.is_dir():
                raise StoreUnreachable(f"chunk store {self.url}: {self.root} is gone",
                                       store=self.url) from None
            raise KeyError(key) from None
        except OSError as exc:
            raise StoreUnreachable(f"chunk store {self.url}: {exc}", store=self.url) from exc

    def _has(self, key: str) -> bool:
        try:
            return self._path(key).is_file()
        except OSError as exc:
            raise StoreUnreachable(f"chunk store {self.url}: {exc}", store=self.url) from exc

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.parent / f".{path.name}.{self._tag}.{os.urandom(4).hex()}.tmp"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                if self.shared:
                    f.flush()
                    os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.rename(tmp, path)
            if self.shared:
                dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreUnreachable(f"chunk store {self.url}: write {key}: {exc}",
                                   store=self.url) from exc


class S3ChunkStore(_ObjectStore):
    """An S3-compatible bucket (boto3, blocking calls in a private thread pool)."""

    def __init__(self, url: str, bucket: str, prefix: str, *, endpoint: str | None,
                 region: str | None, compression: str = "none", latency_ms: float = 0.0,
                 threads: int = 32, connect_timeout: float = 3.0,
                 read_timeout: float = 30.0, attempts: int = 3) -> None:
        super().__init__(url, compression, latency_ms)
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="s3chunk")
        # boto3 clients are thread-safe; one per store with a connection per worker thread.
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=region or "us-east-1",
            config=Config(max_pool_connections=threads, connect_timeout=connect_timeout,
                          read_timeout=read_timeout,
                          retries={"max_attempts": attempts, "mode": "standard"},
                          # Every chunk is SHA-256-verified against its manifest: botocore's
                          # own CRC32 over each 1 MiB body (default since 1.36) only costs CPU.
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _translate(self, exc: Exception, key: str) -> Exception:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                if code == "NoSuchBucket":
                    return StoreUnreachable(f"chunk store {self.url}: no bucket {self.bucket}",
                                            store=self.url)
                return KeyError(key)
            return StoreUnreachable(f"chunk store {self.url}: {code or status}: {exc}",
                                    store=self.url)
        if isinstance(exc, BotoCoreError | OSError):
            return StoreUnreachable(f"chunk store {self.url} unreachable: {exc}", store=self.url)
        return exc

    def _get(self, key: str) -> bytes:
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return bytes(resp["Body"].read())
        except Exception as exc:
            raise self._translate(exc, key) from exc

    def _has(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as exc:
            err = self._translate(exc, key)
            if isinstance(err, KeyError):
                return False
            raise err from exc

    def _put(self, key: str, data: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as exc:
            err = self._translate(exc, key)
            if isinstance(err, KeyError):  # NoSuchBucket reported as 404 by some servers
                err = StoreUnreachable(f"chunk store {self.url}: cannot write {key}",
                                       store=self.url)
            raise err from exc

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


def default_store_url(settings: Settings | None = None) -> str:
    """``$ROLLBOX_CHUNK_STORE`` or the embedded default ``dir://<data_dir>/chunks``."""
    env = os.environ.get("ROLLBOX_CHUNK_STORE")
    if env:
        return env
    return f"dir://{(settings or Settings()).data_dir / 'chunks'}"


def open_store(url: str | None = None) -> ChunkStore:
    """Open a chunk store by URL (see the module docstring); None = :func:`default_store_url`.

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
            return FileChunkStore(url, Path(parsed.path), shared=parsed.scheme == "posix",
                                  compression=compression, latency_ms=latency_ms)
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


def _install_layer(store: ImageStore, tmp: Path, layer: str, source: str) -> None:
    """Rename a verified layer file into the store (layout of store.py) with its metadata."""
    final = store.layers_dir / f"{layer}.erofs"
    meta = store.layers_dir / f"{layer}.json"
    os.chmod(tmp, 0o644)
    if final.exists():
        os.utime(final)
        tmp.unlink(missing_ok=True)
    else:
        os.rename(tmp, final)
    if not meta.exists():
        data = json.dumps({"digest": layer, "size": final.stat().st_size, "created": time.time(),
                           "source": source}, indent=1).encode()
        mtmp = store.tmp_dir / f"meta-{os.getpid()}-{os.urandom(4).hex()}.json"
        mtmp.write_bytes(data)
        os.chmod(mtmp, 0o644)
        os.rename(mtmp, meta)


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
        await asyncio.to_thread(_install_layer, store, tmp, layer, f"pull:{src.url}")
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
    "S3ChunkStore",
    "StoreStats",
    "TransferStats",
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
