"""The cluster's IAM store and quota ledger in PostgreSQL (asyncpg): :class:`PostgresIam` and
:class:`PostgresLedger`, over one pool each, sharing one database (:func:`open_postgres`).

Owns the PostgreSQL schema of projects, keys and the ledger (made on open, idempotent) and the
per-replica caches: verified keys (dropped on a revoke by any replica: NOTIFY
``rollbox_iam``; at most ``VERIFY_CACHE_S`` old otherwise) and the project limits the edge's
admission reads (``get``, refreshed every ``QUOTA_REFRESH_S``). The logic is ``iam.sql``'s,
shared with SQLite. A lost or restarting server raises InfraError (retryable), never a quota
decision. Does not start PostgreSQL (``rollbox.cluster.postgres``).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

from rollbox import errors
from rollbox.iam.model import Principal
from rollbox.iam.sql import (
    QUOTA_COLS,
    Row,
    SqlIam,
    SqlLedger,
    principal_of,
    quota_of,
    well_formed,
)
from rollbox.models import Quota

log = logging.getLogger(__name__)
T = TypeVar("T")
VERIFY_CACHE_S = 5.0
QUOTA_REFRESH_S = 2.0
RETRIES = 8
CHANNEL = "rollbox_iam"

SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    name TEXT COLLATE "C" PRIMARY KEY,
    parent TEXT COLLATE "C",
    max_sandboxes BIGINT,
    max_cpus DOUBLE PRECISION,
    max_memory_mib BIGINT,
    max_layer_mib BIGINT,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS projects_parent ON projects (parent);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    key_hash BYTEA NOT NULL UNIQUE,
    display TEXT NOT NULL,
    project TEXT COLLATE "C" NOT NULL REFERENCES projects(name),
    admin INTEGER NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    revoked_at DOUBLE PRECISION,
    last_used_at DOUBLE PRECISION,
    scope TEXT
);
CREATE TABLE IF NOT EXISTS ledger (
    entry_id TEXT PRIMARY KEY,
    project TEXT COLLATE "C" NOT NULL,
    cpus DOUBLE PRECISION NOT NULL,
    memory_mib BIGINT NOT NULL,
    state TEXT NOT NULL,
    sandbox_id TEXT UNIQUE,
    node TEXT,
    expires_at DOUBLE PRECISION,
    committed_at DOUBLE PRECISION,
    released_at DOUBLE PRECISION
);
CREATE INDEX IF NOT EXISTS ledger_project ON ledger (project);
CREATE INDEX IF NOT EXISTS ledger_node ON ledger (node);
"""
_Q = re.compile(r"\?")
_RETRY = (asyncpg.SerializationError, asyncpg.DeadlockDetectedError)
_LOST = (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
         asyncpg.InternalClientError,
         asyncpg.CannotConnectNowError, asyncpg.AdminShutdownError, asyncio.TimeoutError)


def _sql(sql: str) -> str:
    n = 0

    def sub(_: re.Match[str]) -> str:
        nonlocal n
        n += 1
        return f"${n}"

    return _Q.sub(sub, sql)


class _Tx:
    lock = " FOR UPDATE"

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    async def fetch(self, sql: str, *args: object) -> list[Row]:
        return [tuple(r) for r in await self._conn.fetch(_sql(sql), *args)]

    async def execute(self, sql: str, *args: object) -> int:
        status = await self._conn.execute(_sql(sql), *args)
        tail = status.rsplit(" ", 1)[-1]
        return int(tail) if tail.isdigit() else 0


