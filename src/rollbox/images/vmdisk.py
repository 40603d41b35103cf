"""VM disk images of the ``vm`` backend's disk-image guests (docs/backends/vm.md, "Guest boot
contract"): a read-only raw disk that is one ext4 filesystem, and its manifest, one directory
per image name under the node's data dir.

Layout::

    <data_dir>/vm-disks/<quoted name>/disk.img    raw ext4, root-owned 0444 after the build; a
                                                   sandbox gets a qcow2 overlay over it made by
                                                   the host, never writes it
    <data_dir>/vm-disks/<quoted name>/disk.json   {"name", "format": "raw", "bytes", "sha256",
                                                   "init", ...}: the contract's keys, then what
                                                   was built from what (Debian package versions,
                                                   sizes, the session)

Owns this layout and reading it (:func:`resolve_vm_disk`, :func:`list_vm_disks`); the recipes
that write it live in :mod:`rollbox.images.sources.desktop`. Must not start a VM (the ``vm``
backend does) nor open a disk a guest wrote (red team F39: only a base this node built is read
here, and only its manifest).
"""
from __future__ import annotations

import hashlib
import json
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbox.config import Settings
from rollbox.errors import InfraError, NotFound
from rollbox.images.names import validate_name

# The guest contract's sign that a desktop image's session is drawn: the session creates this
# file (in the guest) once its window manager drew the screen; a machine template's build of a
# desktop waits for it (backends/vm/templates.py). Per boot: nothing in a base image has it.
DESKTOP_DRAWN_FILE = "/tmp/.rollbox-desktop-drawn"

VM_DISKS_DIR = "vm-disks"
DISK_FILE = "disk.img"
MANIFEST_FILE = "disk.json"
DISK_FORMAT = "raw"


@dataclass(frozen=True)
class VmDisk:
    """One built VM disk image: its files and its manifest."""
    name: str
    dir: Path
    disk: Path
    manifest: dict[str, Any]

    @property
    def bytes(self) -> int:
        """The disk's size (the guest's disk capacity, the raw file's length)."""
        return int(self.manifest["bytes"])

    @property
    def init(self) -> str:
        return str(self.manifest["init"])


def vm_disks_root(data_dir: Path | None = None) -> Path:
    """``<data_dir>/vm-disks`` (default: the settings' ``vm_disks_dir``)."""
    if data_dir is None:
        return Settings().vm_disks_dir
    return Path(data_dir) / VM_DISKS_DIR


def vm_disk_dir(root: Path, name: str) -> Path:
    """Directory of image ``name`` (validated) under the vm-disks ``root``."""
    return Path(root) / urllib.parse.quote(validate_name(name), safe="")


def resolve_vm_disk(root: Path, name: str) -> VmDisk:
    """The built VM disk ``name``; NotFound if it was never built (or its build did not
    finish: the manifest is written last)."""
    d = vm_disk_dir(root, name)
    try:
        manifest = json.loads((d / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        raise NotFound(f"VM disk image {name!r} is not built on this node "
                       f"(rollbox image ensure-desktop)", image=name) from None
    except ValueError as exc:
        raise InfraError(f"VM disk image {name!r}: unreadable manifest: {exc}") from None
    if manifest.get("format") != DISK_FORMAT or manifest.get("name") != name:
        raise InfraError(f"VM disk image {name!r}: manifest says {manifest.get('name')!r} "
                         f"format {manifest.get('format')!r}, expected {DISK_FORMAT}")
    disk = d / DISK_FILE
    if not disk.is_file() or disk.stat().st_size != int(manifest.get("bytes", -1)):
        raise InfraError(f"VM disk image {name!r}: {disk} is missing or not "
                         f"{manifest.get('bytes')} bytes")
    return VmDisk(name=name, dir=d, disk=disk, manifest=manifest)


def find_vm_disk(root: Path, name: str) -> VmDisk | None:
    """The VM disk a sandbox's image name means, or None if it names none (then it is a
    layered image's name). ``name`` without a tag is its newest built tag (``desktop`` ->
    ``desktop:1``: numeric tags by number, then by name). A broken disk of that name is an
    InfraError (resolve_vm_disk), not None."""
    validate_name(name)
    if (vm_disk_dir(root, name) / MANIFEST_FILE).is_file():
        return resolve_vm_disk(root, name)
    if ":" in name or not Path(root).is_dir():
        return None
    prefix = urllib.parse.quote(name + ":", safe="")
    tags = [urllib.parse.unquote(d.name)[len(name) + 1:] for d in Path(root).iterdir()
            if d.name.startswith(prefix) and (d / MANIFEST_FILE).is_file()]
    if not tags:
        return None
    newest = max(tags, key=lambda t: (t.isdigit(), int(t) if t.isdigit() else 0, t))
    return resolve_vm_disk(root, f"{name}:{newest}")


def list_vm_disks(root: Path) -> list[VmDisk]:
    out: list[VmDisk] = []
    if not Path(root).is_dir():
        return out
    for d in sorted(Path(root).iterdir()):
        if d.is_dir() and (d / MANIFEST_FILE).is_file():
            out.append(resolve_vm_disk(root, urllib.parse.unquote(d.name)))
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify_vm_disk(disk: VmDisk) -> None:
    """Hash the disk against its manifest; InfraError on a mismatch."""
    got = sha256_file(disk.disk)
    if got != disk.manifest["sha256"]:
        raise InfraError(f"VM disk image {disk.name!r}: sha256 {got} != the manifest's "
                         f"{disk.manifest['sha256']}")
