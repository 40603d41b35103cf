"""``rollbox bench files [--quick] [--json]``: server memory while big single files stream.

N concurrent sandboxes each write one file of SIZE through ``sb.files.write`` (an async
iterator of 1 MiB chunks) and read it back through ``sb.files.read_stream``; the server is
``rollbox serve`` in its own process (its own data dir, cgroup parent, node id and uid range
under a scratch dir; the node's images), and its RSS is sampled every 50 ms. Target (issue 11): peak
RSS <= 300 MiB with four concurrent 1 GB transfers. The last line of ``--json`` is one JSON
object.

``--backend microvm``: the same through a microVM's agent (rollbox.agent.files: the guest's
busybox, parsed as hostile; TCG here), with smaller transfers (2 x 128 MiB, --quick 1 x 32 MiB),
plus the p50 of small operations (stat, a 4 KiB read, a 4 KiB write) on both backends.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import MiB, emit, percentile, rss_bytes, say
from rollbox.config import Settings
from rollbox.embedded import ServerProcess

IMAGE = "busybox:test"


async def small_ops(sb: Any, n: int = 20) -> dict[str, float]:
    """p50 in ms of stat, a 4 KiB read and a 4 KiB write (each a new file's atomic replace)."""
    await sb.files.write("/tmp/small", os.urandom(4096))
    out: dict[str, float] = {}
    for name, op in (("stat", lambda i: sb.files.stat("/tmp/small")),
                     ("read_4k", lambda i: sb.files.read("/tmp/small")),
                     ("write_4k", lambda i: sb.files.write(f"/tmp/w{i}", b"x" * 4096))):
        times = []
        for i in range(n):
            t0 = time.monotonic()
            await op(i)
            times.append(time.monotonic() - t0)
        out[f"{name}_p50_ms"] = round(percentile(times, 50) * 1000, 1)
    return out


async def run(url: str, key: str, pid: int, n: int, size: int,
              backend: str = "container") -> dict[str, Any]:
    import rollbox

    async with rollbox.AsyncClient(url, key) as c:
        boxes = await asyncio.gather(*(c.create(IMAGE, disk_mib=(size >> 20) + 64,
                                                memory_mib=512, backend=backend)
                                       for _ in range(n)))
        try:
            base = rss_bytes(pid) / MiB
            peak = base
            done = asyncio.Event()

            async def sample() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, rss_bytes(pid) / MiB)
                    await asyncio.sleep(0.05)

            async def chunks() -> Any:
                block = bytes(1 << 20)
                for _ in range(size >> 20):
                    yield block

            async def roundtrip(sb: Any) -> tuple[float, float]:
                t0 = time.monotonic()
                await sb.files.write("/tmp/big", chunks())
                t1 = time.monotonic()
                got = 0
                async for part in sb.files.read_stream("/tmp/big"):
                    got += len(part)
                if got != size:
                    raise RuntimeError(f"read back {got} of {size} bytes")
                return t1 - t0, time.monotonic() - t1

            small = await small_ops(boxes[0])
            sampler = asyncio.create_task(sample())
            t0 = time.monotonic()
            times = await asyncio.gather(*(roundtrip(sb) for sb in boxes))
            wall = time.monotonic() - t0
            done.set()
            await sampler
        finally:
            await asyncio.gather(*(sb.delete() for sb in boxes), return_exceptions=True)
    total = n * size
    return {"backend": backend, **small, "transfers": n, "file_bytes": size, "server_rss_base_mib": round(base, 1),
            "server_rss_peak_mib": round(peak, 1),
            "server_rss_growth_mib": round(peak - base, 1),
            "write_mib_s": round(total / 2**20 / max(t[0] for t in times), 1),
            "read_mib_s": round(total / 2**20 / max(t[1] for t in times), 1),
            "wall_s": round(wall, 2), "target_peak_mib": 300, "ok": peak <= 300}


def main(quick: bool = False, json_out: bool = False, backend: str = "container"
         ) -> dict[str, Any]:
    if backend == "microvm":
        n, size = (1, 32 << 20) if quick else (2, 128 << 20)
    else:
        n, size = (4, 200 << 20) if quick else (4, 1 << 30)
    root = Path(tempfile.mkdtemp(prefix="rollbox-bench-files-"))
    root.chmod(0o711)  # runc resolves the rootfs as the sandbox's unprivileged host uid
    node = Settings.scratch(root)  # the node's images, used read-only
    # Its own cgroup parent, node id and uid range: a node's own server may run meanwhile.
    node.cgroup_parent, node.node_id = "rollbox-bench-files", f"bf{os.getpid()}"
    node.uid_base += (node.uid_slots + 32) * 65536
    node.uid_slots = 16
    say(f"rollbox serve (scratch {root}); {backend}: {n} x {size >> 20} MiB write + read")
    srv = ServerProcess(node)
    try:
        srv.start()
        assert srv.proc is not None
        res = asyncio.run(run(srv.url, srv.key, srv.proc.pid, n, size, backend))
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)
    say(f"server RSS {res['server_rss_base_mib']} -> peak {res['server_rss_peak_mib']} MiB "
        f"(target <= 300); write {res['write_mib_s']} MiB/s, read {res['read_mib_s']} MiB/s; "
        f"stat {res['stat_p50_ms']} ms, 4 KiB read {res['read_4k_p50_ms']} ms, "
        f"4 KiB write {res['write_4k_p50_ms']} ms (p50)")
    return emit(res, json_out, digits=None)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv,
         backend="microvm" if "microvm" in sys.argv else "container")
