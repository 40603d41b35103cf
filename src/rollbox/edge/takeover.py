"""Who holds a ``vm`` sandbox's mouse and keyboard (issue 16 item 4): the agent, or the one live
view viewer that took them over.

The rule, on the sandbox's :class:`~rollbox.models.SandboxInfo` (journaled with it, so it holds
across an edge restart):

- nobody took over: the agent's computer-use input goes to the guest; every viewer's stream is
  view-only (its keys and pointer reach nothing);
- a viewer took over (``taken_over``, ``taken_over_by`` = that viewer, ``takeovers`` counted):
  the agent's input is refused (:class:`~rollbox.errors.DisplayLocked`), only that viewer's
  input reaches the guest, every other viewer stays view-only, and another viewer's take-over
  is refused with ``DisplayLocked`` (one holder at a time);
- a release, by any viewer (a holder who left without releasing must not lock the agent out for
  good; a release is recorded with who did it), gives the input back to the agent.

Owns that rule only; the edge records the events and journals the info.
"""
from __future__ import annotations

from rollbox.errors import DisplayLocked
from rollbox.models import SandboxInfo

VIEWER_MAX = 200  # characters of a viewer's name kept (the event log's bound too)


def take(info: SandboxInfo, by: str) -> bool:
    """``by`` takes over; whether anything changed (False: ``by`` holds it already).
    DisplayLocked if another viewer holds it."""
    by = by[:VIEWER_MAX]
    if info.taken_over:
        if info.taken_over_by == by:
            return False
        if info.taken_over_by is None:  # held before holders were recorded: by holds it now
            info.taken_over_by = by  # (a change: journaled, or a restart would forget it)
            return True
        raise DisplayLocked(f"another viewer took over sandbox {info.id}'s screen: mouse and "
                            "keyboard are theirs until it is released", sandbox_id=info.id)
    info.taken_over, info.taken_over_by = True, by
    info.takeovers += 1
    return True


def release(info: SandboxInfo) -> bool:
    """Mouse and keyboard back to the agent; whether anything changed."""
    if not info.taken_over:
        return False
    info.taken_over, info.taken_over_by = False, None
    return True


def viewer_input(info: SandboxInfo, viewer: str) -> bool:
    """Whether ``viewer``'s input reaches the guest now (read at each write of its stream)."""
    return info.taken_over and info.taken_over_by == viewer[:VIEWER_MAX]


def agent_input(info: SandboxInfo, action: str) -> None:
    """DisplayLocked while a viewer holds the screen (the agent's computer-use ``action``)."""
    if info.taken_over:
        raise DisplayLocked(f"a person took over sandbox {info.id}'s screen at its live view: "
                            "mouse and keyboard are theirs until they release it",
                            sandbox_id=info.id, action=action)
