"""EventLog: append is synchronous and O(1) (hot path: every output chunk); a background
thread flushes batches to SQLite every ~50 ms; readers merge the unflushed tail so nothing is
invisible between append and commit.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from rollbox.models import Event

log = logging.getLogger(__name__)

OUTPUT_KINDS = frozenset({"exec.stdout", "exec.stderr"})
# Informative names only: every kind that is not output is kept regardless of the budget.
LIFECYCLE_KINDS = frozenset(
    {"sandbox.created", "sandbox.deleted", "sandbox.ttl", "exec.started", "exec.exited",
     "exec.error", "events.dropped"}
)
END_KIND = "sandbox.deleted"
FLUSH_INTERVAL_S = 0.05

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    sandbox_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    exec_id TEXT,
    data TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_ts ON events (ts);
CREATE TABLE IF NOT EXISTS sandbox_log (
    sandbox_id TEXT PRIMARY KEY,
    next_seq INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    dropped_events INTEGER NOT NULL,
    dropped_bytes INTEGER NOT NULL,
    last_ts REAL NOT NULL
);
"""


@dataclass
class EventStats:
    sandbox_id: str
    events: int  # events kept (== last seq)
    bytes: int  # output bytes kept
    dropped_events: int
    dropped_bytes: int


@dataclass
class _Counters:
    next_seq: int = 1
    bytes: int = 0
    dropped_events: int = 0
    dropped_bytes: int = 0
    last_ts: float = 0.0


_Row = tuple[str, int, float, str, str | None, str]


