"""The edge's fence (rollbox.edge.fence): armed by a probe with the watcher's dead threshold,
expired by a gap without probes longer than it, across a restart by the marker file's mtime
(a quick restart continues, a long gap is reported), disarmed by a probe without one."""
from __future__ import annotations

import os
from pathlib import Path

from rollbox.edge.fence import Fence


class Clocks:
    def __init__(self) -> None:
        self.mono = 50.0
        self.wall = 1.7e9

    def step(self, s: float) -> None:
        self.mono += s
        self.wall += s


def fence(path: Path, c: Clocks) -> Fence:
    return Fence(path, clock=lambda: c.mono, wall=lambda: c.wall)


def test_unarmed_never_expires(tmp_path: Path) -> None:
    c = Clocks()
    f = fence(tmp_path / "edge-n.probed", c)
    assert f.load() is None and f.expired() is None
    c.step(1e6)
    assert f.expired() is None and f.probed(None) is None
    assert not (tmp_path / "edge-n.probed").exists()


def test_gap_past_the_fence_expires_and_the_next_probe_says_so(tmp_path: Path) -> None:
    c = Clocks()
    path = tmp_path / "edge-n.probed"
    f = fence(path, c)
    assert f.probed(7.0) is None
    assert path.read_text().strip() == "7.0"
    c.step(6.5)
    assert f.expired() is None and f.probed(7.0) is None  # in time: renewed
    c.step(7.5)
    gap = f.expired()
    assert gap is not None and abs(gap - 7.5) < 1e-9
    assert f.probed(7.0) == gap  # the probe after the gap reports it (the edge fences first)
    assert f.expired() is None  # and renews


def test_restart_continues_from_the_last_probe(tmp_path: Path) -> None:
    c = Clocks()
    path = tmp_path / "edge-n.probed"
    fence(path, c).probed(7.0)
    os.utime(path, (c.wall, c.wall))
    c.step(3.0)  # kill -9 and back within seconds
    f2 = fence(path, c)
    assert f2.load() is None and f2.fence_s == 7.0
    c.step(4.5)  # and then no probe comes: 7.5 s since the last one
    assert f2.expired() is not None

    c.step(100.0)
    f3 = fence(path, c)  # started long after: declared lost meanwhile
    gap = f3.load()
    assert gap is not None and gap > 100
    assert f3.probed(None) is not None and f3.fence_s is None and not path.exists()


def test_unreadable_marker_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "edge-n.probed"
    path.write_text("garbage")
    f = fence(path, Clocks())
    assert f.load() is None and f.fence_s is None and not path.exists()
