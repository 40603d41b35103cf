"""``python bench/microvm_idle.py N T1,T2,... [ROLLBOX_X=V ...]``: host memory of N idle microVMs.

On a scratch ``rollbox serve`` (bench/microvm.py's ``server``, with the extra ``ROLLBOX_*``
variables given), image ``IMAGE`` with ``VM`` resources on the restore path (the template is
built by two warm-up creates, then an exec round trip is timed in one VM): N VMs are created
one after another, and at each T seconds after the last create this prints, per VM: the drop of
MemAvailable since before the creates (the issue's measure; it moves with everything else on
the host), QEMU's PSS and anonymous RSS (``/proc/<pid>/smaps_rollup``), the charge of the VM's
memory cgroup (shared KSM pages are charged once), and ksmd's CPU. At the end every VM must
answer an exec within 5 s (``alive``). One JSON object on the last line.

Used for the memory figures of docs/backends/microvm.md; ``rollbox bench microvm`` is the
benchmark (this file does not change it).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.microvm import (BACKEND, IMAGE, VM, answers, delete_all, exec_rtt,  # noqa: E402
                           first_exec, server)
from rollbox.benchkit import (  # noqa: E402
    MiB, cgroup_memory_bytes, emit, find_pids, mem_available, process_cpu_s, say, smaps_rollup,
)

KSM = Path("/sys/kernel/mm/ksm")


def ksmd_cpu_s() -> float:
    return sum(process_cpu_s(p) for p in find_pids(comm="ksmd"))


async def measure(n: int, samples: list[float], env: dict[str, str]) -> dict[str, Any]:
    from rollbox.sdk import AsyncClient

    out: dict[str, Any] = {"env": env, "n": n, "image": IMAGE, "vm": VM, "samples": []}
    with server(env) as srv:
        async with AsyncClient(base_url=srv.url, api_key=srv.key, timeout=300) as client:
            await first_exec(client, IMAGE, 2)  # builds the template
            rtt = await exec_rtt(client, IMAGE, 30)
            out.update(exec_p50_ms=round(rtt["p50_ms"], 1),
                       guest_fork_exec_ms=round(rtt["guest_fork_exec_ms"], 1))
            await asyncio.sleep(3)
            before = mem_available()
            k0, t0 = ksmd_cpu_s(), time.monotonic()
            boxes: list[Any] = []
            try:
                for _ in range(n):
                    boxes.append(await client.create(IMAGE, backend=BACKEND, **VM, ttl_s=900))
                created = time.monotonic()
                for t in samples:
                    await asyncio.sleep(max(0.0, created + t - time.monotonic()))
                    avail = mem_available()
                    pids = find_pids(comm_prefix="qemu",
                                     cgroup_part=f"/{srv.settings.cgroup_parent}/")
                    sm = [smaps_rollup(p) for p in pids]
                    k = len(pids) or 1
                    out["samples"].append({
                        "idle_s": t, "qemus": len(pids),
                        "memavail_drop_mib": round((before - avail) / n / MiB, 1),
                        "pss_mib": round(sum(s.get("Pss", 0) for s in sm) / k / MiB, 1),
                        "anon_mib": round(sum(s.get("Anonymous", 0) for s in sm) / k / MiB, 1),
                        "cgroup_mib": round(sum(cgroup_memory_bytes(p) for p in pids) / k / MiB,
                                            1),
                        "ksmd_cores": round((ksmd_cpu_s() - k0) / (time.monotonic() - t0), 3)})
                    say(json.dumps(out["samples"][-1]))
                out["alive"] = sum([await answers(sb) for sb in boxes])
            finally:
                await delete_all(boxes)
    if (KSM / "run").is_file():
        out["ksm"] = {k: (KSM / k).read_text().strip() for k in ("run", "pages_to_scan")}
    return out


def main(argv: list[str]) -> None:
    plain = [a for a in argv if "=" not in a]
    env = dict(a.split("=", 1) for a in argv if "=" in a)
    n = int(plain[0]) if plain else 8
    samples = [float(x) for x in plain[1].split(",")] if len(plain) > 1 else [10.0]
    emit(asyncio.run(measure(n, samples, env)), json_out=True, digits=None)


if __name__ == "__main__":
    main(sys.argv[1:])
