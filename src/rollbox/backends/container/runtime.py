"""The runtimes that start a container sandbox's init, behind one interface (:class:`Runtime`):
an OCI runtime binary (:class:`OciRuntime`, runc) or rollbox's own launcher
(``launcher.NativeRuntime``, ``ROLLBOX_RUNTIME=native``). Both get the same OCI config
(bundle.py) and leave the same things behind: the init's host pid in the pid file, the
sandbox's cgroups; pause/resume/kill are the cgroup freezer's and ``cgroup.kill``'s
(isolation.cgroups), never the runtime's, so a sandbox is adopted after an edge restart the
same way whichever started it.

runc is spawned with posix_spawn so the agent's listening socket lands on fd 3, the agent
binary (which runc execs as ``/proc/self/fd/4``) on fd 4 and the platform shell on fd 5
(``--preserve-fds 3``), and its stdio is /dev/null plus a host-side log file; the call returns
once ``runc run -d`` has exited (the container's init is then running on its own).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

from rollbox.backends.container.rootfs import remove_flat_dir
from rollbox.errors import InfraError
from rollbox.isolation import qos, syscalls


async def wait_pid(pid: int) -> int:
    """Wait for a child without blocking the loop; returns its exit status."""
    loop = asyncio.get_running_loop()
    pidfd = syscalls.pidfd_open(pid)
    fut: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def spawn_init_runner(binary: str, argv: list[str], env: dict[str, str], log_file: Path,
                      fds: list[int], extra: tuple[tuple[int, int], ...] = ()) -> int:
    """posix_spawn what starts a sandbox's init: stdin/stdout /dev/null, stderr appended to
    ``log_file``, ``fds`` on 3, 4, 5... (listener, agent, platform shell), ``extra`` as
    (fd, target) pairs; returns its pid. Under ``qos.BEST_EFFORT_SETUP`` (a warm pool's refill)
    it is moved to SCHED_IDLE as soon as it runs (glibc's posix_spawn takes no SCHED_IDLE)."""
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        pid = os.posix_spawn(
            binary, argv, env,
            file_actions=[(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, devnull, 1),
                          (os.POSIX_SPAWN_DUP2, log, 2)]
            + [(os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(fds)]
            + [(os.POSIX_SPAWN_DUP2, fd, target) for fd, target in extra])
    finally:
        os.close(devnull)
        os.close(log)
    qos.setup_spawned(pid)
    return pid


# runc lives for ~20 ms: garbage collection is pure overhead there.
RUNC_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "GOGC": "off"}


class Runtime(Protocol):
    """What the container backend asks of a runtime."""

    name: str
    # Where the runtime keeps state of its own per container (None: it keeps none).
    root: Path | None

    async def run_detached(self, container_id: str, bundle: Path, config: dict[str, Any],
                           listen_fd: int, agent_fd: int, shell_fd: int, pid_file: Path,
                           log_file: Path) -> int:
        """Start the container's init (the agent, exec'd from ``agent_fd``) as ``config``
        says, with ``listen_fd``/``agent_fd``/``shell_fd`` on its fds 3/4/5; returns its host
        pid once it runs (also written to ``pid_file``). InfraError if it did not start, with
        everything the runtime made undone."""
        ...

    def state_dir(self, container_id: str) -> Path | None:
        ...

    def forget(self, container_id: str) -> None:
        """Drop the runtime's state of a container whose processes and cgroups are gone."""
        ...

    def known(self) -> list[str]:
        """Ids of the containers the runtime holds state of."""
        ...


class OciRuntime:
    """An OCI runtime binary (runc): ``config.json`` in the bundle, ``run -d``."""

    def __init__(self, binary: str, root: Path) -> None:
        self.name = binary
        path = shutil.which(binary)
        if not path:
            raise InfraError(f"OCI runtime {binary!r} not found (run `make deps`)")
        self.binary = path
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _argv(self, *args: str) -> list[str]:
        return [self.binary, "--root", str(self.root), *args]

    async def run_detached(self, container_id: str, bundle: Path, config: dict[str, Any],
                           listen_fd: int, agent_fd: int, shell_fd: int, pid_file: Path,
                           log_file: Path) -> int:
        """``runc run -d``; returns the container init's host pid."""
        (bundle / "config.json").write_text(json.dumps(config))
        pid = spawn_init_runner(
            self.binary,
            self._argv("run", "-d", "--preserve-fds", "3", "--pid-file", str(pid_file),
                       "--bundle", str(bundle), container_id),
            RUNC_ENV, log_file, [listen_fd, agent_fd, shell_fd])
        code = await wait_pid(pid)
        if code != 0:
            tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
            raise InfraError(f"runc run failed ({code}): {tail.strip()}")
        return int(pid_file.read_text())

    def state_dir(self, container_id: str) -> Path | None:
        return self.root / container_id

    def forget(self, container_id: str) -> None:
        """Drop runc's state of a container whose processes and cgroups are already gone."""
        remove_flat_dir(self.root / container_id)

    def known(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())
