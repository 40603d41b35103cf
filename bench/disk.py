"""The disk tier of the writable layer against the memory tier (tmpfs), measured in one run:
``rollbox bench disk [--quick] [--json]``.

An edge in this process on a scratch node of its own (data and run dir below a temp dir, own
cgroup parent, node id and uid band; the node's images read-only), so each figure can name
the tier's own work:

- **create CPU**: CPU of this process (all threads: the edge's blocking work runs in worker
  threads) and its reaped children (runc) per ``create``, tiers interleaved one by one so load
  from elsewhere falls on both alike; plus the writable-layer step alone in a tight loop
  (subvolume + qgroup limit + verify + bind + teardown + delete vs tmpfs mount + checks +
  unmount). The btrfs transaction commits run later in kernel workers, outside both figures.
- **create p50** (wall, c1) per tier.
- **idle memory**: host memory per idle sandbox over ``n`` idle sandboxes of each tier: kernel
  slab (``Slab`` in /proc/meminfo), the btrfs + shmem slab caches alone (/proc/slabinfo), the
  ``MemTotal - MemAvailable`` delta (moves with the whole machine), and the pool's metadata
  bytes per subvolume (clean, reclaimable cache pages once written).
- **clone**: a disk-tier sandbox writes 500 MB, then ``clone_upper`` (btrfs snapshot): time,
  and pool bytes allocated before/after; the memory tier's peer is a copy of its 500 MB upper
  into a tmpfs (``cp -a``), the only way to clone it.
"""
from __future__ import annotations

import argparse
import asyncio
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

from rollbox.backends.container.rootfs import Rootfs  # noqa: E402
from rollbox.benchkit import emit, meminfo, percentile, process_cpu_s  # noqa: E402
from rollbox.config import Settings  # noqa: E402
from rollbox.isolation import syscalls  # noqa: E402
from rollbox.models import ExecSpec, Resources, SandboxSpec  # noqa: E402

IMAGE = "python:3.11"
TIERS = ("disk", "memory")
MiB = 1 << 20


def cpu_s() -> float:
    """CPU seconds of this process (all threads) and its reaped children."""
    return process_cpu_s(children=True)


def fs_slab_kib() -> float:
    """KiB of the btrfs and shmem (tmpfs) slab caches (active objects x size): the two tiers'
    own kernel objects, apart from the rest of the machine's slab."""
    total = 0
    with open("/proc/slabinfo") as f:
        for line in f:
            name, active, _num, size = line.split()[:4]
            if name.startswith(("btrfs_", "shmem_")):
                total += int(active) * int(size)
    return total / 1024


def bench_settings(root: Path) -> Settings:
    s = Settings.scratch(root)
    tag = secrets.token_hex(3)
    s.cgroup_parent = f"rollbox-bench-disk-{tag}"
    s.node_id = f"bd{tag}"
    # A band above the node's own and the test runs' (tests/conftest.py), below 2^32.
    s.uid_base = s.uid_base + (s.uid_slots + 64 + 1024 * 8) * 65536
    s.uid_slots = 512
    return s


def layer_step(edge: Any, tier: str, n: int) -> float:
    """CPU ms of the writable-layer step alone (make, verify, mount, unmount, remove)."""
    backend = edge.backend
    host_uid = backend.slots.host_uid(0)
    t0 = cpu_s()
    for i in range(n):
        sid = f"{edge.node_id}-step{i}"
        rootfs = Rootfs(backend.sandboxes_dir / sid)
        rootfs.dir.mkdir(parents=True)
        if tier == "disk":
            sub = backend.disk.create(sid, 1024 * MiB)
            rootfs._bind_upper(sub, host_uid)
        else:
            rootfs._mount_upper(host_uid, 1024, 200_000)
        assert rootfs.teardown() == []
        assert backend.disk.remove(sid) == []
    return (cpu_s() - t0) / n * 1000


async def creates(edge: Any, n: int) -> dict[str, dict[str, float]]:
    cpu: dict[str, list[float]] = {t: [] for t in TIERS}
    wall: dict[str, list[float]] = {t: [] for t in TIERS}
    for i in range(2 * n):
        tier = TIERS[i % 2]
        c0, w0 = cpu_s(), time.perf_counter()
        info = await edge.create(SandboxSpec(image=IMAGE, disk_tier=tier, ttl_s=300), "bench")
        wall[tier].append(time.perf_counter() - w0)
        cpu[tier].append(cpu_s() - c0)
        await edge.delete(info.id)
    return {t: {"cpu_ms": statistics.mean(cpu[t]) * 1000,
                "p50_ms": percentile(wall[t], 50) * 1000} for t in TIERS}


