"""API keys: ``rbx_`` + 32 random url-safe bytes; at rest only sha256(key) and a display prefix.

Verified keys are cached, but never past a revocation: a revoke in this process clears the
cache, and one made by another process (another connection to the file) changes SQLite's
``data_version``, which every lookup checks first.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rollbox import errors

KEY_PREFIX = "rbx_"
VERIFY_CACHE_S = 60.0  # a cached principal is re-read this often (revocations clear it)
LAST_USED_WRITE_S = 60.0  # a key's last use is written at most this often (a write per call
# would cost a commit per request)
DISPLAY_CHARS = 8  # of the random part; 48 bits shown, 208 bits stay secret
PROJECT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    name TEXT PRIMARY KEY,
    -- Later: nested projects and quotas (parent + limits on sandboxes, cpus, memory). A child's
    -- limits are carved out of its parent's and never exceed them. NULL = unlimited for now.
    parent TEXT REFERENCES projects(name),
    max_sandboxes INTEGER,
    max_cpus REAL,
    max_memory_mib INTEGER,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    key_hash BLOB NOT NULL UNIQUE,
    display TEXT NOT NULL,
    project TEXT NOT NULL REFERENCES projects(name),
    admin INTEGER NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL
);
"""
_MIGRATIONS = ("ALTER TABLE api_keys ADD COLUMN last_used_at REAL",)


@dataclass(frozen=True)
class Principal:
    project: str
    admin: bool
    key_id: str


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    display: str  # e.g. "rbx_AbCdEfGh..." - not a secret
    project: str
    admin: bool
    created_at: float
    revoked: bool
    revoked_at: float | None = None
    last_used_at: float | None = None


@dataclass(frozen=True)
class Project:
    """Placeholder for the nested-quota issue: a project and its (not yet enforced) limits."""

    name: str
    parent: str | None = None
    max_sandboxes: int | None = None
    max_cpus: float | None = None
    max_memory_mib: int | None = None


def _hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyStore:
    def __init__(self, db_path: Path) -> None:
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._cache: dict[bytes, tuple[Principal, float]] = {}
        self._used: dict[str, float] = {}  # key id -> when its last use was written
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            cols = {r[1] for r in self._db.execute("PRAGMA table_info(api_keys)")}
            for stmt in _MIGRATIONS:
                if stmt.split()[-2] not in cols:
                    self._db.execute(stmt)
            self._data_version = self._db.execute("PRAGMA data_version").fetchone()[0]
        try:
            self.db_path.chmod(0o600)
        except OSError:
            pass

    def create(self, project: str, admin: bool = False) -> str:
        """Create a key for ``project``; the plaintext is returned here and never again."""
        if not PROJECT_RE.match(project):
            raise errors.BadRequest(f"invalid project name {project!r}")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        key_id = "key_" + secrets.token_hex(8)
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR IGNORE INTO projects (name, created_at) VALUES (?, ?)", (project, now)
            )
            self._db.execute(
                "INSERT INTO api_keys (key_id, key_hash, display, project, admin, created_at)"
                " VALUES (?,?,?,?,?,?)",
                (key_id, _hash(key), key[: len(KEY_PREFIX) + DISPLAY_CHARS] + "...", project,
                 int(admin), now),
            )
            self._db.execute("COMMIT")
        return key

    def verify(self, key: str | None) -> Principal:
        if not key or not key.startswith(KEY_PREFIX) or len(key) > 128:
            raise errors.Unauthorized("missing or malformed API key")
        digest = _hash(key)
        with self._lock:  # one hold: a revoke can not slip between the read and the cache
            # Another connection committed (a revoke by the CLI, say): nothing cached holds.
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if version != self._data_version:
                self._data_version = version
                self._cache.clear()
            hit = self._cache.get(digest)
            if hit is not None and hit[1] > time.monotonic():
                self._note_use(hit[0].key_id)
                return hit[0]
            row = self._db.execute(
                "SELECT key_id, key_hash, project, admin, revoked_at FROM api_keys"
                " WHERE key_hash=?", (digest,),
            ).fetchone()
            # The lookup is by hash (a guess reveals nothing about real keys); the final check
            # is constant-time anyway.
            if (row is None or not hmac.compare_digest(bytes(row[1]), digest)
                    or row[4] is not None):
                raise errors.Unauthorized("invalid or revoked API key")
            principal = Principal(project=row[2], admin=bool(row[3]), key_id=row[0])
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (principal, time.monotonic() + VERIFY_CACHE_S)
            self._note_use(principal.key_id)
        return principal

    def check_active(self, key_id: str) -> None:
        """Unauthorized unless ``key_id`` names a key that is not revoked (for credentials
        a key was used to get, e.g. E2B envd tokens: read at every use, never cached)."""
        with self._lock:
            row = self._db.execute("SELECT revoked_at FROM api_keys WHERE key_id=?",
                                   (key_id,)).fetchone()
        if row is None or row[0] is not None:
            raise errors.Unauthorized("the key this access token was issued to is revoked")

    def _note_use(self, key_id: str) -> None:
        """Record a key's use to the minute (called with the lock held)."""
        now = time.time()
        if now - self._used.get(key_id, 0.0) < LAST_USED_WRITE_S:
            return
        self._used[key_id] = now
        self._db.execute("UPDATE api_keys SET last_used_at=? WHERE key_id=?", (now, key_id))

    def revoke(self, key_id: str) -> None:
        with self._lock:
            cur = self._db.execute(
                "UPDATE api_keys SET revoked_at=? WHERE key_id=? AND revoked_at IS NULL",
                (time.time(), key_id),
            )
            self._cache.clear()
        if cur.rowcount == 0:
            raise errors.NotFound(f"no active key {key_id!r}")

    def list(self, project: str | None = None) -> list[KeyInfo]:
        q = ("SELECT key_id, display, project, admin, created_at, revoked_at, last_used_at"
             " FROM api_keys")
        args: tuple[str, ...] = ()
        if project is not None:
            q += " WHERE project=?"
            args = (project,)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY created_at", args).fetchall()
        return [KeyInfo(r[0], r[1], r[2], bool(r[3]), r[4], r[5] is not None, r[5], r[6])
                for r in rows]

    def projects(self) -> list[Project]:
        with self._lock:
            rows = self._db.execute(
                "SELECT name, parent, max_sandboxes, max_cpus, max_memory_mib FROM projects"
            ).fetchall()
        return [Project(*r) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
