"""The live view's input lock (rollbox.edge.takeover) on a sandbox's info: the agent's input is
refused while a viewer holds the screen; only the holder's input counts; a second viewer's
take-over is refused with a typed error; a release by anyone gives the input back; the holder
goes with the info's JSON (the journal) and an info journaled before holders were recorded
is claimed by the first viewer that takes over."""
from __future__ import annotations

import pytest

from rollbox.edge import takeover
from rollbox.errors import DisplayLocked
from rollbox.models import Resources, SandboxInfo


def info() -> SandboxInfo:
    return SandboxInfo(id="n-1", node="n", image="busybox:test", layers=[], state="running",
                       created_at=0.0, expires_at=1.0, labels={}, resources=Resources(),
                       backend="vm")


def test_one_holder_at_a_time_and_the_agent_locked_meanwhile() -> None:
    i = info()
    takeover.agent_input(i, "click")  # nobody holds it: the agent's input goes
    assert not takeover.viewer_input(i, "a") and not takeover.viewer_input(i, "b")

    assert takeover.take(i, "a") is True
    assert (i.taken_over, i.taken_over_by, i.takeovers) == (True, "a", 1)
    assert takeover.viewer_input(i, "a") and not takeover.viewer_input(i, "b")
    with pytest.raises(DisplayLocked) as locked:
        takeover.agent_input(i, "type")
    assert locked.value.status == 409 and locked.value.details["action"] == "type"

    with pytest.raises(DisplayLocked, match="another viewer"):  # b can not take it from a
        takeover.take(i, "b")
    assert (i.taken_over_by, i.takeovers) == ("a", 1) and not takeover.viewer_input(i, "b")
    assert takeover.take(i, "a") is False and i.takeovers == 1  # a again: nothing new

    assert takeover.release(i) is True  # by anyone (a holder who left must not lock it)
    assert (i.taken_over, i.taken_over_by) == (False, None)
    assert not takeover.viewer_input(i, "a")
    takeover.agent_input(i, "click")
    assert takeover.release(i) is False

    assert takeover.take(i, "b") is True and i.takeovers == 2
    assert takeover.viewer_input(i, "b") and not takeover.viewer_input(i, "a")


def test_the_holder_is_journaled_and_an_unrecorded_one_is_claimed() -> None:
    i = info()
    takeover.take(i, "a")
    again = SandboxInfo.model_validate_json(i.model_dump_json())  # as the journal keeps it
    assert takeover.viewer_input(again, "a") and not takeover.viewer_input(again, "b")
    older = SandboxInfo.model_validate_json(i.model_dump_json(exclude={"taken_over_by"}))
    assert older.taken_over and older.taken_over_by is None
    assert not takeover.viewer_input(older, "a")  # nobody's input until one takes it
    # a change the edge journals (True), or a restart would leave it unrecorded again
    assert takeover.take(older, "b") is True and older.taken_over_by == "b"
    assert takeover.take(older, "b") is False  # held by b already: nothing to journal
    assert takeover.viewer_input(older, "b") and older.takeovers == 1


def test_long_viewer_names_are_bounded_the_same_everywhere() -> None:
    i = info()
    long = "v" * 500
    takeover.take(i, long)
    assert i.taken_over_by == long[:takeover.VIEWER_MAX]
    assert takeover.viewer_input(i, long)
    assert not takeover.viewer_input(i, long[:takeover.VIEWER_MAX - 1])
