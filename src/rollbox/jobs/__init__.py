"""Trainer-job leases: a job (per project, by name) tags the sandboxes created through it and
is kept alive by its trainer's heartbeats; when it ends or misses
``models.MISSED_HEARTBEATS`` heartbeats, its sandboxes are deleted (no orphans from a killed
trainer).

Owns the lease state (:class:`LeaseStore`, journaled in SQLite here; the cluster issue puts a
cluster-wide implementation behind the same protocol) and the sweep that decides which of a
node's sandboxes must go (:class:`LeaseReaper`). It deletes nothing itself: the edge passes the
callable that does. Knows nothing of HTTP or of the edge's internals.
"""
from rollbox.jobs.leases import LeaseStore, SqliteLeaseStore
from rollbox.jobs.reaper import LeaseReaper

__all__ = ["LeaseReaper", "LeaseStore", "SqliteLeaseStore"]
