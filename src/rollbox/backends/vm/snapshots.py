"""Machine snapshots of ``vm`` sandboxes: disk + memory, kept on the node, restored as new VMs.

A snapshot is what a microVM fork saves (``MicroVMBackend._save_for_fork``: QMP ``stop``, the
devices and RAM migrated into a file the edge opened and passed with ``getfd``, the writable
disk's subvolume snapshotted while QEMU is stopped, ``cont``), kept instead of dropped:

    <data_dir>/vm-snapshots/<id>/state      the saved state (root's, 0600; QEMU wrote it)
    <data_dir>/vm-snapshots/<id>/meta.json  written last by the host: the machine (every
                                            argv input), the layers, the disk's size
    pool subvolume ``MACHINE_SNAPSHOT_PREFIX<id>``  the disk as saved (root-owned)

A restore is a fork child's: a fresh jailed QEMU with the saved machine's argv plus
``-incoming defer``, the disk cloned by snapshot (copy-on-write: every restore its own), the
state passed by fd to ``migrate-incoming``, then the guest made unique (RNG reseeded,
machine-id, hostname, clock: ``template.make_unique``). The state and the disk are hostile
(a guest wrote them): the host never parses either; only ``meta.json``, which the host wrote,
is read. A restore needs the very machine that was saved (vCPUs, memory, layers, disk size,
a NIC or none): anything else is a typed BadRequest naming the difference, before anything is
made.

Owns the snapshot files, their names and who uses one (a snapshot being restored is removed
only after its last restore has its disk clone and state fd); does not start QEMU (the
backend's ``boot``) nor know images (the edge names a snapshot by an image: edge.py).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.container.disk import MACHINE_SNAPSHOT_PREFIX
from rollbox.backends.microvm import qemu
from rollbox.backends.microvm.disks import VmDisks
from rollbox.backends.microvm.template import STATE_NAME, Template, TemplateKey
from rollbox.errors import BadRequest, NotFound

log = logging.getLogger(__name__)

SNAPSHOTS_DIR = "vm-snapshots"
META_NAME = "meta.json"
META_VERSION = 1
ID_RE = re.compile(r"^[0-9a-f]{16,64}$")


@dataclass
class Saved:
    """One kept snapshot as its meta says, and how many restores use it now."""
    id: str
    dir: Path
    machine: qemu.MachineSpec
    layers: tuple[str, ...]
    disk_mib: int
    state_bytes: int
    disk_bytes: int
    source: str
    created: float
    users: int = 0
    doomed: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    disk_prefix: str = MACHINE_SNAPSHOT_PREFIX  # its store's (MachineSnapshots.disk_prefix)

    @property
    def disk_id(self) -> str:
        return self.disk_prefix + self.id

    def template(self) -> Template:
        """The snapshot as the restore path takes a saved image (``MicroVMBackend.boot``)."""
        key = TemplateKey(layers=self.layers, disk_mib=self.disk_mib, guest_digest="",
                          qemu_version="", argv=("snapshot", self.id))
        return Template(key=key, dir=self.dir, disk_id=self.disk_id,
                        state_bytes=self.state_bytes, disk_bytes=self.disk_bytes,
                        created=self.created, last_used=time.time())


def check_id(snapshot_id: str) -> str:
    if not ID_RE.match(snapshot_id):
        raise BadRequest(f"not a machine snapshot id: {snapshot_id[:80]!r}")
    return snapshot_id


class MachineSnapshots:
    """The node's machine snapshots of one ``vm`` backend (its disks in that backend's pool,
    named ``disk_prefix`` + id: the templates' store has its own, ``templates.py``)."""

    def __init__(self, root: Path, disks: VmDisks,
                 disk_prefix: str = MACHINE_SNAPSHOT_PREFIX) -> None:
        self.root = root
        self.disks = disks
        self.disk_prefix = disk_prefix
        self._users: dict[str, Saved] = {}  # snapshots being restored now

    def disk_id(self, snapshot_id: str) -> str:
        return self.disk_prefix + check_id(snapshot_id)

    def dir_of(self, snapshot_id: str) -> Path:
        return self.root / check_id(snapshot_id)

    def staging(self, snapshot_id: str) -> Path:
        """A new, empty, root-only dir for a snapshot's files (BadRequest if it exists)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        d = self.dir_of(snapshot_id)
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            raise BadRequest(f"machine snapshot {snapshot_id} exists already") from None
        return d

    def seal(self, snapshot_id: str, machine: qemu.MachineSpec, spec: ResolvedSpec,
             source: str, **extra: Any) -> Saved:
        """Once the state is written and the disk snapshotted: the disk's files root's, the
        meta written last (a dir without it is an unfinished save, removed by :meth:`drop`);
        ``extra`` goes into the meta."""
        d = self.dir_of(snapshot_id)
        disk_bytes = 0
        with os.scandir(self.disks.pool.path(self.disk_id(snapshot_id))) as it:
            for entry in it:  # the writable disk (a disk-image guest's: its overlay)
                if entry.is_file(follow_symlinks=False):
                    os.chown(entry.path, 0, 0, follow_symlinks=False)
                    disk_bytes += entry.stat(follow_symlinks=False).st_blocks * 512
        meta = {"version": META_VERSION, "id": snapshot_id, "source": source, **extra,
                "machine": {**asdict(machine), "incoming": False,
                            "extra_cmdline": list(machine.extra_cmdline)},
                "layers": list(spec.layers), "disk_mib": spec.resources.disk_mib,
                "state_bytes": (d / STATE_NAME).stat().st_size,
                "disk_bytes": disk_bytes, "created": time.time()}
        tmp = d / (META_NAME + ".tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, d / META_NAME)
        saved = self.read(snapshot_id)
        assert saved is not None
        return saved

    def read(self, snapshot_id: str) -> Saved | None:
        """The finished snapshot ``snapshot_id`` as its meta says (None: none, or unfinished)."""
        d = self.dir_of(snapshot_id)
        try:
            meta = json.loads((d / META_NAME).read_text())
            if meta.get("version") != META_VERSION or meta.get("id") != snapshot_id:
                return None
            m = dict(meta["machine"])
            m["extra_cmdline"] = tuple(m.get("extra_cmdline") or ())
            state_bytes = (d / STATE_NAME).stat().st_size
            if state_bytes != int(meta["state_bytes"]):
                return None  # cut after the save
            return Saved(id=snapshot_id, dir=d, machine=qemu.MachineSpec(**m),
                         layers=tuple(str(x) for x in meta["layers"]),
                         disk_mib=int(meta["disk_mib"]), state_bytes=state_bytes,
                         disk_bytes=int(meta["disk_bytes"]), source=str(meta["source"]),
                         created=float(meta["created"]), meta=meta,
                         disk_prefix=self.disk_prefix)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def ids(self) -> set[str]:
        """Every snapshot id with files on the node (finished or not)."""
        ids = {p.name for p in self.root.iterdir()} if self.root.is_dir() else set()
        if self.disks.pool.exists():
            ids |= {n[len(self.disk_prefix):] for n in self.disks.pool.ids()
                    if n.startswith(self.disk_prefix)}
        return {i for i in ids if ID_RE.match(i)}

    def acquire(self, snapshot_id: str, spec: ResolvedSpec, nic: bool) -> Saved:
        """The snapshot for a restore of ``spec`` (held until :meth:`release`): NotFound if
        there is none, BadRequest naming what differs if ``spec`` is another machine."""
        saved = self._users.get(snapshot_id) or self.read(check_id(snapshot_id))
        if saved is None or saved.doomed:
            raise NotFound(f"no machine snapshot {snapshot_id} on this node",
                           snapshot=snapshot_id)
        m, r = saved.machine, spec.resources
        want = {"layers": (saved.layers, tuple(spec.layers)),
                "resources.memory_mib": (m.memory_mib, r.memory_mib),
                "resources.disk_mib": (saved.disk_mib, r.disk_mib),
                "network": (m.nic, nic)}
        for what, (was, now) in want.items():
            if was != now:
                shown = ("a network policy" if was else "no network") if what == "network" \
                    else was
                raise BadRequest(f"machine snapshot {snapshot_id} was saved with {what} "
                                 f"{shown}: a restore runs the saved machine (memory and "
                                 f"devices), so it needs the same {what}",
                                 reason="snapshot_machine", field=what)
        saved.users += 1
        self._users[snapshot_id] = saved
        return saved

    def release(self, saved: Saved) -> None:
        saved.users -= 1
        if saved.users <= 0:
            self._users.pop(saved.id, None)
            if saved.doomed:
                self._remove(saved.id)

    def drop(self, snapshot_id: str) -> list[str]:
        """Remove a snapshot (at once, or after the restores under way); what is left."""
        saved = self._users.get(check_id(snapshot_id))
        if saved is not None:
            saved.doomed = True
            return []
        return self._remove(snapshot_id)

    def _remove(self, snapshot_id: str) -> list[str]:
        shutil.rmtree(self.dir_of(snapshot_id), ignore_errors=True)
        left = self.disks.remove_rw(self.disk_id(snapshot_id)) if self.disks.pool.exists() \
            else []
        if self.dir_of(snapshot_id).exists():
            left.append(str(self.dir_of(snapshot_id)))
        if left:
            log.error("machine snapshot %s not removed: %s", snapshot_id, left)
        return left

    def leftovers(self, snapshot_id: str) -> list[str]:
        left = [str(self.dir_of(snapshot_id))] if self.dir_of(snapshot_id).exists() else []
        if self.disks.pool.exists():
            left += self.disks.leftovers(self.disk_id(snapshot_id))
        return left

