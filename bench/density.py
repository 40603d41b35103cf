"""``rollbox bench density [--quick] [--n N] [--json]``: N idle sandboxes held at once.

Against ``rollbox serve`` in its own process (a node of its own beside the host's, with every
default setting: :func:`node_settings`; the default runtime), N
sandboxes of ``python:3.11`` with DEFAULT resources (no field of ``Resources`` given) are
created and held; then EVERY one of them answers an exec of ``true`` (all at the end, not a
sample); then all are deleted. Memory per sandbox is the drop of ``MemAvailable`` from before
the first create to after the last one settled, divided by N: it includes kernel memory (slab,
network namespaces, mounts, page tables) and leaves out page cache the way ``MemAvailable``
does, the same reading before and after (no cache drop in between). Beside it, as a cross
check, the same delta of "used without page cache" (``benchkit.used_without_page_cache``), of
``Slab``/``SUnreclaim``/``PageTables`` and of the server's RSS and descriptors; the mean PSS
of a sample of agents and the superblocks each of them holds of its own
(``idle_superblocks_per_sandbox``: ``benchkit.own_superblocks`` of its mount table); and what
came back after the deletes (another engineer's work moves ``MemAvailable`` on a shared host:
a drop that does not come back is not ours alone).
The limits that cap N on this node (uid slots, pid_max, the edge's RLIMIT_NOFILE, netns and
inotify sysctls, admission's budgets) are read and reported (``limits``): ``idle_cap`` is the
smallest. Keys: ``idle_sandboxes`` (held and answering), ``idle_mib_per_sandbox``.
The last line of ``--json`` is one JSON object.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import (
    emit, find_pids, meminfo, own_superblocks, percentile, record, say, smaps_rollup,
    used_without_page_cache,
)
from rollbox.config import Settings
from rollbox.embedded import ServerProcess

IMAGE = "python:3.11"
MIB = 1 << 20


def _proc_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _proc_status(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _host_mounts() -> int:
    return len(Path("/proc/self/mountinfo").read_text().splitlines())


def _netns_count() -> int:
    try:
        return len(os.listdir("/run/netns"))
    except OSError:
        return 0


def _mountinfo(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/mountinfo").read_text()
    except OSError:
        return ""


def _sysctl(name: str) -> int:
    return int(Path("/proc/sys/" + name).read_text().split()[0])


def _nofile_hard(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[4]) if line.split()[4].isdigit() else 1 << 30
    return 0


def snapshot(server_pid: int | None) -> dict[str, int]:
    """Host memory figures and the server's (0 without ``server_pid``)."""
    pid = server_pid or 0
    m = meminfo()
    return {"avail": m["MemAvailable"], "used": used_without_page_cache(), "slab": m["Slab"],
            "sunreclaim": m["SUnreclaim"], "pagetables": m["PageTables"],
            "kernel_stack": m.get("KernelStack", 0),
            "server_rss": _proc_status(pid, "VmRSS") * 1024 if pid else 0,
            "server_fds": _proc_fds(pid) if pid else 0,
            "server_threads": _proc_status(pid, "Threads") if pid else 0,
            "mounts": _host_mounts(), "netns": _netns_count()}


