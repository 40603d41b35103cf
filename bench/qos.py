"""``rollbox bench qos [--quick] [--json]``: what the CPU classes (``SandboxSpec.qos``,
rollbox.isolation.qos) do for a latency-sensitive sandbox on a busy node.

A probe in one latency sandbox does a fixed CPU work unit (a Python loop whose iteration count
is calibrated once, alone, to ~1 ms) ``--units`` times with a 1 ms sleep between units (a
service answering requests), and reports each unit's wall time (``perf_counter_ns`` around the
work). It runs, in one run against one server, these phases interleaved over ``ROUNDS`` rounds
(what else runs on the machine meanwhile falls on every phase alike; samples pooled per phase):

- alone (the baseline);
- with batch sandboxes busy on 50 % and on 100 % of the host's cores: one sandbox per busy
  core (``cpus=1``), each running 4 busy shell loops (4 threads per core, the CFS quota
  holding each sandbox to its core's worth);
- each load twice: with QoS (the load's sandboxes ``qos="batch"``: the idle class) and without
  (the same load as ``qos="latency"``: the normal class, what every sandbox had before).

Inflation = the phase's percentile over the baseline's, minus 1 (0.25: 25 % slower). Reported
per phase: p50/p99 of the unit (ms), inflation, and the load's CPU share (its cgroups' CPU over
the phase's wall time and the load's cores: the idle class still gets what the probe leaves).
The last line of ``--json`` is one JSON object; its ``loadavg_1m_start`` says how busy the
machine was (the probe competes with everything else on it as well).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import cgroup_cpu_s, emit, percentile, record, rounded, say
from rollbox.config import Settings
from rollbox.embedded import server_process

IMAGE = "python:3.11"
THREADS_PER_CORE = 4
GAP_S = 0.001
ROUNDS = 3      # the phases interleaved this many times
UNITS = 3000    # units per phase over all rounds

PROBE = r"""
import json, sys, time
iters, n, gap = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def unit(k):
    x = 0
    for i in range(k):
        x += i * i
    return x
out = []
for _ in range(20):  # warm-up, untimed
    unit(iters)
for _ in range(n):
    t0 = time.perf_counter_ns()
    unit(iters)
    out.append(time.perf_counter_ns() - t0)
    time.sleep(gap)
print(json.dumps(out))
"""

BUSY = "; ".join(["for i in " + " ".join(str(i) for i in range(THREADS_PER_CORE)) +
                  "; do (while :; do :; done) & done", "wait"])


async def run_probe(sb: Any, iters: int, n: int) -> list[float]:
    """Wall times of the probe's units in ms."""
    r = await sb.exec(["python3", "/tmp/probe.py", str(iters), str(n), str(GAP_S)],
                      timeout=600, check=True)
    return [x / 1e6 for x in json.loads(r.stdout.strip().splitlines()[-1])]


async def calibrate(sb: Any) -> int:
    """The iteration count of a ~1 ms unit here (median of a short run, alone)."""
    iters = 20_000
    for _ in range(4):
        p50 = percentile(await run_probe(sb, iters, 200), 50)
        iters = max(1000, int(iters * 1.0 / p50))
    return iters


def cpu_dirs(settings: Settings, sid: str) -> list[Path]:
    root = Path("/sys/fs/cgroup")
    return [d for d in (root / "cpuacct" / settings.cgroup_parent / sid,
                        root / "cpu,cpuacct" / settings.cgroup_parent / sid,
                        root / "unified" / settings.cgroup_parent / sid,
                        root / settings.cgroup_parent / sid) if d.is_dir()][:1]


async def phase(client: Any, probe: Any, iters: int, n: int, busy_cores: int, qos: str | None,
                settings: Settings) -> tuple[list[float], float, float]:
    """The probe's unit times (ms) while ``busy_cores`` load sandboxes of class ``qos`` spin;
    and the load's CPU seconds and the probe's wall seconds meanwhile."""
    load = [await client.create(IMAGE, cpus=1, ttl_s=900, qos=qos)
            for _ in range(busy_cores)] if qos else []
    spins = [asyncio.ensure_future(sb.exec(["sh", "-c", BUSY], timeout=900)) for sb in load]
    try:
        await asyncio.sleep(1.0 if load else 0)  # the loops are all running
        dirs = [d for sb in load for d in cpu_dirs(settings, sb.id)]
        c0, t0 = cgroup_cpu_s(*dirs), time.monotonic()
        units = await run_probe(probe, iters, n)
        wall = time.monotonic() - t0
        used = cgroup_cpu_s(*dirs) - c0
    finally:
        for sb in load:
            await sb.delete()
        for s in spins:
            s.cancel()
        await asyncio.gather(*spins, return_exceptions=True)
    return units, used, wall


