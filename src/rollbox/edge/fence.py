"""The edge's fence: an edge no watcher probed for longer than the watcher's dead threshold
has been declared lost, so it must not keep (or re-adopt) its sandboxes.

A watcher's probe (``EdgeAPI.report(fence_s=...)``) arms the fence with its dead threshold and
marks the time: the marker file ``edge-<node>.probed`` in the data dir holds ``fence_s``, its
mtime is the wall time of the last probe (one utime per probe, no other I/O). The gap since
that probe is what decides:

- a running edge whose gap passes ``fence_s`` (its loop's tick, or the first probe after it,
  whichever comes first) tears its live sandboxes down as ``dead``/``node_lost`` and refuses
  creates until a probe comes again;
- an edge starting after a gap longer than ``fence_s`` (the watcher declared it lost while it
  was down) cleans its journaled sandboxes up as ``node_lost`` instead of re-adopting them; a
  quick restart (kill -9, back within seconds) re-adopts them with their commands.

A probe with ``fence_s=None`` disarms it (an edge nobody probes, e.g. tests of the edge alone,
never fences). Owns the marker file only; the edge does the teardown.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path


class Fence:
    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.wall = wall
        self.fence_s: float | None = None  # armed when not None
        self._probed: float = 0.0  # clock() of the last probe

    def load(self) -> float | None:
        """At start: continue the armed state of the edge process before (the gap counts from
        its last probe). Returns the gap when it passed ``fence_s`` (its sandboxes were
        declared lost), else None."""
        try:
            text = self.path.read_text().strip()
            mtime = self.path.stat().st_mtime
            fence_s = float(text)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # unreadable: a marker this edge did not write
            with contextlib.suppress(OSError):
                self.path.unlink()
            return None
        gap = max(0.0, self.wall() - mtime)
        self.fence_s = fence_s
        self._probed = self.clock() - gap
        return gap if gap > fence_s else None

    def expired(self) -> float | None:
        """The gap since the last probe if the fence is armed and the gap passed it."""
        if self.fence_s is None:
            return None
        gap = self.clock() - self._probed
        return gap if gap > self.fence_s else None

    def probed(self, fence_s: float | None) -> float | None:
        """A probe came with the watcher's ``fence_s`` (None: disarm). Returns the gap since
        the previous probe when it had passed the fence (the caller fences first)."""
        gap = self.expired()
        if fence_s is None:
            if self.fence_s is not None:
                self.fence_s = None
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            return gap
        if fence_s != self.fence_s:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(f"{fence_s!r}\n")
            os.replace(tmp, self.path)
        else:
            try:
                os.utime(self.path)
            except FileNotFoundError:  # removed under us: write it again
                self.path.write_text(f"{fence_s!r}\n")
        self.fence_s = fence_s
        self._probed = self.clock()
        return gap
