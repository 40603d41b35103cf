"""Lifecycle of microVM sandboxes on one node: create, adopt after a restart, destroy, verify.

Creation order: checks against the node (vCPUs, memory) -> uid slot -> layer files (lazy ones
pulled) -> writable disk (sparse ext4 file in its own capped subvolume) -> jail dir and the
listening sockets -> cgroups with the sandbox's limits -> QEMU in its jail -> the guest's
agent answers on the virtio-serial port within the boot timeout (watched: a QEMU that dies
ends the wait at once). Any failure tears everything down and raises a typed error; a guest
that never answers is an InfraError after ``vm_boot_timeout_s``. A restore from a template
takes a spare QEMU of it when there is one (``spares.py``: everything up to QEMU in its jail
done ahead, RAM faulted in), else makes its own; either way it then loads the saved state. A
fork's children take spares of their exact machine too (``vm_fork_spares``), the fork's disk
cloned into the spare's disk file first; no spare is started again until every child of the
fork answered its first command (or is gone, or ``vm_boot_timeout_s`` passed: a guest that
never answers delays refills by that much, no more).

QEMU outlives the edge: after a restart :meth:`adopt` finds it by its journaled pid (checked
to be in the sandbox's cgroup) and reconnects to the agent's socket. Destruction kills by
cgroup, reaps, removes the cgroups, the jail dir with its sockets and the disk's subvolume,
and checks that nothing of the sandbox is left (:meth:`leftovers`: QEMU processes of its uid,
cgroups, jail dir and sockets, disk, netns).

Trust: the guest's root owns the guest (it can stop or impersonate the agent), so every exec
result is marked guest-reported; the channel reaches only this VM (a listening socket the
edge bound in a root-only dir, handed to QEMU as an fd).

Owns the VM handles and the order of the pieces; does not touch the journal, admission or the
API (the edge's), nor the agent protocol (``rollbox.agent``).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from rollbox.agent.tools import PlatformTools
from rollbox.backends.base import (
    BackendCapacity, CaptureOptions, CaptureResult, ForkResult, MachineSnapshot,
    NetworkAttachment, PortStream, ResolvedSpec, SessionSlot, Usage,
)
from rollbox.backends.cancellation import all_or_raise, teardown_after, to_the_end
from rollbox.backends.platform_work import run_shell
from rollbox.backends.ports import relay_through_agent
from rollbox.backends.container.disk import FORK_PREFIX, DiskPool
from rollbox.backends.microvm import balloon, ksm, qemu, qmp
from rollbox.backends.microvm import net as vmnet
from rollbox.backends.microvm.accel import AccelChoice, probe_accel
from rollbox.backends.microvm.disks import VmDisks
from rollbox.backends.container.bundle import normalize_hidden
from rollbox.backends.microvm.files import capture as vm_capture
from rollbox.backends.microvm.files import (
    cut_file_ops, in_sandbox_request, live_channel, mask_hidden, vm_files,
)
from rollbox.backends.microvm.jail import (
    Bind, Jail, Limits, set_cpu, uid_processes, vcpus,
)
from rollbox.backends.microvm.spares import Recipe, Spare, Spares
from rollbox.backends.microvm.steps import Steps
from rollbox.backends.microvm.template import (
    BUILD_PREFIX, SPARE_PREFIX, Template, TemplateLoadError, VmTemplates, load_state,
    make_unique, wait_migration,
)
from rollbox.config import Settings
from rollbox.errors import BadRequest, InfraError
from rollbox.images.store import ImageStore
from rollbox.isolation import cgroups, netns, qos, syscalls
from rollbox.isolation.userns import UidSlots
from rollbox.models import FileStat
from rollbox.netpolicy.policy import parse_rules

log = logging.getLogger(__name__)

CONSOLE_KEEP = 16 << 10
NET_CONFIG_TIMEOUT_S = 20.0
ADOPT_TIMEOUT_S = 5.0
# The edge's descriptors per live microVM (MicroVMBackend.edge_fds).
MICROVM_FDS = 3
MICROVM_NETWORK_FDS = 2
SPARE_FDS = 3  # the edge's descriptors per spare QEMU (MicroVMBackend.node_fds)
FIRST_ANSWER_POLL_S = 0.05  # how often a fork's hold on spare refills looks at its children
FS_SYNC_TIMEOUT_S = 30.0  # a guest's sync before a filesystem-only pause stops it
QEMU_PIDS = 256  # QEMU's threads: vCPUs, main loop, RCU, the block layer's worker pool
FULL_ROOT_ARG = "rollbox.fullroot=1"  # the agent leaves commands every capability (agent.c)

# (socket path, timeout) -> the agent's channel once it said READY. The agent's byte-stream
# transport is rollbox.agent's (lane guest); tests of the VM plumbing before it existed gave
# their own.
AgentConnector = Callable[[str, float], Awaitable[Any]]


async def connect_agent_stream(path: str, timeout: float) -> Any:
    from rollbox.agent.channel import AgentChannel

    return await AgentChannel.connect_stream(path, timeout=timeout)


class UnavailableFiles:
    """Files of a microVM before the agent-side file operations exist: every call is a
    typed refusal, never a host-side access to the guest's disk."""

    def _refuse(self) -> BadRequest:
        return BadRequest("file operations are not available on microVM sandboxes yet")

    async def read(self, path: str, max_bytes: int | None = None) -> bytes:
        raise self._refuse()

    async def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        raise self._refuse()

    async def read_stream(self, path: str, max_bytes: int | None = None,
                          offset: int = 0) -> AsyncIterator[bytes]:
        raise self._refuse()
        yield b""  # pragma: no cover

    async def write_stream(self, path: str, chunks: AsyncIterator[bytes], mode: int = 0o644,
                           max_bytes: int | None = None,
                           xattrs: dict[str, str] | None = None) -> int:
        raise self._refuse()

    async def stat(self, path: str) -> FileStat:
        raise self._refuse()

    async def list(self, path: str) -> list[FileStat]:
        raise self._refuse()

    async def mkdir(self, path: str, parents: bool = False) -> None:
        raise self._refuse()

    async def remove(self, path: str, recursive: bool = False) -> None:
        raise self._refuse()

    async def upload_tar(self, path: str, chunks: AsyncIterator[bytes], *,
                         links: bool = True) -> int:
        raise self._refuse()

    async def download_tar(self, path: str) -> AsyncIterator[bytes]:
        raise self._refuse()
        yield b""  # pragma: no cover

    def close(self) -> None:
        pass


@dataclass
class MicroVM:
    """One live microVM sandbox (a ``SandboxHandle``)."""
    id: str
    slot: int
    host_uid: int
    jail: Jail
    pid: int
    machine: qemu.MachineSpec
    channel: Any
    image_env: dict[str, str] = field(default_factory=dict)
    files: Any = field(default_factory=UnavailableFiles)
    network: NetworkAttachment | None = None
    next_session: int = 0
    squeezed: bool = False
    paused: bool = False
    last_active: float = field(default_factory=time.monotonic)  # last command started
    template: str = ""      # digest of the template it was restored from ("": booted cold)
    # Paused filesystem-only (pause_fs): no QEMU, its rw disk kept; ``paused`` stays True
    # with it (file operations answer SandboxPaused). ``spec``: what resume_fs boots again.
    stopped: bool = False
    spec: ResolvedSpec | None = None
    # The hostname the platform gave the guest (a restore's make_unique: its sandbox id); ""
    # keeps the guest's own boot hostname. A cold boot again (resume_fs) sets it again.
    hostname: str = ""
    kind: str = "microvm"
    guest_reported: bool = True
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def state(self) -> dict[str, Any]:
        out = {"host_uid": self.host_uid, "pid": self.pid, "squeezed": self.squeezed,
               "template": self.template, "hostname": self.hostname,
               "machine": {**asdict(self.machine),
                           "extra_cmdline": list(self.machine.extra_cmdline)}}
        if self.stopped:
            out["stopped"] = True
        return out

    def new_session(self) -> SessionSlot:
        # The agent makes the session's cgroup inside the guest: no fd crosses the VM.
        self.next_session += 1
        return SessionSlot(name=f"x{self.next_session}", cgroup_fd=None)

    def drop_session(self, name: str) -> None:
        pass  # the guest's session cgroups are the agent's

    @property
    def qmp_path(self) -> Path:
        return self.jail.socket_path("qmp")

    @property
    def agent_path(self) -> Path:
        return self.jail.socket_path("agent")


