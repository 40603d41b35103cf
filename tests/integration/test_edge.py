"""The edge with real runc sandboxes: exec semantics, limits, typed errors, TTL, teardown."""
from __future__ import annotations

import asyncio
import errno
import time

import pytest

from rollbox.errors import BadRequest, CapacityExceeded, NotFound, SandboxDead
from rollbox.isolation import cgroups
from rollbox.models import ExecSpec, Resources, SandboxSpec

BB = "busybox:test"


async def run(edge, sid: str, cmd, **kw):  # noqa: ANN001, ANN201
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd, **kw))
    return await edge.exec_wait(sid, eid)


async def test_exec_basics(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB, env={"FOO": "bar"}), "t")
    r = await run(edge, sb.id, "echo $FOO $X; pwd; id -u; echo oops >&2; exit 3",
                  env={"X": "y"}, cwd="/tmp")
    assert r.exit_code == 3
    assert r.stdout == "bar y\n/tmp\n0\n"
    assert r.stderr == "oops\n"
    r = await run(edge, sb.id, ["id", "-u"], user="1000")
    assert r.stdout.strip() == "1000"
    r = await run(edge, sb.id, ["id", "-u"], user="nobody")
    assert r.stdout.strip() == "65534"
    r = await run(edge, sb.id, ["/no/such/binary"])
    assert r.exit_code == 127
    with pytest.raises(BadRequest) as refused:
        await edge.exec_start(sb.id, ExecSpec(cmd="true", cwd="/does/not/exist"))
    assert refused.value.details["errno"] == errno.ENOENT  # the agent's, kept for the caller
    with pytest.raises(BadRequest):
        await edge.exec_start(sb.id, ExecSpec(cmd="true", user="nosuchuser"))


async def test_output_is_streamed_before_exit(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "t")
    eid = await edge.exec_start(sb.id, ExecSpec(cmd="echo first; sleep 0.5; echo second"))
    t0 = time.monotonic()
    seen = []
    async for item in edge.exec_stream(sb.id, eid):
        seen.append((item.kind, item.data, time.monotonic() - t0))
    kinds = [k for k, _, _ in seen]
    assert kinds[0] == "started" and kinds[-1] == "exit"
    first = next(s for s in seen if s[0] == "stdout")
    assert first[1] == b"first\n" and first[2] < 0.4, seen


async def test_stdin_round_trip(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "t")
    eid = await edge.exec_start(sb.id, ExecSpec(cmd=["cat"], stdin=True))
    await edge.exec_stdin(sb.id, eid, b"hello ", False)
    await edge.exec_stdin(sb.id, eid, b"world", True)
    r = await edge.exec_wait(sb.id, eid)
    assert r.exit_code == 0 and r.stdout == "hello world"


async def test_timeout_kills_everything_by_cgroup(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "t")
    t0 = time.monotonic()
    r = await run(edge, sb.id, "(setsid sleep 1000 &); (nohup sleep 1001 >/dev/null 2>&1 &); "
                  "sleep 1002", timeout_s=0.5)
    assert r.timed_out and time.monotonic() - t0 < 3
    r = await run(edge, sb.id, "ps -o comm | grep -c sleep || true")
    assert r.stdout.strip() == "0", r.stdout


async def test_background_list_and_reattach(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "t")
    eid = await edge.exec_start(sb.id, ExecSpec(
        cmd="for i in 1 2 3; do echo $i; sleep 0.1; done", background=True))
    listed = await edge.exec_list(sb.id)
    assert any(e.exec_id == eid and e.state == "running" for e in listed)
    out = b""
    async for item in edge.exec_stream(sb.id, eid):
        out += item.data if item.kind == "stdout" else b""
    assert out == b"1\n2\n3\n"
    # A second attach after the end replays the buffered output and the result.
    items = [i async for i in edge.exec_stream(sb.id, eid)]
    assert items[-1].kind == "exit" and items[-1].result.exit_code == 0


async def test_output_capture_is_bounded(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "t")
    r = await run(edge, sb.id, "yes | head -c 30000000")
    assert r.exit_code == 0
    assert r.stdout_bytes == 30_000_000
    assert r.stdout_dropped > 0
    assert len(r.stdout) < 2_000_000


