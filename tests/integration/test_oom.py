"""Memory overload stays inside the sandboxes: one parent memory cgroup (limited here to 400
MiB through the settings) holds them all, its OOM kills are reported (a command's result, or
the sandbox ``dead`` with reason ``oom``), and OOM scores keep the agent the last choice."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rollbox.isolation import cgroups, oom
from rollbox.models import ExecSpec, Resources, SandboxSpec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"
PARENT_MIB = 400
# busybox dd fills one 600 MiB buffer from /dev/zero: every page faulted in, inside the
# sandbox's own 1 GiB limit but above the parent's 400 MiB.
ALLOC = ["dd", "if=/dev/zero", "of=/dev/null", "bs=600M", "count=1"]


@pytest.fixture
def edge_settings() -> dict:
    return {"sandboxes_memory_max_mib": PARENT_MIB}


async def run(edge, sid: str, cmd: str | list[str]):  # noqa: ANN001, ANN201
    return await edge.exec_wait(sid, await edge.exec_start(sid, ExecSpec(cmd=cmd,
                                                                         timeout_s=60)))


def adj(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


async def test_parent_cgroup_limit_oom_kills_a_command_not_the_agent(edge) -> None:  # noqa: ANN001
    assert cgroups.memory_limit(edge.settings.cgroup_parent) == PARENT_MIB << 20
    sb = await edge.create(SandboxSpec(image=BB, resources=Resources(memory_mib=1024)), "t")
    box = edge.live[sb.id].box
    # Protected where the host allows it (CAP_SYS_RESOURCE); never above a command's score.
    assert adj(box.agent_pid) == (oom.PROTECTED_SCORE if oom.can_protect() else 0)
    r = await run(edge, sb.id, "cat /proc/self/oom_score_adj")
    assert r.stdout.strip() == "0" and not r.oom_killed
    # A command can not make itself less killable than its neighbours.
    r = await run(edge, sb.id, "echo -1 > /proc/self/oom_score_adj")
    assert r.exit_code != 0, r
    # The agent resets every command to 0 after fork, whatever the agent's own score.
    Path(f"/proc/{box.agent_pid}/oom_score_adj").write_text("300")
    r = await run(edge, sb.id, "cat /proc/self/oom_score_adj")
    assert r.stdout.strip() == "0", r
    Path(f"/proc/{box.agent_pid}/oom_score_adj").write_text("0")

    r = await run(edge, sb.id, ALLOC)
    assert r.oom_killed and r.signal == 9, r
    assert cgroups.oom_kills(edge.settings.cgroup_parent, sb.id) >= 1
    ok = await run(edge, sb.id, "echo alive")  # the agent survived the overload
    assert ok.stdout == "alive\n" and not ok.oom_killed
    events = [e for e in await edge.event_log.read(sb.id) if e.kind == "exec.exited"]
    assert any('"oom_killed": true' in e.data for e in events)
    assert (await edge.get(sb.id)).state == "running"


async def test_agent_killed_by_oom_reports_sandbox_dead_oom(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB, resources=Resources(memory_mib=1024)), "t")
    box = edge.live[sb.id].box
    # Stand-in for an agent the kernel picks (unprotected, the largest score): the OOM killer
    # takes it, and with it the sandbox. Two 300 MiB buffers held (dd blocks writing into a
    # pipe nobody reads): together above the parent's limit, neither outscores the agent.
    Path(f"/proc/{box.agent_pid}/oom_score_adj").write_text("1000")
    hold = "dd if=/dev/zero bs=300M count=1 | sleep 60"
    exec_id = await edge.exec_start(sb.id, ExecSpec(cmd=f"{hold} & {hold}; wait",
                                                    timeout_s=60))
    for _ in range(200):
        info = await edge.get(sb.id)
        if info.state in ("dead", "deleted"):
            break
        await asyncio.sleep(0.05)
    assert info.state == "dead" and info.dead_reason == "oom", info
    with pytest.raises(Exception):
        await edge.exec_wait(sb.id, exec_id)
    assert edge.leftovers(sb.id) == []


def test_platform_processes_protect_themselves() -> None:
    """What `rollbox serve`, `rollbox mirror serve` and the lazy daemon call at start."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from rollbox.isolation import oom; "
                          "print(oom.protect(), oom.score())"], capture_output=True, text=True,
                         check=True).stdout.split()
    want = oom.PROTECTED_SCORE if oom.can_protect() else int(Path("/proc/self/oom_score_adj")
                                                               .read_text())
    assert [int(x) for x in out] == [want, want]
