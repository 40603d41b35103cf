"""Job leases: each LeaseStore (SQLite, the embedded default; PostgreSQL, the cluster's) with
the same behaviour and errors (per-project names, resume, end, expiry, persistence), and the
reaper's decisions over each (overdue leases, non-live jobs, grace after a restart)."""
from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.edge.leases import LeaseReaper
from rollbox.jobs import LeaseStore, SqliteLeaseStore
from rollbox.models import JobSpec, Resources, SandboxInfo

Opener = Callable[[], Awaitable[LeaseStore]]


async def close_store(store: LeaseStore) -> None:
    if isinstance(store, SqliteLeaseStore):
        store.close()
    else:
        from rollbox.jobs.postgres import PostgresLeaseStore

        assert isinstance(store, PostgresLeaseStore)
        await store.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=[
    pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")])])
async def opener(request, tmp_path: Path) -> AsyncIterator[Opener]:  # noqa: ANN001
    """Opens the lease store of each backend (again: the same leases, as after a restart);
    closes what it opened."""
    opened: list[LeaseStore] = []
    dsn = None
    if request.param == "postgres":
        from tests.conftest import clean_pg

        dsn = await clean_pg(request.getfixturevalue("postgres"))

    async def open_store() -> LeaseStore:
        if dsn is None:
            store: LeaseStore = SqliteLeaseStore(tmp_path / "leases.db")
        else:
            from rollbox.jobs.postgres import PostgresLeaseStore

            store = await PostgresLeaseStore.connect(dsn)
        opened.append(store)
        return store

    try:
        yield open_store
    finally:
        for store in opened:
            await close_store(store)


async def test_open_resume_heartbeat_end_and_projects(opener: Opener) -> None:
    store = await opener()
    a = await store.open("proj-a", JobSpec(name="run-42", heartbeat_s=2))
    assert a.state == "live" and a.expires_at == pytest.approx(a.heartbeat_at + 6)
    # Same name, another project: another job; project a's is untouched.
    b = await store.open("proj-b", JobSpec(name="run-42", heartbeat_s=5))
    assert (b.project, b.heartbeat_s) == ("proj-b", 5)
    assert (await store.get("proj-a", "run-42")).heartbeat_s == 2
    for call in (lambda: store.get("proj-c", "run-42"),
                 lambda: store.heartbeat("proj-c", "run-42"),
                 lambda: store.live("proj-c", "run-42"),
                 lambda: store.end("proj-c", "run-42", "x")):
        with pytest.raises(errors.NotFound) as err:
            await call()
        assert "proj-a" not in err.value.message and "proj-b" not in err.value.message
    time.sleep(0.01)
    beat = await store.heartbeat("proj-a", "run-42")
    assert beat.heartbeat_at > a.heartbeat_at and beat.expires_at > a.expires_at
    # Re-opening a live job resumes it: same creation time, new interval.
    again = await store.open("proj-a", JobSpec(name="run-42", heartbeat_s=3))
    assert again.created_at == a.created_at and again.heartbeat_s == 3
    ended = await store.end("proj-a", "run-42", "done")
    assert (ended.state, ended.reason) == ("ended", "done") and ended.ended_at
    with pytest.raises(errors.NotFound):
        await store.heartbeat("proj-a", "run-42")
    with pytest.raises(errors.NotFound):
        await store.live("proj-a", "run-42")
    with pytest.raises(errors.NotFound):
        await store.end("proj-a", "run-42", "twice")
    assert (await store.get("proj-a", "run-42")).state == "ended"
    # An ended name starts over as a new job.
    fresh = await store.open("proj-a", JobSpec(name="run-42", heartbeat_s=3))
    assert fresh.state == "live" and fresh.created_at > a.created_at and fresh.reason is None
    assert [j.project for j in await store.list("proj-b")] == ["proj-b"]
    assert {j.project for j in await store.list(None)} == {"proj-a", "proj-b"}
    await close_store(store)
    # Journaled: a restarted server finds the leases as they were.
    store = await opener()
    assert (await store.live("proj-a", "run-42")).heartbeat_s == 3
    assert (await store.live("proj-b", "run-42")).heartbeat_s == 5


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


async def test_reaper_expires_overdue_and_deletes_non_live_jobs(opener: Opener) -> None:
    store = await opener()
    clock = _Clock()
    gone: list[tuple[str, str]] = []
    boxes = [_box("s1", "p", "live"), _box("s2", "p", "late"), _box("s3", "p", "done"),
             _box("s4", "p", None), _box("s5", "p", "never"), _box("s6", "q", "live")]
    await store.open("p", JobSpec(name="live", heartbeat_s=10))
    await store.open("p", JobSpec(name="late", heartbeat_s=0.2))
    await store.open("p", JobSpec(name="done", heartbeat_s=10))
    await store.end("p", "done", "ended by key_x")
    reaper = LeaseReaper(store, lambda: boxes, lambda sid, why: gone.append((sid, why)),
                         clock=clock)
    reaper.started_at -= 100  # long after a start: no grace left
    clock.now += 1.0  # "late" missed 3 heartbeats of 0.2 s, "live" did not
    await reaper.sweep()
    why = dict(gone)
    # s6: project q has no job "live" (only p has): its tag leads nowhere.
    assert set(why) == {"s2", "s3", "s5", "s6"}
    assert "late" in why["s2"] and "expired" in why["s2"] and "heartbeats missed" in why["s2"]
    assert "ended" in why["s3"] and "has no lease" in why["s5"]
    assert (await store.get("p", "late")).state == "expired"
    assert (await store.get("p", "live")).state == "live"


async def test_reaper_gives_grace_after_a_restart(opener: Opener) -> None:
    store = await opener()
    clock = _Clock()
    gone: list[str] = []
    await store.open("p", JobSpec(name="j", heartbeat_s=1))
    clock.now += 30  # the server was down for 30 s: no heartbeat got through
    reaper = LeaseReaper(store, lambda: [_box("s1", "p", "j")],
                         lambda sid, why: gone.append(sid), clock=clock)
    clock.now += 2.9
    await reaper.sweep()
    assert gone == [] and (await store.get("p", "j")).state == "live"  # within 3 heartbeats
    clock.now += 0.2
    await reaper.sweep()
    assert gone == ["s1"] and (await store.get("p", "j")).state == "expired"