class PostgresDb:
    """A pool; ``run`` = one READ COMMITTED transaction, ``execute`` = one statement on its own
    (no BEGIN/COMMIT round trips), both retried on serialization failures and deadlocks; a
    lost server is InfraError (retryable)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def run(self, fn: Callable[[_Tx], Awaitable[T]]) -> T:
        return await self._retried(fn, transaction=True)

    async def _retried(self, fn: Callable[[_Tx], Awaitable[T]], transaction: bool) -> T:
        for attempt in range(RETRIES):
            try:
                async with self.pool.acquire() as conn:
                    if not transaction:  # one statement: atomic by itself
                        return await fn(_Tx(conn))
                    async with conn.transaction():
                        return await fn(_Tx(conn))
            except _RETRY:
                await asyncio.sleep(0.005 * (attempt + 1))
            except errors.RollboxError:
                raise
            except _LOST as exc:
                raise errors.InfraError(f"the IAM database is unreachable: {exc!r}"[:300],
                                        reason="iam_db") from None
        raise errors.InfraError("the IAM database kept failing to serialize a transaction",
                                reason="iam_db")

    async def execute(self, sql: str, *args: object) -> int:
        async def fn(tx: _Tx) -> int:
            return await tx.execute(sql, *args)

        return await self._retried(fn, transaction=False)


async def keep_session(conn: asyncpg.Connection) -> None:
    """A pool's ``reset``: nothing to undo. asyncpg's default sends ``RESET ALL; UNLISTEN *;
    CLOSE ALL; pg_advisory_unlock_all()`` (one more round trip) on every release; these
    connections change no session state (no SET, LISTEN, cursor or session lock: the
    listener has a connection of its own), and a transaction left open is still rolled back
    by the pool before this is called."""


async def create_pool(dsn: str, min_size: int = 1, max_size: int = 10,
                      durable: bool = True) -> asyncpg.Pool:
    """A pool over ``dsn`` with the schema made (InfraError if unreachable). ``durable``
    False: its commits do not wait for the WAL flush (``synchronous_commit=off``: a server
    crash may lose the last fraction of a second of them, never consistency)."""
    settings = {} if durable else {"synchronous_commit": "off"}
    try:
        pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size,
                                         command_timeout=30, server_settings=settings,
                                         reset=keep_session)
    except _LOST as exc:
        raise errors.InfraError(f"the IAM database is unreachable: {exc!r}"[:300],
                                reason="iam_db") from None
    assert pool is not None
    async with pool.acquire() as conn:
        # One schema maker at a time (replicas starting together).
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(7420001)")
            await conn.execute(SCHEMA)
    return pool


class PostgresIam(SqlIam):
    """:class:`rollbox.iam.model.IamStore` in PostgreSQL. Make it with :meth:`open`;
    ``await close()``."""

    integrity_errors = (asyncpg.UniqueViolationError,)

    def __init__(self, pool: asyncpg.Pool, dsn: str) -> None:
        self.db = PostgresDb(pool)
        self.pool = pool
        self.dsn = dsn
        self._cache: dict[bytes, tuple[Principal, float]] = {}
        self._quotas: dict[str, Quota] = {}
        self._listener: asyncpg.Connection | None = None
        self._refresher: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, dsn: str, max_size: int = 10) -> PostgresIam:
        self = cls(await create_pool(dsn, max_size=max_size), dsn)
        try:
            self._listener = await asyncpg.connect(dsn)
            await self._listener.add_listener(CHANNEL, self._notified)
            await self.refresh_quotas()
        except BaseException:
            await self.close()
            raise
        self._refresher = asyncio.create_task(self._refresh_loop())
        return self

    def _notified(self, *_: Any) -> None:
        self._cache.clear()

    # ---- the operator's own (cluster up: the first admin key) ---------------------------
    async def create_operator_key(self, project: str = "admin") -> str:
        """A key administering everything, of top-level ``project`` (made if missing)."""
        from rollbox.iam.sql import new_key

        key, key_id, key_hash, display = new_key()
        now = time.time()

        async def fn(tx: _Tx) -> None:
            await tx.execute("INSERT INTO projects (name, parent, created_at) VALUES (?, NULL,"
                             " ?) ON CONFLICT (name) DO NOTHING", project, now)
            await tx.execute("INSERT INTO api_keys (key_id, key_hash, display, project, admin, "
                             "created_at) VALUES (?, ?, ?, ?, 1, ?)", key_id, key_hash,
                             display, project, now)

        await self.db.run(fn)
        return key

    # ---- IamStore: the backend's part ---------------------------------------------------
    async def authenticate(self, key: str | None) -> Principal:
        if not well_formed(key):
            raise errors.Unauthorized("missing or malformed API key")
        digest = hashlib.sha256(key.encode()).digest()
        hit = self._cache.get(digest)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]

        async def fn(tx: _Tx) -> list[Row]:
            return await tx.fetch("SELECT key_id, key_hash, project, admin, revoked_at, scope "
                                  "FROM api_keys WHERE key_hash = ?", digest)

        rows = await self.db.run(fn)
        if (not rows or not hmac.compare_digest(bytes(rows[0][1]), digest)  # type: ignore[arg-type]
                or rows[0][4] is not None):
            raise errors.Unauthorized("invalid or revoked API key")
        r = rows[0]
        principal = principal_of(str(r[0]), str(r[2]), r[3], r[5])
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (principal, time.monotonic() + VERIFY_CACHE_S)
        return principal

    async def key_active(self, key_id: str) -> None:
        async def fn(tx: _Tx) -> list[Row]:
            return await tx.fetch("SELECT revoked_at FROM api_keys WHERE key_id = ?", key_id)

        rows = await self.db.run(fn)
        if not rows or rows[0][0] is not None:
            raise errors.Unauthorized("the key this access token was issued to is revoked")

    def _revoked(self) -> None:
        self._cache.clear()
        task = asyncio.ensure_future(self._notify())
        task.add_done_callback(lambda t: t.exception())

    async def _notify(self) -> None:
        async def fn(tx: _Tx) -> None:
            await tx.execute(f"NOTIFY {CHANNEL}")

        await self.db.run(fn)

    def get(self, project: str) -> Quota:
        return self._quotas.get(project) or Quota()

    def _quotas_changed(self, project: str) -> None:
        task = asyncio.ensure_future(self.refresh_quotas())
        task.add_done_callback(lambda t: t.exception())

    async def refresh_quotas(self) -> None:
        async def fn(tx: _Tx) -> list[Row]:
            return await tx.fetch(f"SELECT name, {QUOTA_COLS} FROM projects")

        self._quotas = {str(r[0]): quota_of(r[1:]) for r in await self.db.run(fn)}

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(QUOTA_REFRESH_S)
            try:
                await self.refresh_quotas()
            except errors.RollboxError as exc:
                log.warning("refreshing project limits failed: %s", exc)

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.close()
        await self.pool.close()


class PostgresLedger(SqlLedger):
    """:class:`rollbox.iam.model.QuotaLedger` in PostgreSQL (row locks on the project chain,
    READ COMMITTED). Make it with :meth:`open`; ``await close()``. Its commits do not wait for
    the WAL flush (a server crash may lose the last ones; the watcher's reconcile puts back
    what the edges run), which is what lets a chain's lock be held for microseconds, not a
    disk flush."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.db = PostgresDb(pool)
        self.pool = pool

    @classmethod
    async def open(cls, dsn: str, max_size: int = 10) -> PostgresLedger:
        return cls(await create_pool(dsn, max_size=max_size, durable=False))

    async def close(self) -> None:
        await self.pool.close()


async def open_postgres(dsn: str, max_size: int = 10) -> tuple[PostgresIam, PostgresLedger]:
    """An api replica's IAM store and ledger on the database at ``dsn`` (each its own pool);
    the caller closes both."""
    iam = await PostgresIam.open(dsn, max_size=max_size)
    try:
        return iam, await PostgresLedger.open(dsn, max_size=max_size)
    except BaseException:
        await iam.close()
        raise
