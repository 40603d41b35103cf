"""Job leases: the SQLite LeaseStore (per-project names, resume, end, expiry, persistence) and
the reaper's decisions (overdue leases, non-live jobs, grace after a restart)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.edge.leases import LeaseReaper
from rollbox.jobs import SqliteLeaseStore
from rollbox.models import JobSpec, Resources, SandboxInfo


def test_open_resume_heartbeat_end_and_projects(tmp_path: Path) -> None:
    store = SqliteLeaseStore(tmp_path / "leases.db")
    try:
        a = store.open("proj-a", JobSpec(name="run-42", heartbeat_s=2))
        assert a.state == "live" and a.expires_at == pytest.approx(a.heartbeat_at + 6)
        # Same name, another project: another job; project a's is untouched.
        b = store.open("proj-b", JobSpec(name="run-42", heartbeat_s=5))
        assert (b.project, b.heartbeat_s) == ("proj-b", 5)
        assert store.get("proj-a", "run-42").heartbeat_s == 2
        for call in (lambda: store.get("proj-c", "run-42"),
                     lambda: store.heartbeat("proj-c", "run-42"),
                     lambda: store.live("proj-c", "run-42"),
                     lambda: store.end("proj-c", "run-42", "x")):
            with pytest.raises(errors.NotFound) as err:
                call()
            assert "proj-a" not in err.value.message and "proj-b" not in err.value.message
        time.sleep(0.01)
        beat = store.heartbeat("proj-a", "run-42")
        assert beat.heartbeat_at > a.heartbeat_at and beat.expires_at > a.expires_at
        # Re-opening a live job resumes it: same creation time, new interval.
        again = store.open("proj-a", JobSpec(name="run-42", heartbeat_s=3))
        assert again.created_at == a.created_at and again.heartbeat_s == 3
        ended = store.end("proj-a", "run-42", "done")
        assert (ended.state, ended.reason) == ("ended", "done") and ended.ended_at
        with pytest.raises(errors.NotFound):
            store.heartbeat("proj-a", "run-42")
        with pytest.raises(errors.NotFound):
            store.live("proj-a", "run-42")
        with pytest.raises(errors.NotFound):
            store.end("proj-a", "run-42", "twice")
        assert store.get("proj-a", "run-42").state == "ended"
        # An ended name starts over as a new job.
        fresh = store.open("proj-a", JobSpec(name="run-42", heartbeat_s=3))
        assert fresh.state == "live" and fresh.created_at > a.created_at and fresh.reason is None
        assert [j.project for j in store.list("proj-b")] == ["proj-b"]
        assert {j.project for j in store.list(None)} == {"proj-a", "proj-b"}
    finally:
        store.close()
    # Journaled: a restarted server finds the leases as they were.
    store = SqliteLeaseStore(tmp_path / "leases.db")
    try:
        assert store.live("proj-a", "run-42").heartbeat_s == 3
        assert store.live("proj-b", "run-42").heartbeat_s == 5
    finally:
        store.close()


def test_bad_job_specs_are_refused() -> None:
    for bad in ({"name": "a/b"}, {"name": ""}, {"name": "-x"}, {"name": "x" * 129},
                {"name": "ok", "heartbeat_s": 0}, {"name": "ok", "heartbeat_s": 0.1},
                {"name": "ok", "heartbeat_s": 601}, {"name": "ok", "heartbeat_s": -1}):
        with pytest.raises(ValueError):
            JobSpec(**bad)


def _box(sid: str, owner: str, job: str | None) -> SandboxInfo:
    return SandboxInfo(id=sid, node="n", image="i", layers=[], state="running", created_at=0,
                       expires_at=0, labels={}, resources=Resources(), owner=owner, job=job)


class _Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_reaper_expires_overdue_and_deletes_non_live_jobs(tmp_path: Path) -> None:
    store = SqliteLeaseStore(tmp_path / "leases.db")
    clock = _Clock()
    gone: list[tuple[str, str]] = []
    boxes = [_box("s1", "p", "live"), _box("s2", "p", "late"), _box("s3", "p", "done"),
             _box("s4", "p", None), _box("s5", "p", "never"), _box("s6", "q", "live")]
    try:
        store.open("p", JobSpec(name="live", heartbeat_s=10))
        store.open("p", JobSpec(name="late", heartbeat_s=0.2))
        store.open("p", JobSpec(name="done", heartbeat_s=10))
        store.end("p", "done", "ended by key_x")
        reaper = LeaseReaper(store, lambda: boxes, lambda sid, why: gone.append((sid, why)),
                             clock=clock)
        reaper.started_at -= 100  # long after a start: no grace left
        clock.now += 1.0  # "late" missed 3 heartbeats of 0.2 s, "live" did not
        reaper.sweep()
        why = dict(gone)
        # s6: project q has no job "live" (only p has): its tag leads nowhere.
        assert set(why) == {"s2", "s3", "s5", "s6"}
        assert "late" in why["s2"] and "expired" in why["s2"] and "heartbeats missed" in why["s2"]
        assert "ended" in why["s3"] and "has no lease" in why["s5"]
        assert store.get("p", "late").state == "expired"
        assert store.get("p", "live").state == "live"
    finally:
        store.close()


def test_reaper_gives_grace_after_a_restart(tmp_path: Path) -> None:
    store = SqliteLeaseStore(tmp_path / "leases.db")
    clock = _Clock()
    gone: list[str] = []
    try:
        store.open("p", JobSpec(name="j", heartbeat_s=1))
        clock.now += 30  # the server was down for 30 s: no heartbeat got through
        reaper = LeaseReaper(store, lambda: [_box("s1", "p", "j")],
                             lambda sid, why: gone.append(sid), clock=clock)
        clock.now += 2.9
        reaper.sweep()
        assert gone == [] and store.get("p", "j").state == "live"  # within 3 heartbeats
        clock.now += 0.2
        reaper.sweep()
        assert gone == ["s1"] and store.get("p", "j").state == "expired"
    finally:
        store.close()