async def run(quick: bool, url: str, key: str) -> dict[str, Any]:
    from rollbox.sdk import AsyncClient

    settings = Settings()
    cores = os.cpu_count() or 1
    half = max(1, cores // 2)
    rounds, n = (1, 500) if quick else (ROUNDS, UNITS // ROUNDS)
    res: dict[str, Any] = {"image": IMAGE, "quick": quick, "cores": cores, "rounds": rounds,
                           "units_per_phase": rounds * n, "gap_ms": GAP_S * 1000,
                           "threads_per_core": THREADS_PER_CORE,
                           "loadavg_1m_start": os.getloadavg()[0]}
    phases = [("alone", 0, None), ("qos_50", half, "batch"), ("noqos_50", half, "latency"),
              ("qos_100", cores, "batch"), ("noqos_100", cores, "latency")]
    units: dict[str, list[float]] = {name: [] for name, _, _ in phases}
    load_cpu: dict[str, list[float]] = {name: [0.0, 0.0] for name, _, _ in phases}
    async with AsyncClient(base_url=url, api_key=key, timeout=300) as client:
        async with await client.create(IMAGE, cpus=1, ttl_s=1800, qos="latency") as probe:
            await probe.files.write("/tmp/probe.py", PROBE)
            iters = await calibrate(probe)
            res["unit_iterations"] = iters
            say(f"unit: {iters} iterations")
            # the phases interleaved, round after round: what else runs on the machine
            # meanwhile falls on all of them alike
            for r in range(rounds):
                for name, busy, qos in phases:
                    got, used, wall = await phase(client, probe, iters, n, busy, qos, settings)
                    units[name] += got
                    load_cpu[name][0] += used
                    load_cpu[name][1] += wall * busy
                    say(f"round {r + 1} {name}: p50 {percentile(got, 50):.3f} ms "
                        f"p99 {percentile(got, 99):.3f} ms")
    for name, _, _ in phases:  # the raw unit times, for --save's CDF
        record(f"unit_{name}", [x / 1000 for x in units[name]])
    base = {p: percentile(units["alone"], q) for p, q in (("p50", 50), ("p99", 99))}
    for name, busy, _ in phases:
        res[f"{name}_p50_ms"] = percentile(units[name], 50)
        res[f"{name}_p99_ms"] = percentile(units[name], 99)
        if busy:
            used, avail = load_cpu[name]
            res[f"{name}_load_cpu_share"] = used / avail if avail else None
    for cls in ("qos", "noqos"):
        for at in ("50", "100"):
            for p in ("p50", "p99"):
                res[f"{cls}_inflation_{p}_at_{at}"] = res[f"{cls}_{at}_{p}_ms"] / base[p] - 1
    noqos = res["noqos_inflation_p99_at_100"]
    res["qos_vs_noqos_p99_at_100"] = res["qos_inflation_p99_at_100"] / noqos if noqos > 0 \
        else None
    res["loadavg_1m_end"] = os.getloadavg()[0]
    for name, _, _ in phases:
        say(f"{name}: p50 {res[name + '_p50_ms']:.3f} ms p99 {res[name + '_p99_ms']:.3f} ms "
            f"load cpu share {rounded(res.get(name + '_load_cpu_share'), 2)}")
    say(f"p99 inflation at 100 %: qos {res['qos_inflation_p99_at_100']:.3f}, "
        f"no qos {noqos:.3f}")
    return res


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    with server_process(env={"ROLLBOX_CPU_QOS": "1"}) as (url, key):  # the classes on
        res = asyncio.run(run(quick, url, key))
    return emit(res, json_out)


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
