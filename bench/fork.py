"""Fork of a sandbox with a 500 MB writable layer against today's other ways to get n copies,
in one run: ``rollbox bench fork [--quick] [--json]``.

An edge in this process on a scratch node of its own (data and run dir below a temp dir, own
cgroup parent, node id and uid band; the node's images read-only). The source is a
``busybox:test`` container (128 MiB, disk tier) that wrote 500 MB of random bytes (``--quick``: 100 MB)
and keeps a process running. Per phase, repeated and interleaved so load from elsewhere falls
on all alike:

- **fork(n)**, n = 1, 8, 32: ``Edge.fork`` then an exec (``true``) in every child at once;
  *ready* is the time from the fork's start until every child answered (p50/p99 over the
  repetitions), *child ready* each child's own time; *source frozen* what the fork reports
  (freeze + syncfs + btrfs snapshot + thaw); host memory per child (its memory cgroup:
  agent, shell and kernel objects charged to it) and disk per child (pool bytes allocated
  after the fork minus before, per child).
- **snapshot + create(8)**: today's only way through the API: ``snapshot`` of the source (its
  writable layer packed into an EROFS layer), then 8 creates of that image at once, each
  answering an exec.
- **full copy**: one copy of the writable layer (``cp -a --reflink=never`` within the pool):
  what a fork that copies per child would pay per child, in time and disk.
- **create(8)**: 8 plain creates of the image at once, each answering an exec.

- **microVM fork(8)**: a ``python:3.11`` microVM (memory 256 MiB) restored from its template
  (built by the first create, not timed), forked into 8 (memory and processes carried), with
  the children's warm-up (``vm_fork_warm``, off by default) and without, interleaved (the
  node's setting's rounds give ``microvm_fork8_ready_p50_ms``); the peer is 8 creates restored
  from the template, in the same run. Then fork(8) with spare QEMUs (``vm_fork_spares`` 8:
  children restored into QEMUs started ahead, the pool refilled at idle priority and waited
  for before each round) against 0, interleaved: ``microvm_fork8_spares_p50_ms``,
  ``microvm_fork8_nospares_p50_ms``, their ratio, the spares each round's children took
  and the 8 spares' memory (``microvm_fork_spares_memory_mib``). The CPU a fork(8) costs (children's
  QEMUs, the source's, this process) over the host's cores is ``microvm_fork8_cpu_floor_ms``:
  no fork of this design is ready sooner here. One child alone (fork(1)) is profiled: its
  QEMU's CPU until restored, over its first and second exec, and TCG's translated code blocks
  (HMP ``info jit``). Null with the reason where the node offers no microVM fork.

``fork_vs_snapshot_create_ratio`` is fork(8)'s ready p50 over snapshot + create(8)'s (below 1:
fork is faster). fork(1), fork(8) and create(8) run 15 rounds each (``--quick``: 3), fork(32)
3 (1). ``fork8_cpu_ms`` / ``create8_cpu_ms``: CPU per round, deletes included, of this
process (the edge) and its reaped children (runc, the agents and what they ran), whatever
load from elsewhere does to the wall-clock times; ``fork8_vs_create8_cpu_ratio`` their ratio.

- **port proxy**: ``bench/ports`` (its own scratch ``rollbox serve``) after the fork rounds; its
  ``port_proxy_*``, ``direct_*`` and ``api_health_p50_ms`` keys are copied into this JSON.

``--only container,microvm,ports`` runs those phases alone (default: all three).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollbox.benchkit import emit, load_bench, percentile, process_cpu_s  # noqa: E402
from rollbox.config import Settings  # noqa: E402
from rollbox.errors import RollboxError  # noqa: E402
from rollbox.isolation import cgroups  # noqa: E402
from rollbox.models import ExecSpec, ForkSpec, Resources, SandboxSpec, SnapshotSpec  # noqa: E402

IMAGE = "busybox:test"
VM_IMAGE = "python:3.11"
OWNER = "bench"
MiB = 1 << 20


def bench_settings(root: Path) -> Settings:
    s = Settings.scratch(root)
    tag = secrets.token_hex(3)
    s.cgroup_parent = f"rollbox-bench-fork-{tag}"
    s.node_id = f"bf{tag}"
    # A band above the node's own, the test runs' and bench disk's, below 2^32.
    s.uid_base = s.uid_base + (s.uid_slots + 64 + 1024 * 9) * 65536
    s.uid_slots = 512
    return s


async def answer(edge: Any, sid: str, t0: float) -> float:
    eid = await edge.exec_start(sid, ExecSpec(cmd="true", timeout_s=60))
    r = await edge.exec_wait(sid, eid)
    assert r.exit_code == 0, r
    return time.perf_counter() - t0


async def delete_all(edge: Any, ids: list[str]) -> None:
    await asyncio.gather(*(edge.delete(i) for i in ids))


def child_memory_bytes(edge: Any, ids: list[str]) -> float:
    parent = edge.settings.cgroup_parent
    vals = [cgroups.memory_bytes(parent, i) or 0 for i in ids]
    return sum(vals) / len(vals)


def cpu_s() -> float:
    """CPU seconds of this process (the edge's threads) and of its reaped children (runc,
    the sandboxes' agents and commands, reaped by the edge as their subreaper)."""
    return process_cpu_s(None, children=True)


async def fork_round(edge: Any, src: str, n: int) -> dict[str, Any]:
    pool = edge.backend.disk
    before = pool.used_bytes()
    cpu0 = cpu_s()
    t0 = time.perf_counter()
    res = await edge.fork(src, ForkSpec(n=n), OWNER)
    ids = [c.id for c in res.children]
    try:
        ready = await asyncio.gather(*(answer(edge, i, t0) for i in ids))
        measuring = cpu_s()  # the disk and memory figures' own work is left out of "cpu"
        await asyncio.to_thread(pool.sync)
        disk = (pool.used_bytes() - before) / n
        mem = child_memory_bytes(edge, ids)
        cpu0 += cpu_s() - measuring
    finally:
        await delete_all(edge, ids)
    return {"all": max(ready), "each": ready, "frozen": res.frozen_s, "disk": disk, "mem": mem,
            "cpu": cpu_s() - cpu0}


async def creates_ready(edge: Any, spec: SandboxSpec, n: int, t0: float) -> float:
    """``n`` creates of ``spec`` at once, each answering an exec: seconds since ``t0`` until
    the last did; all deleted after."""
    made = await asyncio.gather(*(edge.create(spec, OWNER) for _ in range(n)),
                                return_exceptions=True)
    infos = [i for i in made if not isinstance(i, BaseException)]
    failed = [i for i in made if isinstance(i, BaseException)]
    if failed:  # the others are made by now: deleted before the error goes up (nothing left)
        await delete_all(edge, [i.id for i in infos])
        raise failed[0]
    try:
        return max(await asyncio.gather(*(answer(edge, i.id, t0) for i in infos)))
    finally:
        await delete_all(edge, [i.id for i in infos])


def plain(image: str) -> SandboxSpec:
    return SandboxSpec(image=image, ttl_s=600, resources=Resources(memory_mib=128))


async def create_round(edge: Any, image: str, n: int) -> dict[str, float]:
    cpu0 = cpu_s()
    ready = await creates_ready(edge, plain(image), n, time.perf_counter())
    return {"all": ready, "cpu": cpu_s() - cpu0}


async def snapshot_create_round(edge: Any, src: str, n: int) -> tuple[float, float]:
    name = f"bench/fork-peer-{secrets.token_hex(4)}:1"
    t0 = time.perf_counter()
    await edge.snapshot(src, SnapshotSpec(name=name, scrub=False), OWNER)
    snap_s = time.perf_counter() - t0
    try:
        return await creates_ready(edge, plain(name), n, t0), snap_s
    finally:
        edge.store.remove(name)


def full_copy(edge: Any, src: str) -> tuple[float, float]:
    """One copy of the source's upper into a fresh pool subvolume: (seconds, bytes added)."""
    pool = edge.backend.disk
    upper = edge.backend.rootfs_of(src).upper
    dst = f"{edge.node_id}-copy{secrets.token_hex(3)}"
    target = pool.create(dst, 4096 * MiB)
    before = pool.used_bytes()
    try:
        t0 = time.perf_counter()
        subprocess.run(["cp", "-a", "--reflink=never", str(upper), str(target / "upper")],
                       check=True)
        os.sync()
        took = time.perf_counter() - t0
        pool.sync()
        return took, pool.used_bytes() - before
    finally:
        pool.remove(dst)


def tb_count(jit: str) -> int | None:
    """``TB count`` of HMP ``info jit``: guest code blocks TCG has translated in this QEMU."""
    for line in jit.splitlines():
        if line.startswith("TB count"):
            return int(line.split()[-1])
    return None


async def child_tbs(vm: Any) -> int | None:
    from rollbox.backends.microvm import qmp
    async with qmp.session(vm.qmp_path, 10) as q:
        jit = await q.execute("human-monitor-command", {"command-line": "info jit"})
    return tb_count(str(jit))


async def microvm_profile(edge: Any, src: str) -> dict[str, Any]:
    """One child alone (fork(1): no other restore, no warm-up): its QEMU's CPU when the fork
    returned (QEMU start, state load, resume, make-unique), over its first exec and its second,
    and the guest code blocks TCG translated by then (HMP ``info jit``). A child restored into
    a spare QEMU (``vm_fork_spares``) counts from the fork's start (``in_spare``)."""
    be = edge.backends["microvm"]
    ahead = {sp.pid: process_cpu_s(sp.pid) for sp in be.spares.spares()}
    res = await edge.fork(src, ForkSpec(n=1), OWNER)
    cid = res.children[0].id
    try:
        vm = be._vms[cid]
        restored = process_cpu_s(vm.pid) - ahead.get(vm.pid, 0.0)
        first0 = process_cpu_s(vm.pid)
        tb_restored = await child_tbs(vm)
        await answer(edge, cid, 0.0)
        first = process_cpu_s(vm.pid)
        first_ms = (first - first0) * 1000
        tb_first = await child_tbs(vm)
        await answer(edge, cid, 0.0)
        second = process_cpu_s(vm.pid)
    finally:
        await delete_all(edge, [cid])
    return {"restored_ms": restored * 1000, "first_exec_ms": first_ms,
            "second_exec_ms": (second - first) * 1000, "tb_restored": tb_restored,
            "tb_first_exec": tb_first, "in_spare": vm.pid in ahead}


async def microvm_fork_round(edge: Any, src: str, n: int, warm: bool) -> dict[str, Any]:
    """fork(n) with the children's warm-up on or off; plus the CPU the whole fork cost: the
    children's QEMUs (everything since they started; a child restored into a spare QEMU:
    since the fork started, its start and RAM faults before it left out), the source's QEMU
    and this process (the edge), from the fork's start until every child answered."""
    be = edge.backends["microvm"]
    be.settings.vm_fork_warm = warm
    src_pid = be._vms[src].pid
    ahead = {sp.pid: process_cpu_s(sp.pid) for sp in be.spares.spares()}
    c0, s0 = process_cpu_s(None, children=True), process_cpu_s(src_pid)
    qemus: list[float] = []

    def cpu(ids: list[str]) -> float:
        # read while the children run (before the deletes reap their QEMUs, whose CPU would
        # then be counted again in this process's reaped children)
        pids = [be._vms[i].pid for i in ids]
        qemus.append(sum(process_cpu_s(p) - ahead.get(p, 0.0) for p in pids))
        return (qemus[0] + process_cpu_s(src_pid) - s0
                + process_cpu_s(None, children=True) - c0)

    r = await fork_round_cpu(edge, src, n, cpu)
    r["cpu"] = r["children_cpu"]
    r["child_cpu"] = qemus[0] / n  # one child's QEMU, on average
    return r


async def fork_round_cpu(edge: Any, src: str, n: int, cpu: Any) -> dict[str, Any]:
    be = edge.backends["microvm"]
    spare_pids = {sp.pid for sp in be.spares.spares()}
    t0 = time.perf_counter()
    res = await edge.fork(src, ForkSpec(n=n), OWNER)
    ids = [c.id for c in res.children]
    claimed = sum(be._vms[i].pid in spare_pids for i in ids)
    try:
        ready = await asyncio.gather(*(answer(edge, i, t0) for i in ids))
        children_cpu = cpu(ids)
        refilled = len(be.spares.spares())  # spares started again before all answered
    finally:
        await delete_all(edge, ids)
    return {"all": max(ready), "frozen": res.frozen_s, "children_cpu": children_cpu,
            "claimed": claimed, "refilled": refilled}


SPARES_WAIT_S = 180.0  # refills run at idle CPU priority: on a busy host they wait for idle time


async def spares_settled(be: Any, n: int) -> bool:
    """Wait until the backend holds exactly ``n`` ready spares and stops none (False: not
    within SPARES_WAIT_S)."""
    deadline = time.monotonic() + SPARES_WAIT_S
    while len(be.spares.spares()) != n or be.spares.stopping():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def microvm_spare_rounds(edge: Any, src: str, reps: int) -> dict[str, Any]:
    """fork(8) with ``vm_fork_spares`` 8 (children restored into spare QEMUs: each round waits
    until the pool holds 8 again, refilled at idle priority after the last round's claims) and
    0 (no claim; the pool shrunk back to ``vm_template_spares`` first), interleaved, each
    round starting with nothing of the pool under way; plus the 8 spares' memory, and after
    each fork(8) one child alone (fork(1)) into a spare and into its own QEMU: its QEMU's CPU
    until the fork returned (``microvm_child_cpu_restored_spare_ms`` / ``_nospare_ms``)."""
    be = edge.backends["microvm"]
    n, base = 8, be.spares.per_template
    times: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    alone: dict[bool, list[float]] = {True: [], False: []}  # one child's QEMU until restored
    claimed: list[int] = []
    refilled: list[int] = []  # spares ready again when the last child answered
    out: dict[str, Any] = {}
    try:
        be.spares.set_fork_spares(n)
        await microvm_fork_round(edge, src, 2, False)  # its template now keeps n spares
        for _ in range(reps):
            be.spares.set_fork_spares(n)
            if not await spares_settled(be, n):
                out["microvm_fork8_spares_note"] = (
                    f"{len(be.spares.spares())} of {n} spares ready after {SPARES_WAIT_S:.0f} s "
                    "(refills at idle priority found no idle CPU): rounds cut short")
                break
            out["microvm_fork_spares_memory_mib"] = be.spares.facts()["memory_mib"]
            r = await microvm_fork_round(edge, src, n, False)
            times[True].append(r["all"])
            cpu[True].append(r["cpu"])
            claimed.append(r["claimed"])
            refilled.append(r["refilled"])
            if await spares_settled(be, n):  # one child alone, into a spare
                prof = await microvm_profile(edge, src)
                if prof["in_spare"]:
                    alone[True].append(prof["restored_ms"])
            be.spares.set_fork_spares(0)
            await spares_settled(be, base)
            r = await microvm_fork_round(edge, src, n, False)
            times[False].append(r["all"])
            cpu[False].append(r["cpu"])
            alone[False].append((await microvm_profile(edge, src))["restored_ms"])
    finally:
        be.spares.set_fork_spares(edge.settings.vm_fork_spares)
    if times[True] and times[False]:
        out["microvm_fork8_spares_p50_ms"] = statistics.median(times[True]) * 1000
        out["microvm_fork8_nospares_p50_ms"] = statistics.median(times[False]) * 1000
        out["microvm_fork8_spares_vs_nospares_ratio"] = (out["microvm_fork8_spares_p50_ms"]
                                                         / out["microvm_fork8_nospares_p50_ms"])
        # the CPU in the fork's window (children's QEMUs, the source's, the edge with the
        # refill it starts): less exposed to load from elsewhere than the wall time
        out["microvm_fork8_spares_cpu_s"] = statistics.median(cpu[True])
        out["microvm_fork8_nospares_cpu_s"] = statistics.median(cpu[False])
        out["microvm_fork8_spares_cpu_floor_ms"] = (out["microvm_fork8_spares_cpu_s"]
                                                    / (os.cpu_count() or 1) * 1000)
        out["microvm_fork8_spares_claimed"] = claimed
        out["microvm_fork8_spares_refilled_by_ready"] = refilled
    if alone[True] and alone[False]:  # fork(1): its child's QEMU CPU until the fork returned
        out["microvm_child_cpu_restored_spare_ms"] = statistics.median(alone[True])
        out["microvm_child_cpu_restored_nospare_ms"] = statistics.median(alone[False])
        out["microvm_fork8_spares_rounds"] = len(claimed)
        out["microvm_fork_spare_memory_mib"] = out["microvm_fork_spares_memory_mib"] / n
    return out


async def microvm_rounds(edge: Any, reps: int) -> dict[str, Any]:
    """fork(8) of a python:3.11 microVM (restored from its template, which the first create
    builds) that wrote a file and keeps a process: all 8 children answering an exec, with the
    children's warm-up and without (``vm_fork_warm``), interleaved; the peer is 8 creates restored
    from the template in the same run. Then one child's CPU profile (:func:`microvm_profile`)."""
    spec = SandboxSpec(image=VM_IMAGE, backend="microvm", ttl_s=3600,
                       resources=Resources(memory_mib=256, disk_mib=256))
    be = edge.backends["microvm"]
    src = (await edge.create(spec, OWNER)).id
    out: dict[str, Any] = {"microvm_accel": be.capacity().facts.get("accel")}
    warm_default = be.settings.vm_fork_warm
    cores = os.cpu_count() or 1
    try:
        eid = await edge.exec_start(src, ExecSpec(cmd="echo x > /root/state; sync",
                                                  timeout_s=120))
        assert (await edge.exec_wait(src, eid)).exit_code == 0
        await microvm_fork_round(edge, src, 2, False)  # warm-up: the state file path, caches
        forks: dict[bool, list[float]] = {True: [], False: []}
        frozen, cpu, child_cpu, creates = [], [], [], []
        for _ in range(reps):
            r = await microvm_fork_round(edge, src, 8, warm_default)
            forks[warm_default].append(r["all"])
            frozen.append(r["frozen"])
            cpu.append(r["cpu"])
            child_cpu.append(r["child_cpu"])
            creates.append(await creates_ready(edge, spec, 8, time.perf_counter()))
            forks[not warm_default].append(
                (await microvm_fork_round(edge, src, 8, not warm_default))["all"])
        be.settings.vm_fork_warm = warm_default
        out.update(await microvm_spare_rounds(edge, src, reps))
        prof = await microvm_profile(edge, src)
        # the node's setting's figure, and both ways of vm_fork_warm
        out["microvm_fork8_ready_p50_ms"] = statistics.median(forks[warm_default]) * 1000
        out["microvm_fork8_warm"] = warm_default
        out["microvm_fork8_warm_ready_p50_ms"] = statistics.median(forks[True]) * 1000
        out["microvm_fork8_nowarm_ready_p50_ms"] = statistics.median(forks[False]) * 1000
        out["microvm_fork8_warm_vs_nowarm_ratio"] = (out["microvm_fork8_warm_ready_p50_ms"]
                                                     / out["microvm_fork8_nowarm_ready_p50_ms"])
        out["microvm_fork8_source_frozen_ms"] = statistics.median(frozen) * 1000
        out["microvm_create8_ready_p50_ms"] = statistics.median(creates) * 1000
        out["microvm_fork8_vs_create8_ratio"] = (out["microvm_fork8_ready_p50_ms"]
                                                 / out["microvm_create8_ready_p50_ms"])
        # the CPU one fork(8) costs (children's QEMUs, the source's, the edge) over the cores:
        # no fork of this design can be ready sooner on this host
        out["microvm_fork8_cpu_s"] = statistics.median(cpu)
        out["microvm_fork8_cpu_floor_ms"] = statistics.median(cpu) / cores * 1000
        # of it one child's QEMU (start, restore, make-unique, the first exec) and the rest
        # (the source's save, the edge): 1 s on 2 cores needs 8 children + the rest <= 2 CPU-s
        out["microvm_fork8_child_cpu_ms"] = statistics.median(child_cpu) * 1000
        out["microvm_fork8_platform_cpu_ms"] = statistics.median(
            c - 8 * q for c, q in zip(cpu, child_cpu)) * 1000
        out["microvm_child_cpu_restored_ms"] = prof["restored_ms"]
        out["microvm_child_cpu_first_exec_ms"] = prof["first_exec_ms"]
        out["microvm_child_cpu_second_exec_ms"] = prof["second_exec_ms"]
        out["microvm_child_tb_restored"] = prof["tb_restored"]
        out["microvm_child_tb_first_exec"] = prof["tb_first_exec"]
        # 8 children's first commands alone, over the cores: TCG translating the guest's exec
        # path anew in each child's QEMU, whatever the restore costs
        out["microvm_fork8_first_exec_floor_ms"] = 8 * prof["first_exec_ms"] / cores
        out["microvm_cores"] = cores
        out["microvm_rounds"] = reps
    finally:
        be.settings.vm_fork_warm = warm_default
        await edge.delete(src)
    return out


def ms(xs: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(xs) * 1000, "p99": percentile(xs, 99) * 1000}


PHASES = ("container", "microvm", "ports")


def parse_only(text: str) -> frozenset[str]:
    """``--only a,b``: those of :data:`PHASES`; "": all. ValueError naming an unknown one."""
    only = frozenset(p.strip() for p in text.split(",") if p.strip()) or frozenset(PHASES)
    bad = sorted(only - set(PHASES))
    if bad:
        raise ValueError(f"unknown bench fork phase(s) {', '.join(bad)}: "
                         f"choose from {', '.join(PHASES)}")
    return only


async def run(quick: bool, only: frozenset[str] = frozenset(PHASES)) -> dict[str, Any]:
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog

    root = Path(tempfile.mkdtemp(prefix="rollbox-bench-fork-"))
    root.chmod(0o711)
    events = EventLog(root / "events.db")
    settings = bench_settings(root)
    settings.fork_max_children = 32
    edge = Edge(settings, events)
    await edge.start()
    mb = 100 if quick else 500
    reps = 3 if quick else 15  # fork1, fork8, create8 (fork32: 1 / 3)
    res: dict[str, Any] = {"image": IMAGE, "quick": quick, "writable_mb": mb,
                           "phases": sorted(only), "load_start": round(os.getloadavg()[0], 1)}
    try:
        if "container" in only:
            await container_rounds(edge, res, quick, mb, reps)
        cap = edge.backends["microvm"].capacity() if "microvm" in edge.backends else None
        if "microvm" not in only:
            pass
        elif cap is not None and cap.offered and cap.fork:
            try:
                res.update(await microvm_rounds(edge, 1 if quick else 3))
            except RollboxError as exc:  # the container figures stand; the failure is named
                res["microvm_fork8_ready_p50_ms"] = None
                res["microvm_fork_error"] = f"{exc.code}: {exc.message[:300]}"
        else:
            res["microvm_fork8_ready_p50_ms"] = None
            res["microvm_fork_note"] = ("not measured: the microVM backend is not offered "
                                        "or does not fork on this node")
    finally:
        await edge.close(destroy=True)
        events.close()
        shutil.rmtree(root, ignore_errors=True)
    res["load_end"] = round(os.getloadavg()[0], 1)
    return res


async def container_rounds(edge: Any, res: dict[str, Any], quick: bool, mb: int,
                           reps: int) -> None:
    """The container phases (module docstring) into ``res``."""
    src = (await edge.create(SandboxSpec(image=IMAGE, ttl_s=3600,
                                         resources=Resources(memory_mib=128,
                                                             disk_mib=4 * mb)),
                             OWNER)).id
    eid = await edge.exec_start(src, ExecSpec(
        cmd=f"mkdir -p /work && head -c {mb * MiB} /dev/urandom > /work/blob && sync",
        timeout_s=600))
    assert (await edge.exec_wait(src, eid)).exit_code == 0
    await edge.exec_start(src, ExecSpec(cmd="sleep 3600", timeout_s=3600))
    for _ in range(2):  # warm-up: layer mounts, page cache, the pool
        await fork_round(edge, src, 2)
        await create_round(edge, IMAGE, 2)
    rounds: dict[str, list[Any]] = {"fork1": [], "fork8": [], "fork32": [], "create8": []}
    for i in range(reps):
        for name, op in (("fork1", lambda: fork_round(edge, src, 1)),
                         ("fork8", lambda: fork_round(edge, src, 8)),
                         ("create8", lambda: create_round(edge, IMAGE, 8))):
            rounds[name].append(await op())
        if i < (1 if quick else 3):
            rounds["fork32"].append(await fork_round(edge, src, 32))
    for name in ("fork1", "fork8", "fork32"):
        rs = rounds[name]
        ready = ms([r["all"] for r in rs])
        res[f"{name}_ready_p50_ms"] = ready["p50"]
        res[f"{name}_ready_p99_ms"] = ready["p99"]
        each = ms([x for r in rs for x in r["each"]])
        res[f"{name}_child_ready_p50_ms"] = each["p50"]
        res[f"{name}_child_ready_p99_ms"] = each["p99"]
        res[f"{name}_source_frozen_ms"] = ms([r["frozen"] for r in rs])["p50"]
        res[f"{name}_source_frozen_max_ms"] = max(r["frozen"] for r in rs) * 1000
        res[f"{name}_disk_per_child_kib"] = statistics.median(r["disk"] for r in rs) / 1024
        res[f"{name}_memory_per_child_kib"] = statistics.median(r["mem"] for r in rs) / 1024
        res[f"{name}_rounds"] = len(rs)
    c8 = ms([r["all"] for r in rounds["create8"]])
    res["create8_ready_p50_ms"], res["create8_ready_p99_ms"] = c8["p50"], c8["p99"]
    res["create8_rounds"] = len(rounds["create8"])
    # CPU per round (the round's deletes included): what a fork costs against 8 creates
    # whatever the load from elsewhere does to the wall-clock times
    res["fork8_cpu_ms"] = statistics.median(r["cpu"] for r in rounds["fork8"]) * 1000
    res["create8_cpu_ms"] = statistics.median(r["cpu"] for r in rounds["create8"]) * 1000
    res["fork8_vs_create8_cpu_ratio"] = res["fork8_cpu_ms"] / res["create8_cpu_ms"]
    peer = [await snapshot_create_round(edge, src, 8) for _ in range(1 if quick else 2)]
    res["snapshot_create8_ready_p50_ms"] = statistics.median(p[0] for p in peer) * 1000
    res["snapshot_alone_p50_ms"] = statistics.median(p[1] for p in peer) * 1000
    copy_s, copy_bytes = await asyncio.to_thread(full_copy, edge, src)
    res["full_copy_ms"] = copy_s * 1000
    res["full_copy_disk_kib"] = copy_bytes / 1024
    res["fork_vs_snapshot_create_ratio"] = (res["fork8_ready_p50_ms"]
                                            / res["snapshot_create8_ready_p50_ms"])
    res["fork8_vs_create8_ratio"] = res["fork8_ready_p50_ms"] / res["create8_ready_p50_ms"]
    res["fork8_vs_full_copy8_ratio"] = res["fork8_ready_p50_ms"] / (8 * res["full_copy_ms"])
    await edge.delete(src)


def main(quick: bool = False, json_out: bool = False,
         only: frozenset[str] = frozenset(PHASES)) -> dict[str, Any]:
    res = asyncio.run(run(quick, only))
    if "ports" in only:
        # the port proxy's figures (issue 15 item 6 asks for them in this run's JSON):
        # bench/ports on its own scratch server, after the fork rounds so the two do not share
        # the machine
        ports = load_bench("ports").main(quick=quick, json_out=False)
        res.update({k: v for k, v in ports.items()
                     if k.startswith(("port_", "direct_", "api_"))})
        res["port_proxy_ok"] = ports["ok"]
    res = emit(res, json_out)
    if not json_out:
        for k, v in res.items():
            print(f"{k:34} {v}")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default="", help=f"comma-separated phases: {','.join(PHASES)}")
    a = ap.parse_args()
    main(quick=a.quick, json_out=a.json, only=parse_only(a.only))
