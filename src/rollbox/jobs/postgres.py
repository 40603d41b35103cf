"""The cluster's job leases in PostgreSQL (asyncpg): :class:`PostgresLeaseStore`, the
:class:`rollbox.jobs.LeaseStore` every api replica and every edge of a cluster share, so a
heartbeat through any replica renews a job and each edge's reaper ends that job's sandboxes on
its own node once the lease expired or ended.

Owns the ``job_leases`` table (made on open, idempotent) and nothing else of the database (the
IAM tables beside it are ``rollbox.iam.postgres``'s). Same behaviour and errors as
:class:`rollbox.jobs.SqliteLeaseStore` (its docstring has the lease rules); each call is one
statement, so racing replicas never see half an update. A lost or restarting server raises
InfraError (retryable), never NotFound. Does not start PostgreSQL (``rollbox.cluster.postgres``).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import asyncpg

from rollbox import errors
from rollbox.jobs.leases import lease_info, live_only, not_found
from rollbox.models import MISSED_HEARTBEATS, JobInfo, JobSpec

SCHEMA = """
CREATE TABLE IF NOT EXISTS job_leases (
    project TEXT COLLATE "C" NOT NULL,
    name TEXT COLLATE "C" NOT NULL,
    heartbeat_s DOUBLE PRECISION NOT NULL,
    state TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    heartbeat_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    ended_at DOUBLE PRECISION,
    reason TEXT,
    PRIMARY KEY (project, name)
);
CREATE INDEX IF NOT EXISTS job_leases_live ON job_leases (state, expires_at);
"""
_COLUMNS = "name, project, heartbeat_s, state, created_at, heartbeat_at, expires_at, ended_at, reason"
_LOST = (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
         asyncpg.InternalClientError, asyncpg.CannotConnectNowError, asyncpg.AdminShutdownError,
         asyncio.TimeoutError)


def _lost(exc: BaseException) -> errors.InfraError:
    return errors.InfraError(f"the job lease database is unreachable: {exc!r}"[:300],
                             reason="lease_db")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pool's ``reset``: these connections change no session state, so not asyncpg's
    default RESET ALL/UNLISTEN/CLOSE ALL round trip after every query (an edge's sweep runs
    4 a second); an open transaction is still rolled back by the pool."""


class PostgresLeaseStore:
    """:class:`rollbox.jobs.LeaseStore` over one asyncpg pool (``connect`` makes it)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def connect(cls, dsn: str, max_size: int = 5) -> PostgresLeaseStore:
        try:
            pool = await asyncpg.create_pool(dsn, min_size=1, max_size=max_size,
                                             command_timeout=30, reset=_keep_session)
            assert pool is not None
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(7420002)")  # one schema maker
                await conn.execute(SCHEMA)
        except _LOST as exc:
            raise _lost(exc) from None
        return cls(pool)

    async def _fetch(self, sql: str, *args: Any) -> list[JobInfo]:
        try:
            rows = await self._pool.fetch(sql, *args)
        except _LOST as exc:
            raise _lost(exc) from None
        return [lease_info(tuple(r)) for r in rows]

    async def open(self, project: str, spec: JobSpec) -> JobInfo:
        now = time.time()
        rows = await self._fetch(
            "INSERT INTO job_leases VALUES ($1,$2,$3,'live',$4,$4,$5,NULL,NULL)"
            " ON CONFLICT (project, name) DO UPDATE SET heartbeat_s=excluded.heartbeat_s,"
            " heartbeat_at=excluded.heartbeat_at, expires_at=excluded.expires_at,"
            # a job that ended or expired starts over under the same name
            " created_at=CASE WHEN job_leases.state='live' THEN job_leases.created_at"
            "                 ELSE excluded.created_at END,"
            f" state='live', ended_at=NULL, reason=NULL RETURNING {_COLUMNS}",
            project, spec.name, spec.heartbeat_s, now, now + MISSED_HEARTBEATS * spec.heartbeat_s)
        return rows[0]

    async def heartbeat(self, project: str, name: str) -> JobInfo:
        now = time.time()
        rows = await self._fetch(
            "UPDATE job_leases SET heartbeat_at=$1, expires_at=$1 + $2 * heartbeat_s"
            f" WHERE project=$3 AND name=$4 AND state='live' RETURNING {_COLUMNS}",
            now, float(MISSED_HEARTBEATS), project, name)
        if not rows:
            raise not_found(name, "live job")
        return rows[0]

    async def get(self, project: str, name: str) -> JobInfo:
        rows = await self._fetch(f"SELECT {_COLUMNS} FROM job_leases WHERE project=$1 AND name=$2",
                                 project, name)
        if not rows:
            raise not_found(name)
        return rows[0]

    async def live(self, project: str, name: str) -> JobInfo:
        return live_only(await self.get(project, name))

    async def list(self, project: str | None) -> list[JobInfo]:
        if project is None:
            return await self._fetch(f"SELECT {_COLUMNS} FROM job_leases ORDER BY created_at DESC")
        return await self._fetch(f"SELECT {_COLUMNS} FROM job_leases WHERE project=$1"
                                 " ORDER BY created_at DESC", project)

    async def _leave_live(self, project: str, name: str, state: str,
                          reason: str) -> list[JobInfo]:
        return await self._fetch(
            "UPDATE job_leases SET state=$1, ended_at=$2, reason=$3"
            f" WHERE project=$4 AND name=$5 AND state='live' RETURNING {_COLUMNS}",
            state, time.time(), reason, project, name)

    async def end(self, project: str, name: str, reason: str) -> JobInfo:
        rows = await self._leave_live(project, name, "ended", reason)
        if not rows:
            raise not_found(name, "live job")
        return rows[0]

    async def expire(self, project: str, name: str, reason: str) -> None:
        await self._leave_live(project, name, "expired", reason)

    async def overdue(self, now: float) -> list[JobInfo]:
        return await self._fetch(f"SELECT {_COLUMNS} FROM job_leases"
                                 " WHERE state='live' AND expires_at < $1", now)

    async def states(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], JobInfo]:
        wanted = set(keys)
        if not wanted:
            return {}
        projects, names = zip(*wanted)
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM job_leases WHERE (project, name) IN"
            " (SELECT * FROM unnest($1::text[], $2::text[]))", list(projects), list(names))
        return {(i.project, i.name): i for i in rows}

    async def close(self) -> None:
        await self._pool.close()
