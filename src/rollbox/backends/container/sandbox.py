"""Lifecycle of container sandboxes on one node: create, adopt after a restart, destroy, verify.

Creation order: uid slot -> capped writable layer (verified: a subvolume of the node's disk
pool, or a tmpfs for the memory tier) -> idmapped layers -> overlayfs ->
named netns (made on its own thread alongside the tree's mounts) -> agent socket -> OCI config -> the runtime (``runc run -d``, or the native
launcher: runtime.py, launcher.py) -> cgroup delegation -> agent
handshake. Destruction kills by cgroup, then unwinds in reverse and checks that no process,
mount, subvolume, cgroup, netns or file of the sandbox remains. A create that fails or is
cancelled at any point gets the same teardown; a cancelled one first lets the step under way
end (the prepare thread, ``runc run -d``, the network attach) and stays cancelled if the
teardown fails (``rollbox.backends.cancellation``).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, overload
from pathlib import Path

from rollbox.backends import platform_work
from rollbox.backends.base import (
    BackendCapacity, CaptureOptions, CaptureResult, ForkResult, MachineSnapshot, PortStream,
    ResolvedSpec, SessionSlot, Usage,
)
from rollbox.backends.cancellation import all_or_raise, teardown_after, to_the_end
from rollbox.backends.ports import connect_in_netns
from rollbox.backends.container import bundle
from rollbox.agent import platform_shell
from rollbox.agent.channel import AgentChannel
from rollbox.backends.container.cpuview import CpuViews
from rollbox.backends.container.masks import NodeMask
from rollbox.backends.container.disk import PENDING_REF, DiskPool
from rollbox.backends.container.files import ContainerFiles
from rollbox.hostfs import SandboxFS
from rollbox.backends.container.rootfs import (
    Rootfs, ensure_run_tmpfs, mount_points_under, release_run_tmpfs, remove_flat_dir,
)
from rollbox.backends.container.launcher import NativeRuntime
from rollbox.backends.container.runtime import OciRuntime, Runtime, wait_pid
from rollbox.config import VARS, Settings
from rollbox.errors import BadRequest, InfraError, RollboxError, without_paths
from rollbox.isolation import cgroups, netns, oom, syscalls
from rollbox.isolation import qos as cpu_qos
from rollbox.isolation.userns import RANGE, UidSlots, make_userns_fd
from rollbox.netpolicy import link as netlink
from rollbox.netpolicy import policy as netpolicy
from rollbox.netpolicy import sandbox_net
from rollbox.netpolicy.sandbox_net import SandboxNetwork
from rollbox.models import Resources

log = logging.getLogger(__name__)

# The benchmark-only switch's variable (settings.unhardened_for_bench), as bench/container.py
# sets it for its second server.
UNHARDENED_ENV = VARS["unhardened_for_bench"].env


@dataclass
class ContainerSandbox:
    id: str
    slot: int
    host_uid: int
    rootfs: Rootfs
    run_dir: Path
    v2_cgroup: Path
    agent_pid: int
    channel: AgentChannel
    fs: SandboxFS
    image_env: dict[str, str] = field(default_factory=dict)
    next_session: int = 0
    # Network policy (veth + BPF + DNS gate); None: loopback only, nothing attached.
    network: SandboxNetwork | None = None
    # A fork child's frozen writable layers under its own (lowest first): (the pool's fork
    # lower, the host uid its files are owned by); a fork of it passes them on.
    fork_lowers: list[tuple[str, int]] = field(default_factory=list)
    # False while paused filesystem-only (pause_fs): no process, no cgroup, no netns; the
    # channel is closed. What a boot needs again (resume_fs) is kept here.
    booted: bool = True
    resources: Resources | None = None
    hidden_paths: tuple[str, ...] = ()
    hardened: bool = True
    qos: str = "batch"  # its CPU class's name (isolation.qos)
    kind: ClassVar[str] = "container"
    guest_reported: ClassVar[bool] = False  # the host observes exits itself (pidfd, cgroup)
    files: ContainerFiles = field(init=False)  # fs as the backends' async SandboxFiles

    def __post_init__(self) -> None:
        self.files = ContainerFiles(self.fs)

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "agent.sock"

    def new_session_cgroup(self) -> tuple[str, int]:
        """Create the cgroup of the next exec session; returns (name, O_PATH dir fd)."""
        self.next_session += 1
        name = f"x{self.next_session}"
        return name, cgroups.make_session(self.v2_cgroup, name, self.host_uid)

    def drop_session_cgroup(self, name: str) -> None:
        path = self.v2_cgroup / name
        if not cgroups.procs(path):
            try:
                path.rmdir()
            except OSError:
                pass  # still populated by processes the command left behind

    # ---- SandboxHandle (rollbox.backends.base) ---------------------------------------
    def state(self) -> dict[str, Any]:
        """What the journal keeps for adopt(): the uid (its slot), a fork child's lowers and
        whether it is stopped (paused filesystem-only); the rest is found by id."""
        out: dict[str, Any] = {"host_uid": self.host_uid}
        if self.fork_lowers:
            out["fork_lowers"] = [[name, uid] for name, uid in self.fork_lowers]
        if not self.booted:
            out["stopped"] = True
        return out

    def new_session(self) -> SessionSlot:
        name, fd = self.new_session_cgroup()
        return SessionSlot(name, fd)

    def drop_session(self, name: str) -> None:
        self.drop_session_cgroup(name)

    async def run_shell(self, cmd: str, env: dict[str, str], timeout_s: float,
                        on_output: Callable[[bytes], object] | None = None,
                        tail: int = 4000) -> tuple[int, bytes]:
        """The platform's own command (image builds): see rollbox.backends.platform_work."""
        return await platform_work.run_shell(self, cmd, env, timeout_s, on_output, tail)


def _make_hidden_paths(root: Path, host_uid: int, hidden_paths: Sequence[str]) -> None:
    """A hidden path missing from the image becomes an empty directory before start, so runc
    masks it like the others: what the platform writes there later (the task's tests through
    the file API) stays under the mask. One that can not be made (its parent is a file) is left
    to the agent's Landlock path rules."""
    fs = SandboxFS(root, host_uid)
    try:
        for path in bundle.normalize_hidden(hidden_paths):
            try:
                if not fs.exists(path):
                    fs.mkdir(path, parents=True)
            except RollboxError as exc:
                log.info("hidden path %s not made (%s): Landlock rules only", path, exc)
    finally:
        fs.close()


