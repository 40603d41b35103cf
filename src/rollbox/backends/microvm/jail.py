"""The jail QEMU runs in: an unprivileged host uid, its own cgroups, namespaces and root.

Per sandbox the edge keeps a root-only host dir ``<run_dir>/vm/<id>/`` holding the listening
sockets it bound (``agent.sock``, ``qmp.sock``, ``console.sock``: QEMU gets them as fds 3-5
and never sees their paths), QEMU's pid and its stderr log (size-capped, see :class:`QemuLog`),
and ``root/``, an empty directory
the jailer (``native/jailer/jailer.c``) mounts the jail's tmpfs root on inside a mount
namespace of its own. Inside, QEMU sees ``/usr`` read-only, ``/proc`` of its own pid namespace
(pids only), the device nodes it is given (``/dev/kvm`` only with KVM) and its files at fixed
paths (``qemu.py``); nothing else of the host. It runs as the sandbox's slot uid (the first
uid of its 65536-uid band, used by nothing else), in cgroups ``<parent>/<name>`` of the memory,
cpu and pids hierarchies (the sandbox's limits: QEMU's own RSS counts against the memory
limit) and the v2 hierarchy (``cgroup.kill``), in the sandbox's network namespace or an empty
one, with no capabilities, no_new_privs, and QEMU's own seccomp filter
(``-sandbox on,...``: no exec, no setuid, no resource control).

The cgroups' ``<name>`` is the id the jail was started under: the sandbox's, or a template
spare's (``spares.py``: a QEMU started before its sandbox existed). A spare's jail becomes a
sandbox's by :meth:`Jail.renamed`: the host dir is renamed to the sandbox id, the cgroups keep
their name (a v2 cgroup can not be renamed, and moving QEMU to a new one would leave the memory
it already holds charged to the old), written in the dir (:data:`CGROUP_FILE`), so
:meth:`Jail.of` finds them from the sandbox id alone.

Owns spawning and killing the jailed process and its cgroups and host dir; does not know what
runs inside (``qemu.py``) or the disks (``disks.py``).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from rollbox.backends.cancellation import to_the_end
from rollbox.backends.container.rootfs import remove_flat_dir
from rollbox.backends.container.runtime import wait_pid
from rollbox.backends.microvm.steps import Steps
from rollbox.errors import InfraError
from rollbox.isolation import cgroups, qos
from rollbox.isolation.userns import RANGE as UID_RANGE

log = logging.getLogger(__name__)

SOCKETS = ("agent", "qmp", "console")  # fds 3, 4, 5 in this order
JAILER_TIMEOUT_S = 10.0
# QEMU's stderr log: past LOG_MAX bytes the file is cut to its last LOG_KEEP; the edge reads
# at most LOG_READ bytes per LOG_PAUSE_S (a guest that makes QEMU print costs it that much).
LOG_MAX = 256 << 10
LOG_KEEP = 64 << 10
LOG_READ = 64 << 10
LOG_PAUSE_S = 0.05
# In the host dir of a jail renamed to a sandbox's (Jail.renamed): the name of its cgroups.
CGROUP_FILE = "cgroup"
CGROUP_NAME_MAX = 128


@dataclass(frozen=True)
class Limits:
    memory_bytes: int     # guest RAM + QEMU's own overhead
    cpus: float           # CFS quota in cores
    pids: int             # QEMU's threads
    # The CPU class of the cgroup and of QEMU's threads (isolation.qos): a batch sandbox's, or
    # a spare QEMU's start (idle until a create claims it).
    cpu: qos.CpuClass = qos.CLASSES["latency"]


@dataclass(frozen=True)
class Bind:
    src: Path
    dst: str              # fixed jail path, e.g. /vm/layer0
    writable: bool = False


def _controller_dirs(parent: str, sandbox_id: str) -> dict[str, Path]:
    """The sandbox's cgroup dir per controller this jail limits (and cpuacct, for its CPU
    use), plus "v2" for membership and cgroup.kill."""
    dirs: dict[str, Path] = {"v2": cgroups.v2_dir(parent, sandbox_id)}
    if not cgroups.is_pure_v2():
        for h in cgroups.hierarchies():
            if h.name in ("memory", "cpu", "cpuacct", "pids"):
                dirs[h.name] = h / parent / sandbox_id
            elif h.name.startswith("cpu,") and "cpu" not in dirs:  # cpu,cpuacct co-mounted
                dirs["cpu"] = h / parent / sandbox_id
    return dirs


CFS_PERIOD_US = 100_000


def _cfs_quota_us(cpus: float) -> int:
    return max(1000, int(cpus * CFS_PERIOD_US))


def make_cgroups(parent: str, sandbox_id: str, limits: Limits) -> list[Path]:
    """Create the sandbox's cgroups with its limits; returns the dirs QEMU joins."""
    dirs = _controller_dirs(parent, sandbox_id)
    period = CFS_PERIOD_US
    quota = _cfs_quota_us(limits.cpus)
    try:
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        if cgroups.is_pure_v2():
            v2 = dirs["v2"]
            for ctl in ("memory", "cpu", "pids"):
                try:
                    (v2.parent / "cgroup.subtree_control").write_text(f"+{ctl}")
                except OSError:
                    pass
            (v2 / "memory.max").write_text(str(limits.memory_bytes))
            if (v2 / "memory.swap.max").exists():
                (v2 / "memory.swap.max").write_text("0")
            (v2 / "cpu.max").write_text(f"{quota} {period}")
            (v2 / "pids.max").write_text(str(limits.pids))
            qos.apply_cgroup(v2, limits.cpu, v2=True)
        else:
            mem = dirs["memory"]
            (mem / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            memsw = mem / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limits.memory_bytes))
            (dirs["cpu"] / "cpu.cfs_period_us").write_text(str(period))
            (dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
            (dirs["pids"] / "pids.max").write_text(str(limits.pids))
            qos.apply_cgroup(dirs["cpu"], limits.cpu, v2=False)
    except (OSError, KeyError) as exc:
        raise InfraError(f"cgroups of {sandbox_id} not made: {exc}") from exc
    return list(dirs.values())


def set_cpu(parent: str, name: str, cpus: float, cpu: qos.CpuClass) -> None:
    """The CFS quota (``cpus`` cores) and CPU class of the cgroup ``name`` made by
    :func:`make_cgroups` (a spare, started in the idle class for its template's vCPU count,
    claimed by a sandbox: the sandbox's class, the quota it asked for). QEMU's threads are
    :func:`qos.apply_tasks`'s."""
    dirs = _controller_dirs(parent, name)
    try:
        if cgroups.is_pure_v2():
            (dirs["v2"] / "cpu.max").write_text(f"{_cfs_quota_us(cpus)} {CFS_PERIOD_US}")
            qos.apply_cgroup(dirs["v2"], cpu, v2=True)
        else:
            (dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(_cfs_quota_us(cpus)))
            qos.apply_cgroup(dirs["cpu"], cpu, v2=False)
    except (OSError, KeyError) as exc:
        raise InfraError(f"CPU limits of {name} not set: {exc}") from exc


class QemuLog:
    """QEMU's stderr, capped. QEMU (and the jailer before it) writes to a pipe whose write end
    is non-blocking: a reader that falls behind drops messages, QEMU never waits (it ignores
    SIGPIPE, and so does this process, so a pipe whose reader is gone only loses them). The
    edge reads it into ``path``, which stays under LOG_MAX bytes: past it the file is rewritten
    as a marker and its last LOG_KEEP bytes (the tail is what error messages quote). The
    guest can make QEMU print (device errors, warnings): nothing of it grows without bound.
    Only the edge that started QEMU reads it: after an edge restart the messages are dropped
    (the file keeps what came before)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.read_fd, self.write_fd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(self.read_fd, False)
        self.size = 0
        self.dropped = 0
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - closed by close()
        self.size = self._file.tell()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._later: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Read in the background (after the spawn closed our copy of the write end)."""
        os.close(self.write_fd)
        self.write_fd = -1
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.read_fd, self._on_readable)

    def _on_readable(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self.read_fd)
        if self.drain(LOG_READ) and self.read_fd >= 0:
            self._later = self._loop.call_later(
                LOG_PAUSE_S, self._loop.add_reader, self.read_fd, self._on_readable)

    def drain(self, limit: int = LOG_MAX) -> bool:
        """Move what QEMU wrote (at most ``limit`` bytes) to the file; False once it ended
        (every write end closed: QEMU is gone), then the pipe is closed."""
        got = 0
        while self.read_fd >= 0 and got < limit:
            try:
                data = os.read(self.read_fd, min(65536, limit - got))
            except (BlockingIOError, InterruptedError):
                return True
            if not data:
                self.close()
                return False
            got += len(data)
            self._append(data)
        return self.read_fd >= 0

    def _append(self, data: bytes) -> None:
        if self._file.closed:
            return
        try:
            self._file.write(data)
            self.size += len(data)
            if self.size > LOG_MAX:
                with open(self.path, "rb") as f:
                    f.seek(self.size - LOG_KEEP)
                    tail = f.read()
                self.dropped += self.size - len(tail)
                head = f"[rollbox: {self.dropped} earlier bytes of QEMU's log dropped]\n"
                self._file.seek(0)
                self._file.truncate()
                self._file.write(head.encode() + tail)
                self.size = self._file.tell()
        except OSError as exc:  # the jail dir went (teardown): nothing to keep
            log.debug("QEMU log %s: %s", self.path, exc)
            self._file.close()

    def close(self) -> None:
        if self._later is not None:
            self._later.cancel()
        if self.read_fd >= 0:
            if self._loop is not None:
                self._loop.remove_reader(self.read_fd)
            os.close(self.read_fd)
            self.read_fd = -1
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1
        self._file.close()


