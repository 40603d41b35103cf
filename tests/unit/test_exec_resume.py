"""Byte-offset bookkeeping of resumed exec streams: the edge's replay filter and stream
settling (sessions), and the SDK's de-duplication of resumed output (sdk._resume)."""
from __future__ import annotations

import asyncio
import base64

import pytest

from rollbox import errors
from rollbox.edge.interface import ExecOutput
from rollbox.edge.sessions import ExecSession, StreamBuffer
from rollbox.models import ExecSpec
from rollbox.sdk._resume import Offsets, Reconnect, indeterminate


def _msg(kind: str, offset: int, data: bytes) -> dict:
    return {"type": kind, "offset": offset, "data": base64.b64encode(data).decode()}


def test_offsets_skip_what_the_client_has_and_count_gaps() -> None:
    o = Offsets()
    assert o.take(_msg("stdout", 0, b"hello ")) == b"hello "
    assert o.take(_msg("stdout", 3, b"lo world")) == b"world"  # replayed overlap trimmed
    assert o.take(_msg("stdout", 6, b"wor")) == b""  # all known
    assert o.take(_msg("stdout", 20, b"tail")) == b"tail"  # 9 bytes lost to a restart
    assert o.truncated == {"stdout": 9, "stderr": 0}
    assert o.params() == {"stdout_offset": 24, "stderr_offset": 0}
    assert o.take({"type": "stderr", "data": base64.b64encode(b"e").decode()}) == b"e"


async def test_edge_stream_resumes_from_offsets() -> None:
    s = ExecSession("e1", ExecSpec(cmd="true"))
    s.output("stdout", b"abc")
    s.output("stderr", b"XY")
    s.output("stdout", b"def")
    s.finish(0, None, False)
    items = [i async for i in s.stream((4, 1))]
    got = [(i.kind, i.offset, i.data) for i in items if i.kind in ("stdout", "stderr")]
    assert got == [("stderr", 1, b"Y"), ("stdout", 4, b"ef")]
    assert items[-1].kind == "exit"


def test_rebuilt_stream_reports_the_lost_start_and_merges_the_agent_tail() -> None:
    b = StreamBuffer()
    b.resume_at(1000)  # the agent's ring starts at byte 1000
    b.add(b"x" * 100)
    b.settle(1100, None)
    assert (b.total, b.start, b.dropped) == (1100, 1000, 1000)
    assert b.text() == "[... 1000 bytes lost to a server restart ...]\n" + "x" * 100
    # an agent tail overlapping what the head has is not counted twice
    b = StreamBuffer()
    b.add(b"0123456789")
    b.settle(14, b"6789abcd")  # bytes 6..14; the head has 0..10
    assert (bytes(b.tail), b.dropped) == (b"abcd", 0)
    assert b.text() == "0123456789abcd"


async def test_reconnect_window_is_bounded_and_tracks_maybe_sent() -> None:
    r = Reconnect(0.2)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(errors.ServerUnreachable):
        while True:
            await r.wait(errors.ServerUnreachable("down"))
    assert asyncio.get_running_loop().time() - t0 < 1.0 and not r.may_have_run
    assert isinstance(indeterminate(errors.ServerUnreachable("x"), "k", None, False),
                      errors.ServerUnreachable)
    await Reconnect(1).wait(errors.ConnectionLost("broke"))
    exc = indeterminate(errors.ServerUnreachable("x"), "k", None, True)
    assert isinstance(exc, errors.ExecIndeterminate) and exc.details["idempotency_key"] == "k"
    assert not exc.retryable
    assert isinstance(errors.error_from_payload(exc.to_payload()), errors.ExecIndeterminate)
    assert isinstance(errors.error_from_payload(errors.IdempotencyConflict("x").to_payload()),
                      errors.BadRequest)
    assert ExecOutput("stdout", "e1").offset == 0
