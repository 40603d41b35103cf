"""Audit trail: every command and output chunk of every sandbox, bounded, kept after the
sandbox is gone and streamable live (SQLite, WAL, batched writes).

Owns its own SQLite file only. Does not talk to edges or sandboxes; callers (the api) append.
"""
from rollbox.events.store import LIFECYCLE_KINDS, OUTPUT_KINDS, EventLog, EventStats

__all__ = ["EventLog", "EventStats", "OUTPUT_KINDS", "LIFECYCLE_KINDS"]
