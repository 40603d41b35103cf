"""The sandbox's own limits inside its guest: the pids limit of the guest's sandbox cgroup
(``/sys/fs/cgroup/rollbox``, the parent of the agent's session cgroups), the same value a
container gets from its resolved resources. Set by the host through the agent after every boot
and restore (a template's saved guest carries the limits of the build VM, not the sandbox's),
before the sandbox's first command. The host's cgroup of QEMU bounds the VM as a whole; this
keeps a fork bomb from filling the guest's own process table.

Owns this wiring only (the cgroup itself is made by the agent, native/agent/agent.c).
"""
from __future__ import annotations

from typing import Any

from rollbox import errors
from rollbox.agent.tools import PlatformTools
from rollbox.backends.microvm.files import in_sandbox_request

GUEST_SANDBOX_CGROUP = "/sys/fs/cgroup/rollbox"  # agent.c session_cgroup_path's parent


async def apply_guest_limits(vm: Any, pids: int) -> None:
    """Write the sandbox's pids limit to the guest's sandbox cgroup (InfraError if refused)."""
    tools = PlatformTools(lambda: vm.channel, request=in_sandbox_request)
    path = f"{GUEST_SANDBOX_CGROUP}/pids.max"
    res = await tools.run(["tee", path], stdin=f"{int(pids)}\n".encode(), max_stdout=64)
    if not res.ok:
        raise errors.InfraError(f"microVM {vm.id}: pids limit not set in the guest: "
                                f"{res.message()[:200]}", path=path)
