"""The edge's SQLite journal of its own sandboxes: what it must re-adopt or clean after a
restart (each with its backend's own state, ``SandboxHandle.state()``: the kind is in the
info), and what it answers about sandboxes that are dead or deleted; and of their commands
(exec id <-> agent session, spec, idempotency key, final result), so a restarted edge rebuilds
them from the agent and logs each exit exactly once."""
from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbox.models import SandboxInfo

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    owner TEXT NOT NULL,
    host_uid INTEGER,  -- before backend_state: a container's uid (read as its state)
    info TEXT NOT NULL,
    extra TEXT NOT NULL DEFAULT '{}',
    updated REAL NOT NULL DEFAULT (strftime('%s','now'))
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
-- (sandboxes.backend_state: added by Journal.__init__ to journals made before it)
CREATE TABLE IF NOT EXISTS execs (
    sandbox_id TEXT NOT NULL,
    exec_id TEXT NOT NULL,
    agent_session INTEGER NOT NULL,
    idempotency_key TEXT,
    spec TEXT NOT NULL,
    cgroup TEXT,
    started_at REAL NOT NULL,
    result TEXT,   -- ExecResult JSON once the exit is recorded (exec.exited logged)
    error TEXT,    -- or the error payload JSON of a command that ended without an exit
    PRIMARY KEY (sandbox_id, exec_id)
);
"""


_COLUMNS = "info, backend_state, host_uid, extra"


def _row(row: tuple) -> tuple[SandboxInfo, dict[str, Any] | None, dict]:
    info = SandboxInfo.model_validate_json(row[0])
    if row[1] is not None:
        state = json.loads(row[1])
    else:  # journaled before backend_state: containers kept their uid only
        state = {"host_uid": row[2]} if row[2] is not None else None
    return info, state, json.loads(row[3])


@dataclass
class ExecRecord:
    exec_id: str
    agent_session: int
    spec: str  # ExecSpec JSON
    cgroup: str | None
    started_at: float
    result: str | None
    error: str | None


class Journal:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(sandboxes)")}
        if "backend_state" not in cols:  # JSON of the backend's state(); NULL: none yet
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN backend_state TEXT")
        self._lock = threading.Lock()

    def put(self, info: SandboxInfo, backend_state: dict[str, Any] | None = None,
            extra: dict | None = None) -> None:
        """Record ``info``; ``backend_state`` and ``extra`` (e.g. the commands' env) replace
        the recorded ones when given, else the recorded ones stay."""
        with self._lock:
            self._db.execute(
                "INSERT INTO sandboxes(id, state, owner, backend_state, info, extra)"
                " VALUES(?,?,?,?,?,?)"
                " ON CONFLICT(id) DO UPDATE SET state=excluded.state, info=excluded.info,"
                " backend_state=COALESCE(excluded.backend_state, sandboxes.backend_state),"
                " extra=CASE WHEN excluded.extra='{}' THEN sandboxes.extra ELSE excluded.extra END,"
                " updated=strftime('%s','now')",
                (info.id, info.state, info.owner,
                 json.dumps(backend_state) if backend_state is not None else None,
                 info.model_dump_json(), json.dumps(extra or {})),
            )

    def get(self, sandbox_id: str) -> tuple[SandboxInfo, dict[str, Any] | None, dict] | None:
        """(info, backend state or None, extra) of a journaled sandbox."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
        return _row(row) if row else None

    def live(self) -> list[tuple[SandboxInfo, dict[str, Any] | None, dict]]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM sandboxes WHERE state IN"
                " ('creating','running','paused','stopping')").fetchall()
        return [_row(r) for r in rows]

    def purge_finished(self, older_than_s: float) -> None:
        with self._lock:
            self._db.execute(
                "DELETE FROM sandboxes WHERE state IN ('dead','deleted')"
                " AND updated < strftime('%s','now') - ?", (older_than_s,))

    # ---- commands ---------------------------------------------------------------------
    def exec_put(self, sandbox_id: str, exec_id: str, agent_session: int, spec_json: str,
                 idempotency_key: str | None, cgroup: str | None, started_at: float) -> None:
        """Before the command is sent to the agent (a crash after it finds the record)."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO execs(sandbox_id, exec_id, agent_session,"
                " idempotency_key, spec, cgroup, started_at) VALUES(?,?,?,?,?,?,?)",
                (sandbox_id, exec_id, agent_session, idempotency_key, spec_json, cgroup,
                 started_at))

    def exec_done(self, sandbox_id: str, exec_id: str, result_json: str | None,
                  error_json: str | None = None) -> None:
        with self._lock:
            self._db.execute("UPDATE execs SET result=?, error=? WHERE sandbox_id=? AND exec_id=?",
                             (result_json, error_json, sandbox_id, exec_id))

    def exec_forget(self, sandbox_id: str, exec_ids: list[str] | None = None) -> None:
        """Drop some of a sandbox's command records (None: all of them)."""
        with self._lock:
            if exec_ids is None:
                self._db.execute("DELETE FROM execs WHERE sandbox_id=?", (sandbox_id,))
            else:
                self._db.executemany("DELETE FROM execs WHERE sandbox_id=? AND exec_id=?",
                                     [(sandbox_id, e) for e in exec_ids])

    def execs(self, sandbox_id: str) -> list[ExecRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT exec_id, agent_session, spec, cgroup, started_at, result, error"
                " FROM execs WHERE sandbox_id=? ORDER BY started_at", (sandbox_id,)).fetchall()
        return [ExecRecord(*r) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
