"""Supervisor of the per-node lazy-loading daemon, and the entry point for lazy layers.

:class:`LazyLoader` registers lazy layers (record + manifest), starts the FUSE daemon
(:mod:`.daemon`) as a separate process, restarts it when it died (on demand, and from a watch
task after :meth:`LazyLoader.start`), prefetches each layer's first chunk (EROFS superblock and
metadata) so an unusable store fails the sandbox start with a typed, retryable error rather than
a later read, and reads the daemon's per-layer counters.

One daemon per image store root (per node): its state is in ``lazy/daemon.json``; any process
(edge, CLI) adopts a live daemon and restarts a dead one under ``lazy/.lock``. A restarted daemon
serves a new generation path; an EROFS mount of the dead generation's file is replaced when no
sandbox uses it, and refused (InfraError, retryable) while one still does.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollbox.config import Settings
from rollbox.errors import (
    ChunkCorrupt,
    ChunkMissing,
    ChunkStoreError,
    InfraError,
    NodeCacheFull,
    NotFound,
    StoreUnreachable,
)
from rollbox.images import chunks
from rollbox.images.lazy.paths import LazyPaths, read_record, write_json_atomic
from rollbox.images.store import ImageStore, validate_digest
from rollbox.isolation import syscalls

log = logging.getLogger("rollbox.lazy")

DAEMON_MODULE = "rollbox.images.lazy.daemon"
FUSE_FSTYPE = "fuse.rollbox-lazy"
START_TIMEOUT_S = 15.0
ERRORS = {c.code: c for c in (ChunkCorrupt, ChunkMissing, StoreUnreachable, NodeCacheFull,
                              ChunkStoreError, InfraError)}
SANDBOX_COMPONENT = re.compile(r".+-[0-9a-f]{12}")


def _proc_alive(pid: int) -> bool:
    """Running (not a zombie) and really the lazy daemon (pids are reused)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X") and DAEMON_MODULE.encode() in cmdline


def _fuse_mounts_under(base: Path) -> list[str]:
    prefix = os.path.realpath(base) + "/"
    return [mnt for mnt, fstype, _src in syscalls.read_mountinfo()
            if fstype == FUSE_FSTYPE and mnt.startswith(prefix)]


