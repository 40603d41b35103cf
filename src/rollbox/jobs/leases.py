"""Lease state of trainer jobs: the :class:`LeaseStore` protocol and its SQLite implementation
(the embedded default; the cluster's is ``rollbox.jobs.postgres``).

A lease is keyed by (project, name): another project's job of the same name is another job,
and asking for a job the project does not hold answers NotFound (nothing says whether another
project has one). A live lease's ``expires_at`` is its last heartbeat plus
``MISSED_HEARTBEATS`` intervals; a heartbeat (or a re-open) pushes it forward. A lease leaves
``live`` only by :meth:`end` (the trainer) or :meth:`expire` (the reaper); a late heartbeat on
a live lease past its deadline still counts, which is what lets trainers ride out a server
restart (the edge's reaper gives that grace, see ``rollbox.edge.leases``).
"""
from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from rollbox import errors
from rollbox.edge.leases import JobLeases
from rollbox.models import MISSED_HEARTBEATS, JobInfo, JobSpec

_SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    project TEXT NOT NULL,
    name TEXT NOT NULL,
    heartbeat_s REAL NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    ended_at REAL,
    reason TEXT,
    PRIMARY KEY (project, name)
);
CREATE INDEX IF NOT EXISTS leases_live ON leases(state, expires_at);
"""
_COLUMNS = "name, project, heartbeat_s, state, created_at, heartbeat_at, expires_at, ended_at, reason"


class LeaseStore(JobLeases, Protocol):
    """Where leases live: what the api's job routes use, and what each edge's sweep uses
    (:class:`rollbox.edge.leases.JobLeases`: ``expire``, ``overdue``, ``states``). Every method
    is a coroutine (a local SQLite file, answered inline, for one node; PostgreSQL for a
    cluster, ``rollbox.jobs.postgres``) and raises the same typed errors whichever store
    answers. Closing is the owner's (each store's own ``close``)."""

    async def open(self, project: str, spec: JobSpec) -> JobInfo:
        """Create the lease, or resume a live one (its heartbeat interval becomes
        ``spec.heartbeat_s``). An ended or expired job of that name starts over."""
        ...

    async def heartbeat(self, project: str, name: str) -> JobInfo:
        """Push a live lease's deadline forward; NotFound unless it is live."""
        ...

    async def get(self, project: str, name: str) -> JobInfo:
        """The lease in any state; NotFound if the project never had it."""
        ...

    async def live(self, project: str, name: str) -> JobInfo:
        """The lease if it is live, else NotFound (what a create in the job checks)."""
        ...

    async def list(self, project: str | None) -> list[JobInfo]:
        """Leases of ``project`` (None: all projects), newest first."""
        ...

    async def end(self, project: str, name: str, reason: str) -> JobInfo:
        """Mark a live lease ended; NotFound unless it is live."""
        ...


def not_found(name: str, what: str = "job") -> errors.NotFound:
    return errors.NotFound(f"no {what} {name[:130]!r}", job=name[:130])


def live_only(info: JobInfo) -> JobInfo:
    """``info`` if its lease is live, else the NotFound every store answers."""
    if info.state != "live":
        raise not_found(info.name, "live job")
    return info


class SqliteLeaseStore:
    """:class:`LeaseStore` in one SQLite file (WAL), so leases survive a restart; each call is
    a quick local statement, run inline on the event loop."""

    def __init__(self, path: Path | str) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def _row(self, project: str, name: str) -> JobInfo | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM leases WHERE project=? AND name=?",
                               (project, name)).fetchone()
        return lease_info(row) if row else None

    async def open(self, project: str, spec: JobSpec) -> JobInfo:
        now = time.time()
        deadline = now + MISSED_HEARTBEATS * spec.heartbeat_s
        with self._lock:
            self._db.execute(
                "INSERT INTO leases VALUES (?,?,?,'live',?,?,?,NULL,NULL)"
                " ON CONFLICT(project, name) DO UPDATE SET heartbeat_s=excluded.heartbeat_s,"
                " heartbeat_at=excluded.heartbeat_at, expires_at=excluded.expires_at,"
                # a job that ended or expired starts over under the same name
                " created_at=CASE WHEN leases.state='live' THEN leases.created_at"
                "                 ELSE excluded.created_at END,"
                " state='live', ended_at=NULL, reason=NULL",
                (project, spec.name, spec.heartbeat_s, now, now, deadline))
            info = self._row(project, spec.name)
        assert info is not None
        return info

    async def heartbeat(self, project: str, name: str) -> JobInfo:
        now = time.time()
        with self._lock:
            cur = self._db.execute(
                "UPDATE leases SET heartbeat_at=?, expires_at=? + ? * heartbeat_s"
                " WHERE project=? AND name=? AND state='live'",
                (now, now, MISSED_HEARTBEATS, project, name))
            info = self._row(project, name) if cur.rowcount else None
        if info is None:
            raise not_found(name, "live job")
        return info

    async def get(self, project: str, name: str) -> JobInfo:
        with self._lock:
            info = self._row(project, name)
        if info is None:
            raise not_found(name)
        return info

    async def live(self, project: str, name: str) -> JobInfo:
        return live_only(await self.get(project, name))

    async def list(self, project: str | None) -> list[JobInfo]:
        q, args = f"SELECT {_COLUMNS} FROM leases", ()
        if project is not None:
            q, args = q + " WHERE project=?", (project,)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY created_at DESC", args).fetchall()
        return [lease_info(r) for r in rows]

    def _leave_live(self, project: str, name: str, state: str, reason: str) -> int:
        with self._lock:
            return self._db.execute(
                "UPDATE leases SET state=?, ended_at=?, reason=?"
                " WHERE project=? AND name=? AND state='live'",
                (state, time.time(), reason, project, name)).rowcount

    async def end(self, project: str, name: str, reason: str) -> JobInfo:
        if not self._leave_live(project, name, "ended", reason):
            raise not_found(name, "live job")
        return await self.get(project, name)

    async def expire(self, project: str, name: str, reason: str) -> None:
        self._leave_live(project, name, "expired", reason)

    async def overdue(self, now: float) -> list[JobInfo]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM leases WHERE state='live' AND expires_at < ?",
                (now,)).fetchall()
        return [lease_info(r) for r in rows]

    async def states(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], JobInfo]:
        out: dict[tuple[str, str], JobInfo] = {}
        with self._lock:
            for project, name in set(keys):
                info = self._row(project, name)
                if info is not None:
                    out[(project, name)] = info
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()


def lease_info(row: tuple) -> JobInfo:
    return JobInfo(name=row[0], project=row[1], heartbeat_s=row[2], state=row[3],
                   created_at=row[4], heartbeat_at=row[5], expires_at=row[6], ended_at=row[7],
                   reason=row[8])
