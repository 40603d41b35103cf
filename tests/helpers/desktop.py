"""The desktop_slow tests' desktop: the node's ``desktop:1`` disk (built if missing or of an
older recipe: ``build_desktop_disk``; checked; only read) and the settings of a test edge that
runs it (TCG, the node's vm-disks root). The ``desktop_disk`` fixture (tests/conftest.py) is
this module's :func:`ensure_desktop_disk`, once per session."""
from __future__ import annotations

from typing import Any

from rollbox.images.sources.desktop import build_desktop_disk
from rollbox.images.vmdisk import VmDisk, verify_vm_disk, vm_disks_root


def ensure_desktop_disk() -> VmDisk:
    disk = build_desktop_disk(progress=print)  # the node's, built if missing; used read-only
    verify_vm_disk(disk)
    return disk


def desktop_edge_settings(templates: str = "off", **extra: Any) -> dict[str, Any]:
    """``edge_settings`` of a desktop test: ``templates`` is ``vm_full_templates`` (test
    edges boot cold unless a test says so: conftest.node_settings)."""
    return {"vm_accel": "tcg", "vm_disks_root": vm_disks_root(),
            "vm_full_templates": templates, **extra}
