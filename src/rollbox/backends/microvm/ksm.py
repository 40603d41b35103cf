"""Host page merging (KSM) of microVM guest RAM: clones of one template share their pages.

VMs restored from one template start with the same guest RAM (the kernel, its slab, the
initramfs, the agent), and QEMU marks guest RAM mergeable (``-machine mem-merge=on``,
``qemu.py``). With the host's KSM daemon running, identical pages of those VMs are merged
into one copy-on-write page: measured here, the PSS of an idle VM drops from ~90 to ~31 MiB
after 30 s (docs/backends/microvm.md, memory). KSM is host-wide (``/sys/kernel/mm/ksm``): a
node with ``vm_ksm`` on starts ksmd if it is off and raises its scan rate to at least
``vm_ksm_pages_to_scan`` pages per ``SLEEP_MS``; it never lowers a rate or stops ksmd (other
users of the host may rely on it). A node with ``vm_ksm`` off gives its VMs
``mem-merge=off``, so a ksmd someone else started does not merge them.

Trade-off (docs/security.md): merged pages are a cross-VM side channel on this node (a guest
can tell by write timing whether another VM holds a page of known content).

Owns the sysfs knobs and their read-out; QEMU's flag is ``qemu.py``'s.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SYSFS = Path("/sys/kernel/mm/ksm")
SLEEP_MS = 20  # ksmd's pause between batches (the kernel's default)


@dataclass(frozen=True)
class KsmStatus:
    state: str            # "on" | "off" (vm_ksm off) | "absent" (no KSM in this kernel) | "error"
    pages_to_scan: int = 0
    saved_mib: float = 0.0  # pages_sharing: pages that point to a shared copy instead of their own
    reason: str = ""

    def facts(self) -> dict[str, object]:
        return {"ksm": self.state, "ksm_pages_to_scan": self.pages_to_scan,
                "ksm_saved_mib": round(self.saved_mib, 1)}


def _read_int(sysfs: Path, name: str) -> int:
    return int((sysfs / name).read_text().strip())


def status(sysfs: Path = SYSFS, enabled: bool = True) -> KsmStatus:
    """What ksmd does now (no change)."""
    if not enabled:
        return KsmStatus("off")
    if not (sysfs / "run").is_file():
        return KsmStatus("absent", reason=f"no {sysfs}")
    try:
        run = _read_int(sysfs, "run")
        pages = _read_int(sysfs, "pages_to_scan")
        sharing = _read_int(sysfs, "pages_sharing")
    except (OSError, ValueError) as e:
        return KsmStatus("error", reason=str(e))
    return KsmStatus("on" if run == 1 else "stopped", pages, sharing * os.sysconf("SC_PAGE_SIZE")
                     / (1 << 20))


def enable(pages_to_scan: int, sysfs: Path = SYSFS) -> KsmStatus:
    """Start ksmd (run=1) scanning at least ``pages_to_scan`` pages per batch; returns the
    status after. Never lowers the rate or the batch pause another user set lower."""
    if not (sysfs / "run").is_file():
        return KsmStatus("absent", reason=f"no {sysfs}")
    try:
        if _read_int(sysfs, "pages_to_scan") < pages_to_scan:
            (sysfs / "pages_to_scan").write_text(str(pages_to_scan))
        if _read_int(sysfs, "sleep_millisecs") > SLEEP_MS:
            (sysfs / "sleep_millisecs").write_text(str(SLEEP_MS))
        if _read_int(sysfs, "run") != 1:
            (sysfs / "run").write_text("1")
    except (OSError, ValueError) as e:
        log.warning("KSM not enabled: %s", e)
        return KsmStatus("error", reason=str(e))
    return status(sysfs)
