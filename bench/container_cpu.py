"""Where a create -> exec ``true`` -> destroy cycle spends CPU: ``python bench/container_cpu.py``.

Against ``rollbox serve`` in its own process (as ``rollbox bench container`` runs it):

- **steps** (concurrency 1): the server's own CPU and its reaped children's CPU for each API
  call. ``runc run -d`` is reaped during create; the agent, which is what ``runc init``
  becomes, is reaped during delete, so delete's children column is ``runc init`` + the agent
  + its commands.
- **cycle** (concurrency ``--concurrency``, default 8): per cycle, the machine's busy CPU
  (``/proc/stat``: everything but idle and iowait), the server's, its children's and the
  client's (this process).

For finding what to optimise; the targets are measured by ``rollbox bench container``.
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
from bench.images import machine_busy_s, proc_cpu_s  # noqa: E402
from rollbox.embedded import server_process  # noqa: E402

IMAGE = "python:3.11"


def process_cpu_s(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of ``pid``."""
    own = proc_cpu_s(pid)
    return own, proc_cpu_s(pid, children=True) - own


def server_pid() -> int:
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "rollbox.cli serve"],
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0])


async def steps(client: Any, pid: int, n: int) -> dict[str, dict[str, float]]:
    tot = {k: [0.0, 0.0] for k in ("create", "exec", "delete")}
    for _ in range(n):
        a = process_cpu_s(pid)
        sb = await client.create(IMAGE, ttl_s=300)
        b = process_cpu_s(pid)
        await sb.exec(["true"])
        c = process_cpu_s(pid)
        await sb.delete()
        await asyncio.sleep(0.005)  # the agent is reaped right after the answer
        d = process_cpu_s(pid)
        for k, (x, y) in (("create", (a, b)), ("exec", (b, c)), ("delete", (c, d))):
            tot[k][0] += y[0] - x[0]
            tot[k][1] += y[1] - x[1]
    return {k: {"server_ms": s / n * 1000, "children_ms": ch / n * 1000}
            for k, (s, ch) in tot.items()}


async def cycle(client: Any, pid: int, n: int, conc: int) -> dict[str, float]:
    s0, m0, t0 = process_cpu_s(pid), machine_busy_s(), os.times()
    r = await cycles(client, IMAGE, n, conc)
    s1, m1, t1 = process_cpu_s(pid), machine_busy_s(), os.times()
    client_s = (t1.user + t1.system) - (t0.user + t0.system)
    return {"per_s": r["per_s"], "machine_ms": (m1 - m0) / n * 1000,
            "server_ms": (s1[0] - s0[0]) / n * 1000, "children_ms": (s1[1] - s0[1]) / n * 1000,
            "client_ms": client_s / n * 1000, "errors": r["errors"]}


async def run(args: argparse.Namespace, url: str, key: str) -> None:
    from rollbox.sdk import AsyncClient

    pid = server_pid()
    async with AsyncClient(base_url=url, api_key=key, timeout=120) as client:
        await cycles(client, IMAGE, 8, 2)  # warm-up: layer mounts, page cache
        for name, st in (await steps(client, pid, args.steps)).items():
            print(f"{name:6s} server {st['server_ms']:5.2f} ms  children {st['children_ms']:5.2f} ms")
        r = await cycle(client, pid, args.cycles, args.concurrency)
        print(f"c{args.concurrency}: {r['per_s']:.1f} cycles/s; per cycle: machine "
              f"{r['machine_ms']:.1f} ms, server {r['server_ms']:.2f}, children "
              f"{r['children_ms']:.2f}, client {r['client_ms']:.2f} ms; errors {r['errors']}")


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