async def idle_memory(edge: Any, tier: str, n: int) -> dict[str, float]:
    await asyncio.sleep(1)
    m0, f0 = meminfo(), fs_slab_kib()
    pool0 = edge.backend.disk.used_bytes()
    ids = []
    try:
        for _ in range(n):
            info = await edge.create(SandboxSpec(image=IMAGE, disk_tier=tier, ttl_s=600,
                                                 resources=Resources(memory_mib=256)), "bench")
            ids.append(info.id)
        await asyncio.sleep(2)  # let the creates' transients settle
        edge.backend.disk.sync()  # metadata written: the pool's pages are clean cache now
        m1, f1 = meminfo(), fs_slab_kib()
        pool1 = edge.backend.disk.used_bytes()
    finally:
        await asyncio.gather(*(edge.delete(i) for i in ids), return_exceptions=True)
    # MemAvailable moves with everything else on the machine (tests of other runs): shown,
    # but the slab figures are the ones that can be put on the tier.
    used = (m1["MemTotal"] - m1["MemAvailable"]) - (m0["MemTotal"] - m0["MemAvailable"])
    return {"slab_kib": (m1["Slab"] - m0["Slab"]) / 1024 / n, "fs_slab_kib": (f1 - f0) / n,
            "memavailable_drop_kib": used / 1024 / n,
            "pool_metadata_kib": (pool1 - pool0) / 1024 / n}


async def clone(edge: Any, mb: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for tier in TIERS:
        info = await edge.create(SandboxSpec(image=IMAGE, disk_tier=tier, ttl_s=600,
                                             resources=Resources(disk_mib=2 * mb)), "bench")
        try:
            eid = await edge.exec_start(info.id, ExecSpec(
                cmd=f"head -c {mb * 1000 * 1000} /dev/urandom > /blob && sync", timeout_s=300))
            r = await edge.exec_wait(info.id, eid)
            assert r.exit_code == 0, r
            box = edge.live[info.id].box
            if tier == "disk":
                pool = edge.backend.disk
                used0 = pool.used_bytes()
                t0, c0 = time.perf_counter(), cpu_s()
                copy = await edge.backend.clone_upper(box, f"{info.id}-clone")
                out["clone_ms"] = (time.perf_counter() - t0) * 1000
                out["clone_cpu_ms"] = (cpu_s() - c0) * 1000
                assert (copy / "blob").stat().st_size == mb * 1000 * 1000
                pool.sync()
                out["clone_pool_added_mib"] = (pool.used_bytes() - used0) / MiB
                out["pool_used_before_mib"] = used0 / MiB
                assert pool.remove(f"{info.id}-clone") == []
            else:
                dst = Path(tempfile.mkdtemp(prefix="rollbox-bench-copy-"))
                syscalls.mount("rollbox-bench", dst, "tmpfs", 0, f"size={2 * mb}m")
                try:
                    t0 = time.perf_counter()
                    subprocess.run(["cp", "-a", str(box.rootfs.upper), str(dst / "u")],
                                   check=True)
                    out["copy_ms_memory"] = (time.perf_counter() - t0) * 1000
                finally:
                    syscalls.umount(dst)
                    dst.rmdir()
        finally:
            await edge.delete(info.id)
    out["clone_speedup_vs_copy"] = out["copy_ms_memory"] / out["clone_ms"]
    return out


async def run(quick: bool) -> dict[str, Any]:
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog

    root = Path(tempfile.mkdtemp(prefix="rollbox-bench-disk-"))
    root.chmod(0o711)
    events = EventLog(root / "events.db")
    edge = Edge(bench_settings(root), events)
    await edge.start()
    res: dict[str, Any] = {"image": IMAGE, "quick": quick}
    try:
        t0 = time.perf_counter()
        edge.backend.disk.ensure()
        res["pool_setup_ms"] = (time.perf_counter() - t0) * 1000  # mkfs + loop + mount
        for _ in range(3):  # warm-up: layer mounts, page cache, both tiers
            for tier in TIERS:
                await edge.delete((await edge.create(SandboxSpec(image=IMAGE, disk_tier=tier),
                                                     "bench")).id)
        n_step = 50 if quick else 200
        for tier in TIERS:
            res[f"layer_step_cpu_ms_{tier}"] = layer_step(edge, tier, n_step)
        by_tier = await creates(edge, 20 if quick else 60)
        for tier in TIERS:
            res[f"create_cpu_ms_{tier}"] = by_tier[tier]["cpu_ms"]
            res[f"create_p50_ms_{tier}"] = by_tier[tier]["p50_ms"]
        res["create_cpu_added_ms"] = res["create_cpu_ms_disk"] - res["create_cpu_ms_memory"]
        res["layer_step_cpu_added_ms"] = (res["layer_step_cpu_ms_disk"]
                                          - res["layer_step_cpu_ms_memory"])
        n_idle = 50 if quick else 200
        res["idle_sandboxes"] = n_idle
        for tier in TIERS:
            for k, v in (await idle_memory(edge, tier, n_idle)).items():
                res[f"idle_{k}_{tier}"] = v
        for k in ("slab_kib", "fs_slab_kib", "memavailable_drop_kib"):
            res[f"idle_{k}_added"] = res[f"idle_{k}_disk"] - res[f"idle_{k}_memory"]
        del res["idle_pool_metadata_kib_memory"]
        res["clone_mb"] = 100 if quick else 500
        res.update(await clone(edge, res["clone_mb"]))
    finally:
        await edge.close(destroy=True)
        events.close()
        shutil.rmtree(root, ignore_errors=True)
    return res


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    res = emit(asyncio.run(run(quick)), json_out)
    if not json_out:
        for k, v in res.items():
            print(f"{k:34} {v}")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    main(quick=a.quick, json_out=a.json)
