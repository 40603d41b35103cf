"""What every chunk store holds and how: chunks, layer manifests, image refs, traces.

A layer file (``<digest>.erofs``) is cut into fixed-size chunks; each chunk is stored once under
the SHA-256 of its *uncompressed* bytes, optionally zstd-compressed. A :class:`LayerManifest`
lists a layer's chunks in file order, so any byte range of the layer maps to chunk indices
(``offset // chunk_size``). Key layout, the same for every back-end (relative to the store's
root/prefix)::

    chunks/<hex[:2]>/<hex>        chunk, stored uncompressed
    chunks/<hex[:2]>/<hex>.zst    chunk, zstd frame (content size in the header)
    manifests/<layer>.json        LayerManifest
    refs/<quoted name>.json       named image: {"name", "layers", "config", "created"}
    traces/<layer>.json           chunk-read trace (prefetch hint)

:class:`ObjectStore` is the :class:`ChunkStore` every back-end is, on top of three blob
primitives (``local``, ``posix``, ``s3``). Every chunk read is verified against its digest; a
failure is a typed, retryable :class:`~rollbox.errors.InfraError`.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rollbox.errors import BadRequest, ChunkCorrupt, ChunkMissing, NotFound
from rollbox.images.names import validate_digest, validate_name
from rollbox.images.store import Image

# Chosen from `rollbox bench images` (see docs/images.md, "Chunk size").
DEFAULT_CHUNK_SIZE = 1 << 20
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 64 << 20
COMPRESSIONS = ("none", "zstd")
ZSTD_LEVEL = 3


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



# ---- the back-ends' common part ------------------------------------------------------------

class ObjectStore:
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

