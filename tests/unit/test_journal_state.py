"""The edge journal keeps each sandbox's backend state (SandboxHandle.state()) for adopt(), and
reads rows written before that column existed (a container's uid) as that state."""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from rollbox.edge.journal import Journal
from rollbox.models import Resources, SandboxInfo


def info(sid: str, state: str = "running", backend: str = "container") -> SandboxInfo:
    now = time.time()
    return SandboxInfo(id=sid, node="n", image="i", layers=[], state=state,  # type: ignore[arg-type]
                       created_at=now, expires_at=now + 60, labels={}, resources=Resources(),
                       backend=backend)


def test_backend_state_round_trip_and_kept_when_not_given(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.db")
    j.put(info("n-a", "creating"), extra={"env": {"A": "1"}})
    assert j.get("n-a")[1] is None  # no state before the backend made it
    j.put(info("n-a", backend="microvm"), backend_state={"jail": "/vm", "pid": 7})
    j.put(info("n-a", "paused", backend="microvm"))  # a state change keeps the state
    got, state, extra = j.get("n-a")
    assert (got.state, got.backend, state, extra) == ("paused", "microvm",
                                                      {"jail": "/vm", "pid": 7}, {"env": {"A": "1"}})
    assert [(i.id, s) for i, s, _ in j.live()] == [("n-a", {"jail": "/vm", "pid": 7})]
    j.close()


def test_rows_of_an_older_journal_read_as_container_state(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "old.db")
    db.executescript("""CREATE TABLE sandboxes (id TEXT PRIMARY KEY, state TEXT NOT NULL,
        owner TEXT NOT NULL, host_uid INTEGER, info TEXT NOT NULL,
        extra TEXT NOT NULL DEFAULT '{}', updated REAL NOT NULL DEFAULT 0);""")
    old = info("n-old").model_dump()
    old.pop("backend")
    old.pop("guest_reported")
    db.execute("INSERT INTO sandboxes(id, state, owner, host_uid, info) VALUES(?,?,?,?,?)",
               ("n-old", "running", "", 200000, SandboxInfo(**old).model_dump_json(
                   exclude={"backend", "guest_reported"})))
    db.commit()
    db.close()
    j = Journal(tmp_path / "old.db")
    got, state, _ = j.get("n-old")
    assert got.backend == "container" and state == {"host_uid": 200000}
    j.close()
