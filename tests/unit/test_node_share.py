"""Co-hosted edges each admit by their share of the host (node_share, node_cpus,
node_memory_mib): budgets, reserve, the sandboxes' parent memory limit and the live available
memory, not the whole host's."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollbox.config import Settings
from rollbox.edge.admission import (
    Admission, HostMemory, Limits, host_memory_mib, node_cpus, node_memory_mib,
    node_reserve_mib, sandboxes_memory_max_mib,
)
from rollbox.errors import CapacityExceeded
from rollbox.models import Resources


def test_a_node_with_half_the_host_counts_half() -> None:
    whole, half = Settings(), Settings.for_node(Settings(), "n1", 0, nodes=2)
    host = host_memory_mib()
    assert (node_memory_mib(whole), node_cpus(whole)) == (host, os.cpu_count())
    assert node_memory_mib(half) == host // 2 and node_cpus(half) == os.cpu_count() / 2
    assert node_reserve_mib(half, node_memory_mib(half)) == max(1024, host // 2 // 10)
    assert node_reserve_mib(whole, host) == max(2048, host // 10)  # as before shares
    assert sandboxes_memory_max_mib(half, node_memory_mib(half)) < \
        sandboxes_memory_max_mib(whole, host) / 2 + 1024
    lim = Limits.from_settings(half, node_memory_mib(half))
    adm = Admission(lim, node_memory_mib(half), node_cpus(half), HostMemory("none"), "n1")
    assert adm.budgets()["cpus"] == lim.cpu_overcommit * os.cpu_count() / 2
    assert adm.budgets()["memory_mib"] == lim.memory_overcommit * (host // 2)


def test_explicit_cpus_and_memory_win_over_the_share() -> None:
    s = Settings()
    s.node_share, s.node_cpus, s.node_memory_mib = 0.5, 0.75, 3000
    assert (node_cpus(s), node_memory_mib(s)) == (0.75, 3000)
    assert node_reserve_mib(s, 3000) == max(int(2048 * 3000 / host_memory_mib()), 300)


def test_live_memory_is_the_nodes_share_minus_its_use(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable:   {20 << 20} kB\n")  # 20 GiB free on the host
    shared = HostMemory("rollbox-none-such", meminfo=meminfo, psi=tmp_path / "no-psi",
                        node_mib=3000)
    assert shared.sample().available_mib == 3000  # its share, though the host has more
    alone = HostMemory("rollbox-none-such", meminfo=meminfo, psi=tmp_path / "no-psi")
    assert alone.sample().available_mib == 20 << 10
    s = Settings()
    s.node_memory_mib, s.memory_reserve_mib = 2000, 1999
    lim = Limits.from_settings(s, 2000)
    with pytest.raises(CapacityExceeded, match="short of memory"):
        Admission(lim, 2000, 2.0, HostMemory("rollbox-none-such", meminfo=meminfo,
                                             psi=tmp_path / "no-psi", node_mib=2000),
                  "n1")._check_node(Resources(cpus=1, memory_mib=512), "new")
    # the same budgets over the whole host's free memory admit it
    Admission(lim, 2000, 2.0, alone, "n1")._check_node(Resources(cpus=1, memory_mib=512), "new")


@pytest.mark.parametrize("raw", ["0", "1.5", "-0.2"])
def test_a_share_outside_0_1_is_refused(raw: str) -> None:
    from rollbox.config import VARS, SettingError

    with pytest.raises(SettingError):
        VARS["node_share"].read({"ROLLBOX_NODE_SHARE": raw})
