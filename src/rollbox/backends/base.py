"""The contract between the edge core and a sandbox backend: types only, no behaviour.

The edge (``rollbox.edge``) holds one :class:`Backend` per kind (``SandboxSpec.backend``:
"container", "microvm") and speaks to it only through this module; it never imports a
backend's internals. A backend makes, adopts and destroys sandboxes and answers for one live
sandbox through its :class:`SandboxHandle`: the agent channel (the same protocol for every
backend, ``rollbox.agent``), the files (:class:`SandboxFiles`), the per-backend state the
journal stores and hands back to :meth:`Backend.adopt` after an edge restart.

Owns these shapes only. Must not hold behaviour, touch the journal, admission, the api or any
backend's internals. Changes are additive (new optional members), so every lane and a remote
edge keep coding against it.
"""
from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

# A snapshot's options and answer are the capture's own types (every backend's capture, and
# the agent's for VMs, fill them); capture_writable below names them.
from rollbox.images.snapshot import CaptureOptions, CaptureResult
from rollbox.models import (
    ComputerAction,
    ComputerActionResult,
    DisplayInfo,
    FileStat,
    Qos,
    Resources,
)

if TYPE_CHECKING:
    from rollbox.agent.channel import AgentChannel

BackendKind = str  # "container" | "microvm" | "vm" (a spec's ``backend``)
DiskTier = Literal["disk", "memory"]


@dataclass(frozen=True)
class ResolvedSpec:
    """What a backend needs to make (or re-adopt) one sandbox. The edge resolved the image and
    extra layers to digests, merged the environment and validated the spec; a backend checks
    only what is its own (disk tier, hidden paths it can mask, network rules it can enforce,
    resources above what it can give: typed BadRequest before anything is allocated)."""

    image: str  # the image name the sandbox was made from (template keys, logs)
    layers: tuple[str, ...]  # layer digests, lowest first (the image's + the spec's extras)
    resources: Resources
    env: dict[str, str]  # the base environment of every command (image env + spec env)
    hidden_paths: tuple[str, ...] = ()
    # None: no network at all (loopback only, no link/NIC). A list (maybe empty): a link with
    # this allow-list (named permissions and HOST:PORT rules, rollbox.netpolicy), default deny.
    network_rules: tuple[str, ...] | None = None
    disk_tier: DiskTier = "disk"
    # A machine snapshot (disk + memory, :meth:`Backend.save_machine`) to restore instead of
    # booting, by the id its backend keeps it under: only a backend whose
    # ``capacity().snapshot`` is "machine" ("vm") restores one; every other refuses the spec
    # (BadRequest), as does a "vm" backend for a spec of another machine than the saved one.
    machine_snapshot: str | None = None
    # The CPU class (rollbox.isolation.qos): "batch" runs in the idle class, "latency" normal
    # (and core-scheduled where the host has it).
    qos: Qos = "batch"
    # A vm backend disk image's name (rollbox.images.vmdisk; ``layers`` is then empty): the
    # guest's root is a copy-on-write overlay of that disk, not layers (docs/backends/vm.md).
    disk_image: str = ""
    vm_console: str = "none"  # "vm" backend: "shell" puts a shell on the screen's tty1


@dataclass
class BackendCapacity:
    """What a backend tells node capacity (``Edge.capacity()["backends"][kind]``): whether
    this node offers it, the most one sandbox may ask (None: no limit beyond admission), and
    facts such as the accelerator ("kvm" | "tcg") or the runtime."""

    kind: BackendKind
    offered: bool = True
    reason: str | None = None  # why not offered (e.g. "no guest kernel: run make guest")
    max_cpus: float | None = None
    max_memory_mib: int | None = None
    max_disk_mib: int | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    # Whether :meth:`Backend.fork` works here (the edge refuses a fork with BadRequest
    # otherwise, before anything is reserved). Containers: yes, disk tier only (their
    # processes are not carried); microVMs: yes where templates work (memory and processes
    # carried through a saved image).
    fork: bool = False
    # What a snapshot of one of its sandboxes is. "layer": the writable layer as a new image
    # layer (capture_writable; container, microvm): any layered backend creates from it.
    # "machine": disk + memory (save_machine; vm): only this backend restores it.
    snapshot: Literal["layer", "machine"] = "layer"
    # Whether :meth:`Backend.pause_fs` / :meth:`Backend.resume_fs` work here (a filesystem-
    # only pause; the edge answers NotSupported naming the backend otherwise, before anything
    # is stopped). Containers and microVMs: yes ("vm": not yet).
    fs_pause: bool = False