# The edge's descriptors per live container (ContainerBackend.edge_fds).
CONTAINER_FDS = 2
CONTAINER_NETWORK_FDS = 4

MACHINE_ID = "/etc/machine-id"
# Seed files that carry randomness across boots: a fork child's are replaced with its own.
RANDOM_SEEDS = ("/var/lib/systemd/random-seed", "/var/lib/urandom/random-seed")


def _fresh_identity(root: Path, host_uid: int) -> None:
    """A fork child's own identity in its tree (its hostname is its id, set by runc): a new
    /etc/machine-id where the tree has /etc, new random seed files where the source had
    some. Written into the child's fresh upper, never into the shared lower."""
    fs = SandboxFS(root, host_uid)
    try:
        if fs.exists("/etc"):
            fs.write(MACHINE_ID, (secrets.token_hex(16) + "\n").encode(), 0o444,
                     parents=False)
        for seed in RANDOM_SEEDS:
            if fs.exists(seed):
                fs.write(seed, secrets.token_bytes(512), 0o600, parents=False)
    finally:
        fs.close()


BOOT_ID_FILE = "boot_id"  # in the sandbox's own dir, beside (not in) its tree


def _write_boot_id(sandbox_dir: Path) -> Path:
    """A new boot id (a random UUID, as the kernel's) for this boot of a sandbox, in its own
    platform-owned dir; bound read-only over /proc/sys/kernel/random/boot_id (bundle.py)."""
    path = sandbox_dir / BOOT_ID_FILE
    tmp = sandbox_dir / f".{BOOT_ID_FILE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o444)
    try:
        os.write(fd, (str(uuid.uuid4()) + "\n").encode())
        os.fchmod(fd, 0o444)  # whatever the umask: read inside the sandbox
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


