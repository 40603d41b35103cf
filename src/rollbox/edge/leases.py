"""The sweep that finds this node's sandboxes whose trainer job is no longer live.

Each edge runs one over its own sandboxes (so it works the same when the lease store is
cluster-wide): a live lease past its deadline is marked expired, and every sandbox of a job
that is not live (ended, expired, unknown) is handed to ``destroy`` with the reason. A sandbox
created in a job just as the job ended is caught by the next sweep.

The lease state is not the edge's: the node is given it as :class:`JobLeases`, the part of
``rollbox.jobs.LeaseStore`` (written by the api's job routes: SQLite for one node, PostgreSQL
shared by every edge of a cluster) this sweep reads and writes.

Grace after a restart: the trainers could not heartbeat while the server was down, so a lease
is only expired once ``MISSED_HEARTBEATS`` intervals have passed since this reaper started too.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from rollbox.models import MISSED_HEARTBEATS, JobInfo, SandboxInfo

log = logging.getLogger(__name__)
SWEEP_S = 0.25  # well under the shortest heartbeat interval (models.MIN_HEARTBEAT_S * 3)


class JobLeases(Protocol):
    """The lease state the sweep reads and writes; coroutines (a local SQLite file for one
    node, PostgreSQL shared by every edge of a cluster)."""

    async def expire(self, project: str, name: str, reason: str) -> None:
        """Mark a live lease expired (the reaper; a no-op if it is no longer live)."""
        ...

    async def overdue(self, now: float) -> list[JobInfo]:
        """Live leases whose deadline passed before ``now``."""
        ...

    async def states(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], JobInfo]:
        """The leases of these (project, name) keys that exist."""
        ...


class LeaseReaper:
    def __init__(self, store: JobLeases, sandboxes: Callable[[], Iterable[SandboxInfo]],
                 destroy: Callable[[str, str], object],
                 clock: Callable[[], float] = time.time) -> None:
        """``sandboxes``: the node's live sandboxes (not those being deleted);
        ``destroy(sandbox_id, reason)`` deletes one (it must not block)."""
        self.store = store
        self._sandboxes = sandboxes
        self._destroy = destroy
        self._clock = clock
        self.started_at = clock()

    async def sweep(self) -> list[tuple[str, str]]:
        """One pass; returns the (sandbox id, reason) pairs handed to ``destroy``."""
        now = self._clock()
        for lease in await self.store.overdue(now):
            if now >= self.started_at + MISSED_HEARTBEATS * lease.heartbeat_s:
                await self.store.expire(lease.project, lease.name,
                                  f"{MISSED_HEARTBEATS} heartbeats missed (every "
                                  f"{lease.heartbeat_s:g} s; last {now - lease.heartbeat_at:.1f} s"
                                  " ago)")
        boxes = [i for i in self._sandboxes() if i.job is not None]
        if not boxes:
            return []
        leases = await self.store.states((i.owner, i.job) for i in boxes if i.job is not None)
        doomed = []
        for info in boxes:
            lease = leases.get((info.owner, info.job))  # type: ignore[arg-type]
            if lease is not None and lease.state == "live":
                continue
            why = (f"job {info.job!r} {lease.state}" + (f": {lease.reason}" if lease.reason else "")
                   if lease is not None else f"job {info.job!r} has no lease")
            doomed.append((info.id, why))
        for sandbox_id, why in doomed:
            log.warning("deleting sandbox %s: %s", sandbox_id, why)
            self._destroy(sandbox_id, why)
        return doomed

    async def run(self) -> None:
        """Sweep every ``SWEEP_S`` until cancelled; the grace counts from here."""
        self.started_at = self._clock()
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sweep()
            except Exception:  # noqa: BLE001 - a failed sweep is retried on the next tick
                log.exception("lease sweep failed")