@dataclass
class MachineSnapshot:
    """What :meth:`Backend.save_machine` kept: its id (the backend's name for it), the bytes
    of the saved state and of the disk as saved, how long the source was held still."""

    snapshot_id: str
    state_bytes: int
    disk_bytes: int
    frozen_s: float


@dataclass
class Usage:
    """Live use of one sandbox as the host sees it (None: the backend can not tell)."""

    memory_bytes: int | None = None  # charged on the host (a VM: QEMU's RSS)
    cpu_usage_us: int | None = None
    cpu_throttled_us: int | None = None  # held back by its CPU quota (the host's measure)
    oom_kills: int = 0  # OOM kills of the sandbox's memory limit so far
    disk_bytes: int | None = None  # used of its writable layer


@dataclass(frozen=True)
class SessionSlot:
    """Where one exec session runs: ``name`` identifies it to the backend (its cgroup, journaled
    with the exec); ``cgroup_fd`` is the O_PATH cgroup dir the agent joins the command to, or
    None where the agent makes the session's cgroup itself (inside a VM). The edge closes
    ``cgroup_fd`` once the agent has it."""

    name: str
    cgroup_fd: int | None = None


class NetworkAttachment(Protocol):
    """A live sandbox's network policy enforcement (link, allow-list, DNS gate)."""

    env: dict[str, str]  # joins the commands' env (package mirrors)

    def audit(self) -> dict[str, int]: ...  # NetAudit fields: totals so far
    def audit_news(self) -> dict[str, Any] | None: ...  # totals + new since last; None: none


class PortStream(Protocol):
    """A TCP connection to one port on a sandbox's own loopback (``Backend.open_port``), as
    the port proxy (rollbox.api.ports) drives it: bytes both ways, in order."""

    # The next bytes the service sent; b"" at its end. PortNotListening where the backend
    # learns only now that nothing listened (a relay through the agent).
    async def read(self) -> bytes: ...
    async def write(self, data: bytes) -> None: ...  # waits while the service is not reading
    async def write_eof(self) -> None: ...  # half-close: the service reads its end
    async def close(self) -> None: ...  # idempotent; never raises


@dataclass
class ForkResult:
    """What :meth:`Backend.fork` made: one handle per child, in the order asked, and how long
    the source was held still (frozen or stopped) for the copy everything is taken from."""

    children: list[SandboxHandle]
    frozen_s: float


class SandboxFiles(Protocol):
    """Files of one sandbox, every path resolved inside its root (links never lead out).
    Container: host-side descriptors on its overlay; microVM: through the agent. Sizes are
    capped; errors are typed (NotFound, BadRequest, PayloadTooLarge, DiskFull)."""

    async def read(self, path: str, max_bytes: int | None = None) -> bytes: ...
    async def write(self, path: str, data: bytes, mode: int = 0o644) -> None: ...
    # from byte ``offset`` on (a download resumed where it broke; past the end: nothing)
    def read_stream(self, path: str, max_bytes: int | None = None,
                    offset: int = 0) -> AsyncIterator[bytes]: ...
    # xattrs: user.* attributes of the new file (NotSupported where the backend has none)
    async def write_stream(self, path: str, chunks: AsyncIterator[bytes], mode: int = 0o644,
                           max_bytes: int | None = None,
                           xattrs: dict[str, str] | None = None) -> int: ...
    async def stat(self, path: str) -> FileStat: ...
    async def list(self, path: str) -> list[FileStat]: ...
    async def mkdir(self, path: str, parents: bool = False) -> None: ...
    async def remove(self, path: str, recursive: bool = False) -> None: ...
    # links=False: symlinks and hard links are skipped (grading).
    async def upload_tar(self, path: str, chunks: AsyncIterator[bytes], *,
                         links: bool = True) -> int: ...
    def download_tar(self, path: str) -> AsyncIterator[bytes]: ...
    def close(self) -> None: ...


