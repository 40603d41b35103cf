"""Step timings of one microVM create (restore or cold boot), for the benchmark's breakdown.

A :class:`Steps` is a lap clock: each :meth:`Steps.lap` adds the time since the previous lap
to a named step (a step that comes back adds up). With ``vm_step_log`` set (``bench microvm``
sets it for its server), the backend appends one JSON line per create to that file: sandbox
id, ``restore``/``cold``, the steps and the total in ms. Nothing else reads it.

Owns the clock and the line format; does not decide what a step is (``backend.py``,
``template.py`` name them). How a cancelled create ends: ``rollbox.backends.cancellation``.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)


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
