"""Per-project quotas on one node: the record (:class:`rollbox.models.Quota`) and its store.

Owns the quota table (its own SQLite file next to the key store) and its validation against a
node's capacity. Does not count usage: the edge's admission compares its live sandboxes with
the quota (``edge.admission``), the image store the project's layers (``layer_mib``). The
cluster swaps :class:`SQLiteQuotas` for a PostgreSQL store with the same two methods.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from rollbox import errors
from rollbox.iam.keys import PROJECT_RE
from rollbox.models import Quota

UNLIMITED = Quota()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS quotas (
    project TEXT PRIMARY KEY,
    sandboxes INTEGER,
    cpus REAL,
    memory_mib INTEGER,
    layer_mib INTEGER,
    updated_at REAL NOT NULL
);
"""
FIELDS = ("sandboxes", "cpus", "memory_mib", "layer_mib")


class QuotaStore(Protocol):
    """The api reads and sets quotas; each edge is given the store for ``get`` alone
    (``edge.admission.ProjectQuotas``)."""

    def get(self, project: str) -> Quota: ...
    def set(self, project: str, quota: Quota) -> Quota: ...


def check_project(project: str) -> str:
    if not PROJECT_RE.match(project):
        raise errors.BadRequest(f"invalid project name {project[:140]!r}")
    return project


def check_quota(quota: Quota, node_limits: Mapping[str, float]) -> Quota:
    """BadRequest if a limit is negative or above what one node can hold (``node_limits``:
    the largest of each field over the nodes; a field it lacks is not bounded)."""
    for name in FIELDS:
        value = getattr(quota, name)
        if value is None:
            continue
        if value < 0:
            raise errors.BadRequest(f"quota {name} must be >= 0, got {value}", field=name)
        cap = node_limits.get(name)
        if cap is not None and value > cap:
            raise errors.BadRequest(f"quota {name}={value} is above a node's capacity ({cap})",
                                    field=name, capacity=cap)
    return quota


class SQLiteQuotas:
    """Quotas in SQLite (WAL, one connection, a lock); reads are cached for ``cache_s`` since
    the edge asks on every create. A change made through this object is seen at once; one made
    by another process within ``cache_s``."""

    def __init__(self, db_path: Path, cache_s: float = 1.0) -> None:
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._cache_s = cache_s
        self._cache: dict[str, tuple[Quota, float]] = {}
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)

    def get(self, project: str) -> Quota:
        hit = self._cache.get(project)
        now = time.monotonic()
        if hit is not None and hit[1] > now:
            return hit[0]
        with self._lock:
            row = self._db.execute(
                "SELECT sandboxes, cpus, memory_mib, layer_mib FROM quotas WHERE project=?",
                (project,)).fetchone()
        quota = Quota(**dict(zip(FIELDS, row))) if row is not None else UNLIMITED
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[project] = (quota, now + self._cache_s)
        return quota

    def set(self, project: str, quota: Quota) -> Quota:
        """Replace the project's quota (a None field is unlimited)."""
        check_project(project)
        check_quota(quota, {})
        with self._lock:
            self._db.execute(
                "INSERT INTO quotas (project, sandboxes, cpus, memory_mib, layer_mib, updated_at)"
                " VALUES (?,?,?,?,?,?) ON CONFLICT(project) DO UPDATE SET sandboxes=excluded."
                "sandboxes, cpus=excluded.cpus, memory_mib=excluded.memory_mib, layer_mib="
                "excluded.layer_mib, updated_at=excluded.updated_at",
                (project, quota.sandboxes, quota.cpus, quota.memory_mib, quota.layer_mib,
                 time.time()))
        self._cache.pop(project, None)
        return quota

    def close(self) -> None:
        with self._lock:
            self._db.close()
