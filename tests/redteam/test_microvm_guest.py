"""Red team on real microVM guests through the edge: F40 (root in the guest stalls its own agent,
kills its own kernel), F41 from the guest side (no device leads to QEMU's monitor; text for the
monitor on the emulated serial port does nothing).

In-guest root is expected here: each attack runs as the guest's root with every capability (the
unhardened twin, ``hardened=False``: what a guest kernel exploit gives; commands of a hardened
VM lack most of them, see test_container_platform), and the outcome checked is at the VM's edge
(typed errors in bounded time, a complete teardown, neighbours unaffected).
"""
from __future__ import annotations

import asyncio
import time

import pytest

from rollbox.edge.edge import GUEST_END_GRACE_S, GUEST_START_TIMEOUT_S, HOST_KILL_GRACE_S
from rollbox.errors import InfraError, RollboxError
from rollbox.models import ExecSpec
from tests.redteam import qemu_jail
from tests.redteam.conftest import BB, Boxes, needs_root

pytestmark = needs_root

# Mounts the guest kernel's cgroup2 (root in the guest may), moves the agent (PID 1) into a
# new cgroup and freezes it: from then on nothing in the guest answers the host.
FREEZE_AGENT = ("mkdir -p /tmp/cg && mount -t cgroup2 none /tmp/cg && mkdir /tmp/cg/frozen && "
                "echo 1 > /tmp/cg/frozen/cgroup.procs && echo 1 > /tmp/cg/frozen/cgroup.freeze")


async def alive(vms: Boxes, sid: str) -> bool:
    r = await vms.run(sid, ["echo", "alive"], timeout_s=20)
    return r.stdout == "alive\n"


async def assert_gone(vms: Boxes, sid: str, pid: int) -> None:
    await vms.edge.delete(sid)
    assert vms.edge.leftovers(sid) == []
    assert qemu_jail.qemu_pids_of(sid) == []
    with pytest.raises(FileNotFoundError):
        open(f"/proc/{pid}/status").close()


@pytest.mark.microvm_slow
async def test_f40_guest_root_freezes_its_agent(vms: Boxes) -> None:
    victim, other = await vms.make(BB, hardened=False), await vms.make(BB)
    pid = qemu_jail.qemu_pids_of(victim)[0]
    # SIGSTOP of the agent by the guest's root does nothing (the kernel drops SIGSTOP/SIGKILL
    # sent to PID 1 from its own namespace); the cgroup freezer below does stop it.
    r = await vms.run(victim, "kill -STOP 1; echo rc=$?")
    assert r.stdout == "rc=0\n", r
    assert await alive(vms, victim)
    # The command that freezes the agent never gets its end reported: the host stops waiting
    # a bounded time past its deadline (nothing on the host can kill inside a guest). Its
    # stdin is never read again: a write waits as for any command that does not read, and
    # ends with the command as the host sees it, not with the guest.
    t0 = time.monotonic()
    eid = await vms.edge.exec_start(victim, ExecSpec(cmd=FREEZE_AGENT, timeout_s=3, stdin=True))
    for waiting in (vms.edge.exec_stdin(victim, eid, b"x" * (1 << 20), False),
                    vms.edge.exec_wait(victim, eid)):
        with pytest.raises(InfraError, match="unresponsive guest"):
            await asyncio.wait_for(waiting, 90)
    assert time.monotonic() - t0 < 3 + HOST_KILL_GRACE_S + GUEST_END_GRACE_S + 10
    # The next command is never started by the frozen agent: a typed error, bounded too.
    t0 = time.monotonic()
    with pytest.raises(InfraError, match="unresponsive guest"):
        await asyncio.wait_for(vms.run(victim, ["true"], timeout_s=2), 90)
    assert time.monotonic() - t0 < GUEST_START_TIMEOUT_S + 10
    assert await alive(vms, other)
    await assert_gone(vms, victim, pid)  # the host's teardown needs nothing from the guest
    assert await alive(vms, other)


@pytest.mark.microvm_slow
async def test_f40_guest_root_kills_its_kernel(vms: Boxes) -> None:
    victim, other = await vms.make(BB, hardened=False), await vms.make(BB)
    pid = qemu_jail.qemu_pids_of(victim)[0]
    with pytest.raises(RollboxError):
        r = await asyncio.wait_for(
            vms.run(victim, "echo 1 > /proc/sys/kernel/sysrq; echo c > /proc/sysrq-trigger",
                    timeout_s=10), 60)
        raise AssertionError(f"a crashed guest answered {r}")
    with pytest.raises(RollboxError):  # SandboxDead / InfraError, at once
        await asyncio.wait_for(vms.run(victim, ["true"]), 30)
    assert await alive(vms, other)
    await assert_gone(vms, victim, pid)


async def test_f41_guest_has_no_way_to_the_monitor(vms: Boxes) -> None:
    sid = await vms.make(BB, hardened=False)
    pid = qemu_jail.qemu_pids_of(sid)[0]
    # What devices the guest has: only the agent's virtio-serial port, no console port, no
    # monitor mux.
    r = await vms.run(sid, "mkdir -p /tmp/sys && mount -t sysfs none /tmp/sys && "
                      "cat /tmp/sys/class/virtio-ports/*/name; ls /tmp/sys/class/tty | "
                      "grep -E '^(hvc|ttyS|ttyAMA)' | tr '\\n' ' '; echo; umount /tmp/sys")
    names, ttys = r.stdout.split("\n")[:2]
    assert names.split() == ["org.rollbox.agent"], r
    # Text for QEMU's monitor (QMP and HMP) written to every serial the guest has: the serial
    # is a console the host reads during boot only, never the monitor.
    evil = ('{"execute":"qmp_capabilities"}\\n{"execute":"quit"}\\n'
            'quit\\nsystem_powerdown\\n\\001c\\nquit\\n')
    r = await vms.run(sid, f"for t in {ttys or 'ttyS0'}; do mknod /tmp/$t c 4 64 2>/dev/null; "
                      f"printf '{evil}' > /dev/$t 2>/dev/null || printf '{evil}' > /tmp/$t; "
                      "done; yes quit | head -c 1000000 > /tmp/ttyS0; echo sent", timeout_s=60)
    assert "sent" in r.stdout, r
    await asyncio.sleep(1)
    assert qemu_jail.qemu_pids_of(sid) == [pid]  # QEMU did not quit
    assert await alive(vms, sid)
