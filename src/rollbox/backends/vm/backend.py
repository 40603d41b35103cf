"""Lifecycle of full-VM sandboxes: the microVM backend's, with a q35 machine and a display.

:class:`VMBackend` is a :class:`~rollbox.backends.microvm.backend.MicroVMBackend` whose guests
are ``machine.py``'s q35 VMs booted by SeaBIOS from ``make vmguest``'s bzImage and initramfs:
create (checks, uid slot, layers, writable disk, jail, cgroups, QEMU, the agent answers),
adopt, destroy with the verified teardown, pause/resume, exec/files/events through the agent,
network policy at the tap, usage and leftovers are the microVM's code, run on this machine.
Its own run dir (``<run>/qvm/<id>/``) keeps its jails apart from the microVMs'. Templates,
spares and fork are off (a VM restores nothing yet: docs/backends/vm.md, Snapshot). The
accelerator is the node's microVM probe's (one probe per node; both backends run the same
QEMU on the same /dev/kvm).

Computer use: :meth:`VMBackend.display` gives a :class:`VmDisplay` (screenshot, size, input
actions through ``display.py``, a VNC stream for a live view), each QMP operation under the
VM's lock, a paused VM refused.

Trust, as microVMs: the guest's root owns the guest; exec results are guest-reported; the
screen is drawn by the guest and proves nothing.

Owns the differences from microVMs only; does not touch the journal, admission, the API or
the event log (the edge records actions).
"""
from __future__ import annotations

import hashlib
import logging
import secrets
import socket
import time
from pathlib import Path

from rollbox.backends.base import BackendCapacity, ResolvedSpec
from rollbox.backends.microvm.accel import AccelChoice
from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm import qemu, qmp
from rollbox.backends.microvm.backend import MicroVM, MicroVMBackend
from rollbox.backends.vm import display, machine
from rollbox.config import Settings
from rollbox.errors import SandboxPaused
from rollbox.images.store import ImageStore
from rollbox.isolation.userns import UidSlots
from rollbox.models import ComputerAction, ComputerActionResult, DisplayInfo

log = logging.getLogger(__name__)

KIND = "vm"
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


SIZES_KEEP = 4096  # display sizes a backend keeps (VMBackend.display drops the oldest)


class VMBackend(MicroVMBackend):
    kind = KIND

    def __init__(self, settings: Settings, slots: UidSlots, store: ImageStore,
                 pool: DiskPool | None = None, *, accel_from: MicroVMBackend | None = None,
                 **kw: object) -> None:
        super().__init__(settings, slots, store, pool, **kw)  # type: ignore[arg-type]
        self.run_root = settings.run_dir / "qvm"
        self.templates = None  # no template restore, no fork (see the module docstring)
        self.accel_from = accel_from
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
        cap.fork = False
        return cap

    def argv_for(self, spec: qemu.MachineSpec) -> list[str]:
        return machine.argv(spec, str(self.settings.qemu_binary))

    async def create(self, sandbox_id: str, spec: ResolvedSpec,  # type: ignore[override]
                     **kw: object) -> MicroVM:
        vm = await super().create(sandbox_id, spec, **kw)  # type: ignore[arg-type]
        vm.kind = KIND
        return vm

    async def adopt(self, sandbox_id: str, spec: ResolvedSpec,  # type: ignore[override]
                    state: dict[str, object], paused: bool) -> MicroVM | None:
        vm = await super().adopt(sandbox_id, spec, state, paused)  # type: ignore[arg-type]
        if vm is not None:
            vm.kind = KIND
        return vm

    def detach(self, h: MicroVM) -> None:  # type: ignore[override]
        self._display_sizes.pop(h.id, None)
        super().detach(h)

    def display(self, h: MicroVM) -> VmDisplay:  # type: ignore[override]
        if len(self._display_sizes) > SIZES_KEEP:
            del self._display_sizes[next(iter(self._display_sizes))]
        return VmDisplay(h, self.settings, self._display_sizes)
