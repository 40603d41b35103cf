"""On-disk layout of the lazy loader under ``<image store root>/lazy`` (shared by the daemon,
the loader and :mod:`rollbox.images.store`; imports nothing heavy)::

    layers/<digest>.json    lazy record: {"layer", "store", "size", "created"}
    cache/<digest>.erofs    sparse copy of the layer file (only fetched chunks are allocated)
    cache/<digest>.present  one byte per chunk: 1 = the chunk's bytes in the cache are complete
    cache/<digest>.trace    recorded access trace: chunk indices in first-read order (JSON)
    cache/.clean            present only while no daemon runs after a clean shutdown
    stats/<digest>.json     per-layer counters (cumulative across daemon restarts), with the
                            chunk fetch latency histogram (``FETCH_BUCKETS``)
    fs/g<N>/                FUSE mount point of daemon generation N (one daemon per node)
    daemon.json             {"pid", "generation", "mountpoint", "started"} of the live daemon
    daemon.log, .lock

Layer manifests live in ``<root>/manifests/<digest>.json`` (written by ``chunks.save_manifest``).
A new daemon generation gets a new mount point, so an EROFS mount made on a crashed daemon's
file is recognisable by its source path.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Upper bounds (seconds) of the daemon's chunk fetch latency histogram, per layer in its stats
# file ("fetch_seconds"), which the edge sums into ``rollbox_lazy_fetch_seconds``: a chunk from
# a local dir:// store takes ~1 ms, from S3 tens of ms, queued behind a replayed trace seconds.
FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0)
FETCH_KINDS = ("demand", "prefetch")


@dataclass(frozen=True)
class LazyPaths:
    store_root: Path

    @property
    def root(self) -> Path:
        return self.store_root / "lazy"

    @property
    def layers(self) -> Path:
        return self.root / "layers"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def stats(self) -> Path:
        return self.root / "stats"

    @property
    def fs(self) -> Path:
        return self.root / "fs"

    @property
    def daemon_json(self) -> Path:
        return self.root / "daemon.json"

    @property
    def manifests(self) -> Path:
        return self.store_root / "manifests"

    def make_dirs(self) -> None:
        for d in (self.layers, self.cache, self.stats, self.fs):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    def record(self, digest: str) -> Path:
        return self.layers / f"{digest}.json"

    def manifest(self, digest: str) -> Path:
        return self.manifests / f"{digest}.json"

    def cache_file(self, digest: str) -> Path:
        return self.cache / f"{digest}.erofs"

    def present_file(self, digest: str) -> Path:
        return self.cache / f"{digest}.present"

    def trace_file(self, digest: str) -> Path:
        return self.cache / f"{digest}.trace"

    def stats_file(self, digest: str) -> Path:
        return self.stats / f"{digest}.json"

    def mountpoint(self, generation: int) -> Path:
        return self.fs / f"g{generation}"

    def daemon_state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.daemon_json.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def served_path(self, digest: str) -> Path:
        """The layer file as the current daemon generation serves it (may not be up)."""
        state = self.daemon_state() or {}
        return self.mountpoint(int(state.get("generation", 0))) / f"{digest}.erofs"


def read_record(store_root: Path, digest: str) -> dict[str, Any] | None:
    try:
        return json.loads(LazyPaths(store_root).record(digest).read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.parent / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    os.rename(tmp, path)
