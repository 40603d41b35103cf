"""Trainer-job leases: a job (per project, by name) tags the sandboxes created through it and
is kept alive by its trainer's heartbeats; when it ends or misses
``models.MISSED_HEARTBEATS`` heartbeats, its sandboxes are deleted (no orphans from a killed
trainer).

Owns the lease state (:class:`LeaseStore`: journaled in SQLite for one node, the embedded
default; cluster-wide in PostgreSQL behind the same protocol, ``rollbox.jobs.postgres``, which
is imported from there so that one node never loads asyncpg). Above the edge: each edge is given the
store and runs the sweep that decides which of its sandboxes must go
(``rollbox.edge.leases.LeaseReaper``, over the part of the store it needs,
``edge.leases.JobLeases``). Knows nothing of HTTP or of the edge's internals.
"""
from rollbox.jobs.leases import LeaseStore, SqliteLeaseStore

__all__ = ["LeaseStore", "SqliteLeaseStore"]
