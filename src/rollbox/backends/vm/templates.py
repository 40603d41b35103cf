"""Machine templates of the ``vm`` backend: boot a guest once per key, let its screen settle,
keep its machine (disk + memory), and create sandboxes of that key by restoring it.

What a desktop costs is its boot (45-80 s under TCG to a drawn desktop); a template is a
machine snapshot (``snapshots.py``, its own store ``<data_dir>/vm-machine-templates/`` and pool
subvolumes :data:`TEMPLATE_DISK_PREFIX`) taken of a build VM the backend booted for the key
with nothing of a creator in it (no hidden-path masks, a NIC's filter denying everything),
once the agent answered and the screen has *settled*: :data:`SETTLE_SHOTS` screenshots
:data:`SETTLE_GAP_S` apart that show at most two distinct pictures (a blinking cursor) of one
size. The screenshots are compared by their bytes' sha256 and their PNG header's size only:
never decoded. Its free memory is zeroed first (``balloon.zero_free_memory``: zero pages cost
nothing in the state), then the fork's save (``MicroVMBackend._save_for_fork``), and the build
VM goes. A restore is a snapshot's restore (its own jail, network, disk clone, the guest made
unique).

Key (:func:`template_key`): what the guest booted from (the layer digests, or the disk image's
manifest sha256), the guest artifacts' digest (bzImage, initramfs, manifest), QEMU's version,
the machine's full argv (vCPUs, memory, accelerator, TSC, kernel command line, devices, a NIC)
and the disk size. The snapshot's id is the key's digest, so any change is another template;
when one is built, the others of its family (the same base, vCPUs, memory, disk and NIC: a
kernel, initramfs, QEMU or command line changed since) go. Concurrent creates of one key wait
for one build; a build that fails is not retried for ``vm_template_retry_s`` (those creates
boot cold); a template that fails to restore is dropped and the create boots cold.

Which creates use one: ``vm_full_templates`` ("disk": disk-image guests, the default; "all":
layered images too; "off").

Owns the key, the build and the cache of templates; does not own the snapshot files
(``snapshots.py``) nor the QEMU, jail or disks (the backend's).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.platform_work import run_shell
from rollbox.backends.container.disk import MACHINE_SNAPSHOT_PREFIX
from rollbox.backends.microvm import qemu
from rollbox.backends.microvm.template import BUILD_PREFIX, guest_digest
from rollbox.backends.vm import display
from rollbox.backends.vm.snapshots import MachineSnapshots, Saved
from rollbox.errors import InfraError, NotFound
from rollbox.images.vmdisk import DESKTOP_DRAWN_FILE

if TYPE_CHECKING:
    from rollbox.backends.microvm.backend import MicroVM
    from rollbox.backends.vm.backend import VMBackend

log = logging.getLogger(__name__)

TEMPLATES_DIR = "vm-machine-templates"
TEMPLATE_DISK_PREFIX = MACHINE_SNAPSHOT_PREFIX + "tmpl-"
KEY_VERSION = 1
SETTLE_SHOTS = 6      # screenshots that must agree (at most two pictures: a blinking cursor)
SETTLE_GAP_S = 0.5
# A disk image with an X server (a desktop): its socket exists, a client is connected to it
# and the session said it drew the screen (DESKTOP_DRAWN_FILE; checked by the platform's
# busybox through the agent: an X server's empty root window alone, black, also holds still,
# and xinit's own connection came before the window manager drew: a template of a black
# screen was saved at load 17-25), then DESK_SETTLE_SHOTS screenshots of one picture (a boot
# console's cursor blinks: two pictures, not settled).
X_SOCKET = "/tmp/.X11-unix/X0"
X_SERVER = "/usr/bin/Xorg"
DESK_SETTLE_SHOTS = 10
# connected (state 03) sockets of the X server's address in the guest's /proc/net/unix: a
# client (the window manager) is connected
DESK_CHECK = (f"test -S {X_SOCKET} && grep -q ' 03 .*{X_SOCKET}$' /proc/net/unix && "
              f"test -e {DESKTOP_DRAWN_FILE}")


def template_key(spec: ResolvedSpec, base: str, argv: list[str], guest: str,
                 qemu_version: str) -> str:
    """The key's digest (hex): ``base`` is what the guest booted from (layers or the disk
    image's sha256)."""
    doc = json.dumps({"v": KEY_VERSION, "base": base, "argv": argv, "guest": guest,
                      "qemu": qemu_version, "disk_mib": spec.resources.disk_mib},
                     sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()


def settled(shots: list[tuple[str, tuple[int, int]]], n: int = SETTLE_SHOTS,
            pictures: int = 2) -> bool:
    """Whether the last ``n`` screenshots (sha256, size) show a settled screen: all of one
    size, at most ``pictures`` distinct pictures (2: a blinking cursor)."""
    last = shots[-n:]
    return (len(last) == n and len({size for _, size in last}) == 1
            and len({h for h, _ in last}) <= pictures)


class MachineTemplates:
    """The ``vm`` backend's templates (``vm_full_templates``)."""

    def __init__(self, backend: VMBackend) -> None:
        self.backend = backend
        self.store = MachineSnapshots(backend.settings.data_dir / TEMPLATES_DIR,
                                      backend.disks, TEMPLATE_DISK_PREFIX)
        self._building: dict[str, asyncio.Future[None]] = {}
        self._failed: dict[str, float] = {}

    def wanted(self, spec: ResolvedSpec) -> bool:
        mode = self.backend.settings.vm_full_templates
        return mode == "all" or (mode == "disk" and self.backend.template_base(spec)[1])

    def key_for(self, spec: ResolvedSpec, machine: qemu.MachineSpec) -> tuple[str, str]:
        """(the key's digest, the base it names) of a create of ``spec`` on ``machine``."""
        s, b = self.backend.settings, self.backend
        base = b.template_base(spec)[0]
        guest = guest_digest(b.guest_kernel, b.guest_initrd, s.vm_full_guest_manifest)
        argv = b.argv_for(replace(machine, incoming=False))
        return template_key(spec, base, argv, guest, qemu.version(str(s.qemu_binary))), base

    async def acquire(self, spec: ResolvedSpec, machine: qemu.MachineSpec,
                      timeout_s: float) -> Saved | None:
        """The template of this create, built now if there is none (one build per key);
        held until :meth:`release`. None: boot cold (the build failed now or lately)."""
        try:
            digest, base = await asyncio.to_thread(self.key_for, spec, machine)
        except OSError as exc:
            log.warning("vm template key not computed (%s): booting cold", exc)
            return None
        tid = digest[:32]
        nic = spec.network_rules is not None
        for _ in range(2):
            try:
                return self.store.acquire(tid, spec, nic)
            except NotFound:
                pass
            failed = self._failed.get(tid)
            if failed is not None and \
                    time.monotonic() - failed < self.backend.settings.vm_template_retry_s:
                return None
            build = self._building.get(tid)
            if build is None:
                build = asyncio.ensure_future(self._build(tid, base, spec, machine, timeout_s))
                self._building[tid] = build
                build.add_done_callback(lambda _f: self._building.pop(tid, None))
            try:
                await asyncio.shield(build)
            except Exception as exc:  # noqa: BLE001 - logged; the create boots cold
                self._failed[tid] = time.monotonic()
                log.warning("vm template %s not built: %s", tid[:12], exc)
                return None
        return None

    def release(self, saved: Saved) -> None:
        self.store.release(saved)

    def drop(self, saved: Saved, why: str) -> None:
        """A template that did not restore: removed (the next create builds it again)."""
        log.warning("vm template %s dropped: %s", saved.id[:12], why)
        self.store.drop(saved.id)

    def clear(self) -> list[str]:
        """Every template removed (tests, node teardown); what is left."""
        left: list[str] = []
        for tid in self.store.ids():
            left += self.store.drop(tid)
        return left

    async def _build(self, tid: str, base: str, spec: ResolvedSpec,
                     machine: qemu.MachineSpec, timeout_s: float) -> None:
        b = self.backend
        build_id = f"{BUILD_PREFIX}{tid[:12]}{secrets.token_hex(3)}"
        # nothing of the first creator's spec goes into the saved guest (as microVM templates)
        bare = replace(spec, hidden_paths=(), machine_snapshot=None,
                       network_rules=None if spec.network_rules is None else ())
        r = spec.resources
        family = f"{base} cpus={machine.cpus} mib={r.memory_mib} disk={r.disk_mib} " \
                 f"nic={machine.nic}"  # a template of another key in it is stale
        t0 = time.monotonic()
        vm = await b.boot(build_id, bare, machine, timeout_s)
        try:
            await self._settle(vm, b.template_base(spec)[1])
            await b.zero_free_memory(vm)
            staging = await asyncio.to_thread(self.store.staging, tid)
            try:
                await b._save_for_fork(vm, False, staging, self.store.disk_id(tid))
                await asyncio.to_thread(self.store.seal, tid, machine, bare, build_id,
                                        base=base, family=family, template=True)
            except BaseException:
                await asyncio.to_thread(self.store.drop, tid)
                raise
        finally:
            await b.destroy(vm)
        for old in self.store.ids() - {tid}:  # the same guest and resources' older keys
            saved = self.store.read(old)
            if saved is not None and saved.meta.get("family") == family:
                self.store.drop(old)
        log.info("vm template %s built in %.1f s", tid[:12], time.monotonic() - t0)

    async def _settle(self, vm: MicroVM, disk_image: bool) -> None:
        """Until the build VM's screen settled (:func:`settled`; a disk image with an X
        server: its socket there with a client, :data:`DESK_CHECK`, and one picture), at most
        ``vm_full_template_settle_s``; InfraError past it."""
        screen = self.backend.display(vm)
        limit = self.backend.settings.vm_full_template_settle_s
        deadline = time.monotonic() + limit
        if disk_image:  # a desktop: an image with an X server
            code, _ = await run_shell(vm, f"test -e {X_SERVER}", {}, 30, tail=0)
            disk_image = code == 0
        n, pictures = (DESK_SETTLE_SHOTS, 1) if disk_image else (SETTLE_SHOTS, 2)
        shots: list[tuple[str, tuple[int, int]]] = []
        up = not disk_image
        while not (up and settled(shots, n, pictures)):
            if time.monotonic() > deadline:
                raise InfraError(f"vm template build {vm.id}: the screen did not settle in "
                                 f"{limit:.0f} s")
            if not up:
                code, _ = await run_shell(vm, DESK_CHECK, {}, 30, tail=0)
                up = code == 0
            data = await screen.screenshot()
            shots.append((hashlib.sha256(data).hexdigest(), display.png_size(data)))
            del shots[:-n]
            await asyncio.sleep(SETTLE_GAP_S)