class ContainerBackend:
    kind = "container"

    def __init__(self, settings: Settings, layer_mounts, slots: UidSlots) -> None:  # noqa: ANN001
        self.settings = settings
        self.layer_mounts = layer_mounts
        self.slots = slots
        # Whether the run dir is on rollbox's own tmpfs (mounted by prepare_run_dir, or by an
        # earlier process that may have crashed): then this backend takes it down when it
        # stops idle. Nothing is mounted before start() (or a first create without one): an
        # edge whose start fails on its host claim has touched no host resource.
        self.owns_run_tmpfs = False
        self._run_ready = False
        self.runtime: Runtime = (NativeRuntime(settings.launcher_binary)
                                 if settings.runtime == "native"
                                 else OciRuntime(settings.runtime, settings.run_dir / "runc"))
        self.disk = DiskPool(settings)  # mounted on first use (or found mounted)
        self.sandboxes_dir = settings.sandboxes_dir
        # Where rootfs dirs lived before the run dir held them: sandboxes an older edge left
        # running there are still adopted and cleaned from it.
        self.legacy_sandboxes_dir = settings.data_dir / "sandboxes"
        self.run_root = settings.run_dir / "sandboxes"
        self.cpu_views = CpuViews()
        # /sys and the masked dirs of every sandbox: binds of one read-only tmpfs (masks.py)
        self.mask = NodeMask(settings.run_dir / "mask")
        src = settings.agent_binary
        if not src.exists():
            raise InfraError(f"agent binary missing at {src} (run `make native`)")
        self.agent_path = self._install_host_binary(src.read_bytes(), bundle.AGENT_NAME)
        self.shell_path = self._install_host_binary(
            platform_shell.prepared(settings.platform_shell), platform_shell.NAME)
        bundle.host_mount()  # the boot id's hook runs it: missing, no backend

    def _install_host_binary(self, data: bytes, name: str) -> Path:
        """Copy a binary of the platform (the agent, the platform shell) to a root-owned,
        content-addressed host dir; returns its path. Sandboxes never see it in their tree:
        runc execs the agent from an inherited fd, the agent the shell from another."""
        digest = hashlib.sha256(data).hexdigest()[:16]
        target_dir = self.settings.data_dir / "agent" / digest
        target = target_dir / name
        if not target.exists():
            target_dir.mkdir(parents=True, exist_ok=True)
            tmp = target_dir / f".tmp-{name}"
            tmp.write_bytes(data)
            os.chmod(tmp, 0o555)
            os.replace(tmp, target)
        return target

    def cgroups_path(self, sandbox_id: str) -> str:
        return f"/{self.settings.cgroup_parent}/{sandbox_id}"

    def rootfs_of(self, sandbox_id: str) -> Rootfs:
        """The rootfs of an existing sandbox (in its legacy place if an older edge made it)."""
        legacy = self.legacy_sandboxes_dir / sandbox_id
        if legacy.is_dir() and not (self.sandboxes_dir / sandbox_id).exists():
            return Rootfs(legacy)
        return Rootfs(self.sandboxes_dir / sandbox_id)

    # ---- Backend (rollbox.backends.base) ----------------------------------------------
    async def start(self) -> None:
        """Container inits outlive ``runc run -d``: as subreaper the edge gets and reaps them.
        The cgroup2 mount gets ``favordynmods`` (``cgroup_favordynmods``: fast placements,
        isolation.cgroups). The run dir is made ready (:meth:`prepare_run_dir`)."""
        syscalls.become_subreaper()
        if self.settings.cgroup_favordynmods:
            state = await asyncio.to_thread(cgroups.favor_dynmods)
            if state not in ("on", "set"):
                log.warning("cgroup favordynmods %s: every sandbox placement may wait for an "
                            "RCU grace period", state)
        self.prepare_run_dir()

    def prepare_run_dir(self) -> None:
        """Put the run dir on rollbox's tmpfs (``run_tmpfs``; taken down again by
        :meth:`release_node_resources` once idle) and make its dirs; once (again after a
        release). At start, or at the first create of a backend used without one (builds)."""
        if self._run_ready:
            return
        settings = self.settings
        if settings.run_tmpfs:
            run_fs = ensure_run_tmpfs(settings.run_dir)
            if run_fs == "disk":
                log.warning("%s holds state from a run on disk; it stays on disk (slower "
                            "creates)", settings.run_dir)
            self.owns_run_tmpfs = run_fs in ("mounted", "ours")
        # under the tmpfs mounted now (the rootfs dirs are in the run dir too)
        for d in (self.sandboxes_dir, self.run_root, self.runtime.root):
            if d is not None:
                d.mkdir(parents=True, exist_ok=True)
        self.mask.ensure()
        self._run_ready = True

    async def stop(self) -> None:
        """Nothing of the node runs in the background here."""

    @overload
    async def create(self, sandbox_id: str, spec: ResolvedSpec, *,
                     hardened: bool = True) -> ContainerSandbox: ...
    @overload
    async def create(self, sandbox_id: str, spec: list[str], resources: Resources,
                     image_env: dict[str, str], network: str = "none", *,
                     hardened: bool = True, hidden_paths: Sequence[str] = (),
                     network_rules: list[str] | None = None,
                     disk_tier: str = "disk", qos: str = "batch") -> ContainerSandbox: ...

    async def create(self, sandbox_id: str, spec: ResolvedSpec | list[str],
                     *args: Any, hardened: bool = True, **kw: Any) -> ContainerSandbox:
        """The contract's create from a resolved spec, or :meth:`create_container`'s own
        arguments (layers, resources, env, ...: the platform's build sandboxes)."""
        if isinstance(spec, ResolvedSpec) and spec.machine_snapshot is not None:
            raise BadRequest("a machine snapshot (disk + memory of a 'vm' sandbox) restores "
                             "as a 'vm' sandbox only: a container starts from image layers",
                             reason="machine_snapshot", backend=self.kind)
        self.prepare_run_dir()
        if isinstance(spec, ResolvedSpec):
            return await self.create_container(
                sandbox_id, list(spec.layers), spec.resources, spec.env, hardened=hardened,
                hidden_paths=spec.hidden_paths, disk_tier=spec.disk_tier, qos=spec.qos,
                network_rules=list(spec.network_rules) if spec.network_rules is not None
                else None)
        return await self.create_container(sandbox_id, spec, *args, hardened=hardened, **kw)

    async def create_container(self, sandbox_id: str, layers: list[str], resources: Resources,
                               image_env: dict[str, str], network: str = "none", *,
                               hardened: bool = True, hidden_paths: Sequence[str] = (),
                               network_rules: list[str] | None = None,
                               disk_tier: str = "disk", qos: str = "batch",
                               fork_lowers: Sequence[tuple[str, int]] = ()) -> ContainerSandbox:
        """network: "none" (own netns, loopback only) or "host" — the latter only for the
        platform's own image builds from operator-given commands, never from the API.
        disk_tier: "disk" (a capped subvolume of the node's disk pool) or "memory" (tmpfs).
        hardened=False: the red-team tests' deliberately weak twin (see bundle.py), never from
        the API. hidden_paths: paths of the tree the sandbox's commands can not see.
        fork_lowers: a fork child's frozen writable layers (see :meth:`fork`), each shifted
        from its owner's uids to this sandbox's, referenced for it by the caller before
        (``DiskPool.ref``); the child gets a fresh identity. qos: the CPU class
        (``isolation.qos``; the platform's builds: batch)."""
        bundle.normalize_hidden(hidden_paths)  # bad input fails before anything is allocated
        cpu = cpu_qos.node_class(qos, self.settings.cpu_qos)
        if disk_tier not in ("disk", "memory"):
            raise BadRequest(f"unknown disk tier {disk_tier!r}", disk_tier=disk_tier)
        if network_rules is not None:
            netpolicy.parse_rules(network_rules)
        if self.settings.unhardened_for_bench:
            log.warning("%s=1: sandbox %s is NOT hardened (benchmark only)", UNHARDENED_ENV,
                        sandbox_id)
            hardened = False
        slot = self.slots.acquire()
        host_uid = self.slots.host_uid(slot)
        rootfs = Rootfs(self.sandboxes_dir / sandbox_id)
        run_dir = self.run_root / sandbox_id
        pid: int | None = None
        pids: list[int] = []
        sb: ContainerSandbox | None = None
        # Each step that makes something on the host (the prepare thread, runc, the network)
        # runs to its end if the create is cancelled meanwhile (to_the_end): the teardown
        # below then sees all it made, instead of racing a thread or a runc that goes on.
        try:
            def prepare() -> str:  # blocking kernel work, off the event loop
                # its netns made on a thread of its own meanwhile (that thread exists
                # anyway: unshare moves the thread that calls it); waited for whatever
                # happens here, so the teardown sees it (and removes it after a failure)
                pending = (None if network == "host" else
                           netns.start_create(netns.PREFIX + sandbox_id))
                try:
                    subvolume = (self.disk.create(sandbox_id, resources.disk_mib << 20)
                                 if disk_tier == "disk" else None)
                    shifts = []
                    try:
                        for lower, owner_uid in fork_lowers:
                            shifts.append((self.disk.path(lower) / rootfs.upper.name,
                                           make_userns_fd(host_uid, RANGE, inside=owner_uid)))
                        with self.layer_mounts.in_use(), self.slots.userns_fd(slot) as userns:
                            mounts = [self.layer_mounts.ensure_mounted(d) for d in layers]
                            rootfs.compose(mounts, userns, host_uid,
                                           resources.disk_mib, resources.inodes, subvolume,
                                           upper_lowers=shifts)
                    finally:
                        for _, fd in shifts:
                            os.close(fd)
                    if fork_lowers:
                        _fresh_identity(rootfs.merged, host_uid)
                    if hardened and hidden_paths:
                        _make_hidden_paths(rootfs.merged, host_uid, hidden_paths)
                except BaseException:
                    if pending is not None:  # its own error second to this one
                        with contextlib.suppress(Exception):
                            pending.result()
                    raise
                return "host" if pending is None else str(pending.result())

            ns_path = await to_the_end(asyncio.to_thread(prepare))
            v2 = cgroups.v2_dir(self.settings.cgroup_parent, sandbox_id)
            channel = await self._boot(sandbox_id, rootfs, run_dir, host_uid, resources,
                                       network, hardened, hidden_paths, cpu, pids,
                                       ns_path=ns_path)
            pid = pids[0]
            sb = ContainerSandbox(
                id=sandbox_id, slot=slot, host_uid=host_uid, rootfs=rootfs, run_dir=run_dir,
                v2_cgroup=v2, agent_pid=pid, channel=channel, fs=SandboxFS(rootfs.merged, host_uid),
                image_env=image_env, fork_lowers=list(fork_lowers), resources=resources,
                hidden_paths=tuple(hidden_paths), hardened=hardened, qos=qos,
            )
            if network_rules is not None and network != "host":
                await to_the_end(self.attach_network(sb, network_rules))
            return sb
        except BaseException as exc:
            if pid is None and pids:
                pid = pids[0]
            if sb is not None:
                if sb.network is not None:
                    sb.network.close()  # its gate and map; the link goes with the teardown
                sb.channel.close()
                sb.fs.close()
            if pid is None:  # runc started the agent, then the cancellation came
                pid = _agent_pid(run_dir)
            # a cancelled create stays cancelled even if the teardown fails (it is logged)
            await teardown_after(exc, self._teardown(sandbox_id, rootfs, run_dir, slot, pid))
            raise

    async def _boot(self, sandbox_id: str, rootfs: Rootfs, run_dir: Path, host_uid: int,
                    resources: Resources, network: str, hardened: bool,
                    hidden_paths: Sequence[str], cpu: cpu_qos.CpuClass,
                    pids: list[int], ns_path: str | None = None) -> AgentChannel:
        """Start a sandbox's init and agent over its composed tree (at create, and again at
        resume_fs): its netns (unless made already: ``ns_path``), CPU view, boot id, agent
        socket, OCI bundle, ``runc run -d``, its CPU class, cgroup delegation, handshake. The
        agent's pid goes into ``pids`` as soon as runc reports it (the caller's teardown needs
        it if a later step fails)."""
        if ns_path is None:
            ns_path = ("host" if network == "host" else
                       str(await to_the_end(asyncio.to_thread(netns.create,
                                                              netns.PREFIX + sandbox_id))))
        cpu_view = self.cpu_views.write(rootfs.dir, self.cpu_views.pick(resources.cpus))
        boot_id = _write_boot_id(rootfs.dir)
        self.mask.ready()
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir, 0o700)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock_path = run_dir / "agent.sock"
            sock_path.unlink(missing_ok=True)  # a boot before this one's
            listener.bind(str(sock_path))
            os.chmod(sock_path, 0o600)
            listener.listen(8)
            config = bundle.oci_config(
                sandbox_id=sandbox_id, rootfs=str(rootfs.merged), host_uid=host_uid,
                netns_path=ns_path,
                cgroups_path=self.cgroups_path(sandbox_id), resources=resources,
                hostname=sandbox_id[:63], hardened=hardened, hidden_paths=hidden_paths,
                cpu_view=cpu_view, boot_id=str(boot_id), mask=self.mask,
            )
            agent_fd = os.open(self.agent_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                shell_fd = os.open(self.shell_path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    pid = await to_the_end(self.runtime.run_detached(
                        sandbox_id, rootfs.dir, config, listener.fileno(), agent_fd, shell_fd,
                        run_dir / "pid", run_dir / "agent.log"))
                finally:
                    os.close(shell_fd)
            finally:
                os.close(agent_fd)
            pids.append(pid)
            # The agent is the OOM killer's last choice; its commands start from 0 again
            # (agent.c), which they can not lower (see isolation.oom).
            oom.protect(pid)
            # its CPU class before any command of it runs (the agent waits for the handshake);
            # a few cgroup writes and one sched_setattr, on the loop: a thread hop costs more
            cpu_qos.apply_sandbox(self.settings.cgroup_parent, sandbox_id, pid, cpu)
        finally:
            listener.close()
        v2 = cgroups.v2_dir(self.settings.cgroup_parent, sandbox_id)
        cgroups.delegate(v2, host_uid)
        return await AgentChannel.connect(str(sock_path), timeout=10.0)

    def edge_fds(self, networked: bool) -> int:
        """Its agent channel's socket and its root's O_PATH fd; with a network, the DNS gate's
        UDP and TCP sockets and the BPF allow-list's program and map (measured: 2 and 6)."""
        return CONTAINER_FDS + (CONTAINER_NETWORK_FDS if networked else 0)

    def node_fds(self) -> int:
        """None: every descriptor of this backend is a sandbox's (a warm pool's sandboxes are
        admitted as sandboxes)."""
        return 0

    def capacity(self) -> BackendCapacity:
        """Offered wherever the edge runs; no per-sandbox cap beyond admission (a CPU limit
        above the node's cores is a CFS quota, not a reservation)."""
        facts = {"runtime": self.settings.runtime,
                 **cpu_qos.node_facts(self.settings.cpu_qos)}
        return BackendCapacity(kind=self.kind, facts=facts, fork=True, fs_pause=True)

    async def attach_network(self, sb: ContainerSandbox, rules: list[str]) -> SandboxNetwork:
        """Give a running sandbox its link, BPF allow-list and DNS gate (policy = rules)."""
        net = await sandbox_net.attach(sb.id, netns.PREFIX + sb.id, sb.v2_cgroup, rules,
                                       self.settings)
        sb.network = net
        await asyncio.to_thread(sb.fs.write, sandbox_net.RESOLV_CONF, net.resolv_conf(), 0o644)
        return net

    async def adopt(self, sandbox_id: str, spec: ResolvedSpec, state: dict[str, Any],
                    paused: bool) -> ContainerSandbox | None:
        """Re-adopt one sandbox. A frozen one (paused, or left frozen by a crash mid-snapshot)
        can not answer the handshake: its commands are frozen on their own, the agent alone is
        thawed for the handshake, then it is frozen again if ``paused``."""
        host_uid = state.get("host_uid")
        if not isinstance(host_uid, int):
            log.warning("sandbox %s: journaled state has no uid (%r); cleaning up", sandbox_id,
                        state)
            await self.cleanup(sandbox_id, None)
            return None
        if state.get("stopped"):
            return await self._adopt_stopped(sandbox_id, host_uid, spec, state)
        v2 = cgroups.v2_dir(self.settings.cgroup_parent, sandbox_id)
        v1 = self._v1_freezer(sandbox_id)
        was_frozen = await asyncio.to_thread(cgroups.is_frozen, v2, v1)
        if was_frozen:
            cgroups.set_children_frozen(v2, True)
            cgroups.thaw(v2, v1)
        box = await self._reconnect(
            sandbox_id, host_uid, spec.env,
            network_rules=list(spec.network_rules) if spec.network_rules is not None else None)
        if box is None:
            return None
        box.fork_lowers = [(str(n), int(u)) for n, u in state.get("fork_lowers", [])]
        box.resources, box.hidden_paths = spec.resources, tuple(spec.hidden_paths)
        box.qos = spec.qos
        if paused:
            try:
                await asyncio.to_thread(cgroups.freeze, v2, v1)
            except InfraError as exc:  # the edge's pause() after adopt tells it apart
                log.error("sandbox %s: can not freeze it again (%s)", sandbox_id, exc)
        if was_frozen:
            cgroups.set_children_frozen(v2, False)  # frozen by the parent (paused) or running
        return box

    async def _adopt_stopped(self, sandbox_id: str, host_uid: int, spec: ResolvedSpec,
                             state: dict[str, Any]) -> ContainerSandbox | None:
        """Re-adopt a filesystem-paused sandbox: nothing runs; its tree must still be mounted
        (else it is cleaned up: None). A process found in its cgroup is killed (a boot an
        earlier edge started and did not finish, or did not record)."""
        slot = self.slots.slot_of(host_uid)
        self.slots.claim(slot)
        rootfs = self.rootfs_of(sandbox_id)
        run_dir = self.run_root / sandbox_id
        if not os.path.ismount(rootfs.merged):
            log.warning("sandbox %s: its stopped tree is not mounted; cleaning up", sandbox_id)
            await self._teardown(sandbox_id, rootfs, run_dir, slot, _agent_pid(run_dir))
            return None
        problems = await self._stop_processes(sandbox_id, _agent_pid(run_dir))
        problems += await asyncio.to_thread(self._release_boot, sandbox_id, run_dir)
        if problems:
            log.error("sandbox %s: a stray boot left %s", sandbox_id, problems)
        sb = ContainerSandbox(
            id=sandbox_id, slot=slot, host_uid=host_uid, rootfs=rootfs, run_dir=run_dir,
            v2_cgroup=cgroups.v2_dir(self.settings.cgroup_parent, sandbox_id), agent_pid=0,
            channel=AgentChannel.gone(), fs=SandboxFS(rootfs.merged, host_uid),
            image_env=spec.env, booted=False, resources=spec.resources,
            hidden_paths=tuple(spec.hidden_paths), qos=spec.qos,
            fork_lowers=[(str(n), int(u)) for n, u in state.get("fork_lowers", [])])
        sb.next_session = int(state.get("next_session", 0))
        return sb

    async def pause_fs(self, sb: ContainerSandbox) -> None:  # type: ignore[override]
        """Stop every process (cgroup.kill, the agent reaped), remove the cgroups, runc's
        state, the netns and link and the agent's socket; keep the tree (image layers,
        writable layer, their mounts) and the uid slot. Verified: InfraError naming what is
        left (the edge then tears it down)."""
        if not sb.booted:
            return
        v1 = self._v1_freezer(sb.id)
        if not (sb.v2_cgroup / "cgroup.freeze").exists() and cgroups.is_frozen(sb.v2_cgroup, v1):
            cgroups.thaw(sb.v2_cgroup, v1)  # v1: a frozen task can not take the kill
        if sb.network is not None:
            sb.network.close()  # its gate and map; the link goes below
            sb.network = None
        sb.channel.close()
        problems = await self._stop_processes(sb.id, sb.agent_pid)
        problems += await asyncio.to_thread(self._release_boot, sb.id, sb.run_dir)
        sb.booted, sb.agent_pid = False, 0
        if problems:
            raise InfraError(f"filesystem pause of {sb.id} incomplete", problems=problems)

    async def resume_fs(self, sb: ContainerSandbox,  # type: ignore[override]
                        rules: list[str] | None) -> None:
        """Boot it again over its tree (:meth:`_boot`: a new init, agent and boot id), the
        network re-attached with ``rules``. A failure stops what it started (it stays
        stopped) and raises."""
        if sb.booted:
            return
        assert sb.resources is not None
        pids: list[int] = []
        try:
            sb.channel = await self._boot(sb.id, sb.rootfs, sb.run_dir, sb.host_uid,
                                          sb.resources, "none", sb.hardened, sb.hidden_paths,
                                          cpu_qos.node_class(sb.qos, self.settings.cpu_qos),
                                          pids)
            sb.agent_pid, sb.booted = pids[0], True
            if rules is not None:
                await to_the_end(self.attach_network(sb, rules))
        except BaseException as exc:
            if sb.network is not None:
                sb.network.close()
                sb.network = None
            sb.channel.close()
            pid = pids[0] if pids else _agent_pid(sb.run_dir)

            async def stop() -> None:
                problems = await self._stop_processes(sb.id, pid)
                problems += await asyncio.to_thread(self._release_boot, sb.id, sb.run_dir)
                if problems:
                    raise InfraError(f"a failed boot of {sb.id} left {problems}")

            sb.booted, sb.agent_pid = False, 0
            await teardown_after(exc, stop())
            raise

    def _v1_freezer(self, sandbox_id: str) -> Path:
        return cgroups.ROOT / "freezer" / self.settings.cgroup_parent / sandbox_id

    def detach(self, sb: ContainerSandbox) -> None:  # type: ignore[override]
        """The edge stops; the sandbox runs on. Its root fd would pin its mounts (disk pool)."""
        sb.channel.close()
        sb.fs.close()

    async def cleanup(self, sandbox_id: str, state: dict[str, Any] | None) -> None:
        host_uid = state.get("host_uid") if state else None
        await self.cleanup_orphan(sandbox_id, host_uid if isinstance(host_uid, int) else None)

    async def pause(self, sb: ContainerSandbox) -> None:  # type: ignore[override]
        """Freeze the agent and every command in the sandbox's cgroup (InfraError: thawed)."""
        await asyncio.to_thread(cgroups.freeze, sb.v2_cgroup, self._v1_freezer(sb.id))

    async def resume(self, sb: ContainerSandbox) -> None:  # type: ignore[override]
        await asyncio.to_thread(cgroups.thaw, sb.v2_cgroup, self._v1_freezer(sb.id))

    async def set_network(self, sb: ContainerSandbox,  # type: ignore[override]
                          rules: list[str]) -> None:
        if sb.network is None:
            await self.attach_network(sb, rules)
        else:
            await asyncio.to_thread(sb.network.apply, rules)  # BadRequest: nothing changed

    async def save_machine(self, sb: ContainerSandbox, snapshot_id: str,  # type: ignore[override]
                           spec: ResolvedSpec, paused: bool) -> MachineSnapshot:
        raise BadRequest("a container's snapshot is its writable layer as an image layer "
                         "(capacity().snapshot 'layer'): it has no machine to save",
                         sandbox_id=sb.id)

    def drop_machine(self, snapshot_id: str) -> list[str]:
        return []  # this backend keeps none

    def machine_snapshots(self) -> set[str]:
        return set()

    async def capture_writable(self, sb: ContainerSandbox, dest: Path,  # type: ignore[override]
                               opts: CaptureOptions) -> CaptureResult:
        """The overlay upper, copied as hostile data (rollbox.images.snapshot) into ``dest``;
        lower layers' repositories the upper touches are completed from the merged view."""
        from rollbox.images import snapshot as snap

        def capture() -> CaptureResult:
            pause = (cgroups.frozen(sb.v2_cgroup, self._v1_freezer(sb.id)) if opts.pause
                     else contextlib.nullcontext(0.0))
            with pause:
                t0 = time.monotonic()
                stats = snap.capture_upper(
                    sb.rootfs.upper, dest, id_shift=sb.host_uid, scrub=opts.scrub,
                    exclude=opts.exclude, max_bytes=opts.max_bytes,
                    max_entries=opts.max_entries, content=snap.CONTENTS[opts.content])
                if opts.complete_repos:  # within what is left of the layer's room
                    snap.complete_repos(sb.rootfs.merged, dest, id_shift=sb.host_uid,
                                        max_bytes=max(0, opts.max_bytes - stats.bytes),
                                        max_entries=opts.max_entries)
                copy_s = time.monotonic() - t0
            return CaptureResult(stats, copy_s if opts.pause else 0.0, copy_s)

        try:
            return await asyncio.to_thread(capture)
        except OSError as exc:
            raise without_paths(InfraError(f"snapshot of {sb.id} failed: {exc}"),
                                {dest: "/", sb.rootfs.upper: "/"}) from exc

    async def prepare_exec(self, sb: ContainerSandbox) -> None:  # type: ignore[override]
        """Nothing: a container's memory is never taken back while it idles."""

    async def open_port(self, sb: ContainerSandbox,  # type: ignore[override]
                        port: int) -> PortStream:
        """A socket made in the sandbox's netns, connected to its loopback
        (rollbox.backends.ports): outside its cgroup, so with or without network rules."""
        return await connect_in_netns(netns.PREFIX + sb.id, port)

    def display(self, sb: ContainerSandbox) -> None:  # type: ignore[override]
        """Containers have no screen (computer use is the "vm" backend's)."""
        return None

    def usage(self, sb: ContainerSandbox) -> Usage:  # type: ignore[override]
        parent = self.settings.cgroup_parent
        return Usage(memory_bytes=cgroups.memory_bytes(parent, sb.id),
                     cpu_usage_us=cgroups.cpu_usage_us(parent, sb.id),
                     cpu_throttled_us=cgroups.cpu_throttled_us(parent, sb.id),
                     oom_kills=self.oom_kills(sb), disk_bytes=self.disk.referenced(sb.id))

    def oom_kills(self, sb: ContainerSandbox) -> int:  # type: ignore[override]
        return cgroups.oom_kills(self.settings.cgroup_parent, sb.id)

    def kill_session(self, sb: ContainerSandbox, name: str) -> None:  # type: ignore[override]
        cgroups.kill(sb.v2_cgroup / name)

    async def _reconnect(self, sandbox_id: str, host_uid: int,
                         image_env: dict[str, str],
                         network_rules: list[str] | None = None) -> ContainerSandbox | None:
        """Reconnect to a sandbox started by an earlier edge process; None if it is gone."""
        slot = self.slots.slot_of(host_uid)
        self.slots.claim(slot)
        rootfs = self.rootfs_of(sandbox_id)
        run_dir = self.run_root / sandbox_id
        v2 = cgroups.v2_dir(self.settings.cgroup_parent, sandbox_id)
        pid = None
        try:
            pid = int((run_dir / "pid").read_text())
            if pid not in cgroups.procs(v2):
                raise InfraError("agent not running")
            channel = await AgentChannel.connect(str(run_dir / "agent.sock"), timeout=3.0)
        except (OSError, ValueError, InfraError) as exc:
            log.warning("sandbox %s can not be adopted (%s); cleaning up", sandbox_id, exc)
            await self._teardown(sandbox_id, rootfs, run_dir, slot, pid)
            return None
        sb = ContainerSandbox(
            id=sandbox_id, slot=slot, host_uid=host_uid, rootfs=rootfs, run_dir=run_dir,
            v2_cgroup=v2, agent_pid=pid, channel=channel, fs=SandboxFS(rootfs.merged, host_uid),
            image_env=image_env,
        )
        sb.next_session = max((int(p.name[1:]) for p in v2.glob("x*") if p.name[1:].isdigit()),
                              default=0)
        if network_rules is not None:
            try:
                sb.network = await sandbox_net.adopt(sandbox_id, v2, network_rules, self.settings)
            except Exception as exc:  # noqa: BLE001 - fail closed: cleaned below
                log.warning("sandbox %s: network re-attach failed: %s", sandbox_id, exc)
            if sb.network is None:
                log.warning("sandbox %s: network can not be re-attached; cleaning up", sandbox_id)
                channel.close()
                sb.fs.close()
                await self._teardown(sandbox_id, rootfs, run_dir, slot, pid)
                return None
        return sb

    async def destroy(self, sb: ContainerSandbox) -> None:  # type: ignore[override]
        v1 = self._v1_freezer(sb.id)
        if (sb.booted and not (sb.v2_cgroup / "cgroup.freeze").exists()
                and cgroups.is_frozen(sb.v2_cgroup, v1)):
            cgroups.thaw(sb.v2_cgroup, v1)  # v1: a frozen task can not take the kill
        if sb.network is not None:
            sb.network.close()  # gate stops; link below, programs + map with the cgroup
        sb.channel.close()
        sb.fs.close()
        await self._teardown(sb.id, sb.rootfs, sb.run_dir, sb.slot, sb.agent_pid)

    async def _teardown(self, sandbox_id: str, rootfs: Rootfs, run_dir: Path, slot: int,
                        agent_pid: int | None) -> None:
        """Kill by cgroup, reap, remove cgroups, runc state, mounts, netns, files; verify."""
        problems = await self._stop_processes(sandbox_id, agent_pid)
        # The rest is blocking kernel work: one worker thread, so the loop serves others.
        problems += await asyncio.to_thread(self._release_host_resources, sandbox_id, rootfs,
                                            run_dir)
        if problems:
            log.error("teardown of %s incomplete: %s", sandbox_id, problems)
            raise InfraError(f"teardown of {sandbox_id} incomplete", problems=problems)
        self.slots.release(slot)

    async def _stop_processes(self, sandbox_id: str, agent_pid: int | None) -> list[str]:
        """Kill every process of the sandbox by its cgroup and reap its agent; returns what
        survived."""
        v2 = cgroups.v2_dir(self.settings.cgroup_parent, sandbox_id)
        problems: list[str] = []
        cgroups.kill(v2)
        deadline = time.monotonic() + 10
        while not await cgroups.wait_empty(v2, 0.5):
            cgroups.kill(v2)  # a process forked while the kill went round
            if time.monotonic() > deadline:
                problems.append(f"processes survive in {v2}: {cgroups.procs(v2)}")
                break
        if agent_pid:
            await _reap(agent_pid)
        return problems

    def _release_boot(self, sandbox_id: str, run_dir: Path) -> list[str]:
        """Remove what one boot of a sandbox with no process left made (cgroups, runc state,
        link, netns, agent socket and pid file); returns what could not be removed. The tree
        and its mounts stay."""
        problems = []
        for path in cgroups.sandbox_dirs(self.settings.cgroup_parent, sandbox_id):
            try:
                cgroups.remove_tree(path)
            except OSError as exc:
                problems.append(f"cgroup {path}: {exc}")
        self.runtime.forget(sandbox_id)
        netlink.delete(sandbox_id)
        if netlink.exists(sandbox_id):
            problems.append(f"network link {netlink.link_name(sandbox_id)} left")
        netns.delete(netns.PREFIX + sandbox_id)
        remove_flat_dir(run_dir)
        return problems

    def _release_host_resources(self, sandbox_id: str, rootfs: Rootfs, run_dir: Path) -> list[str]:
        """Remove cgroups, runc state, mounts, netns and files of a sandbox with no process
        left; returns what could not be removed."""
        problems = self._release_boot(sandbox_id, run_dir)
        left = rootfs.teardown()
        if left:
            problems.append(f"mounts left: {left}")
        else:  # a subvolume still bind-mounted can not be deleted
            problems += self.disk.remove(sandbox_id)
            problems += self.disk.unref_lowers(sandbox_id)  # a fork child's shared lowers
        return problems

    def release_node_resources(self) -> None:
        """With no sandbox of this backend left: unmount the shared layer mounts nothing uses,
        remove the empty rollbox parent cgroups, the node's mask (masks.py) and take down
        rollbox's tmpfs on the run dir if it holds no state (all come back on the next start
        or create: :meth:`prepare_run_dir`)."""
        self.layer_mounts.unmount_all()  # layers still under a sandbox are skipped
        cgroups.remove_parent_if_empty(self.settings.cgroup_parent)
        if not any(d.is_dir() and any(d.iterdir()) for d in (self.sandboxes_dir, self.run_root)):
            self.mask.release()  # another backend's sandbox of the node (a build's) keeps it
        self._run_ready = False  # the mask (and the run tmpfs's dirs) come back with it
        if self.owns_run_tmpfs and release_run_tmpfs(self.settings.run_dir):
            self.owns_run_tmpfs = False
        self.disk.release()  # unless a subvolume is left in it

    def leftovers(self, sandbox_id: str) -> list[str]:
        """Everything of a sandbox still on the host (empty after a clean destroy)."""
        left = [str(p) for p in cgroups.sandbox_dirs(self.settings.cgroup_parent, sandbox_id)
                if p.exists()]
        left += mount_points_under(self.sandboxes_dir / sandbox_id)
        left += mount_points_under(self.legacy_sandboxes_dir / sandbox_id)
        if netns.netns_path(netns.PREFIX + sandbox_id).exists():
            left.append(str(netns.netns_path(netns.PREFIX + sandbox_id)))
        if netlink.exists(sandbox_id):
            left.append(f"link {netlink.link_name(sandbox_id)}")
        left += sandbox_net.bpf_leftovers(sandbox_id)
        left += self.disk.leftovers(sandbox_id)
        for p in (self.sandboxes_dir / sandbox_id, self.legacy_sandboxes_dir / sandbox_id,
                  self.run_root / sandbox_id, self.runtime.state_dir(sandbox_id)):
            if p is not None and p.exists():
                left.append(str(p))
        return left

    def host_sandbox_ids(self, prefix: str = "") -> set[str]:
        """Ids (starting with prefix) of sandboxes that have any host resource."""
        ids: set[str] = set()
        for d in (self.sandboxes_dir, self.legacy_sandboxes_dir, self.run_root):
            if d.is_dir():  # the run dir's are made at start (prepare_run_dir)
                ids |= {p.name for p in d.iterdir() if p.is_dir()}
        ids |= set(self.runtime.known())
        ids |= {n[len(netns.PREFIX):] for n in netns.list_rollbox()}
        ids |= {sid for sid in netlink.list_links().values() if sid}
        ids |= {p.name for p in cgroups.leftover(self.settings.cgroup_parent)}
        ids |= self.disk.ids()
        return {i for i in ids if i.startswith(prefix)}

    async def clone_upper(self, sb: ContainerSandbox, clone_id: str) -> Path:
        """A copy-on-write clone of a disk-tier sandbox's writable layer as the subvolume
        ``clone_id`` of the pool (for fork): a btrfs snapshot, no data copied, capped like the
        source. Freeze the sandbox first for a consistent copy. Returns the clone's upper dir;
        the clone is removed with the sandbox of that id (or ``disk.remove``)."""
        if not self.disk.leftovers(sb.id):
            raise BadRequest(f"sandbox {sb.id} has no disk-tier writable layer to clone",
                             sandbox_id=sb.id)
        clone = await asyncio.to_thread(self.disk.clone, sb.id, clone_id)
        return clone / sb.rootfs.upper.name

    async def fork(self, sb: ContainerSandbox,  # type: ignore[override]
                   children: list[tuple[str, ResolvedSpec]], paused: bool) -> ForkResult:
        """Fork a disk-tier sandbox: freeze it (unless ``paused``: frozen already), one
        read-only btrfs snapshot of its writable layer's subvolume, thaw. No syncfs first:
        the snapshot ioctl itself flushes that subvolume's dirty data and waits for its
        ordered extents before it snapshots (btrfs_mksnapshot), while a syncfs of the
        overlay is a sync of the whole pool (every sandbox's dirty data, one more
        transaction commit) with the source held still.
        That snapshot is the shared lower of every child (idmapped from the source's uids to
        each child's), above the image's layers and any lowers the source had itself from a
        fork; each child gets a fresh capped upper of its own and a fresh identity. Nothing of
        the writable layer is copied; the source keeps its upper and its processes (held
        still for the snapshot only). Processes are not carried (containers
        share the host's kernel: there is no image of their memory to restore). All or
        nothing: a child that fails takes the made ones down with it."""
        if not self.disk.leftovers(sb.id):
            raise BadRequest(f"sandbox {sb.id} is on the memory tier: only disk-tier "
                             "sandboxes can be forked (their writable layer clones without "
                             "a copy)", sandbox_id=sb.id, disk_tier="memory")
        v1 = self._v1_freezer(sb.id)

        child_ids = [cid for cid, _ in children]
        snapped: list[str] = []  # the new lower, once it exists (PENDING_REF holds it)

        def freeze_and_snapshot() -> tuple[list[tuple[str, int]], float]:
            t0 = time.monotonic()
            if not paused:
                cgroups.freeze(sb.v2_cgroup, v1)
            try:
                snapped.append(self.disk.fork_lower(sb.id))
            finally:
                if not paused:
                    cgroups.thaw(sb.v2_cgroup, v1)
            frozen_s = time.monotonic() - t0
            lowers = [*sb.fork_lowers, (snapped[0], sb.host_uid)]
            # Every child's references at once (one lock), before any mounts a lower.
            self.disk.ref([name for name, _ in lowers], child_ids)
            return lowers, frozen_s

        made: list[ContainerSandbox] = []
        try:
            try:
                # to its end if cancelled: the lower and its references are then known to
                # the cleanup below
                lowers, frozen_s = await to_the_end(asyncio.to_thread(freeze_and_snapshot))
            except OSError as exc:  # the freezer (fork_lower raises InfraError itself)
                raise InfraError(f"fork of {sb.id}: freeze failed: {exc}") from exc
            async def one(child_id: str, spec: ResolvedSpec) -> ContainerSandbox:
                child = await self.create_container(
                    child_id, list(spec.layers), spec.resources, spec.env,
                    hidden_paths=spec.hidden_paths, disk_tier="disk", qos=spec.qos,
                    network_rules=list(spec.network_rules)
                    if spec.network_rules is not None else None, fork_lowers=lowers)
                made.append(child)
                return child

            boxes = await all_or_raise([one(cid, spec) for cid, spec in children])
            return ForkResult(children=list(boxes), frozen_s=frozen_s)
        except BaseException as exc:
            await teardown_after(exc, self._destroy_all(made))
            raise
        finally:
            if snapped:
                await asyncio.to_thread(self._drop_refs, snapped[0],
                                        [c for c in child_ids if c not in
                                         {b.id for b in made}])

    def _drop_refs(self, lower: str, sandbox_ids: list[str]) -> None:
        """After a fork: the references of children that were never made (a failed child's
        teardown dropped its own; one that never ran its create, e.g. cancelled first, did
        not) unless something of one is left, then the fork's own hold on the new lower."""
        for sid in sandbox_ids:
            if not self.leftovers(sid):
                self.disk.unref_lowers(sid)
        self.disk.unref(lower, PENDING_REF)

    async def _destroy_all(self, boxes: list[ContainerSandbox]) -> None:
        results = await asyncio.gather(*(self.destroy(b) for b in boxes),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise InfraError(f"{len(failed)} fork children not torn down: {failed[0]}")

    async def cleanup_orphan(self, sandbox_id: str, host_uid: int | None = None) -> None:
        slot = self.slots.slot_of(host_uid) if host_uid is not None else -1
        if slot >= 0:
            self.slots.claim(slot)
        pid = _agent_pid(self.run_root / sandbox_id)
        await self._teardown(sandbox_id, self.rootfs_of(sandbox_id), self.run_root / sandbox_id,
                             slot, pid)


def _agent_pid(run_dir: Path) -> int | None:
    """The agent's host pid as runc wrote it (None: runc did not get that far)."""
    try:
        return int((run_dir / "pid").read_text())
    except (OSError, ValueError):
        return None


_late_reaps: set[asyncio.Task] = set()


async def _reap(pid: int, timeout_s: float = 10.0) -> None:
    """Reap the killed agent (a long-lived edge would otherwise pile up zombies, one per
    sandbox). It leaves its cgroup before it becomes a zombie, so wait for the exit itself: as
    the pid namespace's init it exits only after every other process of the sandbox is
    reaped, which takes seconds on a loaded node. Past ``timeout_s`` the teardown goes on and
    a background task still reaps it (given up, it stayed a zombie holding the slot's uid)."""
    task = asyncio.ensure_future(wait_pid(pid))
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(task)
    except (ChildProcessError, ProcessLookupError):
        pass  # not our child (adopted from an earlier edge process) or already reaped
    except TimeoutError:
        log.warning("agent %d not reaped after %.1fs; reaping it in the background",
                    pid, timeout_s)
        _late_reaps.add(task)
        task.add_done_callback(_late_reaps.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
