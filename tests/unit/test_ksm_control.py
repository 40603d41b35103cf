"""KSM knobs of the microVM backend (ksm.py) on a sysfs-shaped directory, and QEMU's flag."""
from __future__ import annotations

from pathlib import Path

from rollbox.backends.microvm import ksm, qemu


def _sysfs(tmp_path: Path, run: int = 0, pages: int = 100, sleep_ms: int = 20,
           sharing: int = 0) -> Path:
    d = tmp_path / "ksm"
    d.mkdir()
    for name, v in (("run", run), ("pages_to_scan", pages), ("sleep_millisecs", sleep_ms),
                    ("pages_sharing", sharing)):
        (d / name).write_text(f"{v}\n")
    return d


def test_enable_starts_ksmd_and_raises_the_rate(tmp_path: Path) -> None:
    d = _sysfs(tmp_path, run=0, pages=100, sleep_ms=200)
    st = ksm.enable(1000, d)
    assert (d / "run").read_text().strip() == "1"
    assert (d / "pages_to_scan").read_text().strip() == "1000"
    assert (d / "sleep_millisecs").read_text().strip() == str(ksm.SLEEP_MS)
    assert st.state == "on" and st.pages_to_scan == 1000


def test_enable_never_lowers_what_another_user_set(tmp_path: Path) -> None:
    d = _sysfs(tmp_path, run=1, pages=5000, sleep_ms=10, sharing=256)
    st = ksm.enable(1000, d)
    assert (d / "pages_to_scan").read_text().strip() == "5000"
    assert (d / "sleep_millisecs").read_text().strip() == "10"
    assert st.saved_mib == 256 * 4096 / (1 << 20)


def test_no_ksm_in_the_kernel_and_switched_off(tmp_path: Path) -> None:
    assert ksm.enable(1000, tmp_path / "absent").state == "absent"
    d = _sysfs(tmp_path, run=0)
    assert ksm.status(d, enabled=False).state == "off"
    assert ksm.status(d).state == "stopped"
    assert (d / "run").read_text().strip() == "0"  # status() changes nothing


def test_guest_ram_mergeable_unless_ksm_is_off() -> None:
    on = qemu.argv(qemu.MachineSpec(cpus=1, memory_mib=256, layers=1))
    off = qemu.argv(qemu.MachineSpec(cpus=1, memory_mib=256, layers=1, mem_merge=False))
    assert "mem-merge=on" in on[on.index("-M") + 1]
    assert "mem-merge=off" in off[off.index("-M") + 1]
