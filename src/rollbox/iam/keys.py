"""The embedded IAM store: projects, API keys and quotas in one SQLite file (:class:`SQLiteIam`,
also known by its old name ``KeyStore``), and the quota ledger in the same file
(:class:`SQLiteLedger`). No external service.

Keys are ``rbx_`` + 32 random url-safe bytes; at rest only sha256(key) and a display prefix.
Verified keys are cached, but never past a revocation: a revoke in this process clears the
cache, and one made by another process (another connection to the file) changes SQLite's
``data_version``, which every lookup checks first.

A file of the flat IAM (projects with no parent, keys, quotas in a ``quotas.db`` beside it) is
carried forward on open: its keys keep working (its admin keys stay the operator's), a project
named ``a/b`` gets the parent ``a`` (made, unlimited, if missing) and the old quotas become the
projects' limits, kept as they were (the delegation rule is checked when they are next set;
the ledger checks every ancestor anyway). The sync methods (``create``, ``verify``, ``revoke``,
``list``) are the host's own (operator CLI, tests); the api uses the async
:class:`rollbox.iam.model.IamStore` methods.
"""
from __future__ import annotations

import hashlib
import hmac
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from rollbox import errors
from rollbox.iam.model import PROJECT_RE, KeyInfo, Principal, ancestors, parent_of
from rollbox.iam.sql import (
    KEY_COLS,
    QUOTA_COLS,
    KeyFormat,
    Row,
    SqlIam,
    SqlLedger,
    key_info,
    new_key,
    principal_of,
    quota_of,
    well_formed,
)
from rollbox.models import Quota