def limits(server_pid: int, s: Settings, per_sandbox_fds: float, per_sandbox_pids: float,
           per_sandbox_mounts: float) -> dict[str, Any]:
    """What caps the number of idle sandboxes on this node, each as the count it allows:
    admission's three budgets (90 %: the reserved share is for grades) for default resources,
    uid slots, the edge's descriptors (admission's cap), pid_max over the processes a sandbox
    has, netns and mount count sysctls; ``host_memory_at_1mib``: MiB sandboxes may use."""
    from rollbox.edge.admission import Limits, fd_sandboxes, node_cpus, node_memory_mib
    from rollbox.models import Resources

    r = Resources()
    lim = Limits.from_settings(s, node_memory_mib(s))
    new = 1 - lim.reserved_share
    cpus = node_cpus(s)
    nofile = _nofile_hard(server_pid)
    out: dict[str, Any] = {
        "uid_slots": s.uid_slots,
        "max_sandboxes": int(lim.max_sandboxes * new),
        "memory_requests": int(lim.memory_overcommit * node_memory_mib(s) * new // r.memory_mib),
        "cpu_requests": int(lim.cpu_overcommit * cpus * new // r.cpus),
        "pid_max": int(_sysctl("kernel/pid_max") // max(per_sandbox_pids, 1)),
        "edge_nofile": fd_sandboxes(nofile),  # admission refuses beyond it
        "max_net_namespaces": _sysctl("user/max_net_namespaces"),
        "mount_max": int(_sysctl("fs/mount-max") // max(per_sandbox_mounts, 0.01)),
        "host_memory_at_1mib": node_memory_mib(s) - lim.reserve_mib,
    }
    raw = {"pid_max": _sysctl("kernel/pid_max"), "edge_nofile": nofile,
           "inotify_max_user_instances": _sysctl("fs/inotify/max_user_instances"),
           "fs_mount_max": _sysctl("fs/mount-max"),
           "per_sandbox_fds": per_sandbox_fds, "per_sandbox_pids": per_sandbox_pids,
           "per_sandbox_mounts": per_sandbox_mounts}
    return {"caps": out, "raw": raw, "idle_cap": min(out.values()),
            "capped_by": min(out, key=out.__getitem__)}


async def hold(client: Any, n: int, server_pid: int | None, node_id: str,
               concurrency: int = 16, image: str = IMAGE) -> dict[str, Any]:
    """Create ``n`` idle sandboxes of ``image`` (default resources), measure, exec in every
    one, delete. ``server_pid``: the server's process, for its RSS and descriptors (None: a
    server this process did not start; those keys are then 0)."""
    await asyncio.sleep(2)
    before = snapshot(server_pid)
    t0 = time.monotonic()
    boxes: list[Any] = []
    create_lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    failed: list[str] = []

    async def one() -> None:
        async with sem:
            t = time.monotonic()
            try:
                boxes.append(await client.create(image, ttl_s=3600))
            except Exception as exc:  # noqa: BLE001 (counted and said: the run goes on)
                failed.append(f"{type(exc).__name__}: {exc}")
                return
            create_lat.append(time.monotonic() - t)
            if len(boxes) % 500 == 0:
                say(f"  {len(boxes)} held ({time.monotonic() - t0:.0f} s)")

    try:
        await asyncio.gather(*(one() for _ in range(n)))
        create_s = time.monotonic() - t0
        record("idle_create", create_lat)
        say(f"created {len(boxes)} of {n} in {create_s:.1f} s ({len(boxes) / create_s:.1f}/s), "
            f"{len(failed)} failed{': ' + failed[0] if failed else ''}")
        await asyncio.sleep(5)  # settle: deferred frees, the agents' first pages
        after = snapshot(server_pid)
        agents = find_pids(cgroup_part=f"/{node_id}-")
        sample = agents[:: max(1, len(agents) // 50)]
        pss = [smaps_rollup(p).get("Pss", 0) for p in sample]
        host_mi = Path("/proc/self/mountinfo").read_text()
        supers = [len(own_superblocks(_mountinfo(p), host_mi)) for p in sample]
        supers = [n for n in supers if n]  # 0: the agent went away meanwhile
        # every sandbox answers, at the end
        t1 = time.monotonic()
        answered = 0
        exec_lat: list[float] = []
        esem = asyncio.Semaphore(32)

        async def check(sb: Any) -> None:
            nonlocal answered
            async with esem:
                t = time.monotonic()
                try:
                    r = await sb.exec(["true"])
                except Exception:  # noqa: BLE001 (counted as not answering)
                    return
                exec_lat.append(time.monotonic() - t)
                answered += r.exit_code == 0

        await asyncio.gather(*(check(sb) for sb in boxes))
        exec_s = time.monotonic() - t1
        record("idle_exec_all", exec_lat)
        say(f"{answered} of {len(boxes)} answered exec true in {exec_s:.1f} s")
    finally:
        t2 = time.monotonic()
        dsem = asyncio.Semaphore(concurrency)

        async def rm(sb: Any) -> None:
            async with dsem:
                try:
                    await sb.delete()
                except Exception as exc:  # noqa: BLE001
                    say(f"delete {sb.id}: {exc}")

        await asyncio.gather(*(rm(sb) for sb in boxes))
        delete_s = time.monotonic() - t2
    await asyncio.sleep(5)
    gone = snapshot(server_pid)
    held = len(boxes)
    d = {k: after[k] - before[k] for k in before}
    per = max(1, held)
    res: dict[str, Any] = {
        "idle_requested": n, "idle_created": held, "idle_create_failed": len(failed),
        "idle_sandboxes": answered,
        "idle_all_answered": answered == held and held == n,
        "idle_mib_per_sandbox": -d["avail"] / per / MIB,
        "idle_used_mib_per_sandbox": d["used"] / per / MIB,
        "idle_slab_kib_per_sandbox": d["slab"] / per / 1024,
        "idle_sunreclaim_kib_per_sandbox": d["sunreclaim"] / per / 1024,
        "idle_pagetables_kib_per_sandbox": d["pagetables"] / per / 1024,
        "idle_kernel_stack_kib_per_sandbox": d["kernel_stack"] / per / 1024,
        "idle_server_rss_kib_per_sandbox": d["server_rss"] / per / 1024,
        "idle_server_fds_per_sandbox": d["server_fds"] / per,
        "idle_host_mounts_per_sandbox": d["mounts"] / per,
        "idle_netns_per_sandbox": d["netns"] / per,
        "idle_processes_per_sandbox": len(agents) / per,
        "idle_agent_pss_kib_mean": (sum(pss) / len(pss) / 1024) if pss else None,
        "idle_superblocks_per_sandbox": (sum(supers) / len(supers)) if supers else None,
        "idle_create_per_s": held / create_s if create_s else None,
        "idle_create_p50_ms": percentile(create_lat, 50) * 1000 if create_lat else None,
        "idle_exec_all_s": exec_s,
        "idle_exec_p50_ms": percentile(exec_lat, 50) * 1000 if exec_lat else None,
        "idle_delete_s": delete_s,
        "idle_mib_not_returned_per_sandbox": (before["avail"] - gone["avail"]) / per / MIB,
        "idle_server_threads": after["server_threads"],
        "idle_failures": sorted(set(failed))[:5],
    }
    return res


def node_settings(root: Path) -> Settings:
    """A node of its own below ``root`` (``Settings.scratch``: its cgroup parent, a free uid
    band and subnet taken at start), so the run does not wait for the host's default node,
    which other work uses; every limit and default resource stays the default."""
    s = Settings.scratch(root)
    s.node_id = f"dn{secrets.token_hex(3)}"
    return s


def main(quick: bool = False, json_out: bool = False, n: int | None = None) -> dict[str, Any]:
    n = n or (200 if quick else 3200)
    with tempfile.TemporaryDirectory(prefix="rollbox-density-") as tmp:
        Path(tmp).chmod(0o711)  # the launcher reaches the run dir as the sandbox's uid
        s = node_settings(Path(tmp))
        srv = ServerProcess(s)
        srv.start()
        try:
            from rollbox.sdk import AsyncClient

            assert srv.proc is not None
            pid = srv.proc.pid

            async def go() -> dict[str, Any]:
                async with AsyncClient(base_url=srv.url, api_key=srv.key, timeout=300) as client:
                    for sb in await client.create_many(4, IMAGE, ttl_s=300):  # warm-up
                        await sb.delete()
                    return await hold(client, n, pid, s.node_id)

            res = asyncio.run(go())
            lim = limits(pid, s, res["idle_server_fds_per_sandbox"],
                         res["idle_processes_per_sandbox"], res["idle_host_mounts_per_sandbox"])
        finally:
            srv.stop()
    res.update({"image": IMAGE, "runtime": s.runtime, "limits": lim["caps"],
                "limits_raw": lim["raw"], "idle_cap": lim["idle_cap"],
                "idle_capped_by": lim["capped_by"]})
    say(f"idle: {res['idle_sandboxes']} sandboxes answering, "
        f"{res['idle_mib_per_sandbox']:.2f} MiB each (MemAvailable), cap {lim['idle_cap']} "
        f"({lim['capped_by']})")
    return emit(res, json_out)