def _run_coro(coro: Any) -> Any:
    """Run a coroutine from sync code, whether or not this thread has a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def sandbox_of(reader: str, cgroup_parent: str | None = None) -> str | None:
    """The sandbox id in a reader's cgroup path, if it is a sandbox's."""
    parts = [p for p in reader.split("/") if p]
    if cgroup_parent is not None:
        for a, b in itertools.pairwise(parts):
            if a == cgroup_parent:
                return b
        return None
    for p in parts:
        if SANDBOX_COMPONENT.fullmatch(p):
            return p
    return None


class LazyLoader:
    """Lazy layers of one image store (one per node), served by one supervised daemon."""

    _guard = threading.Lock()

    def __init__(self, store: ImageStore, settings: Settings | None = None, *,
                 cache_limit: int | None = None, readahead: int | None = None,
                 watch_interval: float = 1.0) -> None:
        """The daemon's cache and readahead: ``cache_limit``/``readahead`` if given (tests,
        benchmarks), else the node's lazy settings (default: this process's Settings)."""
        s = settings or Settings()
        self.store = store
        self.paths = LazyPaths(store.root)
        self.paths.make_dirs()
        self.cache_limit = cache_limit or s.lazy_cache_bytes
        self.readahead = s.lazy_readahead if readahead is None else readahead
        self.read_ahead_kb = s.lazy_read_ahead_kb
        self.max_readahead = s.lazy_max_readahead
        self.store_traces = s.lazy_store_traces
        self.watch_interval = watch_interval
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._watchers = 0  # edges of this process that started it (co-hosted edges share it)
        # The newest loader of a store is the one LayerMounts uses in this process.
        with _LOADERS_GUARD:
            _LOADERS[os.path.realpath(store.root)] = self

    # ---- layer records ---------------------------------------------------------------------

    def register(self, layer: str, store_url: str, manifest: Any = None) -> dict[str, Any]:
        """Record ``layer`` as lazily served from ``store_url`` (fetching its manifest if the
        node has none); idempotent."""
        validate_digest(layer)
        if manifest is None:
            manifest = chunks.load_manifest(self.store, layer)
        if manifest is None:
            cs = chunks.open_store(store_url)

            async def get() -> Any:
                try:
                    return await cs.get_manifest(layer)
                finally:
                    await cs.close()

            manifest = _run_coro(get())
        if manifest.layer != layer:
            raise ChunkCorrupt(f"manifest names {manifest.layer}, expected {layer}")
        chunks.save_manifest(self.store, manifest)
        record = read_record(self.store.root, layer)
        if record is None or record.get("store") != store_url:
            record = {"layer": layer, "store": store_url, "size": manifest.size,
                      "created": time.time()}
            write_json_atomic(self.paths.record(layer), record)
        return record

    def is_lazy(self, layer: str) -> bool:
        return self.store.is_lazy(layer)

    # ---- daemon ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            fd = os.open(self.paths.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def daemon_state(self) -> dict[str, Any] | None:
        return self.paths.daemon_state()

    def healthy(self, state: dict[str, Any] | None = None) -> bool:
        """The recorded daemon runs and its FUSE mount answers."""
        state = state if state is not None else self.daemon_state()
        if not state or not _proc_alive(int(state.get("pid", 0))):
            return False
        mnt = str(state.get("mountpoint", ""))
        if os.path.realpath(mnt) not in _fuse_mounts_under(self.paths.fs):
            return False
        try:
            os.stat(mnt)
        except OSError:
            return False  # ENOTCONN: the connection was aborted
        return True

    def generation(self) -> int:
        return int((self.daemon_state() or {}).get("generation", 0))

    def serves(self, generation: int) -> bool:
        """Daemon ``generation`` is the live one and answers (LayerMounts' check of a lazy
        layer mounted on its file)."""
        state = self.daemon_state()
        return (state is not None and state.get("generation") == generation
                and self.healthy(state))

    def ensure_daemon(self) -> dict[str, Any]:
        """The live daemon's state, starting (or restarting) it if needed."""
        state = self.daemon_state()
        if self.healthy(state):
            assert state is not None
            return state
        with self._locked():
            state = self.daemon_state()
            if self.healthy(state):
                assert state is not None
                return state
            if state is not None:
                self.restarts += 1
                log.warning("lazy daemon generation %s is dead: restarting",
                            state.get("generation"))
            self._reap()
            self._drop_dead_mounts()
            gen = int((state or {}).get("generation", 0)) + 1
            return self._spawn(gen)

    def _reap(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None

    def _drop_dead_mounts(self, keep: str | None = None) -> None:
        for mnt in _fuse_mounts_under(self.paths.fs):
            if mnt == keep:
                continue
            with contextlib.suppress(OSError):
                syscalls.umount(mnt, syscalls.MNT_DETACH)
        for d in self.paths.fs.glob("g*"):
            if str(d) != keep:
                with contextlib.suppress(OSError):
                    d.rmdir()

    def daemon_command(self, gen: int) -> list[str]:
        cmd = [sys.executable, "-m", DAEMON_MODULE, "--store-root", str(self.store.root),
               "--generation", str(gen), "--cache-limit", str(self.cache_limit),
               "--readahead", str(self.readahead)]
        if self.read_ahead_kb is not None:  # default: the daemon's (1 MiB)
            cmd += ["--read-ahead-kb", str(self.read_ahead_kb)]
        if self.max_readahead is not None:  # default: the kernel's
            cmd += ["--max-readahead", str(self.max_readahead)]
        if not self.store_traces:
            cmd.append("--no-store-traces")
        return cmd

    def _spawn(self, gen: int) -> dict[str, Any]:
        cmd = self.daemon_command(gen)
        logf = open(self.paths.root / "daemon.log", "ab")  # noqa: SIM115
        try:
            env = dict(os.environ)
            src = str(Path(__file__).resolve().parents[3])
            env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"]
                                       if env.get("PYTHONPATH") else "")
            # Own session: the daemon outlives the process that started it (sandboxes keep
            # their mounts across an edge restart).
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf,
                                          stderr=logf, start_new_session=True, env=env,
                                          close_fds=True)
        finally:
            logf.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            state = self.daemon_state()
            if state and int(state.get("generation", -1)) == gen and self.healthy(state):
                return state
            if self._proc.poll() is not None:
                break
            time.sleep(0.02)
        tail = ""
        with contextlib.suppress(OSError):
            tail = (self.paths.root / "daemon.log").read_text()[-800:]
        self._stop_proc()
        raise InfraError(f"lazy-loading daemon did not start: {tail.strip()[-400:]}",
                         reason="daemon_start")

    def _stop_proc(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    # ---- layers ------------------------------------------------------------------------------

    def ensure_layer_sync(self, layer: str, store_url: str | None = None) -> Path:
        """Path of the lazily served layer file, with its first chunk (EROFS superblock and
        metadata) fetched; typed retryable error if the chunk cannot be had."""
        validate_digest(layer)
        record = read_record(self.store.root, layer)
        if store_url is not None and (record is None or record.get("store") != store_url):
            record = self.register(layer, store_url)
        if record is None:
            raise NotFound(f"layer {layer} has no lazy record; pull it with "
                           "`rollbox image pull --lazy`", layer=layer)
        if not self.paths.manifest(layer).exists():
            self.register(layer, str(record["store"]))
        state = self.ensure_daemon()
        path = Path(state["mountpoint"]) / f"{layer}.erofs"
        t0 = time.time()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.pread(fd, 64 << 10, 0)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._layer_error(layer, exc, since=t0 - 1) from None
        return path

    async def ensure_layer(self, layer: str, store_url: str | None = None) -> Path:
        return await asyncio.to_thread(self.ensure_layer_sync, layer, store_url)

    def _layer_error(self, layer: str, exc: OSError, since: float) -> Exception:
        stats = self.layer_stats(layer) or {}
        err = stats.get("last_error") or {}
        if err and float(err.get("time", 0)) >= since:
            cls = ERRORS.get(str(err.get("code")), InfraError)
            return cls(f"lazy layer {layer[:19]}: {err.get('message')}", layer=layer,
                       chunk=err.get("chunk"))
        if exc.errno == errno.ENOENT:
            return InfraError(f"lazy layer {layer} is not served by the daemon", layer=layer)
        return InfraError(f"lazy layer {layer[:19]}: {exc}", layer=layer)

    def layer_stats(self, layer: str) -> dict[str, Any] | None:
        import json

        try:
            return json.loads(self.paths.stats_file(layer).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def stats(self, cgroup_parent: str | None = None) -> dict[str, Any]:
        """Per-layer counters from the daemon, per-sandbox sums (by the reader's cgroup), the
        daemon's state and the cache's use."""
        layers: dict[str, Any] = {}
        sandboxes: dict[str, dict[str, int]] = {}
        for p in sorted(self.paths.stats.glob("sha256-*.json")):
            digest = p.name[: -len(".json")]
            s = self.layer_stats(digest)
            if s is None:
                continue
            layers[digest] = s
            for reader, c in (s.get("readers") or {}).items():
                sid = sandbox_of(reader, cgroup_parent)
                if sid is None:
                    continue
                per = sandboxes.setdefault(sid, {"layers": 0})  # type: ignore[arg-type]
                per["layers"] += 1
                for k, v in c.items():
                    per[k] = per.get(k, 0) + int(v)
        used = 0
        for p in self.paths.cache.glob("sha256-*.erofs"):
            with contextlib.suppress(FileNotFoundError):
                used += p.stat().st_blocks * 512
        state = self.daemon_state() or {}
        return {"daemon": {**state, "alive": self.healthy(state) if state else False,
                           "restarts": self.restarts},
                "cache": {"limit": int(state.get("cache_limit", self.cache_limit)), "used": used},
                "layers": layers, "sandboxes": sandboxes}

    # ---- lifetime ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start (or adopt) the daemon and a task that restarts it when it dies (the task runs
        even if this first start fails: it keeps trying). Each start counts: the watch runs
        until as many ``stop(daemon=False)`` (several edges of one process share a store's
        loader: one edge's close must not end the other's watch)."""
        self._watchers += 1
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_loop())
        await asyncio.to_thread(self.ensure_daemon)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.watch_interval)
            try:
                if not await asyncio.to_thread(self.healthy):
                    await asyncio.to_thread(self.ensure_daemon)
            except Exception as exc:  # noqa: BLE001 - keep watching; ensure_layer reports
                log.warning("lazy daemon restart failed: %s", exc)

    def stop_sync(self, timeout: float = 10.0) -> bool:
        """Stop the daemon if no mount uses its files; True if it is gone."""
        state = self.daemon_state()
        base = os.path.realpath(self.paths.fs) + "/"
        in_use = [mnt for mnt, fstype, src in syscalls.read_mountinfo()
                  if fstype == "erofs" and os.path.realpath(src).startswith(base)]
        if in_use:
            log.info("lazy daemon kept: %d mounts use it", len(in_use))
            return False
        with self._locked():
            pid = int((state or {}).get("pid", 0))
            for mnt in _fuse_mounts_under(self.paths.fs):
                with contextlib.suppress(OSError):
                    syscalls.umount(mnt, 0)  # the daemon sees the unmount and exits cleanly
            deadline = time.monotonic() + timeout
            while pid and _proc_alive(pid) and time.monotonic() < deadline:
                if self._proc is not None:
                    self._proc.poll()
                time.sleep(0.02)
            if pid and _proc_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if self._proc is not None:
                self._proc.wait()
                self._proc = None
            self._drop_dead_mounts()
            self.paths.daemon_json.unlink(missing_ok=True)
        return True

    async def stop(self, *, daemon: bool = True) -> None:
        """Stop the watch task and (unless ``daemon`` is False, or layers are mounted) the
        daemon. ``daemon=False`` (an edge's close) ends the watch only when no other start
        is left."""
        self._watchers = max(0, self._watchers - 1) if not daemon else 0
        if self._watchers == 0 and self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        if daemon:
            await asyncio.to_thread(self.stop_sync)


_LOADERS: dict[str, LazyLoader] = {}
_LOADERS_GUARD = threading.Lock()


def loader_for(store: ImageStore, settings: Settings | None = None) -> LazyLoader:
    """This process's loader of ``store`` (one per store root), else a new one with
    ``settings`` (default: this process's)."""
    key = os.path.realpath(store.root)
    with _LOADERS_GUARD:
        loader = _LOADERS.get(key)
    return loader if loader is not None else LazyLoader(store, settings)


def existing_loader(store: ImageStore) -> LazyLoader | None:
    """This process's loader of ``store`` if one was made (an edge's, or the first lazy mount's
    of a layer pulled after the edge started); None, making none (a metrics scrape's look)."""
    with _LOADERS_GUARD:
        return _LOADERS.get(os.path.realpath(store.root))


class CurrentLoader:
    """The lazy layers of ``store`` as :class:`rollbox.images.mounts.LayerMounts` gets them
    (its ``LazyLayers``): this process's loader of the store, looked up at each use, so the
    newest loader made for a store serves it and none is made before a lazy layer is mounted."""

    def __init__(self, store: ImageStore, settings: Settings | None = None) -> None:
        self.store = store
        self.settings = settings  # of a loader made here

    def ensure_layer_sync(self, layer: str) -> Path:
        return loader_for(self.store, self.settings).ensure_layer_sync(layer)

    def generation(self) -> int:
        return loader_for(self.store, self.settings).generation()

    def serves(self, generation: int) -> bool:
        return loader_for(self.store, self.settings).serves(generation)


def register_lazy_image(store: ImageStore, image: Any, store_url: str) -> Any:
    """Record every layer of ``image`` that the node lacks as lazy from ``store_url`` (its
    manifest is already saved by ``chunks.pull_image(lazy=True)``), then tag the image."""
    loader = loader_for(store)
    for layer in image.layers:
        if not store.has_layer(layer):
            loader.register(layer, store_url)
    return store.tag(image.name, list(image.layers), image.config)