T = TypeVar("T")
VERIFY_CACHE_S = 60.0  # a cached principal is re-read this often (revocations clear it)
LAST_USED_WRITE_S = 60.0  # a key's last use is written at most this often (a write per call
# would cost a commit per request)
QUOTA_CACHE_S = 1.0  # the edge's get(): a change by another process is seen within this
BUSY_TIMEOUT_MS = 10_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    name TEXT PRIMARY KEY,
    parent TEXT,
    max_sandboxes INTEGER,
    max_cpus REAL,
    max_memory_mib INTEGER,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS projects_parent ON projects (parent);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    key_hash BLOB NOT NULL UNIQUE,
    display TEXT NOT NULL,
    project TEXT NOT NULL REFERENCES projects(name),
    admin INTEGER NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS ledger (
    entry_id TEXT PRIMARY KEY,
    project TEXT NOT NULL,
    cpus REAL NOT NULL,
    memory_mib INTEGER NOT NULL,
    state TEXT NOT NULL,
    sandbox_id TEXT UNIQUE,
    node TEXT,
    expires_at REAL,
    committed_at REAL,
    released_at REAL
);
CREATE INDEX IF NOT EXISTS ledger_project ON ledger (project);
CREATE INDEX IF NOT EXISTS ledger_node ON ledger (node);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT);
"""
# (table, column, type) added to files of older versions
COLUMNS = (("api_keys", "last_used_at", "REAL"), ("api_keys", "scope", "TEXT"),
           ("projects", "max_layer_mib", "INTEGER"))


def _hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class _Tx:
    lock = ""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    async def fetch(self, sql: str, *args: object) -> list[Row]:
        return self._db.execute(sql, args).fetchall()

    async def execute(self, sql: str, *args: object) -> int:
        return self._db.execute(sql, args).rowcount


class SqliteDb:
    """One connection (WAL), a lock; ``run`` is BEGIN IMMEDIATE .. COMMIT around ``fn``, which
    must not suspend (it only awaits the transaction's own calls, which run inline): the
    transaction never spans a wait of the event loop."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.lock = threading.Lock()
        with self.lock:
            self.conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self.conn.execute("PRAGMA journal_mode=WAL")
            # A commit without an fsync (WAL: safe against a crash of the process, not of the
            # host): the ledger is made right from the edges' live sets anyway, and a create
            # costs three of these transactions.
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(SCHEMA)
            for table, col, kind in COLUMNS:
                cols = {r[1] for r in self.conn.execute(f"PRAGMA table_info({table})")}
                if col not in cols:
                    self.conn.execute(f"ALTER TABLE {table} ADD COLUMN {col} {kind}")
        try:
            self.path.chmod(0o600)
        except OSError:
            pass

    def run_now(self, fn: Callable[[_Tx], Awaitable[T]]) -> T:
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                coro = fn(_Tx(self.conn))
                try:
                    coro.send(None)  # type: ignore[attr-defined]
                except StopIteration as done:
                    self.conn.execute("COMMIT")
                    return done.value  # type: ignore[no-any-return]
                coro.close()  # type: ignore[attr-defined]
                raise RuntimeError("a SQLite transaction must not wait on the event loop")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise

    async def run(self, fn: Callable[[_Tx], Awaitable[T]]) -> T:
        return self.run_now(fn)

    async def execute(self, sql: str, *args: object) -> int:
        with self.lock:
            return self.conn.execute(sql, args).rowcount

    def close(self) -> None:
        with self.lock:
            self.conn.close()


class SQLiteIam(SqlIam):
    """:class:`rollbox.iam.model.IamStore` in SQLite. ``legacy_quotas``: the flat IAM's
    quota file, imported once (then left alone)."""

    integrity_errors = (sqlite3.IntegrityError,)

    def __init__(self, db_path: Path, legacy_quotas: Path | None = None) -> None:
        self.db_path = Path(db_path)
        self.db = SqliteDb(self.db_path)
        self._db = self.db.conn
        self._lock = self.db.lock
        self._cache: dict[bytes, tuple[Principal, float]] = {}
        self._used: dict[str, float] = {}  # key id -> when its last use was written
        self._quotas: dict[str, tuple[Quota, float]] = {}
        self._migrate(legacy_quotas)
        with self._lock:
            self._data_version = self._db.execute("PRAGMA data_version").fetchone()[0]

    # ---- migration from the flat IAM --------------------------------------------------
    def _migrate(self, legacy_quotas: Path | None) -> None:
        async def fn(tx: _Tx) -> None:
            names = {str(r[0]) for r in await tx.fetch("SELECT name FROM projects")}
            now = time.time()
            for name in sorted(names):
                chain = ancestors(name)
                for anc in chain:
                    if anc not in names:
                        await tx.execute("INSERT INTO projects (name, parent, created_at) "
                                         "VALUES (?, ?, ?)", anc, parent_of(anc), now)
                        names.add(anc)
                await tx.execute("UPDATE projects SET parent = ? WHERE name = ? AND parent "
                                 "IS NOT ?", parent_of(name), name, parent_of(name))
            if legacy_quotas is None or not legacy_quotas.exists():
                return
            if await tx.fetch("SELECT v FROM meta WHERE k = 'quotas_imported'"):
                return
            old = sqlite3.connect(legacy_quotas)
            try:
                rows = old.execute("SELECT project, sandboxes, cpus, memory_mib, layer_mib "
                                   "FROM quotas").fetchall()
            except sqlite3.Error:
                rows = []
            finally:
                old.close()
            for project, *limits in rows:
                if project not in names:
                    continue  # a quota of a project no key was ever made for
                await tx.execute(f"UPDATE projects SET ({QUOTA_COLS}) = (?, ?, ?, ?) WHERE "
                                 "name = ?", *limits, project)
            await tx.execute("INSERT INTO meta (k, v) VALUES ('quotas_imported', ?)",
                             str(legacy_quotas))

        self.db.run_now(fn)

    # ---- the host's own sync methods (operator CLI, tests) ----------------------------
    def create(self, project: str, admin: bool = False, fmt: KeyFormat = "rollbox") -> str:
        """A key for ``project`` (made, with its ancestors, unlimited, if missing); the
        plaintext is returned here and never again. ``admin``: the operator's (administers
        everything). Project admin keys come from :meth:`create_key`."""
        if not PROJECT_RE.match(project):
            raise errors.BadRequest(f"invalid project name {project!r}")
        key, key_id, key_hash, display = new_key(fmt)
        now = time.time()

        async def fn(tx: _Tx) -> None:
            for name in [*ancestors(project), project]:
                await tx.execute("INSERT OR IGNORE INTO projects (name, parent, created_at) "
                                 "VALUES (?, ?, ?)", name, parent_of(name), now)
            await tx.execute("INSERT INTO api_keys (key_id, key_hash, display, project, admin, "
                             "created_at) VALUES (?,?,?,?,?,?)", key_id, key_hash, display,
                             project, int(admin), now)

        self.db.run_now(fn)
        return key

    def verify(self, key: str | None) -> Principal:
        if not well_formed(key):
            raise errors.Unauthorized("missing or malformed API key")
        digest = _hash(key)
        with self._lock:  # one hold: a revoke can not slip between the read and the cache
            # Another connection committed (a revoke by the CLI, say): nothing cached holds.
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if version != self._data_version:
                self._data_version = version
                self._cache.clear()
                self._quotas.clear()
            hit = self._cache.get(digest)
            if hit is not None and hit[1] > time.monotonic():
                self._note_use(hit[0].key_id)
                return hit[0]
            row = self._db.execute(
                "SELECT key_id, key_hash, project, admin, revoked_at, scope FROM api_keys"
                " WHERE key_hash=?", (digest,),
            ).fetchone()
            # The lookup is by hash (a guess reveals nothing about real keys); the final check
            # is constant-time anyway.
            if (row is None or not hmac.compare_digest(bytes(row[1]), digest)
                    or row[4] is not None):
                raise errors.Unauthorized("invalid or revoked API key")
            principal = principal_of(row[0], row[2], row[3], row[5])
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
        q = f"SELECT {KEY_COLS} FROM api_keys"
        args: tuple[str, ...] = ()
        if project is not None:
            q += " WHERE project=?"
            args = (project,)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY created_at", args).fetchall()
        return [key_info(r) for r in rows]

    # ---- IamStore: the backend's part ---------------------------------------------------
    async def authenticate(self, key: str | None) -> Principal:
        return self.verify(key)

    async def key_active(self, key_id: str) -> None:
        self.check_active(key_id)

    def get(self, project: str) -> Quota:
        hit = self._quotas.get(project)
        now = time.monotonic()
        if hit is not None and hit[1] > now:
            return hit[0]
        with self._lock:
            row = self._db.execute(f"SELECT {QUOTA_COLS} FROM projects WHERE name=?",
                                   (project,)).fetchone()
        quota = quota_of(row) if row is not None else Quota()
        if len(self._quotas) > 10_000:
            self._quotas.clear()
        self._quotas[project] = (quota, now + QUOTA_CACHE_S)
        return quota

    def _revoked(self) -> None:
        with self._lock:
            self._cache.clear()

    def _quotas_changed(self, project: str) -> None:
        self._quotas.pop(project, None)

    def close(self) -> None:
        self.db.close()


KeyStore = SQLiteIam  # the flat IAM's name, kept for the host's callers


class SQLiteLedger(SqlLedger):
    """:class:`rollbox.iam.model.QuotaLedger` in SQLite: the ``ledger`` table of the IAM
    file (BEGIN IMMEDIATE makes each reserve atomic against every other process on the file).
    Its own connection, or (:meth:`of`) the IAM store's in the same process: then its writes
    do not look like another process's to the store's key cache."""

    def __init__(self, db_path: Path) -> None:
        self.db = SqliteDb(Path(db_path))
        self._owned = True

    @classmethod
    def of(cls, iam: SQLiteIam) -> SQLiteLedger:
        self = cls.__new__(cls)
        self.db = iam.db
        self._owned = False  # the store's: closed with it
        return self

    def close(self) -> None:
        if self._owned:
            self.db.close()
