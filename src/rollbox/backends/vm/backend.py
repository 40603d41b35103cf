"""Lifecycle of full-VM sandboxes: the microVM backend's, with a q35 machine and a display.

:class:`VMBackend` is a :class:`~rollbox.backends.microvm.backend.MicroVMBackend` whose guests
are ``machine.py``'s q35 VMs booted by SeaBIOS from ``make vmguest``'s bzImage and initramfs:
create (checks, uid slot, layers, writable disk, jail, cgroups, QEMU, the agent answers),
adopt, destroy with the verified teardown, pause/resume, exec/files/events through the agent,
network policy at the tap, usage and leftovers are the microVM's code, run on this machine.
Its own run dir (``<run>/qvm/<id>/``) keeps its jails apart from the microVMs'. A spec with
``disk_image`` (a VM disk image, ``rollbox.images.vmdisk``) boots that image instead of layers:
its root is a qcow2 overlay of the read-only base (``rootdisk.py``; the machine names the disk
in ``MachineSpec.root_disk``), the agent hands PID 1 to the image's init (docs/backends/vm.md,
"Two kinds of guest"); a restore or fork child of one gets a clone of the saved overlay over
the same base. Templates and spares are off. A snapshot is the machine (disk + memory, ``snapshots.py``; the microVM fork's
save, kept), restored as new ``vm`` sandboxes by a create whose spec names it; fork is the
microVM's (the same save, restored into each child). The accelerator is the node's microVM
probe's (one probe per node; both backends run the same QEMU on the same /dev/kvm).

Computer use: :meth:`VMBackend.display` gives a :class:`VmDisplay` (screenshot, size, input
actions through ``display.py``, a VNC stream for a live view), each QMP operation under the
VM's lock, a paused VM refused.

Trust, as microVMs: the guest's root owns the guest; exec results are guest-reported; the
screen is drawn by the guest and proves nothing.

Owns the differences from microVMs only; does not touch the journal, admission, the API or
the event log (the edge records actions).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rollbox.backends.base import (
    BackendCapacity, CaptureOptions, CaptureResult, MachineSnapshot, ResolvedSpec,
)
from rollbox.backends.cancellation import to_the_end
from rollbox.backends.microvm.accel import AccelChoice
from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm import qemu, qmp
from rollbox.backends.microvm.backend import MicroVM, MicroVMBackend
from rollbox.backends.microvm.jail import Bind
from rollbox.backends.microvm.steps import Steps
from rollbox.backends.microvm.template import BUILD_PREFIX, Template, TemplateLoadError
from rollbox.backends.ports import SocketPort
from rollbox.backends.vm import display, machine, rfb, rootdisk
from rollbox.backends.vm.snapshots import SNAPSHOTS_DIR, MachineSnapshots, Saved
from rollbox.backends.vm.templates import MachineTemplates
from rollbox.config import Settings
from rollbox.errors import BadRequest, ConnectionLost, InfraError, SandboxPaused
from rollbox.images.store import ImageStore
from rollbox.isolation.userns import UidSlots
from rollbox.models import ComputerAction, ComputerActionResult, DisplayInfo

log = logging.getLogger(__name__)

KIND = "vm"
TTY1_CMDLINE = "rollbox.tty1=1"  # native/agent/agent.c: the platform's sh on tty1
SIZE_FRESH_S = 1.0  # a display size this recent is used to check an action's coordinates


class VmDisplay:
    """The screen and input of one VM (``backends.base.Display``)."""

    def __init__(self, vm: MicroVM, settings: Settings,
                 sizes: dict[str, tuple[tuple[int, int], float]]) -> None:
        self.vm = vm
        self.settings = settings
        self._sizes = sizes  # the backend's: sandbox id -> (last screenshot's size, when)

    def _check_running(self) -> None:
        if self.vm.paused:
            raise SandboxPaused(f"sandbox {self.vm.id} is paused: resume it first",
                                sandbox_id=self.vm.id)

    async def _shot(self) -> bytes:
        self._check_running()
        async with self.vm.lock:
            self._check_running()
            async with qmp.session(self.vm.qmp_path) as q:
                data = await display.screendump(q, self.settings.vm_screenshot_max_bytes)
        self._sizes[self.vm.id] = (display.png_size(data), time.monotonic())
        return data

    async def screenshot(self) -> bytes:
        return await self._shot()

    async def _size(self) -> tuple[int, int]:
        known = self._sizes.get(self.vm.id)
        if known is not None and time.monotonic() - known[1] < SIZE_FRESH_S:
            return known[0]
        return display.png_size(await self._shot())

    def known_size(self) -> tuple[tuple[int, int], float] | None:
        """(size, when) of this VM's last screenshot, if any: no QMP."""
        return self._sizes.get(self.vm.id)

    async def refresh_size(self) -> None:
        """A screenshot for its size only (a live view's background refresh); a paused or
        unreachable VM leaves the known size as it was."""
        try:
            await self._shot()
        except (SandboxPaused, InfraError, OSError) as exc:
            log.debug("vm %s: display size not refreshed: %s", self.vm.id, exc)

    async def vnc_client(self) -> socket.socket:
        """A connected VNC (RFB) stream to this VM's screen, for a live view: one end of a
        socketpair the other end of which QEMU gets with QMP ``getfd`` + ``add_client
        protocol=vnc`` (QEMU runs ``-vnc none``: nothing listens, in the jail or on the host).
        The caller owns the returned socket (non-blocking) and closes it; QEMU's end closes
        with it. What QEMU sends on it is hostile (RFB from a guest-facing process)."""
        self._check_running()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            async with self.vm.lock:
                async with qmp.session(self.vm.qmp_path) as q:
                    name = f"vnc{secrets.token_hex(4)}"
                    await q.getfd(theirs.fileno(), name)
                    await q.execute("add_client", {"protocol": "vnc", "fdname": name,
                                                   "skipauth": True})
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        return ours

    async def live_view(self, allow_input: Callable[[], bool]) -> LiveView:
        """The live view's checked stream (``base.Display.live_view``)."""
        return LiveView(self, await self.vnc_client(), allow_input)

    async def send_input(self, batches: list[list[dict[str, Any]]]) -> None:
        """Input batches of the live view, through the one QMP input path the agent's actions
        take (``display.send``: to the display's console, so the pointer reaches the tablet
        bound to it), under the VM's lock, unpaced (the person's own timing); a paused VM
        drops them (its viewer sees the screen stand still)."""
        if not batches or self.vm.paused:
            return
        async with self.vm.lock:
            if self.vm.paused:
                return
            async with qmp.session(self.vm.qmp_path) as q:
                await display.send(q, display.VIEW_INPUT, batches)

    async def info(self) -> DisplayInfo:
        w, h = display.png_size(await self._shot())
        return DisplayInfo(width=w, height=h)

    async def act(self, action: ComputerAction) -> ComputerActionResult:
        size = await self._size()
        batches = display.plan(action, size, self.settings.vm_type_max_chars)  # checked first
        self._check_running()
        async with self.vm.lock:
            self._check_running()
            ts = time.time()
            async with qmp.session(self.vm.qmp_path) as q:
                await display.send(q, action.action, batches)
        digest = None
        if action.screenshot_hash:
            digest = hashlib.sha256(await self._shot()).hexdigest()
        return ComputerActionResult(action=action.action,
                                    display=DisplayInfo(width=size[0], height=size[1]),
                                    events=display.events_in(batches), ts=ts,
                                    screenshot_sha256=digest)


