"""Where a create -> exec ``true`` -> destroy cycle spends CPU: ``python bench/container_cpu.py``.

Against ``rollbox serve`` in its own process (as ``rollbox bench container`` runs it):

- **steps** (concurrency 1): the server's own CPU and its reaped children's CPU for each API
  call. ``runc run -d`` is reaped during create; the agent, which is what ``runc init``
  becomes, is reaped during delete, so delete's children column is ``runc init`` + the agent
  + its commands.
- **cycle** (concurrency ``--concurrency``, default 8): per cycle, the machine's busy CPU
  (``/proc/stat``: everything but idle, iowait and steal), the server's, its children's and the
  client's (this process); the server's split into its event loop's thread (user / system)
  and its other threads (the prepare and teardown workers, the netns threads: user / system),
  and the kernel's threads (kworkers, ksoftirqd, rcu: every process of kthreadd, other work of
  the host's included, as the machine figure).

For finding what to optimise; the targets are measured by ``rollbox bench container``. The
last line is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.container import cycles  # noqa: E402
from rollbox.benchkit import (  # noqa: E402
    CpuMeter, clock_ticks, emit, machine_busy_s, process_cpu_s, read_proc_cpu,
)
from rollbox.embedded import server_process  # noqa: E402

IMAGE = "python:3.11"


def own_and_children_s(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of ``pid``."""
    own = process_cpu_s(pid)
    return own, process_cpu_s(pid, children=True) - own


def server_pid() -> int:
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "rollbox.cli serve"],
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0])


async def steps(client: Any, pid: int, n: int) -> dict[str, dict[str, float]]:
    tot = {k: [0.0, 0.0] for k in ("create", "exec", "delete")}
    for _ in range(n):
        a = own_and_children_s(pid)
        sb = await client.create(IMAGE, ttl_s=300)
        b = own_and_children_s(pid)
        await sb.exec(["true"])
        c = own_and_children_s(pid)
        await sb.delete()
        await asyncio.sleep(0.005)  # the agent is reaped right after the answer
        d = own_and_children_s(pid)
        for k, (x, y) in (("create", (a, b)), ("exec", (b, c)), ("delete", (c, d))):
            tot[k][0] += y[0] - x[0]
            tot[k][1] += y[1] - x[1]
    return {k: {"server_ms": s / n * 1000, "children_ms": ch / n * 1000}
            for k, (s, ch) in tot.items()}


def thread_ticks(pid: int) -> dict[str, tuple[int, int]]:
    """(utime, stime) in clock ticks of each live thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        st = read_proc_cpu(f"{pid}/task/{tid}")
        if st is not None:
            out[tid] = (st.utime, st.stime)
    return out


def kernel_threads_s() -> float:
    """CPU seconds of every live kernel thread (kthreadd and its children)."""
    ticks = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if d == "2" or fields[1] == "2":
            ticks += int(fields[11]) + int(fields[12])
    return ticks / clock_ticks()


async def cycle(client: Any, pid: int, n: int, conc: int) -> dict[str, float]:
    before = thread_ticks(pid)
    with CpuMeter({"machine": machine_busy_s, "server": lambda: process_cpu_s(pid),
                   "server_and_children": lambda: process_cpu_s(pid, children=True),
                   "client": process_cpu_s, "kernel_threads": kernel_threads_s}) as m:
        r = await cycles(client, IMAGE, n, conc)
    after = thread_ticks(pid)
    cpu = m.spent
    loop = str(pid)  # the main thread runs the event loop
    ms = 1000 / clock_ticks() / n

    def spent(which: int, mine: bool) -> float:
        return ms * sum(v[which] - before.get(t, (0, 0))[which] for t, v in after.items()
                        if (t == loop) == mine)

    return {"per_s": r["per_s"], "machine_ms": cpu["machine"] / n * 1000,
            "server_ms": cpu["server"] / n * 1000,
            "server_loop_user_ms": spent(0, True), "server_loop_sys_ms": spent(1, True),
            "server_threads_user_ms": spent(0, False), "server_threads_sys_ms": spent(1, False),
            "children_ms": (cpu["server_and_children"] - cpu["server"]) / n * 1000,
            "client_ms": cpu["client"] / n * 1000,
            "kernel_threads_ms": cpu["kernel_threads"] / n * 1000, "errors": r["errors"]}


async def run(args: argparse.Namespace, url: str, key: str) -> None:
    from rollbox.sdk import AsyncClient

    pid = server_pid()
    async with AsyncClient(base_url=url, api_key=key, timeout=120) as client:
        await cycles(client, IMAGE, 8, 2)  # warm-up: layer mounts, page cache
        split = await steps(client, pid, args.steps)
        for name, st in split.items():
            print(f"{name:6s} server {st['server_ms']:5.2f} ms  children {st['children_ms']:5.2f} ms")
        r = await cycle(client, pid, args.cycles, args.concurrency)
        print(f"c{args.concurrency}: {r['per_s']:.1f} cycles/s; per cycle: machine "
              f"{r['machine_ms']:.1f} ms, server {r['server_ms']:.2f}, children "
              f"{r['children_ms']:.2f}, client {r['client_ms']:.2f} ms; errors {r['errors']}")
        print(f"    server's loop thread user {r['server_loop_user_ms']:.2f} sys "
              f"{r['server_loop_sys_ms']:.2f} ms, its other threads user "
              f"{r['server_threads_user_ms']:.2f} sys {r['server_threads_sys_ms']:.2f} ms; "
              f"kernel threads {r['kernel_threads_ms']:.2f} ms")
    emit({"steps": split, f"c{args.concurrency}": r}, json_out=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=100, help="sequential cycles for the split")
    ap.add_argument("--cycles", type=int, default=240)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    with server_process() as (url, key):
        asyncio.run(run(args, url, key))


if __name__ == "__main__":
    main()