class Display(Protocol):
    """A sandbox's screen and input devices (computer use; backend "vm" only): the screen as
    the VM draws it, input through one QEMU path. Errors are typed: BadRequest for input the
    display can not take (naming why; nothing reaches the guest then), SandboxPaused for a
    paused VM, InfraError for a VM that does not answer."""

    async def screenshot(self) -> bytes: ...  # PNG bytes as QEMU wrote them (never decoded)
    async def info(self) -> DisplayInfo: ...  # the size it has now
    async def act(self, action: ComputerAction) -> ComputerActionResult: ...
    # A connected VNC (RFB) stream to the screen for a live view (a socketpair end; QEMU got
    # the other by QMP add_client: nothing listens). The caller closes it.
    async def vnc_client(self) -> socket.socket: ...
    # The live view's stream (rollbox.backends.vm.rfb): what QEMU's VNC server sends, as it is;
    # what the viewer writes is checked message by message (BadRequest ends it), only what
    # draws the screen reaches QEMU, and its keyboard and pointer go through the one input
    # path while ``allow_input()`` is true (dropped otherwise). The caller closes it.
    async def live_view(self, allow_input: Callable[[], bool]) -> PortStream: ...


class SandboxHandle(Protocol):
    """One live sandbox of some backend, as the edge core holds it."""

    id: str
    kind: BackendKind
    channel: AgentChannel  # the same agent protocol for every backend
    files: SandboxFiles
    # True for VMs: exec results come from an untrusted guest (ExecResult.guest_reported).
    guest_reported: bool
    image_env: dict[str, str]  # the commands' base env (the edge adds the network's env)
    network: NetworkAttachment | None  # None: no network policy attached
    next_session: int  # the last session number handed out (exec ids are e<n>)

    def state(self) -> dict[str, Any]: ...  # JSON-able; journaled, fed back to adopt()
    def new_session(self) -> SessionSlot: ...  # bumps next_session
    def drop_session(self, name: str) -> None: ...  # after the command's end (best effort)


