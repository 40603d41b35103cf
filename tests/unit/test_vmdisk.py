"""The vm-disks layout (rollbox.images.vmdisk) and the desktop recipe's input checks; the
build itself and a boot are tests/integration/test_vm_desktop_image.py (desktop_slow)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollbox.errors import BadRequest, InfraError, NotFound
from rollbox.images.sources.desktop import build_desktop_disk
from rollbox.images.vmdisk import (
    list_vm_disks,
    resolve_vm_disk,
    sha256_file,
    verify_vm_disk,
    vm_disk_dir,
)


def _make(root: Path, name: str, data: bytes = b"\0" * 4096, **extra: object) -> Path:
    d = vm_disk_dir(root, name)
    d.mkdir(parents=True)
    (d / "disk.img").write_bytes(data)
    manifest = {"name": name, "format": "raw", "bytes": len(data),
                "sha256": sha256_file(d / "disk.img"), "init": "/sbin/init", **extra}
    (d / "disk.json").write_text(json.dumps(manifest))
    return d


def test_resolve_and_list(tmp_path: Path) -> None:
    d = _make(tmp_path, "desktop:1")
    assert d.name == "desktop%3A1"
    disk = resolve_vm_disk(tmp_path, "desktop:1")
    assert disk.disk == d / "disk.img" and disk.bytes == 4096 and disk.init == "/sbin/init"
    verify_vm_disk(disk)
    assert [x.name for x in list_vm_disks(tmp_path)] == ["desktop:1"]
    assert list_vm_disks(tmp_path / "none") == []


def test_missing_bad_and_tampered(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        resolve_vm_disk(tmp_path, "desktop:1")
    with pytest.raises(BadRequest):
        resolve_vm_disk(tmp_path, "../etc")
    d = _make(tmp_path, "desktop:1")
    (d / "disk.img").write_bytes(b"\1" * 4096)  # same size, other bytes
    with pytest.raises(InfraError, match="sha256"):
        verify_vm_disk(resolve_vm_disk(tmp_path, "desktop:1"))
    (d / "disk.img").write_bytes(b"\1" * 10)
    with pytest.raises(InfraError, match="bytes"):
        resolve_vm_disk(tmp_path, "desktop:1")
    (d / "disk.json").write_text("{")
    with pytest.raises(InfraError, match="manifest"):
        resolve_vm_disk(tmp_path, "desktop:1")
    _make(tmp_path, "other:1", format="qcow2")
    with pytest.raises(InfraError, match="format"):
        resolve_vm_disk(tmp_path, "other:1")


def test_recipe_refuses_bad_input_before_building(tmp_path: Path) -> None:
    with pytest.raises(BadRequest):
        build_desktop_disk(tmp_path, name="Bad Name")
    with pytest.raises(BadRequest):
        build_desktop_disk(tmp_path, suite="bookworm; rm -rf /")
    assert not any(tmp_path.iterdir())