class Jail:
    """The host side of one sandbox's jail (its dir, sockets, cgroups, process); its cgroups
    are named ``cgroup_name`` (default: the sandbox id, see the module's docstring)."""

    def __init__(self, run_root: Path, cgroup_parent: str, sandbox_id: str,
                 cgroup_name: str | None = None) -> None:
        self.sandbox_id = sandbox_id
        self.dir = run_root / sandbox_id
        self.cgroup_parent = cgroup_parent
        self.cgroup_name = cgroup_name or sandbox_id
        self.v2 = cgroups.v2_dir(cgroup_parent, self.cgroup_name)
        self.qemu_log: QemuLog | None = None  # read by the edge that spawned QEMU

    @classmethod
    def of(cls, run_root: Path, cgroup_parent: str, sandbox_id: str) -> Jail:
        """The jail of ``sandbox_id`` as its host dir says (cgroups of another name when it was
        a spare's, :meth:`renamed`)."""
        name = None
        try:
            text = (run_root / sandbox_id / CGROUP_FILE).read_text().strip()
            if 0 < len(text) <= CGROUP_NAME_MAX and "/" not in text and not text.startswith("."):
                name = text
        except (OSError, UnicodeDecodeError):
            pass
        return cls(run_root, cgroup_parent, sandbox_id, name)

    def renamed(self, sandbox_id: str) -> Jail:
        """This jail (a spare's, QEMU running in it) as ``sandbox_id``'s: the host dir renamed
        (its sockets and pid file with it; QEMU holds its descriptors, never the paths), the
        cgroups kept and named in the dir. This object is spent."""
        new = Jail(self.dir.parent, self.cgroup_parent, sandbox_id, self.cgroup_name)
        if os.path.lexists(new.dir):
            raise InfraError(f"jail dir of {sandbox_id} exists already")
        (self.dir / CGROUP_FILE).write_text(self.cgroup_name)  # said before the dir has the id
        os.rename(self.dir, new.dir)
        new.qemu_log, self.qemu_log = self.qemu_log, None
        if new.qemu_log is not None:
            new.qemu_log.path = new.log_file
        return new

    def socket_path(self, name: str) -> Path:
        return self.dir / f"{name}.sock"

    @property
    def pid_file(self) -> Path:
        return self.dir / "pid"

    @property
    def squeeze_marker(self) -> Path:
        """Present while the VM is squeezed (a restarted edge reads it back)."""
        return self.dir / "squeezed"

    @property
    def log_file(self) -> Path:
        return self.dir / "qemu.log"

    def read_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None

    def alive(self, pid: int | None) -> bool:
        """Whether ``pid`` is this jail's QEMU (still in the sandbox's v2 cgroup)."""
        return pid is not None and pid in cgroups.procs(self.v2)

    def prepare(self) -> list[socket.socket]:
        """Make the host dir and bind the listening sockets (agent, qmp, console)."""
        self.dir.mkdir(parents=True, exist_ok=False)
        os.chmod(self.dir, 0o700)
        (self.dir / "root").mkdir(mode=0o755)
        socks: list[socket.socket] = []
        try:
            for name in SOCKETS:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                socks.append(s)
                s.bind(str(self.socket_path(name)))
                os.chmod(self.socket_path(name), 0o600)
                s.listen(4)
        except BaseException:
            for s in socks:
                s.close()
            raise
        return socks

    async def spawn(self, jailer: Path, qemu_argv: list[str], host_uid: int, limits: Limits,
                    binds: list[Bind], sockets: list[socket.socket], *,
                    netns: Path | None = None, devices: tuple[str, ...] = (),
                    extra_fds: tuple[int, ...] = (), steps: Steps | None = None) -> int:
        """Start QEMU in the jail; returns its host pid once it has exec'd. ``extra_fds``
        follow the sockets (a VM's tap at fd 6). A cancellation meanwhile waits for the
        jailer's end (at most JAILER_TIMEOUT_S): a jailer left running put QEMU in its cgroup
        after the teardown had emptied it, and that QEMU outlived its sandbox."""
        return await to_the_end(self._spawn(jailer, qemu_argv, host_uid, limits, binds,
                                            sockets, netns, devices, extra_fds, steps))

    async def _spawn(self, jailer: Path, qemu_argv: list[str], host_uid: int, limits: Limits,
                     binds: list[Bind], sockets: list[socket.socket], netns: Path | None,
                     devices: tuple[str, ...], extra_fds: tuple[int, ...],
                     steps: Steps | None) -> int:
        cg_dirs = await asyncio.to_thread(make_cgroups, self.cgroup_parent, self.cgroup_name,
                                          limits)
        if steps is not None:
            steps.lap("cgroups")
        args = [str(jailer), "--root", str(self.dir / "root"), "--uid", str(host_uid),
                "--gid", str(host_uid), "--pidfile", str(self.pid_file),
                "--keep-fds", str(len(sockets) + len(extra_fds))]
        for d in cg_dirs:
            args += ["--cgroup", str(d)]
        if limits.cpu.idle:  # the jailer and QEMU at SCHED_IDLE too, not only the cgroup
            args += ["--sched", "idle"]
        if netns is not None:
            args += ["--netns", str(netns)]
        for dev in devices:
            args += ["--dev", dev]
        for b in binds:
            args += ["--rw" if b.writable else "--ro", f"{b.src}:{b.dst}"]
        args += ["--", *qemu_argv]
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        self.close_log()
        self.qemu_log = qlog = QemuLog(self.log_file)
        try:
            actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, devnull, 1),
                       (os.POSIX_SPAWN_DUP2, qlog.write_fd, 2)]
            fds = [s.fileno() for s in sockets] + list(extra_fds)
            actions += [(os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(fds)]
            pid = os.posix_spawn(str(jailer), args, {}, file_actions=actions)
        except BaseException:
            self.close_log()
            raise
        finally:
            os.close(devnull)
        qlog.start()
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for returns the result when a
            # cancellation of the caller meets the jailer's exit, and the cancel is lost
            async with asyncio.timeout(JAILER_TIMEOUT_S):
                code = await wait_pid(pid)
        except TimeoutError:
            os.kill(pid, 9)
            await wait_pid(pid)
            raise InfraError(f"jailer of {self.sandbox_id} did not finish in "
                             f"{JAILER_TIMEOUT_S:.0f} s") from None
        if code != 0:
            raise InfraError(f"QEMU of {self.sandbox_id} not started: {self.log_tail()}")
        qpid = self.read_pid()
        if qpid is None:
            raise InfraError(f"QEMU of {self.sandbox_id} not started: no pid")
        if steps is not None:
            steps.lap("jailer_exec")
        return qpid

    def log_tail(self, limit: int = 2000) -> str:
        """The end of QEMU's stderr log (what it wrote so far, read first)."""
        if self.qemu_log is not None:
            self.qemu_log.drain()
        try:
            with open(self.log_file, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    async def kill(self, pid: int | None, host_uid: int | None = None,
                   timeout_s: float = 10.0) -> list[str]:
        """Kill everything in the sandbox's cgroup, wait until it is empty, reap QEMU (and any
        other exited child of ours running as the slot's uids: a jailer or QEMU whose pid was
        never written), then check that none of them is left, zombies included (see
        :func:`uid_processes`); returns what survives. An empty cgroup is not enough: a dying QEMU leaves
        it before it is reaped, and a slot handed on then shares its uid with it."""
        cgroups.kill(self.v2)
        deadline = time.monotonic() + timeout_s
        while not await cgroups.wait_empty(self.v2, 0.5):
            cgroups.kill(self.v2)
            if time.monotonic() > deadline:
                return [f"processes survive in {self.v2}: {cgroups.procs(self.v2)}"]
        if pid is not None:
            try:
                async with asyncio.timeout(5.0):
                    await wait_pid(pid)
            except (ChildProcessError, ProcessLookupError, TimeoutError):
                pass  # not our child (adopted) or already reaped: the uid check decides
        if host_uid is None:
            return []
        return await reap_uid_range(host_uid, pid, max(1.0, deadline - time.monotonic()))

    def close_log(self) -> None:
        """Stop reading QEMU's stderr (the edge stops or the jail goes)."""
        if self.qemu_log is not None:
            self.qemu_log.close()
            self.qemu_log = None

    def release(self) -> list[str]:
        """Remove the cgroups and host dir of a jail with no process left; returns what is
        left. A dir that names cgroups still there stays (a later cleanup finds them)."""
        self.close_log()
        problems: list[str] = []
        for path in cgroups.sandbox_dirs(self.cgroup_parent, self.cgroup_name):
            try:
                cgroups.remove_tree(path)
            except OSError as exc:
                problems.append(f"cgroup {path}: {exc}")
        if problems and self.cgroup_name != self.sandbox_id:
            return problems
        root = self.dir / "root"
        try:
            root.rmdir()  # an empty mount point (the jail's mounts were never on the host)
        except FileNotFoundError:
            pass
        except OSError as exc:
            problems.append(f"{root}: {exc}")
        remove_flat_dir(self.dir)
        if self.dir.exists():
            problems.append(str(self.dir))
        return problems

    def leftovers(self) -> list[str]:
        left = [str(p) for p in cgroups.sandbox_dirs(self.cgroup_parent, self.cgroup_name)
                if p.exists()]
        if self.dir.exists():
            left.append(str(self.dir))
        return left


def uid_processes(host_uid: int, pid: int | None = None) -> dict[int, str]:
    """The sandbox's host processes of the slot starting at ``host_uid``, zombies too: its
    QEMU ``pid`` and any child of this process (the node's subreaper: the jailer's QEMU is
    reparented to it) running as a uid of the slot; pid -> state letter. Processes of the
    slot's uids with another parent are another edge's (test runs may share a uid band)."""
    found: dict[int, str] = {}
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if not host_uid <= os.stat(f"/proc/{name}").st_uid < host_uid + UID_RANGE:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        state, ppid = stat[stat.rfind(b")") + 2:].split()[:2]
        if int(name) == pid or int(ppid) == me:
            found[int(name)] = state.decode()
    return found


def _reap_ours(pids: dict[int, str]) -> None:
    """Reap the exited ones that are our children."""
    for pid, state in pids.items():
        if state in ("Z", "X"):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass  # another process's child: it reaps it


async def reap_uid_range(host_uid: int, pid: int | None, timeout_s: float) -> list[str]:
    """Wait (bounded) until none of the sandbox's processes of the slot's uids (see
    :func:`uid_processes`) is left, reaping our own exited children; returns what is left."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        left = uid_processes(host_uid, pid)
        if not left:
            return []
        _reap_ours(left)
        if time.monotonic() > deadline:
            return [f"process {p} (state {st}) still runs as a uid of slot {host_uid}"
                    for p, st in sorted(left.items())]
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)


def vcpus(cpus: float) -> int:
    return max(1, math.ceil(cpus))