class Backend(Protocol):
    """A kind of sandbox on one node. Every method raises typed errors (rollbox.errors);
    a failed create leaves nothing behind."""

    kind: BackendKind

    async def start(self) -> None: ...  # node start (probes, e.g. the accelerator)
    # Edge stop: the backend's own node-level work ends (a microVM template's spare QEMUs);
    # its sandboxes keep running.
    async def stop(self) -> None: ...
    def capacity(self) -> BackendCapacity: ...
    # Descriptors the edge process holds for one live sandbox of this kind, with a network
    # policy attached or not (measured: its channel, its root or QEMU's log and pipe, a
    # network's DNS gate sockets and BPF objects): admission counts them against the edge's
    # RLIMIT_NOFILE, so a full table is a refused create, never EMFILE half-way.
    def edge_fds(self, networked: bool) -> int: ...
    # Descriptors the edge process holds for the backend's own node work, for no sandbox
    # (a microVM template's spare QEMUs; container: none), now: admission counts them too.
    def node_fds(self) -> int: ...
    async def create(self, sandbox_id: str, spec: ResolvedSpec) -> SandboxHandle: ...
    # After an edge restart: reconnect to a sandbox an earlier edge made (spec rebuilt from
    # the journal, state as its handle's state() was journaled); paused: leave it frozen.
    # None: it is gone (the backend cleaned what was left).
    async def adopt(self, sandbox_id: str, spec: ResolvedSpec, state: dict[str, Any],
                    paused: bool) -> SandboxHandle | None: ...
    async def destroy(self, h: SandboxHandle) -> None: ...  # verified teardown, also paused
    def detach(self, h: SandboxHandle) -> None: ...  # edge stops, sandbox keeps running
    # Clean what a sandbox left that is not live (state None: an orphan found on the host).
    async def cleanup(self, sandbox_id: str, state: dict[str, Any] | None) -> None: ...
    def host_sandbox_ids(self, prefix: str = "") -> set[str]: ...  # orphans after a restart
    def leftovers(self, sandbox_id: str) -> list[str]: ...  # empty after a clean destroy
    def release_node_resources(self) -> None: ...  # no sandbox of this backend left

    async def pause(self, h: SandboxHandle) -> None: ...  # freeze all of it (InfraError)
    async def resume(self, h: SandboxHandle) -> None: ...
    # Filesystem-only pause (only where ``capacity().fs_pause``): every process of the sandbox
    # stopped (its agent too: the handle's channel closes), its memory and CPU released (a
    # container's cgroup and netns removed, a microVM's QEMU ended), its filesystem kept (the
    # image layers, the writable layer / rw disk) with the uid slot, so ``h.files`` of a
    # host-side backend still work. ``h.state()`` says so from then on; ``adopt`` of that
    # state (``paused`` True) gives the stopped handle back without booting it. Verified:
    # InfraError if a process survives (the sandbox is then torn down by the edge).
    async def pause_fs(self, h: SandboxHandle) -> None: ...
    # Boot a filesystem-paused sandbox again over the same layers: a fresh init and agent
    # (``h.channel`` replaced), a new boot id, the network re-attached with ``rules`` (None:
    # none); no process of before. A failure stops what it started and leaves it paused.
    async def resume_fs(self, h: SandboxHandle, rules: list[str] | None) -> None: ...
    # Network policy: attach a link with ``rules`` or change the rules of the attached one
    # (existing connections cut where no longer allowed); BadRequest leaves it unchanged.
    async def set_network(self, h: SandboxHandle, rules: list[str]) -> None: ...
    # Snapshot: what it is per backend is ``capacity().snapshot``.
    # "layer" (container, microvm): copy the writable layer, as an overlay upper, into the new
    # host dir ``dest`` that storage builds a layer from; parsed as hostile, capped by
    # ``opts``. The image made of it (the source's layers + that layer) creates sandboxes of
    # any layered backend (container, microvm, vm).
    async def capture_writable(self, h: SandboxHandle, dest: Path,
                               opts: CaptureOptions) -> CaptureResult: ...
    # "machine" (vm): disk + memory, kept by the backend as ``snapshot_id`` (the edge's new
    # token; ``spec``: the sandbox's, as the backend got it): the source held still (unless ``paused``: it is), its state and disk saved, run
    # again; restorable (``ResolvedSpec.machine_snapshot``) as new sandboxes of this backend
    # only, each its own id, identity, network and copy-on-write disk (docs/backends/vm.md,
    # Snapshot). BadRequest where ``capacity().snapshot`` is "layer".
    async def save_machine(self, h: SandboxHandle, snapshot_id: str, spec: ResolvedSpec,
                           paused: bool) -> MachineSnapshot: ...
    # A machine snapshot's files removed (after restores under way); what is left.
    def drop_machine(self, snapshot_id: str) -> list[str]: ...
    def machine_snapshots(self) -> set[str]: ...  # ids of those kept on the node (edge start)

    # Fork: ``children`` (id, spec: the source's) as copies of the live (or, ``paused``,
    # frozen) sandbox ``h``: its filesystem as at one instant, never a copy of its writable
    # layer per child, each child with its own identity (hostname = its id, machine-id,
    # random seeds). The source keeps running (held still only for the instant). All or
    # nothing: a failure tears down every child made and raises a typed error. Only where
    # ``capacity().fork``; otherwise BadRequest.
    async def fork(self, h: SandboxHandle, children: list[tuple[str, ResolvedSpec]],
                   paused: bool) -> ForkResult: ...

    # Before a command starts (after the edge checked it is not paused): make the sandbox
    # ready to run it, e.g. a squeezed VM's balloon deflated (container: nothing).
    async def prepare_exec(self, h: SandboxHandle) -> None: ...

    # Exposed ports: a connection to 127.0.0.1:``port`` as the sandbox itself sees it (its own
    # loopback, never the host's or another sandbox's), also in a sandbox with no network at
    # all; the caller checked 1 <= port <= 65535 and that the sandbox runs. PortNotListening
    # when nothing listens there (or at the first read, see PortStream.read). The path is the
    # backend's own: container: a socket made inside the sandbox's netns by a host thread,
    # outside its cgroup (its BPF filters do not apply, and the socket can reach only that
    # netns); microVM: a relay through the agent (busybox nc to the guest's loopback, bytes
    # over the exec session's stdin/stdout on virtio-serial), no guest network needed.
    async def open_port(self, h: SandboxHandle, port: int) -> PortStream: ...

    # Computer use: the sandbox's screen and input (None: this backend has no display; the
    # edge then refuses with BadRequest). Only "vm" sandboxes have one.
    def display(self, h: SandboxHandle) -> Display | None: ...

    def usage(self, h: SandboxHandle) -> Usage: ...
    def oom_kills(self, h: SandboxHandle) -> int: ...  # cheap: read on SIGKILL exits only
    # Host-side backstop past a command's deadline: kill its session (VM: through the agent
    # or nothing; the guest's own timeout comes first).
    def kill_session(self, h: SandboxHandle, name: str) -> None: ...
