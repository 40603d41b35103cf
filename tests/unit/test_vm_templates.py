"""The vm backend's template key (any input changed: another key) and when a build VM's
screen counts as settled (``backends/vm/templates.py``)."""
from __future__ import annotations

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.vm.templates import SETTLE_SHOTS, settled, template_key
from rollbox.models import Resources


def spec(disk_mib: int = 64) -> ResolvedSpec:
    return ResolvedSpec(image="i", layers=("sha256:x",), env={},
                        resources=Resources(cpus=1, memory_mib=256, disk_mib=disk_mib))


def test_template_keys_and_settling() -> None:
    s = spec()
    k = template_key(s, "layers:x", ["qemu", "-m", "256"], "g", "8.2")
    assert k == template_key(s, "layers:x", ["qemu", "-m", "256"], "g", "8.2")
    others = {template_key(s, "layers:y", ["qemu", "-m", "256"], "g", "8.2"),
              template_key(s, "layers:x", ["qemu", "-m", "512"], "g", "8.2"),
              template_key(s, "layers:x", ["qemu", "-m", "256"], "h", "8.2"),
              template_key(s, "layers:x", ["qemu", "-m", "256"], "g", "9.0"),
              template_key(spec(65), "layers:x", ["qemu", "-m", "256"], "g", "8.2")}
    assert k not in others and len(others) == 5
    still = [("a", (8, 8))] * SETTLE_SHOTS
    blink = [("a", (8, 8)), ("b", (8, 8))] * (SETTLE_SHOTS // 2)
    assert settled(still) and settled(blink)
    assert not settled(still[1:])  # too few
    assert not settled(still[:-1] + [("a", (9, 8))])  # the mode changed
    assert not settled(blink[:-1] + [("c", (8, 8))])  # still drawing
