"""Exec sessions as the edge keeps them: bounded output (head kept for replay, tail kept,
rest counted), live subscribers, and the final result. A session outlives the HTTP stream that
started it, so a client can re-attach to it (from byte offsets); a restarted edge rebuilds it
from the agent's retained output, whose first byte may lie past the stream's start (``start``:
truncated by the restart)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from rollbox.edge.interface import ExecOutput
from rollbox.models import ExecInfo, ExecResult, ExecSpec

HEAD_LIMIT = 1 << 20  # bytes per stream kept for replay and the final result
TAIL_LIMIT = 64 << 10


class StreamBuffer:
    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.dropped = 0
        self.start = 0  # stream offset of head[0]: bytes before it were lost to a restart

    def resume_at(self, offset: int) -> None:
        """A rebuilt stream whose first retained byte is at ``offset``."""
        if self.total == 0 and offset > 0:
            self.start = self.total = self.dropped = offset

    def add(self, data: bytes) -> bytes:
        """Record data; return the part that fits in the head (for replay)."""
        self.total += len(data)
        room = HEAD_LIMIT - len(self.head)
        kept = data[:room] if room > 0 else b""
        self.head += kept
        rest = data[len(kept):]
        if rest:
            self.tail += rest
            if len(self.tail) > TAIL_LIMIT:
                self.dropped += len(self.tail) - TAIL_LIMIT
                del self.tail[: len(self.tail) - TAIL_LIMIT]
        return kept

    def settle(self, agent_total: int, agent_tail: bytes | None) -> None:
        """At exit: the agent's byte count is the truth; when we missed bytes (not forwarded
        past the stream limit, or while no edge was connected), its tail (the true last
        bytes, less what our head already has) replaces ours."""
        if agent_tail is not None and agent_total > self.total:
            head_end = self.start + len(self.head)
            overlap = head_end - (agent_total - len(agent_tail))
            self.tail = bytearray(agent_tail[max(0, overlap):][-TAIL_LIMIT:])
        self.total = max(self.total, agent_total)
        self.dropped = self.total - len(self.head) - len(self.tail)

    def text(self) -> str:
        # A restart's loss (before the head; also in ``*_truncated_bytes``) is named apart from
        # the limit's (between head and tail): bench/rl.py parses both.
        lost = self.dropped - self.start  # between head and tail
        front = f"[... {self.start} bytes lost to a server restart ...]\n" if self.start else ""
        if not self.tail:
            return front + self.head.decode(errors="replace")
        marker = f"\n[... {lost} bytes dropped ...]\n" if lost else ""
        return (front + bytes(self.head).decode(errors="replace") + marker
                + bytes(self.tail).decode(errors="replace"))


class ExecSession:
    def __init__(self, exec_id: str, spec: ExecSpec, guest_reported: bool = False) -> None:
        self.exec_id = exec_id
        self.spec = spec
        self.guest_reported = guest_reported  # its exit comes from a guest (a microVM's agent)
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self.out = StreamBuffer()
        self.err = StreamBuffer()
        self.replay: list[ExecOutput] = [ExecOutput("started", exec_id)]
        self.subscribers: set[asyncio.Queue[ExecOutput]] = set()
        self.result: ExecResult | None = None
        self.error: Exception | None = None
        self.done = asyncio.Event()
        self.agent_session = None  # channel Session, set once started
        self.cgroup_name: str | None = None

    def publish(self, item: ExecOutput) -> None:
        for q in self.subscribers:
            q.put_nowait(item)

    def output(self, stream: str, data: bytes) -> None:
        buf = self.out if stream == "stdout" else self.err
        offset = buf.total
        kept = buf.add(data)
        if kept:
            self.replay.append(ExecOutput(stream, self.exec_id, kept,  # type: ignore[arg-type]
                                          offset=offset))
        self.publish(ExecOutput(stream, self.exec_id, data,  # type: ignore[arg-type]
                                offset=offset))

    def finish(self, exit_code: int | None, signal: int | None, timed_out: bool,
               oom_killed: bool = False) -> ExecResult:
        self.result = ExecResult(
            exec_id=self.exec_id, exit_code=exit_code, signal=signal, timed_out=timed_out,
            oom_killed=oom_killed,
            duration_s=time.monotonic() - self._t0,
            stdout=self.out.text(), stderr=self.err.text(),
            stdout_bytes=self.out.total, stderr_bytes=self.err.total,
            stdout_dropped=self.out.dropped, stderr_dropped=self.err.dropped,
            stdout_truncated_bytes=self.out.start, stderr_truncated_bytes=self.err.start,
            guest_reported=self.guest_reported,
        )
        item = ExecOutput("exit", self.exec_id, result=self.result)
        self.replay.append(item)
        self.publish(item)
        self.done.set()
        return self.result

    def fail(self, error: Exception) -> None:
        self.error = error
        item = ExecOutput("error", self.exec_id, error=error)
        self.replay.append(item)
        self.publish(item)
        self.done.set()

    def restore(self, result: ExecResult | None, error: Exception | None) -> None:
        """A command whose end was journaled before a restart: its recorded outcome."""
        if result is not None:
            for stream, text, dropped in (("stdout", result.stdout, result.stdout_dropped),
                                          ("stderr", result.stderr, result.stderr_dropped)):
                if text and not dropped:  # complete: resumable from any offset
                    self.replay.append(ExecOutput(stream, self.exec_id,  # type: ignore[arg-type]
                                                  text.encode()))
            self.result = result
            self.replay.append(ExecOutput("exit", self.exec_id, result=result))
            self.done.set()
        else:
            self.fail(error or RuntimeError("unknown outcome"))

    async def stream(self, offsets: tuple[int, int] = (0, 0)) -> AsyncIterator[ExecOutput]:
        """Replay, then follow. Output below ``offsets`` (stdout, stderr) is skipped, so a
        client resuming a broken stream gets each byte once; a byte it can no longer get shows
        as an item whose ``offset`` lies past what it has."""
        q: asyncio.Queue[ExecOutput] = asyncio.Queue()
        replay = list(self.replay)
        if not self.done.is_set():
            self.subscribers.add(q)
        try:
            for item in replay:
                item = _after(item, offsets)
                if item is not None:
                    yield item
                if item is not None and item.kind in ("exit", "error"):
                    return
            while True:
                item = _after(await q.get(), offsets)
                if item is None:
                    continue
                yield item
                if item.kind in ("exit", "error"):
                    return
        finally:
            self.subscribers.discard(q)

    def info(self) -> ExecInfo:
        return ExecInfo(
            exec_id=self.exec_id, cmd=self.spec.cmd,
            state="exited" if self.done.is_set() else "running", started_at=self.started_at,
            exit_code=self.result.exit_code if self.result else None,
            timed_out=bool(self.result and self.result.timed_out), background=self.spec.background,
            pty=self.spec.pty is not None,
            stdout_bytes=self.out.total, stderr_bytes=self.err.total,
        )


def _after(item: ExecOutput, offsets: tuple[int, int]) -> ExecOutput | None:
    """``item`` less the bytes below the client's offset for its stream (None: nothing left)."""
    if item.kind not in ("stdout", "stderr"):
        return item
    have = offsets[0] if item.kind == "stdout" else offsets[1]
    end = item.offset + len(item.data)
    if end <= have:
        return None
    if item.offset >= have:
        return item
    return ExecOutput(item.kind, item.exec_id, item.data[have - item.offset:], offset=have)