class EventLog:
    def __init__(self, db_path: Path, per_sandbox_bytes: int = 16 << 20) -> None:
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.per_sandbox_bytes = per_sandbox_bytes
        self._lock = threading.Lock()
        self._pending: list[_Row] = []
        self._inflight: list[_Row] = []  # taken by the flusher, not yet committed
        self._dirty: set[str] = set()
        # Deleted sandboxes whose counters leave memory once flushed (reloaded if touched again).
        self._ended: set[str] = set()
        self._counters: dict[str, _Counters] = {}
        self._followers: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self._db_lock = threading.Lock()
        with self._db_lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        self._closed = False
        self._wake = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="eventlog-flush", daemon=True)
        self._flusher.start()

    # ---- writing -------------------------------------------------------------------------
    def append(
        self, sandbox_id: str, kind: str, exec_id: str | None = None, data: str | bytes = ""
    ) -> int | None:
        """Record one event; returns its seq, or None if it was dropped by the budget."""
        if isinstance(data, bytes):
            size = len(data)
            text = data.decode("utf-8", "replace")
        else:
            text = data
            size = len(text)  # chars; close enough for a budget and avoids an encode per call
        now = time.time()
        if sandbox_id not in self._counters:
            self._load_counters(sandbox_id)
        with self._lock:
            if self._closed:
                raise RuntimeError("EventLog is closed")
            c = self._counters.get(sandbox_id) or self._counters.setdefault(sandbox_id, _Counters())
            if kind in OUTPUT_KINDS:
                if c.bytes + size > self.per_sandbox_bytes:
                    c.dropped_events += 1
                    c.dropped_bytes += size
                    self._dirty.add(sandbox_id)
                    return None
                c.bytes += size
            elif kind == END_KIND and c.dropped_events:
                self._append_locked(
                    sandbox_id, c, now, "events.dropped", None,
                    json.dumps({"dropped_events": c.dropped_events,
                                "dropped_bytes": c.dropped_bytes}),
                )
            seq = self._append_locked(sandbox_id, c, now, kind, exec_id, text)
            if kind == END_KIND:
                self._ended.add(sandbox_id)
        self._notify(sandbox_id)
        return seq

    def _append_locked(
        self, sandbox_id: str, c: _Counters, now: float, kind: str, exec_id: str | None, text: str
    ) -> int:
        seq = c.next_seq
        c.next_seq += 1
        c.last_ts = now
        self._pending.append((sandbox_id, seq, now, kind, exec_id, text))
        self._dirty.add(sandbox_id)
        return seq

    def _load_counters(self, sandbox_id: str) -> _Counters:
        # First touch of a sandbox by this process: resume its seq and budget after a reopen.
        # Called without self._lock held (lock order is db_lock -> lock, as in flush()).
        with self._db_lock:
            row = self._db.execute(
                "SELECT next_seq, bytes, dropped_events, dropped_bytes, last_ts"
                " FROM sandbox_log WHERE sandbox_id=?", (sandbox_id,),
            ).fetchone()
        with self._lock:
            return self._counters.setdefault(sandbox_id, _Counters(*row) if row else _Counters())

    def _notify(self, sandbox_id: str) -> None:
        waiters = self._followers.get(sandbox_id)
        if not waiters:
            return
        for loop, ev in list(waiters):
            if not ev.is_set():
                try:
                    loop.call_soon_threadsafe(ev.set)
                except RuntimeError:  # loop closed; its follower is gone
                    waiters.discard((loop, ev))

    def _flush_loop(self) -> None:
        while True:
            self._wake.wait(FLUSH_INTERVAL_S)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # keep the audit thread alive; the next batch retries
                log.exception("event log flush failed")
            with self._lock:
                if self._closed and not self._pending:
                    return

    def flush(self) -> None:
        """Write everything appended so far (called by the flusher; safe from any thread)."""
        with self._db_lock:
            with self._lock:
                if not self._pending and not self._dirty:
                    return
                batch, self._pending = self._pending, []
                self._inflight = batch
                stats = [
                    (sid, c.next_seq, c.bytes, c.dropped_events, c.dropped_bytes, c.last_ts)
                    for sid in self._dirty
                    if (c := self._counters.get(sid)) is not None
                ]
                self._dirty = set()
                ended, self._ended = self._ended, set()
            try:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT OR REPLACE INTO events VALUES (?,?,?,?,?,?)", batch)
                self._db.executemany(
                    "INSERT OR REPLACE INTO sandbox_log VALUES (?,?,?,?,?,?)", stats
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                with self._lock:  # put the batch back in front, keep order
                    self._pending = batch + self._pending
                    self._dirty.update(s[0] for s in stats)
                    self._inflight = []
                    self._ended |= ended
                raise
            with self._lock:
                self._inflight = []
                for sid in ended:
                    if sid not in self._dirty and not self._followers.get(sid):
                        self._counters.pop(sid, None)

    # ---- reading -------------------------------------------------------------------------
    def read_sync(self, sandbox_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        with self._lock:
            # Snapshot the uncommitted tail first: whatever is not in it is already committed.
            tail = [r for r in self._inflight if r[0] == sandbox_id and r[1] > after_seq]
            tail += [r for r in self._pending if r[0] == sandbox_id and r[1] > after_seq]
        with self._db_lock:
            rows = self._db.execute(
                "SELECT sandbox_id, seq, ts, kind, exec_id, data FROM events"
                " WHERE sandbox_id=? AND seq>? ORDER BY seq LIMIT ?",
                (sandbox_id, after_seq, limit),
            ).fetchall()
        if tail:
            seen = {r[1] for r in rows}
            rows.extend(r for r in tail if r[1] not in seen)
            rows.sort(key=lambda r: r[1])
            del rows[limit:]
        return [
            Event(sandbox_id=r[0], seq=r[1], ts=r[2], kind=r[3], exec_id=r[4], data=r[5])
            for r in rows
        ]

    async def read(self, sandbox_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        # Indexed range reads are sub-millisecond; a thread hop would cost more than it saves.
        return self.read_sync(sandbox_id, after_seq, limit)

    async def stream(self, sandbox_id: str, after_seq: int, follow: bool) -> AsyncIterator[Event]:
        """``EdgeAPI.events``: with ``follow``, :meth:`follow`; else every event after
        ``after_seq`` there is now (read in pages, however many)."""
        if follow:
            async for ev in self.follow(sandbox_id, after_seq):
                yield ev
            return
        while batch := await self.read(sandbox_id, after_seq, 1000):
            for ev in batch:
                yield ev
            if len(batch) < 1000:
                return
            after_seq = batch[-1].seq

    async def follow(self, sandbox_id: str, after_seq: int = 0) -> AsyncIterator[Event]:
        """Replay events after ``after_seq`` then stream new ones; ends after sandbox.deleted."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        key = (loop, wake)
        with self._lock:
            self._followers.setdefault(sandbox_id, set()).add(key)
        try:
            last = after_seq
            while True:
                wake.clear()
                batch = await self.read(sandbox_id, last, 1000)
                for ev in batch:
                    last = ev.seq
                    yield ev
                    if ev.kind == END_KIND:
                        return
                if not batch:
                    if self._closed:
                        return
                    try:
                        async with asyncio.timeout(1.0):
                            await wake.wait()
                    except TimeoutError:
                        pass
        finally:
            with self._lock:
                waiters = self._followers.get(sandbox_id)
                if waiters is not None:
                    waiters.discard(key)
                    if not waiters:
                        del self._followers[sandbox_id]

    def stats(self, sandbox_id: str) -> EventStats:
        if sandbox_id not in self._counters:
            self._load_counters(sandbox_id)
        with self._lock:
            c = self._counters.get(sandbox_id) or _Counters()
            return EventStats(sandbox_id, c.next_seq - 1, c.bytes, c.dropped_events,
                              c.dropped_bytes)

    # ---- housekeeping --------------------------------------------------------------------
    def purge_older_than(self, seconds: float) -> int:
        """Delete the logs of sandboxes whose last event is older than ``seconds``."""
        cutoff = time.time() - seconds
        self.flush()
        with self._db_lock:
            sids = [r[0] for r in self._db.execute(
                "SELECT sandbox_id FROM sandbox_log WHERE last_ts<?", (cutoff,))]
            self._db.execute("BEGIN")
            n = 0
            for sid in sids:
                n += self._db.execute("DELETE FROM events WHERE sandbox_id=?", (sid,)).rowcount
                self._db.execute("DELETE FROM sandbox_log WHERE sandbox_id=?", (sid,))
            # Rows of sandboxes still in use are trimmed by age too (long-lived sandboxes).
            n += self._db.execute("DELETE FROM events WHERE ts<?", (cutoff,)).rowcount
            self._db.execute("COMMIT")
        with self._lock:
            for sid in sids:
                c = self._counters.get(sid)
                if c is not None and c.last_ts < cutoff:
                    del self._counters[sid]
        return n

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        self._flusher.join()
        self.flush()
        with self._db_lock:
            self._db.close()
