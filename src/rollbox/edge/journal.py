"""The edge's SQLite journal of its own sandboxes: what it must re-adopt or clean after a
restart, and what it answers about sandboxes that are dead or deleted."""
from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

from rollbox.models import SandboxInfo

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    owner TEXT NOT NULL,
    host_uid INTEGER,
    info TEXT NOT NULL,
    extra TEXT NOT NULL DEFAULT '{}',
    updated REAL NOT NULL DEFAULT (strftime('%s','now'))
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
"""


class Journal:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def put(self, info: SandboxInfo, host_uid: int | None = None, extra: dict | None = None) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO sandboxes(id, state, owner, host_uid, info, extra) VALUES(?,?,?,?,?,?)"
                " ON CONFLICT(id) DO UPDATE SET state=excluded.state, info=excluded.info,"
                " host_uid=COALESCE(excluded.host_uid, sandboxes.host_uid),"
                " extra=CASE WHEN excluded.extra='{}' THEN sandboxes.extra ELSE excluded.extra END,"
                " updated=strftime('%s','now')",
                (info.id, info.state, info.owner, host_uid, info.model_dump_json(),
                 json.dumps(extra or {})),
            )

    def get(self, sandbox_id: str) -> tuple[SandboxInfo, int | None, dict] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT info, host_uid, extra FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
        if not row:
            return None
        return SandboxInfo.model_validate_json(row[0]), row[1], json.loads(row[2])

    def live(self) -> list[tuple[SandboxInfo, int | None, dict]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT info, host_uid, extra FROM sandboxes WHERE state IN"
                " ('creating','running','paused','stopping')").fetchall()
        return [(SandboxInfo.model_validate_json(r[0]), r[1], json.loads(r[2])) for r in rows]

    def purge_finished(self, older_than_s: float) -> None:
        with self._lock:
            self._db.execute(
                "DELETE FROM sandboxes WHERE state IN ('dead','deleted')"
                " AND updated < strftime('%s','now') - ?", (older_than_s,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
