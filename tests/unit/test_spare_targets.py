"""How many spare QEMUs each template keeps (backends/microvm/spares.py ``Spares._targets``):
templates never forked stay within ``vm_template_spares_max`` however high
``vm_fork_spares`` is; a forked one keeps ``vm_fork_spares``; most recently used first."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from rollbox.backends.microvm import qemu
from rollbox.backends.microvm.spares import Recipe, Spares
from rollbox.config import Settings


def spares(per: int, most: int, fork: int) -> Spares:
    s = Settings.scratch(Path("/nonexistent"))
    s.vm_template_spares, s.vm_template_spares_max, s.vm_fork_spares = per, most, fork
    return Spares(SimpleNamespace(settings=s))  # type: ignore[arg-type]


def recipe(age_s: float, forked: bool = False) -> Recipe:
    return Recipe(machine=qemu.MachineSpec(cpus=1, memory_mib=256, layers=1), layers=(), cpus=1.0, disk_id="d", ram_file=None,
                  pages=None, last_used=time.monotonic() - age_s, forked=forked)


def test_templates_never_forked_stay_within_the_plain_bound() -> None:
    sp = spares(1, 4, 8)
    sp._wanted = {f"t{i}": recipe(i) for i in range(6)}
    targets = sp._targets()
    assert sum(targets.values()) == 4
    assert [d for d, n in targets.items() if n] == ["t0", "t1", "t2", "t3"]  # newest first


def test_a_forked_template_keeps_the_fork_count_and_the_rest_what_is_left() -> None:
    sp = spares(1, 4, 6)
    sp._wanted = {"old": recipe(5), "forked": recipe(1, forked=True), "new": recipe(0)}
    assert sp._targets() == {"new": 1, "forked": 5, "old": 0}  # 6 in all, newest first
    sp._wanted = {"forked": recipe(0, forked=True), "plain": recipe(1)}
    assert sp._targets() == {"forked": 6, "plain": 0}
