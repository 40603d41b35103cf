"""Starting the OCI runtime (runc by default) without a shell and without waiting on pipes.

runc is spawned with posix_spawn so the agent's listening socket lands on fd 3, the agent
binary (which runc execs as ``/proc/self/fd/4``) on fd 4 and the platform shell on fd 5
(``--preserve-fds 3``), and its stdio is /dev/null plus a host-side log file; the call returns
once ``runc run -d`` has exited (the container's init is then running on its own).
"""
from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

from rollbox.backends.container.rootfs import remove_flat_dir
from rollbox.errors import InfraError
from rollbox.isolation import syscalls


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


# runc lives for ~20 ms: garbage collection is pure overhead there.
RUNC_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "GOGC": "off"}


class Runtime:
    def __init__(self, binary: str, root: Path) -> None:
        path = shutil.which(binary)
        if not path:
            raise InfraError(f"OCI runtime {binary!r} not found (run `make deps`)")
        self.binary = path
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _argv(self, *args: str) -> list[str]:
        return [self.binary, "--root", str(self.root), *args]

    async def run_detached(self, container_id: str, bundle: Path, listen_fd: int, agent_fd: int,
                           shell_fd: int, pid_file: Path, log_file: Path) -> int:
        """``runc run -d``; returns the container init's host pid."""
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            pid = os.posix_spawn(
                self.binary,
                self._argv("run", "-d", "--preserve-fds", "3", "--pid-file", str(pid_file),
                           "--bundle", str(bundle), container_id),
                RUNC_ENV,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, devnull, 0),
                    (os.POSIX_SPAWN_DUP2, devnull, 1),
                    (os.POSIX_SPAWN_DUP2, log, 2),
                    (os.POSIX_SPAWN_DUP2, listen_fd, 3),
                    (os.POSIX_SPAWN_DUP2, agent_fd, 4),
                    (os.POSIX_SPAWN_DUP2, shell_fd, 5),
                ],
            )
        finally:
            os.close(devnull)
            os.close(log)
        code = await wait_pid(pid)
        if code != 0:
            tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
            raise InfraError(f"runc run failed ({code}): {tail.strip()}")
        return int(pid_file.read_text())

    def state_dir(self, container_id: str) -> Path:
        return self.root / container_id

    def forget(self, container_id: str) -> None:
        """Drop runc's state of a container whose processes and cgroups are already gone."""
        remove_flat_dir(self.state_dir(container_id))

    def known(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())
