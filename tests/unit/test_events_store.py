"""EventLog: ordering, bounding, live follow, durability across reopen."""
from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbox.events import EventLog


@pytest.fixture
def log(tmp_path: Path) -> Iterator[EventLog]:
    el = EventLog(tmp_path / "ev.db", per_sandbox_bytes=1000)
    try:
        yield el
    finally:
        el.close()


async def test_order_and_seq_per_sandbox(log: EventLog) -> None:
    for i in range(50):
        assert log.append("a", "exec.stdout", "e1", f"a{i}") == i + 1
        assert log.append("b", "exec.stderr", "e2", f"b{i}".encode()) == i + 1
    evs = await log.read("a")  # visible before the flusher ran
    assert [e.data for e in evs] == [f"a{i}" for i in range(50)]
    await asyncio.sleep(0.2)  # flushed now; same answer from SQLite
    evs = await log.read("a", after_seq=10, limit=5)
    assert [e.seq for e in evs] == [11, 12, 13, 14, 15]
    assert all(e.sandbox_id == "a" and e.exec_id == "e1" for e in evs)
    assert [e.data for e in await log.read("b", 48)] == ["b48", "b49"]


async def test_bytes_decoded_with_replacement(log: EventLog) -> None:
    log.append("a", "exec.stdout", "e", b"ok \xff\xfe end")
    (ev,) = await log.read("a")
    assert ev.data == "ok \ufffd\ufffd end"


async def test_budget_drops_output_keeps_lifecycle(log: EventLog) -> None:
    log.append("a", "sandbox.created")
    kept = [log.append("a", "exec.stdout", "e", b"x" * 100) for _ in range(30)]
    assert kept[:9] == list(range(2, 11)) and kept[10:] == [None] * 20
    assert log.append("a", "exec.exited", "e", "{}") is not None
    st = log.stats("a")
    assert st.bytes == 1000 and st.dropped_events == 20 and st.dropped_bytes == 2000
    log.append("a", "sandbox.deleted")
    evs = await log.read("a")
    assert [e.kind for e in evs[-3:]] == ["exec.exited", "events.dropped", "sandbox.deleted"]
    assert json.loads(evs[-2].data) == {"dropped_events": 20, "dropped_bytes": 2000}
    assert sum(e.kind == "exec.stdout" for e in evs) == 10
    # Other sandboxes have their own budget.
    assert log.append("b", "exec.stdout", "e", b"y" * 1000) == 1


async def test_follow_replays_then_streams_and_ends(log: EventLog) -> None:
    log.append("a", "sandbox.created")
    log.append("a", "exec.stdout", "e", "first")
    got: list[str] = []

    async def consume() -> None:
        async for ev in log.follow("a", after_seq=1):
            got.append(ev.kind + ":" + ev.data)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    assert got == ["exec.stdout:first"]
    t0 = time.monotonic()
    log.append("a", "exec.stdout", "e", "live")
    while len(got) < 2 and time.monotonic() - t0 < 2:
        await asyncio.sleep(0.005)
    assert got[-1] == "exec.stdout:live" and time.monotonic() - t0 < 0.5
    log.append("a", "sandbox.deleted")
    await asyncio.wait_for(task, 2)  # follow ends by itself
    assert got[-1] == "sandbox.deleted:"


async def test_survives_reopen_and_continues_seq(tmp_path: Path) -> None:
    db = tmp_path / "ev.db"
    el = EventLog(db, per_sandbox_bytes=300)
    try:
        for i in range(5):
            el.append("a", "exec.stdout", "e", b"z" * 100)
    finally:
        el.close()  # flushes
    el = EventLog(db, per_sandbox_bytes=300)
    try:
        assert [e.seq for e in await el.read("a")] == [1, 2, 3]
        st = el.stats("a")
        assert st.events == 3 and st.dropped_events == 2
        assert el.append("a", "exec.exited", "e") == 4  # seq continues, budget remembered
        assert el.append("a", "exec.stdout", "e", b"z") is None
    finally:
        el.close()


async def test_purge_older_than(log: EventLog) -> None:
    log.append("old", "sandbox.created")
    log.flush()
    with sqlite3.connect(log.db_path) as db:  # age it
        db.execute("UPDATE events SET ts=ts-1000")
        db.execute("UPDATE sandbox_log SET last_ts=last_ts-1000")
    log._counters.clear()  # as after a restart: counters come back from the DB
    log.append("new", "sandbox.created")
    assert log.purge_older_than(500) == 1
    assert await log.read("old") == []
    assert len(await log.read("new")) == 1


def test_many_appends_are_cheap(tmp_path: Path) -> None:
    el = EventLog(tmp_path / "ev.db")
    try:
        n = 50_000
        t0 = time.perf_counter()
        for i in range(n):
            el.append(f"s{i % 100}", "exec.stdout", "e", b"line of output\n")
        dt = time.perf_counter() - t0
        print(f"append: {n / dt:,.0f}/s")
        assert n / dt > 20_000
        el.flush()
        assert el.read_sync("s7", 0, 10_000)[-1].seq == n // 100
    finally:
        el.close()
