"""Step timings of one microVM create (restore or cold boot), for the benchmark's breakdown.

A :class:`Steps` is a lap clock: each :meth:`Steps.lap` adds the time since the previous lap
to a named step (a step that comes back adds up). With ``vm_step_log`` set (``bench microvm``
sets it for its server), the backend appends one JSON line per create to that file: sandbox
id, ``restore``/``cold``, the steps and the total in ms. Nothing else reads it.

A create cancelled midway (a trainer gave up on it) must end cancelled and leave nothing:
:func:`to_the_end` lets a step with host side effects (a thread, the jailer) end before the
cancellation goes on, so the teardown sees what it made; :func:`teardown_after` keeps a
teardown that fails from replacing the cancellation (a template build that seemed to fail
would boot the create cold, and it would finish).

Owns the clock, the line format and those two rules; does not decide what a step is
(``backend.py``, ``template.py`` name them).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Steps:
    def __init__(self) -> None:
        self.start = self._last = time.monotonic()
        self.ms: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.ms[name] = self.ms.get(name, 0.0) + (now - self._last) * 1000
        self._last = now

    def total_ms(self) -> float:
        return (time.monotonic() - self.start) * 1000

    def write(self, path: Path | None, sandbox_id: str, kind: str) -> None:
        """Append this create's line to ``path`` (nothing without one; a failed write is
        logged, never the create's failure)."""
        if path is None:
            return
        line = json.dumps({"id": sandbox_id, "kind": kind, "total_ms": self.total_ms(),
                           "steps": self.ms}) + "\n"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("vm step log %s not written: %s", path, exc)


async def to_the_end(step: Awaitable[T], dispose: Callable[[T], object] | None = None) -> T:
    """Await ``step`` to its end even when the caller is cancelled meanwhile, then raise the
    cancellation: a thread (``to_thread``) or a child process goes on after a cancel and
    would make its files, cgroups or processes behind the teardown's back. ``dispose`` gets
    what a step that ended well after all made (its caller will never use it). A second
    cancellation stops the wait (the step then ends on its own)."""
    task = asyncio.ensure_future(step)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if dispose is not None and not task.cancelled() and task.exception() is None:
            dispose(task.result())
        raise


async def teardown_after(failure: BaseException, teardown: Awaitable[object]) -> None:
    """Run ``teardown`` (shielded) for a step that failed with ``failure``. Its own error
    propagates after an error, but never replaces a cancellation (it is logged: the create
    stays cancelled, whatever the teardown left)."""
    try:
        await asyncio.shield(teardown)
    except Exception as exc:
        if isinstance(failure, Exception):
            raise
        log.warning("teardown after a cancellation failed (the cancellation goes on): %s", exc)