class LiveView:
    """One viewer's stream (a PortStream): QEMU's RFB bytes to the viewer as they are; the
    viewer's through :class:`~rollbox.backends.vm.rfb.ClientFilter`, its input sent by
    :meth:`VmDisplay.send_input` while ``allow_input()`` is true. Closing it lets go of what
    it held down in the guest, then closes the socket (QEMU drops the client).

    Writes run one at a time, in the order they were called (a FIFO lock: a caller that
    does not wait for one write before the next still gets its messages in order). Pointer
    positions are scaled by the display size known without a screenshot: the newer of this
    stream's own ServerInit (:class:`~rollbox.backends.vm.rfb.ServerInit`, read as QEMU's
    bytes pass) and the VM's last screenshot; when that is older than ``SIZE_FRESH_S`` a
    screenshot is taken in the background (one at a time) for the messages after (a guest
    that changes its mode meanwhile). Only a pointer message before any size is known waits
    for one."""

    def __init__(self, screen: VmDisplay, sock: socket.socket,
                 allow_input: Callable[[], bool]) -> None:
        self.screen = screen
        self.port = SocketPort(sock)
        self.allow_input = allow_input
        self.filter = rfb.ClientFilter()
        self.server = rfb.ServerInit()
        # in the log lines: one sandbox's streams told apart (a raw client's refusal beside a
        # page's writes once read as one stream's writes overtaking each other)
        self.tag = f"{screen.vm.id}/{secrets.token_hex(3)}"
        log.debug("live view %s: opened", self.tag)
        self._server_seen = 0.0  # when ServerInit's size was read
        self._writing = asyncio.Lock()
        self._refresh: asyncio.Task[None] | None = None
        self._closed = False
        self._reading = 0

    async def read(self) -> bytes:
        # A close while a read waits shuts the socket down (the read wakes with b"") and
        # leaves closing it to that read: a socket closed under a pending read never wakes it.
        self._reading += 1
        try:
            data = await self.port.read()
        except OSError:
            return b""
        finally:
            self._reading -= 1
            if self._closed and not self._reading:
                await self.port.close()
        if not self.server.done:
            self.server.feed(data)
            if self.server.size is not None:
                self._server_seen = time.monotonic()
        return data

    def _known_size(self) -> tuple[tuple[int, int], float] | None:
        """(size, when seen) of the newer of ServerInit's and the last screenshot's."""
        shot = self.screen.known_size()
        own = (self.server.size, self._server_seen) if self.server.size else None
        if shot is None or (own is not None and own[1] > shot[1]):
            return own
        return shot

    def _refresh_if_stale(self, seen: float) -> None:
        if time.monotonic() - seen >= SIZE_FRESH_S and not self._closed and (
                self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.ensure_future(self.screen.refresh_size())

    async def write(self, data: bytes) -> None:
        async with self._writing:
            try:
                await self._write(data)
            except Exception as exc:
                log.debug("live view %s: %d bytes from the viewer ended the stream: %r",
                          self.tag, len(data), exc)
                raise

    async def _write(self, data: bytes) -> None:
        if self._closed:
            raise ConnectionLost("the live view's stream is closed")
        allow = self.allow_input() and not self.screen.vm.paused
        known = self._known_size() if allow else None
        if allow:
            try:  # no size known (no ServerInit yet, no screenshot): the one wait
                self.filter.size = known[0] if known else await self.screen._size()
            except SandboxPaused:
                allow = False
        pointers = self.filter.pointers
        forward, batches = self.filter.feed(data, allow)  # BadRequest: the caller ends it
        if known is not None and self.filter.pointers > pointers:
            self._refresh_if_stale(known[1])
        if forward:
            try:
                await self.port.write(forward)
            except OSError as exc:  # closed meanwhile
                raise ConnectionLost(f"the live view's stream is closed: {exc}") from None
        t0 = time.monotonic()
        await self.screen.send_input(batches)
        log.debug("live view %s: %d bytes in, %d forwarded, %d input batches (allow=%s) "
                  "in %.3f s", self.tag, len(data), len(forward), len(batches), allow,
                  time.monotonic() - t0)

    async def write_eof(self) -> None:
        await self.port.write_eof()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        log.debug("live view %s: closed", self.tag)
        try:
            if self._refresh is not None:
                self._refresh.cancel()
                with contextlib.suppress(BaseException):
                    await self._refresh
            with contextlib.suppress(Exception):
                await self.screen.send_input(self.filter.release())
        finally:
            with contextlib.suppress(OSError):
                self.port.sock.shutdown(socket.SHUT_RDWR)
            if not self._reading:
                await self.port.close()


SIZES_KEEP = 4096  # display sizes a backend keeps (VMBackend.display drops the oldest)


class VMBackend(MicroVMBackend):
    kind = KIND
    snapshot_kind = "machine"

    def __init__(self, settings: Settings, slots: UidSlots, store: ImageStore,
                 pool: DiskPool | None = None, *, accel_from: MicroVMBackend | None = None,
                 **kw: object) -> None:
        super().__init__(settings, slots, store, pool, **kw)  # type: ignore[arg-type]
        self.run_root = settings.run_dir / "qvm"
        self.templates = None  # no template restore (see the module docstring)
        self.snapshots = MachineSnapshots(settings.data_dir / SNAPSHOTS_DIR, self.disks)
        self.machine_templates = MachineTemplates(self)
        self.accel_from = accel_from
        self.rootdisks = rootdisk.RootDisks(settings, self.disks.pool)
        # sandbox id -> (display size, when seen): each VM's last screenshot's size
        self._display_sizes: dict[str, tuple[tuple[int, int], float]] = {}

    @property
    def guest_kernel(self) -> Path:
        return self.settings.vm_full_kernel

    @property
    def guest_initrd(self) -> Path:
        return self.settings.vm_full_initrd

    async def _choose_accel(self) -> AccelChoice:
        """The node's microVM backend's choice when it has made one (it starts first): no
        second probe boot; else this backend's own probe."""
        if self.accel_from is not None and self.accel_from.accel is not None:
            return self.accel_from.accel
        return await super()._choose_accel()

    def capacity(self) -> BackendCapacity:
        cap = super().capacity()
        cap.facts["computer_use"] = True
        return cap

    def forks(self) -> bool:
        return True  # the microVM's fork: a saved image restored into each child, no template

    def fs_pauses(self) -> bool:
        """The microVM's filesystem-only pause: the guest synced, QEMU stopped (its disks
        flushed) and killed; resume boots the q35 machine cold over what it kept (the rw disk,
        or a disk image guest's qcow2 overlay: :meth:`resume_binds`). A VM restored from a
        template or a machine snapshot boots cold too: its disk is its own clone."""
        return True

    def kept_disk(self, sandbox_id: str, machine: qemu.MachineSpec) -> Path:
        """A disk image guest keeps its qcow2 overlay (it has no rw disk); layered guests
        their rw disk."""
        if machine.root_disk:
            return self.rootdisks.overlay_path(sandbox_id)
        return super().kept_disk(sandbox_id, machine)

    async def resume_binds(self, h: MicroVM, spec: ResolvedSpec,  # type: ignore[override]
                           machine: qemu.MachineSpec) -> list[Bind]:
        """A disk image guest's: the base (checked again) read-only and the overlay it kept
        (never opened here: handed to the jailed QEMU as the guest left it); layered guests
        as microVMs."""
        if not machine.root_disk:
            return await super().resume_binds(h, spec, machine)
        disk = await asyncio.to_thread(self.rootdisks.verified, machine.root_disk)
        return [Bind(self.guest_kernel, qemu.KERNEL), Bind(self.guest_initrd, qemu.INITRD),
                Bind(disk.disk, rootdisk.BASE_IMG),
                Bind(self.rootdisks.overlay_path(h.id), rootdisk.ROOT_QCOW2, writable=True)]

    def argv_for(self, spec: qemu.MachineSpec) -> list[str]:
        return machine.argv(spec, str(self.settings.qemu_binary))

    def check_spec(self, spec: ResolvedSpec) -> None:
        super().check_spec(spec)
        if spec.vm_console == "shell" and (spec.hidden_paths or spec.disk_image):
            # the shell starts at boot, before the paths' Landlock rules; a disk image's tty1
            # is its own init's
            raise BadRequest("vm_console \"shell\" is for layered images without "
                             "hidden_paths", reason="vm_console")
        if spec.disk_image and spec.layers:
            raise BadRequest(f"VM disk image {spec.disk_image!r} takes no layers",
                             image=spec.disk_image)
        if spec.disk_image and spec.hidden_paths:
            # the agent's masks would be the image init's to undo: no defence on a disk guest
            raise BadRequest(f"hidden paths are not offered on VM disk image "
                             f"{spec.disk_image!r} (its init is the guest's root)",
                             image=spec.disk_image)

    def machine_for(self, spec: ResolvedSpec) -> qemu.MachineSpec:
        """The microVM's machine; a disk image's root instead of layers; ``vm_console=
        "shell"`` adds ``rollbox.tty1=1`` (the agent starts the platform's sh on tty1, the
        screen, inside the sandbox root)."""
        m = super().machine_for(spec)
        if spec.vm_console == "shell":
            m = replace(m, extra_cmdline=(*m.extra_cmdline, TTY1_CMDLINE))
        if not spec.disk_image:
            return m
        disk = self.rootdisks.resolve(spec.disk_image)
        return replace(m, layers=0, rw_disk=False, root_disk=disk.name, init=disk.init)

    async def disk_binds(self, sandbox_id: str, spec: ResolvedSpec,  # type: ignore[override]
                         machine: qemu.MachineSpec, host_uid: int, template: Template | None,
                         ram_file: Path | None, steps: Steps) -> list[Bind]:
        """A disk image guest's root (``rootdisk.py``): the base ``machine.root_disk``
        (checked, hashed once) read-only, and over it a new qcow2 overlay in the sandbox's
        subvolume, or for a restore (a snapshot, a fork child) a copy-on-write clone of the
        saved one (a file the guest wrote: cloned and handed to QEMU, never opened here).
        Layered guests as microVMs."""
        if not machine.root_disk:
            return await super().disk_binds(sandbox_id, spec, machine, host_uid, template,
                                            ram_file, steps)
        disk = await asyncio.to_thread(self.rootdisks.verified, machine.root_disk)
        steps.lap("disk_verify")
        if template is None:
            overlay = await to_the_end(asyncio.to_thread(
                self.rootdisks.create_overlay, sandbox_id, disk,
                spec.resources.disk_mib << 20, host_uid))
            steps.lap("disk_overlay")
        else:
            overlay = await to_the_end(asyncio.to_thread(
                self.rootdisks.clone_overlay, template.disk_id, sandbox_id, host_uid))
            steps.lap("disk_clone")
        return [Bind(self.guest_kernel, qemu.KERNEL), Bind(self.guest_initrd, qemu.INITRD),
                Bind(disk.disk, rootdisk.BASE_IMG),
                Bind(overlay, rootdisk.ROOT_QCOW2, writable=True)]

    async def capture_writable(self, h: MicroVM, dest: Path,  # type: ignore[override]
                               opts: CaptureOptions) -> CaptureResult:
        if h.machine.root_disk:
            raise BadRequest(f"sandbox {h.id} runs VM disk image {h.machine.root_disk!r}: it "
                             "has no writable layer to snapshot as an image layer (its "
                             "snapshot is the machine)", sandbox_id=h.id)
        return await super().capture_writable(h, dest, opts)

    async def start(self) -> None:
        """The microVM's node start, and build VMs of templates an earlier edge left."""
        await super().start()
        for left_id in self.host_sandbox_ids(BUILD_PREFIX):
            await self.cleanup(left_id, None)

    def template_base(self, spec: ResolvedSpec) -> tuple[str, bool]:
        """(what a guest of ``spec`` boots from, for a template's key; whether that is a
        disk image)."""
        if spec.disk_image:
            return "disk:" + str(self.rootdisks.resolve(spec.disk_image).manifest["sha256"]), True
        return "layers:" + ",".join(spec.layers), False

    async def create(self, sandbox_id: str, spec: ResolvedSpec,  # type: ignore[override]
                     **kw: object) -> MicroVM:
        """Restored from ``spec.machine_snapshot`` (:meth:`_restore_machine`), or from the
        spec's machine template where ``vm_full_templates`` wants one (the first create of a
        key builds it: ``templates.py``; a template that fails to restore is dropped and the
        create boots cold), else booted cold. ``kw`` (a machine, an unhardened guest: tests
        and the probe) always boots cold."""
        if spec.machine_snapshot is not None:
            return await self._restore_machine(sandbox_id, spec)
        if not kw and self.machine_templates.wanted(spec):
            self.check_spec(spec)
            machine = self.machine_for(spec)
            saved = await self.machine_templates.acquire(spec, machine,
                                                         self.settings.vm_boot_timeout_s)
            if saved is not None:
                try:
                    return await self._restore_saved(sandbox_id, spec, saved)
                except TemplateLoadError as exc:
                    self.machine_templates.drop(saved, str(exc))
                    log.warning("vm %s: template did not restore, booting cold: %s",
                                sandbox_id, exc)
                except InfraError as exc:
                    log.warning("vm %s: restore failed, booting cold: %s", sandbox_id, exc)
                finally:
                    self.machine_templates.release(saved)
        return await super().create(sandbox_id, spec, **kw)  # type: ignore[arg-type]

    async def _restore_machine(self, sandbox_id: str, spec: ResolvedSpec) -> MicroVM:
        """A new VM from a machine snapshot: the saved machine (BadRequest if ``spec`` asks
        another: ``snapshots.acquire``) in a fresh jail, its own copy-on-write disk clone and
        network, the saved state loaded by the jailed QEMU, the guest made unique; everything
        torn down on failure (an InfraError)."""
        assert spec.machine_snapshot is not None
        self.check_spec(spec)
        saved = self.snapshots.acquire(spec.machine_snapshot, spec,
                                       nic=spec.network_rules is not None)
        try:
            return await self._restore_saved(sandbox_id, spec, saved)
        finally:
            self.snapshots.release(saved)

    async def _restore_saved(self, sandbox_id: str, spec: ResolvedSpec,
                             saved: Saved) -> MicroVM:
        if saved.machine.accel != self._accel_name():
            raise BadRequest(f"machine snapshot {saved.id} was saved under "
                             f"{saved.machine.accel}, this node runs VMs under "
                             f"{self._accel_name()}: it can not restore it",
                             reason="snapshot_machine")
        vm = await self.boot(sandbox_id, spec, saved.machine, self.settings.vm_boot_timeout_s,
                             template=saved.template())
        vm.template = ""  # not the microVM template cache's: a saved machine's own image
        self._track(vm)
        return vm

    async def save_machine(self, h: MicroVM, snapshot_id: str,  # type: ignore[override]
                           spec: ResolvedSpec, paused: bool) -> MachineSnapshot:
        """Disk + memory of ``h`` kept as ``snapshot_id`` (``snapshots.py``): the fork's save
        (QMP ``stop`` unless paused, the state migrated into a file by fd, the disk's
        subvolume snapshotted, ``cont``) into the snapshot's own dir and disk; ``spec`` is
        the sandbox's (its layers and disk size go into the meta). Nothing is left of a save
        that fails."""
        staging = await asyncio.to_thread(self.snapshots.staging, snapshot_id)
        try:
            frozen_s, _ = await self._save_for_fork(h, paused, staging,
                                                    self.snapshots.disk_id(snapshot_id))
            saved = await asyncio.to_thread(self.snapshots.seal, snapshot_id, h.machine, spec,
                                            h.id)
        except BaseException:
            await asyncio.to_thread(self.snapshots.drop, snapshot_id)
            raise
        return MachineSnapshot(snapshot_id=snapshot_id, state_bytes=saved.state_bytes,
                               disk_bytes=saved.disk_bytes, frozen_s=frozen_s)

    def drop_machine(self, snapshot_id: str) -> list[str]:
        return self.snapshots.drop(snapshot_id)

    def machine_snapshots(self) -> set[str]:
        return self.snapshots.ids()

    def detach(self, h: MicroVM) -> None:  # type: ignore[override]
        self._display_sizes.pop(h.id, None)
        super().detach(h)

    def display(self, h: MicroVM) -> VmDisplay:  # type: ignore[override]
        if len(self._display_sizes) > SIZES_KEEP:
            del self._display_sizes[next(iter(self._display_sizes))]
        return VmDisplay(h, self.settings, self._display_sizes)
