"""The per-node lazy-loading FUSE daemon: ``python -m rollbox.images.lazy.daemon``.

Serves ``<mountpoint>/<digest>.erofs`` for every layer with a lazy record (see
:mod:`rollbox.images.lazy.paths`). A read maps to chunk indices; a chunk missing from the sparse
node cache is fetched from the layer's chunk store (one in-flight fetch per chunk, shared by every
reader), verified against its digest, written to the cache, then marked present in the bitmap —
so bytes are served only from verified, complete chunks. A miss also prefetches the next
``readahead`` chunks; the first cold use of a layer records the order of chunk reads (the trace),
later first uses replay it as prefetch. Traces are shared through the chunk store too: a node
without one replays the store's, and puts its own there when the store has none. A chunk that cannot be had (missing, corrupt, store down,
cache full) fails the read with EIO and leaves its typed reason in the layer's stats file for the
loader to raise.

Each chunk fetched is timed, from the fetch's start (its wait for a fetch slot included) to its
bytes verified in the cache, into the layer's fetch latency histogram (``demand``: a read asked
for it; ``prefetch``: read-ahead or a replayed trace), kept in the stats file with the counters.

Reads are attributed to the reader's v2 cgroup (FUSE request pid -> /proc/<pid>/cgroup), which
names the sandbox for sandbox processes; reads by the daemon's own prefetch count as "prefetch".

After an unclean exit (kill -9) the bitmap is trusted only after each present chunk is re-hashed
on its first read, so a torn write can never be served.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import concurrent.futures
import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mfusepy

from rollbox.errors import ChunkCorrupt, InfraError, NodeCacheFull, RollboxError
from rollbox.images.lazy.paths import FETCH_BUCKETS, FETCH_KINDS, LazyPaths, write_json_atomic
from rollbox.images.names import is_digest
from rollbox.images.stores import ChunkStore, open_store
from rollbox.images.stores.base import LayerManifest
from rollbox.isolation import oom

log = logging.getLogger("rollbox.lazy")

FETCH_TIMEOUT_S = 60.0
FETCH_CONCURRENCY = 16
PREFETCH_CONCURRENCY = 8
TRACE_PUT_TIMEOUT_S = 10.0
FUSE_MAX_THREADS = 64
# Kernel readahead on the FUSE file (its bdi; the kernel's default is 128 KiB). Every FUSE read
# is a round trip through this process: 1 MiB windows cut a cached tree read from ~4,800 to
# ~1,600 requests (measured: cached reads 1.7x -> ~1.0x the local file, docs/images.md).
FUSE_READ_AHEAD_KB = 1024
CGROUP_TTL_S = 2.0
# Reads in a row that continue the previous one before read-ahead kicks in.
SEQUENTIAL_STREAK = 2
STATS_FLUSH_S = 0.25
COUNTERS = ("bytes_requested", "bytes_read_unique", "bytes_fetched", "bytes_fetched_stored",
            "bytes_written", "cache_hits", "cache_misses", "chunks_fetched", "chunks_prefetched",
            "chunks_verified", "fetch_errors", "reads")
# Granularity of ``bytes_read_unique`` (distinct bytes of the layer file read through FUSE).
READ_PAGE = 4096
READER_COUNTERS = ("bytes_requested", "bytes_fetched", "cache_hits", "cache_misses")


def _new_counters(names: tuple[str, ...] = COUNTERS) -> dict[str, int]:
    return dict.fromkeys(names, 0)


def _error_info(exc: BaseException, chunk: int) -> dict[str, Any]:
    if isinstance(exc, RollboxError):
        code, message = exc.code, exc.message
    elif isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        code, message = NodeCacheFull.code, f"node cache disk full: {exc}"
    elif isinstance(exc, concurrent.futures.TimeoutError):
        code, message = "store_unreachable", f"chunk fetch timed out after {FETCH_TIMEOUT_S}s"
    else:
        code, message = InfraError.code, f"{type(exc).__name__}: {exc}"
    return {"code": code, "message": message, "chunk": chunk, "time": time.time()}


class Layer:
    """One lazily served layer: its sparse cache file, present bitmap, in-flight fetches."""

    def __init__(self, daemon: Daemon, digest: str, manifest: LayerManifest, store_url: str,
                 trusted: bool) -> None:
        self.daemon = daemon
        self.digest = digest
        self.m = manifest
        self.store_url = store_url
        self.n = len(manifest.chunks)
        p = daemon.paths
        self.cache_fd = os.open(p.cache_file(digest), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(self.cache_fd).st_size != manifest.size:
            os.ftruncate(self.cache_fd, manifest.size)  # sparse: allocates nothing
        self.present_fd = os.open(p.present_file(digest), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                  0o600)
        raw = os.pread(self.present_fd, self.n, 0)
        self.present = bytearray(raw.ljust(self.n, b"\0")[: self.n])
        if len(raw) != self.n:
            os.pwrite(self.present_fd, bytes(self.present), 0)
        # After an unclean exit a present byte may precede its data on disk: re-hash first.
        self.trusted = trusted
        self.checked: set[int] = set()
        self.lock = threading.Lock()
        self.inflight: dict[int, concurrent.futures.Future[None]] = {}
        self.opens = 0
        self.last_chunk = -2
        self.streak = 0
        self.last_used = time.time()
        self.counters = _new_counters()
        # Pages of the layer file read through FUSE by this daemon (bytes_read_unique).
        self.read_pages = bytearray(-(-manifest.size // READ_PAGE))
        self.readers: dict[str, dict[str, int]] = {}
        self.last_error: dict[str, Any] | None = None
        # Chunk fetch latency histogram per kind: counts per bucket of FETCH_BUCKETS (+Inf
        # last, not cumulative) and the sum of seconds.
        self.fetch_counts = {k: [0] * (len(FETCH_BUCKETS) + 1) for k in FETCH_KINDS}
        self.fetch_sum = dict.fromkeys(FETCH_KINDS, 0.0)
        self.trace_path = p.trace_file(digest)
        self.recording = not self.trace_path.exists()
        self.trace: list[int] = []
        self.traced: set[int] = set()
        # Set once the store is known to hold no trace of this layer: ours is then put there
        # when saved, for cold nodes to replay (Daemon.replay_store_trace).
        self.share_trace = False
        self.shared_len = 0
        self.dirty = True
        self._load_stats()

    def _load_stats(self) -> None:
        try:
            old = json.loads(self.daemon.paths.stats_file(self.digest).read_text())
        except (FileNotFoundError, ValueError):
            return
        for k in COUNTERS:
            self.counters[k] = int(old.get(k, 0))
        # The page map is not persisted: a new daemon counts distinct reads afresh.
        self.counters["bytes_read_unique"] = 0
        for who, c in (old.get("readers") or {}).items():
            self.readers[who] = {k: int(c.get(k, 0)) for k in READER_COUNTERS}
        self.last_error = old.get("last_error")
        hist = old.get("fetch_seconds") or {}
        if hist.get("le") == list(FETCH_BUCKETS):  # other bounds (an older daemon): afresh
            for k in FETCH_KINDS:
                h = hist.get(k) or {}
                counts = h.get("counts")
                if isinstance(counts, list) and len(counts) == len(FETCH_BUCKETS) + 1:
                    self.fetch_counts[k] = [int(c) for c in counts]
                    self.fetch_sum[k] = float(h.get("sum", 0.0))

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            present = sum(self.present)
            return {"layer": self.digest, "store": self.store_url, "size": self.m.size,
                    "chunk_size": self.m.chunk_size, "chunks": self.n,
                    "chunks_present": present, "open": self.opens, "last_used": self.last_used,
                    **self.counters, "readers": {k: dict(v) for k, v in self.readers.items()},
                    "last_error": self.last_error, "trace_recorded": self.trace_path.exists(),
                    "fetch_seconds": {"le": list(FETCH_BUCKETS), **{
                        k: {"counts": list(self.fetch_counts[k]), "sum": self.fetch_sum[k]}
                        for k in FETCH_KINDS}},
                    "updated": time.time()}

    def _reader(self, who: str) -> dict[str, int]:
        c = self.readers.get(who)
        if c is None:
            c = self.readers[who] = _new_counters(READER_COUNTERS)
        return c

    def _mark_read(self, offset: int, end: int) -> None:
        """Count the bytes of [offset, end) in pages not read before (self.lock held)."""
        first, stop = offset // READ_PAGE, (end - 1) // READ_PAGE + 1
        pages = self.read_pages
        new = stop - first - pages.count(1, first, stop)
        if not new:
            return
        nbytes = new * READ_PAGE
        if stop == len(pages) and not pages[-1]:  # the last page is short
            nbytes -= len(pages) * READ_PAGE - self.m.size
        pages[first:stop] = b"\1" * (stop - first)
        self.counters["bytes_read_unique"] += nbytes

    # -- chunk state, called with self.lock held --
    def _usable(self, i: int) -> bool:
        if not self.present[i]:
            return False
        if self.trusted or i in self.checked:
            return True
        ref = self.m.chunks[i]
        data = os.pread(self.cache_fd, ref.size, i * self.m.chunk_size)
        if len(data) == ref.size and "sha256-" + hashlib.sha256(data).hexdigest() == ref.digest:
            self.checked.add(i)
            self.counters["chunks_verified"] += 1
            return True
        self.present[i] = 0
        os.pwrite(self.present_fd, b"\0", i)
        return False

    def _start(self, i: int, prefetch: bool) -> concurrent.futures.Future[None]:
        fut = self.inflight.get(i)
        if fut is None:
            fut = asyncio.run_coroutine_threadsafe(self._fetch(i, prefetch), self.daemon.loop)
            self.inflight[i] = fut

            def done(_f: concurrent.futures.Future[None], i: int = i) -> None:
                with self.lock:
                    self.inflight.pop(i, None)

            fut.add_done_callback(done)
        return fut

    def prefetch(self, indices: list[int]) -> None:
        with self.lock:
            for i in indices:
                if 0 <= i < self.n and not self.present[i] and i not in self.inflight:
                    self._start(i, prefetch=True)

    # -- the read path (FUSE worker threads) --
    def read(self, size: int, offset: int, who: str) -> bytes:
        end = min(offset + size, self.m.size)
        if offset >= end:
            return b""
        waits: list[tuple[int, concurrent.futures.Future[None]]] = []
        with self.lock:
            self.last_used = time.time()
            self.dirty = True
            r = self._reader(who)
            self.counters["reads"] += 1
            self.counters["bytes_requested"] += end - offset
            r["bytes_requested"] += end - offset
            self._mark_read(offset, end)
            chunks = self.m.chunk_range(offset, end - offset)
            for i in chunks:
                if self.recording and i not in self.traced:
                    self.traced.add(i)
                    self.trace.append(i)
                if self._usable(i):
                    self.counters["cache_hits"] += 1
                    r["cache_hits"] += 1
                    continue
                self.counters["cache_misses"] += 1
                r["cache_misses"] += 1
                fut = self._start(i, prefetch=False)
                waits.append((i, fut))
            # Read-ahead only for sequential reads (this read starts where the last one ended):
            # small scattered reads (imports) would otherwise fetch mostly unused neighbours.
            if chunks.start in (self.last_chunk, self.last_chunk + 1):
                self.streak += 1
            else:
                self.streak = 0
            self.last_chunk = chunks.stop - 1
            if waits and self.streak >= SEQUENTIAL_STREAK:
                ra = self.daemon.readahead
                for j in range(chunks.stop, min(self.n, chunks.stop + ra)):
                    if not self.present[j] and j not in self.inflight:
                        self._start(j, prefetch=True)
        for i, fut in waits:
            try:
                fut.result(timeout=FETCH_TIMEOUT_S)
            except BaseException as exc:  # noqa: BLE001 - every failure is EIO to the reader
                info = _error_info(exc, i)
                with self.lock:
                    self.last_error = info
                    self.counters["fetch_errors"] += 1
                    self.dirty = True
                # Written now, so the loader can raise the typed error of this EIO.
                with contextlib.suppress(OSError):
                    self.daemon._write_stats(self)
                log.warning("layer %s chunk %d: %s", self.digest[:19], i, info["message"])
                raise mfusepy.FuseOSError(errno.EIO) from None
            with self.lock:
                r["bytes_fetched"] += self.m.chunks[i].size
        data = os.pread(self.cache_fd, end - offset, offset)
        if len(data) != end - offset:
            raise mfusepy.FuseOSError(errno.EIO)
        return data

    async def _fetch(self, i: int, prefetch: bool) -> None:
        ref = self.m.chunks[i]
        # Prefetches take at most PREFETCH_CONCURRENCY of the fetch slots: a demand read never
        # queues behind a whole replayed trace.
        t0 = time.monotonic()
        async with self.daemon.prefetch_sem if prefetch else contextlib.nullcontext():
            await self._fetch_now(i, prefetch, ref, t0)

    async def _fetch_now(self, i: int, prefetch: bool, ref: Any, t0: float) -> None:
        async with self.daemon.fetch_sem:
            with self.lock:
                if self.present[i]:
                    return
            store = self.daemon.store_for(self.store_url)
            raw = await store.get_chunk(ref)
            # Our stores verify every chunk (in their worker thread); any other ChunkStore's
            # bytes are hashed here, off the event loop, before they reach the cache.
            verify = not getattr(store, "verifies_chunks", False)
            await asyncio.to_thread(self._store_chunk, i, raw, verify)
        took = time.monotonic() - t0
        kind = "prefetch" if prefetch else "demand"
        with self.lock:
            self.fetch_counts[kind][bisect.bisect_left(FETCH_BUCKETS, took)] += 1
            self.fetch_sum[kind] += took
            self.counters["chunks_fetched"] += 1
            self.counters["bytes_fetched"] += ref.size
            self.counters["bytes_fetched_stored"] += ref.stored_size
            self.counters["bytes_written"] += ref.size
            if prefetch:
                self.counters["chunks_prefetched"] += 1
            self.dirty = True

    def _store_chunk(self, i: int, raw: bytes, verify: bool = True) -> None:
        ref = self.m.chunks[i]
        if len(raw) != ref.size or (
                verify and "sha256-" + hashlib.sha256(raw).hexdigest() != ref.digest):
            raise ChunkCorrupt(f"chunk {i} of {self.digest} fails verification",
                               digest=ref.digest)
        self.daemon.make_room(len(raw), keep=self.digest)
        off = i * self.m.chunk_size
        n = os.pwrite(self.cache_fd, raw, off)
        if n != len(raw):
            raise OSError(errno.ENOSPC, "short write to the node cache")
        with self.lock:
            # Data first, then the present byte: a reader never sees a chunk before its bytes.
            self.present[i] = 1
            self.checked.add(i)
            os.pwrite(self.present_fd, b"\1", i)
        self.daemon.add_usage(len(raw))

    def save_trace(self) -> None:
        with self.lock:
            if not self.recording or not self.trace:
                return
            trace = list(self.trace)
            # Put again whenever it grew: the first save is often a mere probe's open/release.
            share = self.share_trace and len(trace) > self.shared_len
            if share:
                self.shared_len = len(trace)
        write_json_atomic(self.trace_path, trace)
        if share:
            self.daemon.share_trace(self, trace)

    def close(self) -> None:
        os.close(self.cache_fd)
        os.close(self.present_fd)


class Daemon(mfusepy.Operations):
    use_ns = True

    def __init__(self, paths: LazyPaths, generation: int, mountpoint: Path, *,
                 cache_limit: int, readahead: int, max_readahead: int | None = None,
                 read_ahead_kb: int | None = FUSE_READ_AHEAD_KB,
                 store_traces: bool = True) -> None:
        self.paths = paths
        self.read_ahead_kb = read_ahead_kb
        self.max_readahead = max_readahead
        self.generation = generation
        self.mountpoint = mountpoint
        self.cache_limit = cache_limit
        self.readahead = readahead
        self.trusted = (paths.cache / ".clean").exists()
        (paths.cache / ".clean").unlink(missing_ok=True)
        self.layers: dict[str, Layer] = {}
        self.handles: dict[int, Layer] = {}
        self._next_fh = 1
        self.guard = threading.Lock()
        self.usage_lock = threading.Lock()
        self.usage = self._scan_usage()
        self.stores: dict[str, ChunkStore] = {}
        self.stores_lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.fetch_sem = asyncio.Semaphore(FETCH_CONCURRENCY)
        self.prefetch_sem = asyncio.Semaphore(PREFETCH_CONCURRENCY)
        # Share chunk-read traces through the store (replay another node's, put ours if the
        # store has none); off (the node's lazy_store_traces): node-local traces only.
        self.store_traces = store_traces
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="fetch",
                                             daemon=True)
        self._loop_thread.start()
        self._cgroups: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="stats", daemon=True)
        self.started = time.time()

    # -- bookkeeping --
    def _scan_usage(self) -> int:
        total = 0
        for p in self.paths.cache.glob("sha256-*.erofs"):
            try:
                total += p.stat().st_blocks * 512
            except FileNotFoundError:
                pass
        return total

    def add_usage(self, n: int) -> None:
        with self.usage_lock:
            self.usage += n

    def make_room(self, n: int, keep: str) -> None:
        """Evict cached layers no mount uses (least recently used first) until ``n`` bytes fit
        under the cache limit; NodeCacheFull if they cannot."""
        with self.usage_lock:
            if self.usage + n <= self.cache_limit:
                return
        candidates = []
        for p in self.paths.cache.glob("sha256-*.erofs"):
            digest = p.name[: -len(".erofs")]
            if digest == keep or not is_digest(digest):
                continue
            layer = self.layers.get(digest)
            if layer is not None and (layer.opens or layer.inflight):
                continue
            try:
                used = layer.last_used if layer else self.paths.present_file(digest).stat().st_mtime
            except FileNotFoundError:
                used = 0.0
            candidates.append((used, digest))
        for _used, digest in sorted(candidates):
            with self.guard:
                layer = self.layers.get(digest)
                if layer is not None and (layer.opens or layer.inflight):
                    continue
                if layer is not None:
                    layer.save_trace()
                    self._write_stats(layer)
                    del self.layers[digest]
                    layer.close()
                try:
                    freed = self.paths.cache_file(digest).stat().st_blocks * 512
                except FileNotFoundError:
                    freed = 0
                self.paths.cache_file(digest).unlink(missing_ok=True)
                self.paths.present_file(digest).unlink(missing_ok=True)
            log.info("evicted %s (%d bytes)", digest[:19], freed)
            with self.usage_lock:
                self.usage = max(0, self.usage - freed)
                if self.usage + n <= self.cache_limit:
                    return
        raise NodeCacheFull(f"node cache limit {self.cache_limit} bytes reached and no unused "
                            "layer to evict", limit=self.cache_limit)

    def store_for(self, url: str) -> ChunkStore:
        store = self.stores.get(url)
        if store is None:
            with self.stores_lock:
                store = self.stores.get(url)
                if store is None:
                    store = self.stores[url] = open_store(url)
        return store

    def _open_stores(self) -> None:
        """Open the store of every lazy layer now, not on the first cold read: an S3 store's
        first open imports boto3 and builds its client (~0.3 s of CPU), which every sandbox's
        first read would otherwise wait for."""
        urls = set()
        for rec in self.paths.layers.glob("sha256-*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                urls.add(str(json.loads(rec.read_text())["store"]))
        for url in sorted(urls):
            try:
                self.store_for(url)
            except Exception as exc:  # noqa: BLE001 - the first read reports it, typed
                log.warning("store %s not opened: %s", url, exc)

    def reader_of(self, pid: int) -> str:
        """The reader's v2 cgroup path (names the sandbox), cached briefly per pid."""
        if pid == os.getpid() or pid <= 0:
            return "prefetch"
        now = time.monotonic()
        hit = self._cgroups.get(pid)
        if hit is not None and now - hit[1] < CGROUP_TTL_S:
            return hit[0]
        who = "host"
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                for line in f:
                    if line.startswith("0::"):
                        who = line[3:].strip() or "/"
                        break
        except OSError:
            pass
        if len(self._cgroups) > 4096:
            self._cgroups.clear()
        self._cgroups[pid] = (who, now)
        return who

    def layer(self, digest: str) -> Layer | None:
        with self.guard:
            layer = self.layers.get(digest)
            if layer is not None:
                return layer
            if not is_digest(digest):
                return None
            try:
                record = json.loads(self.paths.record(digest).read_text())
                manifest = LayerManifest.from_json(self.paths.manifest(digest).read_bytes())
            except (FileNotFoundError, ValueError, RollboxError):
                return None
            layer = Layer(self, digest, manifest, str(record["store"]), self.trusted)
            self.layers[digest] = layer
        # First use in this daemon: replay the recorded trace as prefetch; on a node without
        # one, the trace another node left in the store (a cold node cache, not a blind one).
        if not layer.recording:
            try:
                trace = [int(i) for i in json.loads(layer.trace_path.read_text())]
            except (OSError, ValueError, TypeError):
                trace = []
            if trace:
                layer.prefetch(trace)
        elif self.store_traces:
            asyncio.run_coroutine_threadsafe(self.replay_store_trace(layer), self.loop)
        return layer

    async def replay_store_trace(self, layer: Layer) -> None:
        try:
            store = await asyncio.to_thread(self.store_for, layer.store_url)
            get = getattr(store, "get_trace", None)
            if get is None:
                return
            trace = await get(layer.digest)
        except Exception as exc:  # noqa: BLE001 - a hint only: reads fetch on demand anyway
            log.info("no store trace for %s: %s", layer.digest[:19], exc)
            return
        if trace:
            log.info("replaying the store's trace of %s: %d chunks", layer.digest[:19],
                     len(trace))
            layer.prefetch(trace)
        else:
            with layer.lock:
                layer.share_trace = True

    def share_trace(self, layer: Layer, trace: list[int]) -> None:
        """Put ``trace`` into the layer's store (blocking, bounded; failures only logged)."""
        async def put() -> None:
            store = self.store_for(layer.store_url)
            put_trace = getattr(store, "put_trace", None)
            if put_trace is not None:
                await put_trace(layer.digest, trace)

        try:
            asyncio.run_coroutine_threadsafe(put(), self.loop).result(TRACE_PUT_TIMEOUT_S)
            log.info("trace of %s (%d chunks) put in its store", layer.digest[:19], len(trace))
        except Exception as exc:  # noqa: BLE001 - a hint only
            log.warning("trace of %s not put in its store: %s", layer.digest[:19], exc)

    def _write_stats(self, layer: Layer) -> None:
        snap = layer.snapshot()
        write_json_atomic(self.paths.stats_file(layer.digest), snap)
        layer.dirty = False

    def _flush_loop(self) -> None:
        while not self._stop.wait(STATS_FLUSH_S):
            self.flush_stats()

    def flush_stats(self) -> None:
        with self.guard:
            layers = list(self.layers.values())
        for layer in layers:
            if layer.dirty:
                try:
                    self._write_stats(layer)
                except OSError as exc:
                    log.warning("stats of %s: %s", layer.digest[:19], exc)

    # -- FUSE operations --
    def init_with_config(self, conn: Any, config: Any) -> None:
        if conn is not None and self.max_readahead is not None:
            # The kernel's readahead on the FUSE file adds to EROFS's own: cap it, so a read
            # fetches little more than what EROFS asked for.
            conn.max_readahead = self.max_readahead
        self._flusher.start()
        threading.Thread(target=self._open_stores, name="stores", daemon=True).start()
        if self.read_ahead_kb:
            threading.Thread(target=self._set_read_ahead, name="bdi", daemon=True).start()
        write_json_atomic(self.paths.daemon_json, {
            "pid": os.getpid(), "generation": self.generation,
            "mountpoint": str(self.mountpoint), "started": self.started,
            "cache_limit": self.cache_limit, "readahead": self.readahead,
            "trusted_cache": self.trusted})
        log.info("serving generation %d at %s", self.generation, self.mountpoint)

    def _set_read_ahead(self, timeout: float = 5.0) -> None:
        """Set the kernel readahead of this mount's bdi once the mount shows in mountinfo (not
        from init: the mount is not complete while FUSE_INIT is being answered)."""
        target = os.path.realpath(self.mountpoint)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set():
            with open("/proc/self/mountinfo") as f:
                dev = next((ln.split()[2] for ln in f
                            if ln.split()[4] == target and " - fuse.rollbox-lazy " in ln), None)
            if dev is not None:
                try:
                    Path(f"/sys/class/bdi/{dev}/read_ahead_kb").write_text(f"{self.read_ahead_kb}\n")
                    log.info("readahead of bdi %s: %d KiB", dev, self.read_ahead_kb)
                except OSError as exc:
                    log.warning("readahead of bdi %s not set: %s", dev, exc)
                return
            time.sleep(0.02)
        log.warning("mount %s not seen in mountinfo: kernel readahead left as is", target)

    def destroy(self, path: str) -> None:
        self._stop.set()
        with self.guard:
            layers = list(self.layers.values())
        for layer in layers:
            for fut in list(layer.inflight.values()):
                fut.cancel()
            layer.save_trace()
        self.flush_stats()
        for layer in layers:
            os.fsync(layer.cache_fd)
            os.fsync(layer.present_fd)
        self.stop_fetch_loop()
        (self.paths.cache / ".clean").touch()
        log.info("clean shutdown")

    def stop_fetch_loop(self, timeout: float = 5.0) -> None:
        """Stop the fetch loop's thread and close the loop (fetches still running are cut)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout)
        if not self._loop_thread.is_alive():
            self.loop.close()

    def _digest_of(self, path: str) -> str | None:
        name = path.lstrip("/")
        if "/" in name or not name.endswith(".erofs"):
            return None
        return name[: -len(".erofs")]

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        now = int(self.started * 1e9)
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2, "st_mtime": now,
                    "st_ctime": now, "st_atime": now}
        digest = self._digest_of(path)
        if digest is None or not self.paths.record(digest).exists():
            raise mfusepy.FuseOSError(errno.ENOENT)
        layer = self.layers.get(digest)
        if layer is not None:
            size = layer.m.size
        else:
            try:
                size = int(json.loads(self.paths.record(digest).read_text())["size"])
            except (OSError, ValueError, KeyError):
                raise mfusepy.FuseOSError(errno.ENOENT) from None
        return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": size,
                "st_mtime": now, "st_ctime": now, "st_atime": now}

    def readdir(self, path: str, fh: Any) -> list[str]:
        if path != "/":
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        names = [p.name[: -len(".json")] + ".erofs" for p in self.paths.layers.glob("sha256-*.json")]
        return [".", "..", *sorted(names)]

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise mfusepy.FuseOSError(errno.EROFS)
        digest = self._digest_of(path)
        layer = self.layer(digest) if digest else None
        if layer is None:
            raise mfusepy.FuseOSError(errno.ENOENT)
        with self.guard:
            fh = self._next_fh
            self._next_fh += 1
            self.handles[fh] = layer
            layer.opens += 1
        return fh

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        layer = self.handles.get(fh)
        if layer is None:
            raise mfusepy.FuseOSError(errno.EBADF)
        pid = mfusepy.fuse_get_context()[2]
        return layer.read(size, offset, self.reader_of(pid))

    def release(self, path: str, fh: int) -> int:
        with self.guard:
            layer = self.handles.pop(fh, None)
            if layer is not None:
                layer.opens -= 1
        if layer is not None:
            layer.save_trace()
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_namemax": 255}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="rollbox.images.lazy.daemon")
    ap.add_argument("--store-root", required=True, type=Path)
    ap.add_argument("--generation", required=True, type=int)
    ap.add_argument("--cache-limit", type=int, default=64 << 30)
    ap.add_argument("--readahead", type=int, default=4, help="chunks")
    ap.add_argument("--read-ahead-kb", type=int, default=FUSE_READ_AHEAD_KB,
                    help="kernel readahead on the FUSE files (their bdi), KiB; 0: the kernel's")
    ap.add_argument("--max-readahead", type=int, default=None,
                    help="kernel readahead on the FUSE file, bytes (default: the kernel's)")
    ap.add_argument("--no-store-traces", action="store_true",
                    help="keep chunk-read traces on this node only")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s lazy[%(process)d] %(levelname)s %(message)s")
    oom.protect()  # sandboxes' reads hang on it: never the OOM killer's choice
    paths = LazyPaths(args.store_root)
    paths.make_dirs()
    mountpoint = paths.mountpoint(args.generation)
    mountpoint.mkdir(mode=0o755, exist_ok=True)
    ops = Daemon(paths, args.generation, mountpoint, cache_limit=args.cache_limit,
                 readahead=args.readahead, max_readahead=args.max_readahead,
                 read_ahead_kb=args.read_ahead_kb or None,
                 store_traces=not args.no_store_traces)
    mfusepy.FUSE(ops, str(mountpoint), foreground=True, nothreads=False, allow_other=True,
                 fsname="rollbox-lazy", subtype="rollbox-lazy", kernel_cache=True,
                 attr_timeout=3600, entry_timeout=3600, default_permissions=True,
                 # A read waiting on a chunk fetch holds a FUSE worker thread: allow more than
                 # libfuse's default 10, so 16 sandboxes' cold reads wait in parallel.
                 max_threads=FUSE_MAX_THREADS)


if __name__ == "__main__":
    main()