async def test_limits_disk_memory_pids(edge) -> None:  # noqa: ANN001
    # The memory tier's tmpfs (test_disk_tier covers the disk tier's qgroup cap).
    sb = await edge.create(SandboxSpec(image=BB, disk_tier="memory", resources=Resources(
        disk_mib=16, memory_mib=64, pids=64)), "t")
    r = await run(edge, sb.id, "dd if=/dev/zero of=/tmp/big bs=1M count=64", timeout_s=20)
    assert r.signal == 25, r  # SIGXFSZ: RLIMIT_FSIZE is the disk cap
    r = await run(edge, sb.id, "for i in 1 2 3; do dd if=/dev/zero of=/tmp/f$i bs=1M count=12 "
                  "|| exit 1; done", timeout_s=20)
    assert r.exit_code == 1 and "space" in r.stderr.lower(), r  # the capped tmpfs is full
    r = await run(edge, sb.id, "dd if=/dev/zero of=/dev/null bs=200M count=1", timeout_s=20)
    assert r.exit_code != 0  # OOM-killed or allocation refused
    r = await run(edge, sb.id, "for i in $(seq 200); do sleep 5 & done; wait", timeout_s=3)
    assert r.timed_out or r.exit_code != 0
    r = await run(edge, sb.id, ["echo", "alive"])  # the sandbox survived its own abuse
    assert r.stdout == "alive\n"


async def test_isolation_basics(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "t")
    r = await run(edge, sb.id, "cat /proc/self/uid_map")
    host_uid = int(r.stdout.split()[1])
    assert host_uid >= 65536  # sandbox root is an unprivileged host uid
    r = await run(edge, sb.id, "head -c 8 /proc/kpagecgroup | wc -c")
    assert r.stdout.strip() == "0"
    r = await run(edge, sb.id, "test -e /.rollbox || test -e /proc/1/fd/4 || echo absent")
    assert r.stdout == "absent\n"  # the agent binary is in no path of the sandbox
    r = await run(edge, sb.id, "find /sys -type f | sort | tr '\\n' ' '; echo; "
                  "ip link 2>/dev/null | grep -c eth || true")
    # no host sysfs: only the platform's generated CPU files (backends/container/cpuview.py)
    assert r.stdout.splitlines()[0] == " ".join(
        f"/sys/devices/system/cpu/{f}" for f in ("online", "possible", "present")) + " ", r


async def test_typed_errors_and_deleted_sandbox(edge) -> None:  # noqa: ANN001
    with pytest.raises(NotFound):
        await edge.create(SandboxSpec(image="no/such:image"), "t")
    with pytest.raises(NotFound):
        await edge.get(f"{edge.node_id}-000000000000")
    sb = await edge.create(SandboxSpec(image=BB), "t")
    await edge.delete(sb.id)
    assert edge.leftovers(sb.id) == []
    with pytest.raises(SandboxDead):
        await edge.exec_start(sb.id, ExecSpec(cmd="true"))
    assert (await edge.get(sb.id)).state == "deleted"
    await edge.delete(sb.id)  # idempotent
    events = await edge.event_log.read(sb.id)
    assert [e.kind for e in events][-1] == "sandbox.deleted"


async def test_admission_refuses_beyond_capacity(edge) -> None:  # noqa: ANN001
    edge.limits.max_sandboxes = 2
    await edge.create(SandboxSpec(image=BB), "t")
    await edge.create(SandboxSpec(image=BB), "t")
    with pytest.raises(CapacityExceeded) as exc:
        await edge.create(SandboxSpec(image=BB), "t")
    assert exc.value.retryable


async def test_ttl_reclaims(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB, ttl_s=1), "t")
    await asyncio.sleep(3)
    info = await edge.get(sb.id)
    assert info.state == "deleted" and info.dead_reason == "ttl expired"
    assert edge.leftovers(sb.id) == []


async def test_sandbox_death_is_reported(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "t")
    cgroups.kill(edge.live[sb.id].box.v2_cgroup)  # the whole sandbox dies (like an OOM)
    for _ in range(100):
        if (await edge.get(sb.id)).state == "dead":
            break
        await asyncio.sleep(0.05)
    info = await edge.get(sb.id)
    assert info.state == "dead" and "died" in (info.dead_reason or "")
    with pytest.raises(SandboxDead):
        await edge.exec_start(sb.id, ExecSpec(cmd="true"))
    assert edge.leftovers(sb.id) == []


async def test_files_through_edge(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "t")
    await edge.file_write(sb.id, "/tmp/a/b.txt", b"payload", 0o600)
    r = await run(edge, sb.id, "cat /tmp/a/b.txt; stat -c '%u %a' /tmp/a/b.txt")
    assert r.stdout == "payload0 600\n"
    await run(edge, sb.id, "ln -s /etc/passwd /tmp/link")
    assert (await edge.file_stat(sb.id, "/tmp/link")).type == "symlink"