class ConsoleTail:
    """Reads the guest's serial console during boot, keeping the last bytes (diagnostics of a
    guest that never answers); closed once the agent is up, so a chatty guest costs nothing
    after boot (QEMU drops console bytes nobody reads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = bytearray()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, str(self.path))
            while True:
                chunk = await loop.sock_recv(sock, 65536)
                if not chunk:
                    return
                self.data += chunk
                del self.data[:-CONSOLE_KEEP]
        except OSError:
            return
        finally:
            sock.close()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # wait() never raises the reader's end: a cancellation of the caller arriving
            # meanwhile still propagates (an except CancelledError here swallowed it)
            await asyncio.wait({self._task})

    def tail(self, n: int = 2000) -> str:
        return bytes(self.data[-n:]).decode(errors="replace")


def _close_sockets(sockets: list[socket.socket]) -> None:
    for s in sockets:
        s.close()


def _close_network(made: tuple[vmnet.VmNetwork, int]) -> None:
    """What a network attach made for a create cancelled meanwhile (the teardown removes
    the link and the namespace)."""
    net, tap_fd = made
    net.close()
    os.close(tap_fd)


def _journaled_hostname(state: dict[str, Any]) -> str:
    """The platform-given hostname of a journaled VM (``MicroVM.hostname``); "" if none or
    not one (the journal is the edge's own, but a bad field is no reason to lose a VM)."""
    name = state.get("hostname")
    return name if isinstance(name, str) and 0 < len(name.encode()) <= 63 and \
        "\0" not in name and "/" not in name else ""


async def _pid_exited(pid: int) -> None:
    """Returns once ``pid`` has exited (pidfd readable); at once if it is gone."""
    loop = asyncio.get_running_loop()
    try:
        fd = syscalls.pidfd_open(pid)
    except OSError:
        return
    fut: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def qemu_anon_bytes(pid: int) -> int:
    """QEMU's anonymous resident memory (``RssAnon`` of /proc/<pid>/status); 0 if gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _host_memory_mib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 0


class MicroVMBackend:
    kind = "microvm"
    # capacity().snapshot: a microVM's is its writable layer (the full-VM backend saves the
    # machine: disk + memory)
    snapshot_kind: Literal["layer", "machine"] = "layer"
    files_for: Callable[[MicroVM], Any] = staticmethod(vm_files)

    def __init__(self, settings: Settings, slots: UidSlots, store: ImageStore,
                 pool: DiskPool | None = None, *,
                 connect_agent: AgentConnector = connect_agent_stream) -> None:
        self.settings = settings
        self.slots = slots
        self.store = store
        self.disks = VmDisks(pool or DiskPool(settings), store)
        self.connect_agent = connect_agent
        self.run_root = settings.run_dir / "vm"
        self.accel: AccelChoice | None = None
        self.ksm = ksm.KsmStatus("off")
        self._vms: dict[str, MicroVM] = {}  # live VMs of this backend (the idle squeezer's)
        self._squeezer: asyncio.Task[None] | None = None
        # sandbox id -> (first uid of its slot, QEMU's pid, slot released), kept after the
        # teardown so leftovers() still sees a process of the slot (bounded: oldest dropped)
        self._slot_uids: dict[str, tuple[int, int | None, bool]] = {}
        # sandbox id -> its cgroups' name when it was a spare's (leftovers() after the jail
        # dir is gone; bounded like _slot_uids)
        self._cgroup_names: dict[str, str] = {}
        self.spares = Spares(self)
        self._creating = 0  # creates in flight (spares start only when there is none)
        self._no_create = asyncio.Event()
        self._no_create.set()
        self._holds: set[asyncio.Task[None]] = set()  # forks whose children run first commands
        self.templates = VmTemplates(self) if settings.vm_templates else None

    # ---- node -----------------------------------------------------------------------------
    @property
    def guest_kernel(self) -> Path:
        """The kernel this backend's guests boot (a full VM's backend has its own)."""
        return self.settings.vm_kernel

    @property
    def guest_initrd(self) -> Path:
        return self.settings.vm_initrd

    def _missing(self) -> str | None:
        """Why this node can not run this backend's VMs (None: it can)."""
        for what, path in (("QEMU", self.settings.qemu_binary),
                           ("the jailer (make native)", self.settings.vm_jailer),
                           ("the guest kernel", self.guest_kernel),
                           ("the guest initramfs", self.guest_initrd)):
            if not Path(path).is_file():
                return f"{what} missing at {path}"
        return None

    async def start(self) -> None:
        """Node start: choose the accelerator (a probe boot decides whether KVM works)."""
        # QEMU outlives its jailer (which exits once it exec'd); as subreaper this process
        # gets and reaps it (this host's init never reaps).
        syscalls.become_subreaper()
        if self.templates is not None:  # build VMs and spares an earlier edge left, the cache
            for left_id in self.host_sandbox_ids(BUILD_PREFIX) | self.host_sandbox_ids(
                    SPARE_PREFIX):
                await self.cleanup(left_id, None)
            await asyncio.to_thread(self.templates.recover)
        if self.settings.vm_ksm:
            self.ksm = await asyncio.to_thread(
                ksm.enable, self.settings.vm_ksm_pages_to_scan, self.settings.vm_ksm_sysfs)
            log.info("microvm KSM: %s %s", self.ksm.state, self.ksm.reason)
        if self._missing() is None:
            self.accel = await self._choose_accel()

    async def _choose_accel(self) -> AccelChoice:
        """The accelerator this backend's VMs run under: a probe boot decides whether KVM
        works (a full VM's backend takes the node's microVM backend's choice instead)."""
        accel = await probe_accel(self)
        log.info("microvm accelerator: %s (%s)", accel.accel, accel.reason)
        return accel

    async def stop(self) -> None:
        """Edge stop: the templates' spare QEMUs go (sandboxes keep running)."""
        for task in list(self._holds):
            task.cancel()
        await self.spares.stop()

    def edge_fds(self, networked: bool) -> int:
        """The agent's channel socket, QEMU's log and its output pipe; with a network, the DNS
        gate's UDP and TCP sockets (measured: 3 and 5; a "vm" sandbox, which inherits it, too)."""
        return MICROVM_FDS + (MICROVM_NETWORK_FDS if networked else 0)

    def node_fds(self) -> int:
        """The template spares' (``spares.py``): each ready or starting spare QEMU's QMP
        socket, its log file and output pipe (measured: 3 each)."""
        return SPARE_FDS * self.spares.held()

    def capacity(self) -> BackendCapacity:
        missing = self._missing()
        facts: dict[str, Any] = {"qemu": qemu.version(str(self.settings.qemu_binary))}
        if self.templates is not None:  # restores share the template's RAM, or copy it
            facts["template_ram"] = "shared" if self.templates.shared_ram else "copied"
            facts["template_spares"] = self.spares.facts()
        if self.accel is not None:
            facts.update(accel=self.accel.accel, accel_reason=self.accel.reason)
        facts.update(ksm.status(self.settings.vm_ksm_sysfs, self.settings.vm_ksm).facts())
        facts.update(qos.node_facts(self.settings.cpu_qos))
        return BackendCapacity(
            kind=self.kind, offered=missing is None, reason=missing,
            max_cpus=float(os.cpu_count() or 1), max_memory_mib=_host_memory_mib(),
            facts=facts, fork=self.forks(), snapshot=self.snapshot_kind,
            fs_pause=self.fs_pauses())

    def fs_pauses(self) -> bool:
        """Whether :meth:`pause_fs` works here (a microVM's: a cold boot over its rw disk)."""
        return True

    def forks(self) -> bool:
        """Whether :meth:`fork` works here: a microVM's where templates are on (the fork's
        saved image is restored as a template is)."""
        return self.templates is not None

    def _accel_name(self) -> str:
        return self.accel.accel if self.accel is not None else "tcg"

    # ---- create ---------------------------------------------------------------------------
    def check_spec(self, spec: ResolvedSpec) -> None:
        """Refuse (BadRequest) what this backend can not give, before anything is made."""
        qos.cpu_class(spec.qos)  # an unknown class
        if spec.machine_snapshot is not None and self.snapshot_kind != "machine":
            raise BadRequest("a machine snapshot (disk + memory of a 'vm' sandbox) restores as "
                             f"a 'vm' sandbox only: a {self.kind} starts from image layers",
                             reason="machine_snapshot", backend=self.kind)
        r = spec.resources
        if vcpus(r.cpus) > (os.cpu_count() or 1):
            raise BadRequest(f"cpus={r.cpus} is more than this node's {os.cpu_count()} CPUs",
                             reason="resources")
        host = _host_memory_mib()
        if r.memory_mib > host:
            raise BadRequest(f"memory_mib={r.memory_mib} is more than this node's {host} MiB",
                             reason="resources")
        if spec.disk_tier != "disk":
            raise BadRequest("microVMs have a disk-backed writable disk only (disk_tier "
                             "'disk')", disk_tier=spec.disk_tier)
        if spec.network_rules is not None:
            parse_rules(list(spec.network_rules))  # BadRequest before anything is made
        normalize_hidden(spec.hidden_paths)  # BadRequest before anything is made
        missing = self._missing()
        if missing is not None:
            raise BadRequest(f"this node does not offer microVMs: {missing}")

    def machine_for(self, spec: ResolvedSpec) -> qemu.MachineSpec:
        return qemu.MachineSpec(
            cpus=vcpus(spec.resources.cpus), memory_mib=spec.resources.memory_mib,
            layers=len(spec.layers), rw_disk=True, accel=self._accel_name(),
            tsc_khz=qemu.host_tsc_khz(), tb_size_mib=self.settings.vm_tb_size_mib,
            nic=spec.network_rules is not None,
            free_page_reporting=self.settings.vm_free_page_reporting,
            mem_merge=self.settings.vm_ksm, pids=spec.resources.pids)

    def limits_for(self, machine: qemu.MachineSpec, cpus: float) -> Limits:
        tb = machine.tb_size_mib if machine.accel == "tcg" else 0
        mem = (machine.memory_mib + self.settings.vm_overhead_mib + tb) << 20
        return Limits(memory_bytes=mem, cpus=cpus, pids=QEMU_PIDS)

    async def create(self, sandbox_id: str, spec: ResolvedSpec, *,
                     boot_timeout_s: float | None = None,
                     machine: qemu.MachineSpec | None = None,
                     check_boot: bool = True, hardened: bool = True) -> MicroVM:
        """A microVM whose agent answered: restored from the spec's template when templates
        are on (the first create of a key builds it), else, or when that fails, booted cold.
        ``machine`` overrides the spec's (probe, tests) and always boots cold;
        ``check_boot=False`` accepts a guest whose agent answers although its boot failed
        (the accelerator probe has no layers to mount). ``hardened=False``: the red-team
        tests' twin whose commands keep every capability of the guest's root (what a guest
        kernel exploit gives; never from the API), booted cold."""
        self.check_spec(spec)
        timeout = boot_timeout_s or self.settings.vm_boot_timeout_s
        vm = None
        if not hardened:
            base = machine or self.machine_for(spec)
            machine = replace(base, extra_cmdline=base.extra_cmdline + (FULL_ROOT_ARG,))
        with self._in_flight():
            if machine is None and self.templates is not None:
                vm = await self._restore(sandbox_id, spec, self.machine_for(spec), timeout)
            if vm is None:
                vm = await self.boot(sandbox_id, spec, machine or self.machine_for(spec),
                                     timeout, check_boot=check_boot)
        self._track(vm)
        return vm

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        """A create or a fork under way: spares are started only when there is none."""
        self._creating += 1
        self._no_create.clear()
        try:
            yield
        finally:
            self._creating -= 1
            if self._creating == 0:
                self._no_create.set()

    def _hold_until_answered(self, vms: list[MicroVM]) -> None:
        """A fork's children were made: no spare is started until each of them answered its
        first command after this (an exit on its agent channel), is gone, or
        ``vm_boot_timeout_s`` passed (a child no one runs a command in). Refilling the spares the
        fork took while its children run their first commands took CPU from those commands
        (2-3 of 8 spares restarted before the last child answered, under TCG on 2 cores)."""
        marks = {vm.id: (vm, vm.channel, vm.channel.exits) for vm in vms}
        task = asyncio.ensure_future(self._first_answers(marks))
        self._holds.add(task)
        task.add_done_callback(self._holds.discard)

    async def _first_answers(self, marks: dict[str, tuple[MicroVM, Any, int]]) -> None:
        with self._in_flight():
            deadline = time.monotonic() + self.settings.vm_boot_timeout_s
            while marks and time.monotonic() < deadline:
                for vid, (vm, ch, n) in list(marks.items()):
                    if ch.exits > n or ch.closed.done() or vm.channel is not ch \
                            or self._vms.get(vid) is not vm:
                        del marks[vid]
                if marks:
                    await asyncio.sleep(FIRST_ANSWER_POLL_S)

    async def creates_idle(self) -> None:
        """Returns once no create or fork of this backend is in flight."""
        while self._creating:
            await self._no_create.wait()

    # ---- idle squeeze ---------------------------------------------------------------------
    def _track(self, vm: MicroVM) -> None:
        self._vms[vm.id] = vm
        if self.settings.vm_idle_squeeze_s > 0 and (
                self._squeezer is None or self._squeezer.done()):
            self._squeezer = asyncio.ensure_future(self._squeeze_idle())

    async def _squeeze_idle(self) -> None:
        """Squeeze every VM that runs no command and started none for ``vm_idle_squeeze_s``
        (it gets its memory back in ``prepare_exec``); ends when the backend has no VM."""
        idle_s = self.settings.vm_idle_squeeze_s
        while self._vms:
            await asyncio.sleep(min(5.0, idle_s / 2))
            now = time.monotonic()
            for vm in list(self._vms.values()):
                if vm.squeezed or vm.paused or now - vm.last_active < idle_s:
                    continue
                try:
                    await self.squeeze(vm, idle_for_s=idle_s)
                except InfraError as exc:  # gone meanwhile, or QMP refused: try next round
                    log.debug("microVM %s not squeezed: %s", vm.id, exc)

    async def _restore(self, sandbox_id: str, spec: ResolvedSpec, machine: qemu.MachineSpec,
                       timeout_s: float) -> MicroVM | None:
        """The sandbox restored from its template; None (logged): boot cold instead."""
        assert self.templates is not None
        steps = Steps()
        tpl = await self.templates.acquire(spec, machine, timeout_s)
        steps.lap("template_lookup")
        if tpl is None:
            return None
        restored = self.templates.restore_machine(tpl, machine)
        try:
            spare = None if machine.nic else self.spares.claim(tpl.digest)
            if spare is not None:
                vm = await self._restore_spare(sandbox_id, spec, spare, tpl, timeout_s, steps)
            else:
                vm = await self.boot(sandbox_id, spec, restored, timeout_s, template=tpl,
                                     steps=steps)
            self.spares.want(tpl, Recipe(
                machine=restored, layers=tuple(spec.layers), cpus=float(machine.cpus),
                disk_id=tpl.disk_id, ram_file=tpl.ram_path if tpl.shared_ram else None,
                pages=None if tpl.shared_ram else tpl.pages_path))
            return vm
        except TemplateLoadError as exc:
            self.templates.cache.drop(tpl, str(exc))
            log.warning("microVM %s: template failed to load, booting cold: %s", sandbox_id, exc)
        except InfraError as exc:
            log.warning("microVM %s: restore failed, booting cold: %s", sandbox_id, exc)
        finally:
            self.templates.cache.release(tpl)
        return None

    async def boot(self, sandbox_id: str, spec: ResolvedSpec, machine: qemu.MachineSpec,
                   timeout_s: float, template: Template | None = None,
                   check_boot: bool = True, steps: Steps | None = None,
                   ram_file: Path | None = None) -> MicroVM:
        """Boot cold, or restore ``template`` (its disk cloned as saved, its RAM file mapped
        read-only when ``machine.ram`` is RAM_CLONE); everything torn down on failure.
        ``ram_file``: a template build's RAM file (``machine.ram`` RAM_SHARED), given to this
        VM's uid and QEMU writable. ``steps`` times it (``vm_step_log``)."""
        steps = steps or Steps()
        slot = self.slots.acquire()
        host_uid = self.slots.host_uid(slot)
        jail = Jail(self.run_root, self.settings.cgroup_parent, sandbox_id)
        net: vmnet.VmNetwork | None = None
        tap_fd = -1
        # Each step that makes something on the host runs to its end if the create is
        # cancelled meanwhile (to_the_end): the teardown below then sees all it made.
        try:
            if machine.nic:
                # The network first: QEMU joins its namespace and gets the tap at TAP_FD. A
                # template's build VM gets none of the creator's rules (deny everything).
                await to_the_end(asyncio.to_thread(netns.create, vmnet.netns_name(sandbox_id)))
                rules = ([] if sandbox_id.startswith(BUILD_PREFIX)
                         else list(spec.network_rules or ()))
                net, tap_fd = await to_the_end(vmnet.attach(sandbox_id, rules, self.settings),
                                               dispose=_close_network)
                steps.lap("network")
            binds = await self.disk_binds(sandbox_id, spec, machine, host_uid, template,
                                          ram_file, steps)
            vm = await self._launch(sandbox_id, slot, host_uid, jail, machine, binds,
                                    spec.resources.cpus, spec.env, timeout_s, template,
                                    check_boot, tap_fd=tap_fd, steps=steps,
                                    cpu=qos.node_class(spec.qos, self.settings.cpu_qos))
            await self._sandbox_ready(vm, spec, net, steps,
                                      "cold" if template is None else "restore")
            return vm
        except BaseException as exc:
            if net is not None:
                net.close()
            # a cancelled create stays cancelled even if the teardown fails: an InfraError
            # here made a template build look failed, and the create booted cold and finished
            await teardown_after(exc, self.teardown(sandbox_id, jail, slot, jail.read_pid()))
            if isinstance(exc, (InfraError, BadRequest)) or not isinstance(exc, Exception):
                raise
            raise InfraError(f"microVM {sandbox_id} not created: {exc}") from exc
        finally:
            if tap_fd >= 0:
                os.close(tap_fd)  # QEMU holds its own (the tap lives as long as QEMU)

    async def disk_binds(self, sandbox_id: str, spec: ResolvedSpec, machine: qemu.MachineSpec,
                         host_uid: int, template: Template | None, ram_file: Path | None,
                         steps: Steps) -> list[Bind]:
        """The VM's disks made (layer files, a fresh or cloned writable disk, a template's RAM
        file given to its uid) and their binds (``binds_for``); a full VM's disk image guest
        has its own (``backends/vm``). The caller's teardown removes what was made."""
        layer_files = await self.disks.layer_files(list(spec.layers))
        steps.lap("layers")
        if template is None:
            rw = await to_the_end(self.disks.create_rw_async(
                sandbox_id, spec.resources.disk_mib << 20, host_uid))
            steps.lap("disk_mkfs")
        else:
            rw = await to_the_end(asyncio.to_thread(self.disks.clone_rw, template.disk_id,
                                                    sandbox_id, host_uid))
            steps.lap("disk_clone")
        if machine.ram == qemu.RAM_SHARED:
            assert ram_file is not None
            await asyncio.to_thread(os.chown, ram_file, host_uid, host_uid)
        elif machine.ram == qemu.RAM_CLONE:
            assert template is not None and template.shared_ram
        return self.binds_for(machine, layer_files, rw, build_ram=ram_file,
                              clone_ram=template.ram_path if template is not None else None)

    async def _restore_spare(self, sandbox_id: str, spec: ResolvedSpec, spare: Spare,
                             template: Template, timeout_s: float, steps: Steps,
                             fill_from: str | None = None) -> MicroVM:
        """Restore ``template`` into a spare QEMU of it (``spares.py``): its disk and jail
        become the sandbox's, its CPU quota the create's; the state load onwards as any
        restore. ``fill_from``: a fork's disk subvolume, cloned into the spare's disk file
        (``VmDisks.fill_rw``) before its state (``template``) is loaded. Everything torn down
        on failure."""
        jail = spare.jail
        renamed: list[Jail] = []  # the renamed jail, also when a cancellation came meanwhile
        try:  # the renames run to their end (to_the_end): the teardown must find what it names
            await to_the_end(asyncio.to_thread(self.disks.pool.rename, spare.id, sandbox_id))
            jail = await to_the_end(asyncio.to_thread(spare.jail.renamed, sandbox_id),
                                    dispose=renamed.append)
            self._cgroup_names.pop(sandbox_id, None)
            self._cgroup_names[sandbox_id] = jail.cgroup_name
            if len(self._cgroup_names) > 4096:
                del self._cgroup_names[next(iter(self._cgroup_names))]
            # the sandbox's CPU class (a spare starts in the idle one) and the quota it asked for
            cpu = qos.node_class(spec.qos, self.settings.cpu_qos)
            await asyncio.to_thread(set_cpu, self.settings.cgroup_parent, jail.cgroup_name,
                                    spec.resources.cpus, cpu)
            await asyncio.to_thread(qos.apply_start, spare.pid, cpu)
            steps.lap("spare_claim")
            if fill_from is not None:
                await to_the_end(asyncio.to_thread(self.disks.fill_rw, fill_from, sandbox_id))
                steps.lap("disk_fill")
            vm = await self._resume(sandbox_id, spare.slot, spare.host_uid, jail, spare.pid,
                                    spare.machine, spec.env, timeout_s, template, steps,
                                    monitor=spare.monitor)
            await self._sandbox_ready(vm, spec, None, steps, "restore")
            return vm
        except BaseException as exc:
            spare.monitor.close()
            await teardown_after(exc, self._spare_teardown(sandbox_id, (renamed or [jail])[0],
                                                           spare))
            if isinstance(exc, (InfraError, BadRequest)) or not isinstance(exc, Exception):
                raise
            raise InfraError(f"microVM {sandbox_id} not created: {exc}") from exc

    async def _spare_teardown(self, sandbox_id: str, jail: Jail, spare: Spare) -> None:
        """A claim that failed: everything of the sandbox, and the spare's disk if the rename
        did not happen."""
        await self.teardown(sandbox_id, jail, spare.slot, spare.pid)
        left = await asyncio.to_thread(self.disks.remove_rw, spare.id)
        if left:
            raise InfraError(f"teardown of {sandbox_id} incomplete", problems=left)

    async def _sandbox_ready(self, vm: MicroVM, spec: ResolvedSpec,
                             net: vmnet.VmNetwork | None, steps: Steps, kind: str) -> None:
        """The sandbox's own network and hidden paths, before any command of it; the step
        line written."""
        vm.spec = spec  # what a filesystem-only pause boots again
        try:
            if net is not None:
                vm.network = net
                await self.configure_guest_network(vm, net.guest)  # after a restore too
                steps.lap("guest_network")
            await mask_hidden(vm, spec.hidden_paths)
            steps.lap("hidden_paths")
        except BaseException:
            vm.channel.close()
            raise
        steps.write(self.settings.vm_step_log, vm.id, kind)

    def binds_for(self, machine: qemu.MachineSpec, layer_files: list[Path], rw: Path, *,
                  build_ram: Path | None = None, clone_ram: Path | None = None) -> list[Bind]:
        """The files of a VM at their jail paths (``qemu.py``): kernel, initramfs, layers,
        writable disk, and with ``machine.ram`` a template's RAM file (``build_ram`` of a
        build VM, writable; ``clone_ram`` of a restore, read-only)."""
        binds = [Bind(self.guest_kernel, qemu.KERNEL), Bind(self.guest_initrd, qemu.INITRD)]
        binds += [Bind(f, qemu.layer_path(i)) for i, f in enumerate(layer_files)]
        binds.append(Bind(rw, qemu.RW_DISK, writable=True))
        if machine.ram == qemu.RAM_SHARED:
            assert build_ram is not None
            binds.append(Bind(build_ram, qemu.RAM_FILE, writable=True))
        elif machine.ram == qemu.RAM_CLONE:
            assert clone_ram is not None
            binds.append(Bind(clone_ram, qemu.RAM_FILE))  # read-only bind
        return binds

    def argv_for(self, machine: qemu.MachineSpec) -> list[str]:
        """QEMU's argv of ``machine`` (a full VM's backend gives its q35 machine)."""
        return qemu.argv(machine, str(self.settings.qemu_binary))

    def display(self, h: MicroVM) -> None:
        """No screen or input devices on a microVM (the full-VM backend's have them)."""
        return None

    async def spawn_qemu(self, jail: Jail, machine: qemu.MachineSpec, binds: list[Bind],
                         host_uid: int, cpus: float, *, netns: Path | None = None,
                         tap_fd: int = -1, steps: Steps | None = None,
                         cpu: qos.CpuClass = qos.CLASSES["latency"]) -> int:
        """QEMU of ``machine`` (its argv as is: ``incoming`` for a restore) in a new jail;
        its pid once it has exec'd. ``cpu``: its cgroup's and threads' CPU class (a batch
        sandbox's, or a spare's start: the idle one)."""
        devices = ("/dev/kvm",) if machine.accel == "kvm" else ()
        argv = self.argv_for(machine)
        sockets = await to_the_end(asyncio.to_thread(jail.prepare), dispose=_close_sockets)
        if steps is not None:
            steps.lap("jail_dir")
        try:
            limits = replace(self.limits_for(machine, cpus), cpu=cpu)
            return await jail.spawn(self.settings.vm_jailer, argv, host_uid, limits, binds,
                                    sockets,
                                    devices=devices, netns=netns,
                                    extra_fds=(tap_fd,) if tap_fd >= 0 else (), steps=steps)
        finally:
            for s in sockets:
                s.close()  # QEMU holds its own copies

    async def configure_guest_network(self, vm: MicroVM, guest: vmnet.GuestConfig) -> None:
        """The guest's interface, route and resolver, set by the platform's own tools through
        the agent (the guest kernel has no ip= autoconfiguration). The filter at the tap does
        not rely on any of it: a guest that sets something else only loses its network."""
        tools = PlatformTools(lambda: vm.channel, timeout_s=NET_CONFIG_TIMEOUT_S)
        for argv in guest.commands():
            res = await tools.run(argv, max_stdout=4096)
            if not res.ok:
                raise InfraError(f"microVM {vm.id}: {' '.join(argv[:3])} failed in the guest: "
                                 f"{res.message()[:200]}")
        res = await tools.run(["tee", vmnet.RESOLV_CONF], stdin=guest.resolv_conf(),
                              max_stdout=4096)
        if not res.ok:
            raise InfraError(f"microVM {vm.id}: {vmnet.RESOLV_CONF} not written: "
                             f"{res.message()[:200]}")

    async def _launch(self, sandbox_id: str, slot: int, host_uid: int, jail: Jail,
                      machine: qemu.MachineSpec, binds: list[Bind], cpus: float,
                      env: dict[str, str], boot_timeout_s: float,
                      template: Template | None = None,
                      check_boot: bool = True, tap_fd: int = -1,
                      steps: Steps | None = None,
                      cpu: qos.CpuClass = qos.CLASSES["latency"]) -> MicroVM:
        """Start QEMU in its jail (a restore: paused until the template's state is loaded)
        and wait for the agent; the caller tears down on failure. With a NIC, QEMU runs in
        the sandbox's network namespace with the tap at TAP_FD. ``cpu``: the sandbox's CPU
        class (isolation.qos: cgroup and threads; a latency class's core cookie on QEMU)."""
        steps = steps or Steps()
        ns = netns.netns_path(vmnet.netns_name(sandbox_id)) if machine.nic else None
        pid = await self.spawn_qemu(jail, replace(machine, incoming=template is not None),
                                    binds, host_uid, cpus, netns=ns,
                                    tap_fd=tap_fd if machine.nic else -1, steps=steps, cpu=cpu)
        await asyncio.to_thread(qos.apply_start, pid, cpu)
        if template is not None:
            return await self._resume(sandbox_id, slot, host_uid, jail, pid, machine, env,
                                      boot_timeout_s, template, steps)
        channel = await self._wait_agent(jail, pid, boot_timeout_s, check_boot)
        steps.lap("boot_to_agent")
        vm = MicroVM(id=sandbox_id, slot=slot, host_uid=host_uid, jail=jail, pid=pid,
                     machine=machine, channel=channel, image_env=dict(env), kind=self.kind)
        vm.files = self.files_for(vm)
        return vm

    async def _resume(self, sandbox_id: str, slot: int, host_uid: int, jail: Jail, pid: int,
                      machine: qemu.MachineSpec, env: dict[str, str], timeout_s: float,
                      template: Template, steps: Steps,
                      monitor: qmp.QMP | None = None) -> MicroVM:
        """A QEMU waiting in ``-incoming defer`` gets the template's state, runs, and its guest
        is made unique before the sandbox exists (``monitor``: its QMP, connected already).
        The caller tears down on failure."""
        # Connected before the state is loaded: the port is then connected as it was at the
        # save, so the resumed guest gets no close and open events to handle, only the HELLO
        # waiting in the socket (a new nonce: a new host connection to it).
        connect = asyncio.ensure_future(
            self.connect_agent(str(jail.socket_path("agent")), timeout_s))
        try:
            await load_state(template, jail, timeout_s, steps, monitor=monitor)
        except BaseException:
            connect.cancel()
            (early,) = await asyncio.gather(connect, return_exceptions=True)
            if not isinstance(early, BaseException):
                early.close()
            raise
        try:
            # no BOOT_INFO check: the template's boot passed it before the save
            channel = await self._wait_agent(jail, pid, timeout_s, check_boot=False,
                                             connect=connect)
        except InfraError as exc:
            raise TemplateLoadError(f"restored guest did not answer: {exc}") from exc
        steps.lap("agent_connect")
        try:
            await make_unique(channel, sandbox_id)  # before any command
            steps.lap("make_unique")
        except BaseException as exc:
            channel.close()
            if isinstance(exc, InfraError):
                raise TemplateLoadError(f"restored guest not made unique: {exc}") from exc
            raise
        vm = MicroVM(id=sandbox_id, slot=slot, host_uid=host_uid, jail=jail, pid=pid,
                     machine=machine, channel=channel, image_env=dict(env),
                     template=template.digest, hostname=sandbox_id[:63], kind=self.kind)
        vm.files = self.files_for(vm)
        return vm

    async def _wait_agent(self, jail: Jail, pid: int, timeout_s: float,
                          check_boot: bool = True,
                          connect: asyncio.Future[Any] | None = None) -> Any:
        """The agent's channel once it answers (through ``connect`` if the caller started
        it); InfraError if QEMU dies or the wait runs out (the console's last lines go to the
        log, never to the caller: guest-written)."""
        console = ConsoleTail(jail.socket_path("console"))
        console.start()
        t0 = time.monotonic()
        if connect is None:
            connect = asyncio.ensure_future(
                self.connect_agent(str(jail.socket_path("agent")), timeout_s))
        died = asyncio.ensure_future(_pid_exited(pid))
        try:
            done, _ = await asyncio.wait({connect, died}, timeout=timeout_s + 1,
                                         return_when=asyncio.FIRST_COMPLETED)
            if connect in done and connect.exception() is None:
                channel = connect.result()
                try:
                    if check_boot:
                        await self._check_boot(channel, jail.sandbox_id)
                except BaseException:
                    channel.close()
                    raise
                return channel
            if died not in done and connect in done:
                # a QEMU that died closed the agent's socket: the connect fails first
                await asyncio.wait({died}, timeout=2.0)
            if died.done():
                why = f"QEMU exited during boot ({jail.log_tail(500) or 'no message'})"
            elif connect in done:
                why = f"the agent did not answer ({connect.exception()})"
            else:
                why = f"the agent did not answer in {timeout_s:.0f} s"
            log.warning("microVM %s: %s after %.1f s; console: %r", jail.sandbox_id, why,
                        time.monotonic() - t0, console.tail())
            raise InfraError(f"microVM {jail.sandbox_id} did not boot: {why}",
                             sandbox_id=jail.sandbox_id)
        finally:
            for t in (connect, died):
                if not t.done():
                    t.cancel()
            await asyncio.gather(connect, died, return_exceptions=True)
            await console.stop()

    async def _check_boot(self, channel: Any, sandbox_id: str) -> None:
        """A guest whose agent answers but whose boot failed (a layer it can not mount, a
        missing disk) is no sandbox: InfraError with the agent's first failed step."""
        info = await channel.boot_info()
        if info.errno:
            raise InfraError(f"microVM {sandbox_id} did not boot: {info.error[:300]}",
                             sandbox_id=sandbox_id, reason="guest_boot")

    # ---- adopt / destroy ------------------------------------------------------------------
    async def adopt(self, sandbox_id: str, spec: ResolvedSpec, state: dict[str, Any],
                    paused: bool) -> MicroVM | None:
        """Reconnect to a VM an earlier edge started; None if it is gone (then cleaned). One
        paused filesystem-only (state ``stopped``) comes back stopped, nothing booted."""
        host_uid = int(state["host_uid"])
        slot = self.slots.slot_of(host_uid)
        self.slots.claim(slot)
        jail = Jail.of(self.run_root, self.settings.cgroup_parent, sandbox_id)
        pid = int(state.get("pid") or 0) or None
        m = dict(state["machine"])
        m["extra_cmdline"] = tuple(m.get("extra_cmdline") or ())
        machine = qemu.MachineSpec(**m)
        if state.get("stopped"):
            if not self.kept_disk(sandbox_id, machine).exists():
                log.warning("microVM %s: its stopped rw disk is gone; cleaning up", sandbox_id)
                await self.teardown(sandbox_id, jail, slot, None)
                return None
            # a boot an earlier edge started and did not record: killed, its jail removed
            problems = await self._stop_boot(sandbox_id, jail, host_uid, jail.read_pid())
            if problems:
                log.error("microVM %s: a stray boot left %s", sandbox_id, problems)
            from rollbox.agent.channel import AgentChannel

            vm = MicroVM(id=sandbox_id, slot=slot, host_uid=host_uid, jail=jail, pid=0,
                         machine=machine, channel=AgentChannel.gone(),
                         image_env=dict(spec.env), paused=True, stopped=True, spec=spec,
                         hostname=_journaled_hostname(state))
            vm.files = self.files_for(vm)  # SandboxPaused until it boots again
            return vm
        try:
            if not jail.alive(pid):
                raise InfraError("QEMU not running")
            async with qmp.session(jail.socket_path("qmp")) as q:
                if paused:  # a stopped guest can not answer the handshake
                    await q.cont()
                # Squeezes after the create are not in the journal: the jail dir's marker
                # (or a balloon still short of the full size) says so; the next exec deflates.
                squeezed = (jail.squeeze_marker.exists()
                            or await q.query_balloon() < (machine.memory_mib - 1) << 20)
            channel = await self.connect_agent(str(jail.socket_path("agent")),
                                               ADOPT_TIMEOUT_S)
        except (OSError, ValueError, InfraError) as exc:
            log.warning("microVM %s can not be adopted (%s); cleaning up", sandbox_id, exc)
            await self.teardown(sandbox_id, jail, slot, pid)
            return None
        assert pid is not None
        vm = MicroVM(id=sandbox_id, slot=slot, host_uid=host_uid, jail=jail, pid=pid,
                     machine=machine, channel=channel, image_env=dict(spec.env),
                     squeezed=squeezed, template=str(state.get("template") or ""),
                     hostname=_journaled_hostname(state), kind=self.kind)
        vm.files = self.files_for(vm)
        vm.spec = spec
        if spec.network_rules is not None:
            try:
                vm.network = await vmnet.adopt(sandbox_id, list(spec.network_rules),
                                               self.settings)
            except Exception as exc:  # noqa: BLE001 - fail closed: torn down below
                log.warning("microVM %s: network re-attach failed: %s", sandbox_id, exc)
            if vm.network is None or not machine.nic:
                log.warning("microVM %s: network can not be re-attached; cleaning up",
                            sandbox_id)
                self.detach(vm)
                await self.teardown(sandbox_id, jail, slot, pid)
                return None
        if paused:
            await self.pause(vm)
        self._track(vm)
        return vm

    async def destroy(self, h: MicroVM) -> None:  # type: ignore[override]
        self.detach(h)
        await self.teardown(h.id, h.jail, h.slot, h.pid or None)  # 0: stopped, no QEMU

    def detach(self, h: MicroVM) -> None:  # type: ignore[override]
        """The edge stops; the VM keeps running (adopted by the next edge). Its DNS gate
        stops with this edge (the next one starts it again); the filter stays in force."""
        self._vms.pop(h.id, None)
        if isinstance(h.network, vmnet.VmNetwork):
            h.network.close()
        h.channel.close()
        h.files.close()
        h.jail.close_log()

    async def cleanup(self, sandbox_id: str, state: dict[str, Any] | None) -> None:
        slot = -1
        if state is not None and "host_uid" in state:
            slot = self.slots.slot_of(int(state["host_uid"]))
            self.slots.claim(slot)
        jail = Jail.of(self.run_root, self.settings.cgroup_parent, sandbox_id)
        await self.teardown(sandbox_id, jail, slot, jail.read_pid())

    async def teardown(self, sandbox_id: str, jail: Jail, slot: int, pid: int | None) -> None:
        """Kill, reap and remove everything of the sandbox; the uid slot goes back to the pool
        only once no process of its uids is left (else InfraError, the slot stays out)."""
        if slot >= 0:
            self._slot_uids.pop(sandbox_id, None)
            self._slot_uids[sandbox_id] = (self.slots.host_uid(slot), pid, False)
            if len(self._slot_uids) > 4096:
                del self._slot_uids[next(iter(self._slot_uids))]
        problems = await jail.kill(pid, self.slots.host_uid(slot) if slot >= 0 else None)
        if not problems:
            problems += await asyncio.to_thread(jail.release)
            problems += await asyncio.to_thread(self.disks.remove_rw, sandbox_id)
            # With QEMU gone its tap is gone; the link's host end and the namespace (the
            # filter table goes with it) are removed here.
            problems += await asyncio.to_thread(vmnet.delete, sandbox_id)
        if problems:
            log.error("teardown of microVM %s incomplete: %s", sandbox_id, problems)
            raise InfraError(f"teardown of {sandbox_id} incomplete", problems=problems)
        if slot >= 0:
            self._slot_uids[sandbox_id] = (self.slots.host_uid(slot), pid, True)
            self.slots.release(slot)

    def _uid_processes(self, sandbox_id: str) -> list[str]:
        """Host processes running as a uid of this sandbox's slot (its QEMU), zombies
        included (see jail.uid_processes); the slot is known from the pid file's process while
        the jail dir exists, and remembered by :meth:`teardown` after it is gone. Once the
        teardown gave the slot back (no process of it was left) only that QEMU's pid counts:
        the slot's next owner (a spare QEMU, another sandbox) runs as the same uids."""
        known = self._slot_uids.get(sandbox_id)
        if known is None:
            try:
                pid = int((self.run_root / sandbox_id / "pid").read_text())
                uid = os.stat(f"/proc/{pid}").st_uid
            except (OSError, ValueError):
                return []
            lo = self.settings.uid_base
            if not lo <= uid < lo + self.settings.uid_slots * 65536:
                return []
            known = (self.slots.host_uid(self.slots.slot_of(uid)), pid, False)
        host_uid, qemu_pid, released = known
        return [f"process {p} (uid slot {host_uid}, state {st})"
                for p, st in sorted(uid_processes(host_uid, qemu_pid).items())
                if not released or p == qemu_pid]

    def leftovers(self, sandbox_id: str) -> list[str]:
        jail = Jail.of(self.run_root, self.settings.cgroup_parent, sandbox_id)
        if jail.cgroup_name == sandbox_id and sandbox_id in self._cgroup_names:
            jail = Jail(self.run_root, self.settings.cgroup_parent, sandbox_id,
                        self._cgroup_names[sandbox_id])  # its dir is gone: as remembered
        left = self._uid_processes(sandbox_id) + jail.leftovers()
        left += self.disks.leftovers(sandbox_id)
        left += vmnet.leftovers(sandbox_id)
        if netns.netns_path(netns.PREFIX + sandbox_id).exists():
            left.append(str(netns.netns_path(netns.PREFIX + sandbox_id)))
        return left

    def host_sandbox_ids(self, prefix: str = "") -> set[str]:
        ids: set[str] = set()
        if self.run_root.is_dir():
            ids |= {p.name for p in self.run_root.iterdir() if p.is_dir()}
        return {i for i in ids if i.startswith(prefix)}

    def release_node_resources(self) -> None:
        if self._squeezer is not None and not self._vms:
            self._squeezer.cancel()
        try:
            self.run_root.rmdir()
        except OSError:
            pass
        cgroups.remove_parent_if_empty(self.settings.cgroup_parent)

    # ---- running VMs ----------------------------------------------------------------------
    async def pause(self, h: MicroVM) -> None:  # type: ignore[override]
        """Stop the vCPUs (QMP ``stop``): the guest and every command halt, memory stays.
        File operations fail with SandboxPaused from here on, those in progress too (its agent
        stops with it: they would wait out their deadline)."""
        async with h.lock:
            h.paused = True
            cut_file_ops(h)
            try:
                async with qmp.session(h.qmp_path) as q:
                    await q.stop()
            except BaseException:
                h.paused = False
                raise

    async def resume(self, h: MicroVM) -> None:  # type: ignore[override]
        async with h.lock:
            async with qmp.session(h.qmp_path) as q:
                await q.cont()
            h.paused = False

    async def pause_fs(self, h: MicroVM) -> None:  # type: ignore[override]
        """Filesystem-only pause: the guest's dirty pages written to its rw disk (``sync`` by
        the platform's tools: what it wrote before survives; a guest that does not answer in
        FS_SYNC_TIMEOUT_S loses what it had not written back), QMP ``stop`` (QEMU drains and
        flushes its block devices, a full VM's qcow2 overlay too), then QEMU killed and reaped,
        its jail (cgroups, dir) and network (link, namespace, filter) removed. The rw disk and
        the uid slot stay. Verified: InfraError naming what is left."""
        async with h.lock:
            if h.stopped:
                return
            h.paused = True
            cut_file_ops(h)
            try:
                async with qmp.session(h.qmp_path) as q:
                    await q.cont()  # a frozen guest can not sync
                tools = PlatformTools(lambda: h.channel, timeout_s=FS_SYNC_TIMEOUT_S)
                res = await tools.run(["sync"], max_stdout=4096)
                if not res.ok:
                    log.warning("microVM %s: guest sync failed before the stop: %s", h.id,
                                res.message()[:200])
                async with qmp.session(h.qmp_path) as q:
                    await q.stop()  # QEMU drains and flushes its disks (a qcow2's metadata)
            except (InfraError, OSError) as exc:
                log.warning("microVM %s: no guest sync before the stop (%s)", h.id, exc)
            self.detach(h)
            problems = await self._stop_boot(h.id, h.jail, h.host_uid, h.pid)
            h.stopped, h.pid, h.network, h.squeezed = True, 0, None, False
            h.files = self.files_for(h)  # detach closed them; these answer SandboxPaused
            if problems:
                raise InfraError(f"filesystem pause of {h.id} incomplete", problems=problems)

    async def _stop_boot(self, sandbox_id: str, jail: Jail, host_uid: int,
                         pid: int | None) -> list[str]:
        """Kill and reap one boot's QEMU, remove its jail and network; returns what is left.
        The rw disk stays."""
        problems = await jail.kill(pid, host_uid)
        if not problems:
            problems += await asyncio.to_thread(jail.release)
            problems += await asyncio.to_thread(vmnet.delete, sandbox_id)
        return problems

    async def resume_fs(self, h: MicroVM,  # type: ignore[override]
                        rules: list[str] | None) -> None:
        """Boot it again, cold, over its rw disk (a fresh jail, QEMU, guest kernel and agent:
        a new boot id), with a NIC and ``rules`` if it had one, its hidden paths masked again.
        A failure stops what it started (it stays stopped) and raises."""
        async with h.lock:
            if not h.stopped:
                return
            if h.spec is None:
                raise InfraError(f"microVM {h.id}: no spec to boot it again from")
            # a VM made without a NIC gets none (as set_network refuses to add one)
            spec = replace(h.spec, network_rules=(tuple(rules or ()) if h.machine.nic
                                                  else None))
            machine = self.machine_for(spec)
            jail = Jail(self.run_root, self.settings.cgroup_parent, h.id)
            net: vmnet.VmNetwork | None = None
            tap_fd = -1
            try:
                if machine.nic:
                    await to_the_end(asyncio.to_thread(netns.create, vmnet.netns_name(h.id)))
                    net, tap_fd = await to_the_end(
                        vmnet.attach(h.id, list(spec.network_rules or ()), self.settings),
                        dispose=_close_network)
                binds = await self.resume_binds(h, spec, machine)
                vm = await self._launch(h.id, h.slot, h.host_uid, jail, machine, binds,
                                        spec.resources.cpus, h.image_env,
                                        self.settings.vm_boot_timeout_s, tap_fd=tap_fd)
                if h.hostname:  # a restored guest's identity: its hostname as it had it
                    try:
                        await vm.channel.set_hostname(h.hostname)
                    except BaseException:
                        vm.channel.close()
                        raise
                await self._sandbox_ready(vm, spec, net, Steps(), "cold")
            except BaseException as exc:
                if net is not None:
                    net.close()

                async def stop() -> None:
                    problems = await self._stop_boot(h.id, jail, h.host_uid, jail.read_pid())
                    if problems:
                        raise InfraError(f"a failed boot of {h.id} left {problems}")

                await teardown_after(exc, stop())
                if isinstance(exc, (InfraError, BadRequest)) or not isinstance(exc, Exception):
                    raise
                raise InfraError(f"microVM {h.id} did not boot again: {exc}") from exc
            finally:
                if tap_fd >= 0:
                    os.close(tap_fd)
            h.jail, h.pid, h.machine, h.channel = vm.jail, vm.pid, vm.machine, vm.channel
            h.network, h.template, h.spec = vm.network, "", spec
            h.files = self.files_for(h)
            h.stopped = h.paused = h.squeezed = False
            h.last_active = time.monotonic()
        self._track(h)

    def kept_disk(self, sandbox_id: str, machine: qemu.MachineSpec) -> Path:
        """The file a filesystem-paused VM keeps and boots again from: its rw disk."""
        return self.disks.rw_path(sandbox_id)

    async def resume_binds(self, h: MicroVM, spec: ResolvedSpec,
                           machine: qemu.MachineSpec) -> list[Bind]:
        """The binds a filesystem-paused VM boots again with: its layers and the rw disk it
        kept (a full VM's disk image guest: its kept overlay, ``backends/vm``)."""
        layer_files = await self.disks.layer_files(list(spec.layers))
        return self.binds_for(machine, layer_files, self.disks.rw_path(h.id))

    async def status(self, h: MicroVM) -> str:
        """QEMU's run state (``running``, ``paused``, ...)."""
        async with h.lock:
            async with qmp.session(h.qmp_path) as q:
                return await q.status()

    async def squeeze(self, h: MicroVM, idle_for_s: float | None = None) -> int | None:
        """Squeeze a VM's memory (balloon up to the floor); returns the target bytes. With
        ``idle_for_s``: only if it is still idle that long (checked under its lock) and holds
        enough to be worth it (``balloon.worth_squeezing``), else None.
        ``squeezed`` is set before QEMU hears of it, so a ``prepare_exec`` that comes in the
        meantime waits and deflates."""
        if h.machine.ram == qemu.RAM_CLONE:
            return None  # QEMU can not discard a clone's RAM (template.restore_machine)
        if idle_for_s is not None and not balloon.worth_squeezing(
                qemu_anon_bytes(h.pid), h.machine.memory_mib):
            return None
        async with h.lock:
            if idle_for_s is not None and (
                    h.squeezed or h.paused or h.channel.busy()
                    or time.monotonic() - h.last_active < idle_for_s):
                return None
            h.squeezed = True
            try:
                h.jail.squeeze_marker.touch()
                async with qmp.session(h.qmp_path) as q:
                    return await balloon.squeeze(q, h.machine.memory_mib)
            except BaseException:
                h.squeezed = False
                h.jail.squeeze_marker.unlink(missing_ok=True)
                raise

    async def zero_free_memory(self, h: MicroVM) -> int:
        """Zero the guest's free memory (``balloon.zero_free_memory``; a template before its
        save); returns the MiB zeroed."""
        tools = PlatformTools(lambda: h.channel, request=in_sandbox_request,
                              timeout_s=balloon.ZERO_TIMEOUT_S)
        return await balloon.zero_free_memory(tools, h.machine.memory_mib)

    async def prepare_exec(self, h: MicroVM) -> None:
        """Before a command: a squeezed VM gets its memory back first (deflate on demand)."""
        h.last_active = time.monotonic()
        if not h.squeezed:
            return
        async with h.lock:
            if not h.squeezed:
                return
            async with qmp.session(h.qmp_path) as q:
                if not await balloon.deflate(q, h.machine.memory_mib):
                    log.warning("microVM %s: balloon not fully deflated in time", h.id)
            h.squeezed = False
            h.jail.squeeze_marker.unlink(missing_ok=True)
            h.last_active = time.monotonic()

    async def set_network(self, h: MicroVM, rules: list[str]) -> None:  # type: ignore[override]
        """A new policy for a VM created with one (the set at the tap replaced: connections the
        new policy leaves out are cut at once). A VM created without one has no NIC: refused."""
        if not isinstance(h.network, vmnet.VmNetwork):
            raise vmnet.refuse_late_attach(h.id)
        await asyncio.to_thread(h.network.apply, rules)

    async def capture_writable(self, h: MicroVM, dest: Path,  # type: ignore[override]
                               opts: CaptureOptions) -> CaptureResult:
        return await vm_capture(h.files, dest, opts)

    async def open_port(self, h: MicroVM, port: int) -> PortStream:  # type: ignore[override]
        """A relay through the agent to the guest's 127.0.0.1:port (rollbox.backends.ports);
        the guest needs no network. A squeezed VM gets its memory back first."""
        await self.prepare_exec(h)
        return await relay_through_agent(live_channel(h), port)

    async def fork(self, h: MicroVM, children: list[tuple[str, ResolvedSpec]],  # type: ignore[override]
                   paused: bool) -> ForkResult:
        """Fork a VM with its memory and processes: QMP ``stop`` (unless paused), its state
        (devices and RAM) migrated into a file, its disk's subvolume snapshotted (a
        ``FORK_PREFIX`` subvolume of the pool: nothing copied), ``cont``. That saved image is
        restored into each child as a template is (QEMU with ``-incoming defer``, the disk
        cloned by snapshot, the state loaded, the guest made unique: hostname, machine-id,
        reseeded RNG, clock), each with its own network; both files go when the children are
        made. With ``vm_fork_spares``, up to that many children restore into ready spare QEMUs
        of the source's exact machine and layers (``spares.py``: QEMU started, RAM faulted in
        ahead), the fork's disk cloned into the spare's disk file (``VmDisks.fill_rw``); a
        child whose spare fails (QEMU gone, the clone refused, the state not loaded) is torn
        down and restored into a QEMU of its own, as are the children beyond the spares. With
        ``vm_fork_warm`` (off by default) and more children than cores, each child runs the
        platform shell's ``true`` once made unique, outside the one-restore-per-core gate.
        All or nothing: a child that fails takes the made ones down with it."""
        if h.stopped:  # no QEMU to save: its memory was let go
            raise BadRequest(f"sandbox {h.id} is paused filesystem-only: resume it before a "
                             "fork (a microVM fork carries its memory)", sandbox_id=h.id)
        if not self.forks():
            raise BadRequest(f"microVM sandbox {h.id} can not be forked: this node's "
                             "templates are off (ROLLBOX_VM_TEMPLATES)", sandbox_id=h.id)
        if h.machine.ram:
            raise BadRequest(f"microVM sandbox {h.id} maps its template's RAM file: a fork "
                             "of it is not supported", sandbox_id=h.id)
        token = secrets.token_hex(6)
        staging = self.settings.data_dir / "vm-forks" / token
        disk_id = f"{FORK_PREFIX}vm{token}"
        await asyncio.to_thread(staging.mkdir, 0o700, True)
        with self._in_flight():  # no spare is started while the fork runs
            return await self._fork(h, children, paused, staging, disk_id)

    async def _fork(self, h: MicroVM, children: list[tuple[str, ResolvedSpec]], paused: bool,
                    staging: Path, disk_id: str) -> ForkResult:
        """:meth:`fork` once its staging dir exists (removed here, with the fork's disk)."""
        made: list[MicroVM] = []
        claimed: list[Spare | None] = []
        try:
            frozen_s, tpl = await self._save_for_fork(h, paused, staging, disk_id)
            if h.template:  # its template keeps vm_fork_spares from now on
                self.spares.forked(h.template)
            most = min(len(children), self.spares.fork_spares)
            layers = tuple(children[0][1].layers)
            claimed = [*self.spares.claim_like(h.machine, layers, most)] \
                if most and not h.machine.nic and all(
                    tuple(spec.layers) == layers for _, spec in children) else []
            claimed += [None] * (len(children) - len(claimed))

            # At most one restore per host core at a time: more only starve each other (a
            # TCG guest that gets no CPU misses the make-unique step's deadline).
            width = max(1, os.cpu_count() or 1)
            gate = asyncio.Semaphore(width)
            warm = self.settings.vm_fork_warm and len(children) > width

            async def one(i: int, child_id: str, spec: ResolvedSpec) -> MicroVM:
                async with gate:
                    spare, claimed[i] = claimed[i], None
                    vm = None if spare is None else \
                        await self._fork_into_spare(child_id, spec, spare, tpl, disk_id)
                    if vm is None:
                        vm = await self.boot(child_id, spec, h.machine,
                                             self.settings.vm_boot_timeout_s, template=tpl)
                vm.next_session = h.next_session  # the guest's session cgroups so far
                vm.template = ""  # not restorable by the cache: a fork's own image
                made.append(vm)
                self._track(vm)
                if warm:  # outside the gate: it runs while later children restore
                    await self._warm_fork_child(vm)
                return vm

            vms = await all_or_raise([one(i, cid, spec)
                                      for i, (cid, spec) in enumerate(children)])
            self._hold_until_answered(list(vms))
            return ForkResult(children=list(vms), frozen_s=frozen_s)
        except BaseException as exc:
            async def undo() -> None:
                for vm in made:
                    await self.destroy(vm)
            await teardown_after(exc, undo())
            raise
        finally:
            # spares claimed and never used (the fork failed before their child's turn)
            unused = [self.spares.give_up(sp) for sp in claimed if sp is not None]
            if unused:
                await asyncio.gather(*unused, return_exceptions=True)
            await asyncio.to_thread(self.disks.remove_rw, disk_id)
            await asyncio.to_thread(shutil.rmtree, staging, True)

    async def _fork_into_spare(self, child_id: str, spec: ResolvedSpec, spare: Spare,
                               tpl: Template, disk_id: str) -> MicroVM | None:
        """A fork child restored into a claimed spare (the fork's disk ``disk_id`` cloned into
        the spare's, the fork's state ``tpl`` loaded); None (logged) when that failed and
        everything of it is torn down: the child then gets a QEMU of its own."""
        steps = Steps()
        try:
            return await self._restore_spare(child_id, spec, spare, tpl,
                                             self.settings.vm_boot_timeout_s, steps,
                                             fill_from=disk_id)
        except InfraError as exc:  # TemplateLoadError too: torn down by _restore_spare
            if exc.details.get("problems"):
                raise  # the teardown left something: no second QEMU under the same id
            log.warning("microVM fork child %s: spare %s failed (%s); starting its own QEMU",
                        child_id, spare.id, exc)
            self._cgroup_names.pop(child_id, None)  # its next cgroups are named by its id
            return None

    async def save_machine(self, h: MicroVM, snapshot_id: str,  # type: ignore[override]
                           spec: ResolvedSpec, paused: bool) -> MachineSnapshot:
        """A microVM's snapshot is its writable layer (``capture_writable``); its machine is
        saved only by a fork, for the fork's children."""
        raise BadRequest(f"a {self.kind}'s snapshot is its writable layer as an image layer "
                         "(capacity().snapshot 'layer'): its machine is not kept",
                         sandbox_id=h.id)

    def drop_machine(self, snapshot_id: str) -> list[str]:
        return []  # this backend keeps none

    def machine_snapshots(self) -> set[str]:
        return set()

    async def _warm_fork_child(self, vm: MicroVM) -> None:
        """The platform shell's ``true`` in a fork child (its own session, exited before the
        fork returns: no process is left): a child's first command under TCG costs ~0.2 s of
        QEMU CPU (~22k guest code blocks translated: the guest kernel's session, fork and exec
        paths, bash-static's start), the second ~0.02 s. Run while later children restore,
        that CPU fills what the one-restore-per-core gate leaves idle instead of piling up
        after the fork returns. InfraError if it does not exit 0 (the child does not work)."""
        code, _ = await run_shell(vm, "true", {}, self.settings.vm_boot_timeout_s, tail=0)
        if code != 0:
            raise InfraError(f"microVM fork child {vm.id}: warm-up command exited {code}",
                             sandbox_id=vm.id)

    async def _save_for_fork(self, h: MicroVM, paused: bool, staging: Path,
                             disk_id: str) -> tuple[float, Template]:
        """Stop ``h``, save its state into ``staging`` and snapshot its disk as ``disk_id``,
        run it again; (seconds it was held still, the image as a Template to restore)."""
        from rollbox.backends.microvm.template import STATE_NAME, TemplateKey

        state = staging / STATE_NAME
        timeout_s = self.settings.vm_boot_timeout_s
        async with h.lock:
            t0 = time.monotonic()
            async with qmp.session(h.qmp_path, timeout_s) as q:
                if not paused:
                    await q.stop()  # flushes the block layer: the disk file is as saved
                try:
                    fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 0o600)
                    try:
                        await q.getfd(fd, "fork")
                    finally:
                        os.close(fd)
                    # stopped: nothing to converge, so no cap on the copy (default 128 MiB/s)
                    await q.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})
                    await q.migrate("fd:fork")
                    await wait_migration(q, timeout_s)
                    await asyncio.to_thread(self.disks.pool.clone, h.id, disk_id)
                finally:
                    if not paused:
                        await q.cont()
            frozen_s = time.monotonic() - t0
        size = (await asyncio.to_thread(os.stat, state)).st_size
        key = TemplateKey(layers=(), disk_mib=0, guest_digest="", qemu_version="",
                          argv=("fork", h.id, staging.name))
        now = time.time()
        return frozen_s, Template(key=key, dir=staging, disk_id=disk_id, state_bytes=size,
                                  disk_bytes=0, created=now, last_used=now)

    def usage(self, h: MicroVM) -> Usage:  # type: ignore[override]
        parent, name = self.settings.cgroup_parent, h.jail.cgroup_name
        return Usage(memory_bytes=cgroups.memory_bytes(parent, name),
                     cpu_usage_us=cgroups.cpu_usage_us(parent, name),
                     cpu_throttled_us=cgroups.cpu_throttled_us(parent, name),
                     oom_kills=self.oom_kills(h))

    def oom_kills(self, h: MicroVM) -> int:  # type: ignore[override]
        return cgroups.oom_kills(self.settings.cgroup_parent, h.jail.cgroup_name)

    def kill_session(self, h: MicroVM, name: str) -> None:  # type: ignore[override]
        """No host-side backstop inside a VM: the agent's own deadline kills the session (a
        guest that ignores it only wastes its own vCPU quota)."""
