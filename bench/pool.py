"""``rollbox bench pool [--quick] [--json]``: warm pools (rollbox.edge.pool, issue 17 item 5).

Two servers of this node, one after the other, each in its own process as deployed, the same
image and the same bursty arrival: bursts of ``POOL`` creates at once (the pool's size), a gap,
again, ``BURSTS`` times (>= 10x the pool's size in all); each arrival creates a sandbox, runs
``true`` in it (its first exec) and deletes it. The first server has ``ROLLBOX_POOL`` on (pool
size ``POOL`` per key and in all, the default demand window) and its refill runs in the
background all along: nothing is pre-made, the first burst finds the pool empty, and the CPU
of the server's process tree and of the sandboxes' cgroups (where a refill spends) over the
whole run is divided by the creates. The peer is the same arrival against a server with pools
off (every create cold). Keys: ``pool_create_p50_ms`` / ``_p99_ms`` (the create call through
the HTTP API) and ``pool_create_to_first_exec_p50_ms`` of the bursts, the hit ratio (from the
server's ``/metrics``), ``pool_cpu_ms_per_create`` against the cold run's; then arrivals one at
a time, ``SERIAL_GAP_S`` apart: ``pool_serial_create_to_first_exec_p50_ms`` is the warm pool's
create -> first exec through the API; the cold run's figures as ``cold_*``. Last, the same one
at a time against an edge in this process (no API), pool on and refilling, then off:
``pool_edge_create_to_first_exec_p50_ms`` (issue 17's target <= 3 ms) and ``cold_edge_*``. The last line of ``--json`` is one JSON object.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from rollbox.benchkit import (
    CpuMeter, cgroup_cpu_s, emit, percentile, ratio, record, rounded, say, tree_cpu_s,
)
from rollbox.config import Settings
from rollbox.embedded import server_process

IMAGE = "python:3.11"
POOL = 8  # the pool's size (per key and in all) and a burst's
BURSTS = (10, 12)  # bursts (quick, full): 80 / 96 creates, >= 10x the pool
GAP_S = 1.0  # between bursts: time for the refill
SERIAL = (16, 30)  # arrivals one at a time after the bursts (quick, full)
SERIAL_GAP_S = 0.5  # > the pool.POOL_QUIET_S the refill waits for


def pool_env() -> dict[str, str]:
    return {"ROLLBOX_POOL": "on", "ROLLBOX_POOL_MAX_PER_KEY": str(POOL),
            "ROLLBOX_POOL_MAX_TOTAL": str(POOL), "ROLLBOX_POOL_MIN_PER_KEY": "1"}


def serve_pid() -> int:
    """The pid of the ``rollbox serve`` this process started (server_process's child)."""
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "rollbox.cli serve"],
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0])


def pool_counts(url: str, key: str) -> dict[str, float]:
    """hit / miss creates of the server's warm pool, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(f"{url}/metrics", headers={"authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - our own loopback server
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "rollbox_pool_creates":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["result"]] = out.get(s.labels["result"], 0.0) + s.value
    return out


async def bursty(url: str, key: str, bursts: int, serial: int, prefix: str,
                 res: dict[str, Any]) -> None:
    """The arrival: ``bursts`` x ``POOL`` creates at once, GAP_S apart; create latency and
    create -> first exec of each, CPU per create over the whole of it; then ``serial``
    arrivals one at a time."""
    from rollbox.isolation import cgroups
    from rollbox.sdk import AsyncClient

    create: list[float] = []
    first: list[float] = []
    errors = 0
    deletes: set[asyncio.Task] = set()
    boxes = cgroups.v2_root() / Settings().cgroup_parent
    pid = serve_pid()
    async with AsyncClient(base_url=url, api_key=key, timeout=120) as client:
        async def arrival() -> None:
            nonlocal errors
            t0 = time.monotonic()
            try:
                sb = await client.create(IMAGE, ttl_s=300)
                t1 = time.monotonic()
                r = await sb.exec(["true"])
                t2 = time.monotonic()
            except Exception:  # noqa: BLE001 - counted, the run goes on
                errors += 1
                return
            if r.exit_code != 0:
                errors += 1
            create.append(t1 - t0)
            first.append(t2 - t0)
            task = asyncio.create_task(sb.delete())
            deletes.add(task)
            task.add_done_callback(deletes.discard)

        await arrival()  # warm-up: layer mounts, page cache (not counted below)
        create.clear()
        first.clear()
        meter = CpuMeter({"server": lambda: tree_cpu_s(pid),
                          "sandboxes": lambda: cgroup_cpu_s(boxes)}).start()
        for _ in range(bursts):
            await asyncio.gather(*(arrival() for _ in range(POOL)))
            await asyncio.sleep(GAP_S)
        if deletes:
            await asyncio.gather(*deletes, return_exceptions=True)
        spent = meter.stop()
        n_burst = len(create)
        # One at a time, the refill given SERIAL_GAP_S between them: a warm pool's create ->
        # first exec (the cold server's: a cold one's).
        for _ in range(serial):
            await arrival()
            if deletes:
                await asyncio.gather(*deletes, return_exceptions=True)
            await asyncio.sleep(SERIAL_GAP_S)
    serial_create, serial_first = create[n_burst:], first[n_burst:]
    del create[n_burst:], first[n_burst:]
    record(f"{prefix}serial_create_to_first_exec", serial_first)
    res[f"{prefix}serial_create_p50_ms"] = percentile(serial_create, 50) * 1000
    res[f"{prefix}serial_create_to_first_exec_p50_ms"] = percentile(serial_first, 50) * 1000
    res[f"{prefix}serial_create_to_first_exec_p99_ms"] = percentile(serial_first, 99) * 1000
    n = max(1, len(create))
    record(f"{prefix}create", create)
    record(f"{prefix}create_to_first_exec", first)
    res[f"{prefix}creates"] = len(create)
    res[f"{prefix}errors"] = errors
    res[f"{prefix}create_p50_ms"] = percentile(create, 50) * 1000
    res[f"{prefix}create_p99_ms"] = percentile(create, 99) * 1000
    res[f"{prefix}create_to_first_exec_p50_ms"] = percentile(first, 50) * 1000
    res[f"{prefix}create_to_first_exec_p99_ms"] = percentile(first, 99) * 1000
    res[f"{prefix}cpu_ms_per_create"] = (spent["server"] + spent["sandboxes"]) * 1000 / n


async def edge_serial(n: int, res: dict[str, Any]) -> None:
    """The API's share left out: an edge in this process (a scratch node of its own, this
    node's images), arrivals one at a time SERIAL_GAP_S apart (create -> exec ``true`` ->
    delete) with its pool on and refilling, then the same with the pool off (cold)."""
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog
    from rollbox.models import ExecSpec, SandboxSpec

    with tempfile.TemporaryDirectory(prefix="rollbox-bench-pool-") as tmp:
        root = Path(tmp)
        root.chmod(0o711)
        s = Settings.scratch(root)
        s.node_id = f"bp{secrets.token_hex(3)}"
        s.uid_slots = 256  # a band of its own beside the node's and other scratch nodes'
        s.pool = True
        for k, v in pool_env().items():
            if k != "ROLLBOX_POOL":
                setattr(s, k.removeprefix("ROLLBOX_").lower(), int(v))
        events = EventLog(root / "events.db")
        edge = Edge(s, events)
        await edge.start()
        try:
            for prefix in ("pool_edge_", "cold_edge_"):
                lat: list[float] = []
                for i in range(n + 1):
                    t0 = time.perf_counter()
                    info = await edge.create(SandboxSpec(image=IMAGE, ttl_s=300), "bench")
                    r = await edge.exec_run(info.id, ExecSpec(cmd="true", timeout_s=60))
                    if i:  # the first: warm-up (and the pool's first miss)
                        lat.append(time.perf_counter() - t0)
                    assert r.exit_code == 0, r
                    await edge.delete(info.id)
                    await asyncio.sleep(SERIAL_GAP_S)
                record(f"{prefix}create_to_first_exec", lat)
                res[f"{prefix}create_to_first_exec_p50_ms"] = percentile(lat, 50) * 1000
                res[f"{prefix}create_to_first_exec_p99_ms"] = percentile(lat, 99) * 1000
                if prefix == "pool_edge_":
                    res["pool_edge_hits"] = edge.pool.hits
                    await edge.pool.close()  # the cold run: every create cold
                    s.pool = False
        finally:
            await edge.close(destroy=True)
            events.close()


def run(quick: bool) -> dict[str, Any]:
    bursts = BURSTS[0] if quick else BURSTS[1]
    serial = SERIAL[0] if quick else SERIAL[1]
    res: dict[str, Any] = {"image": IMAGE, "quick": quick, "pool_size": POOL,
                           "bursts": bursts, "burst_gap_s": GAP_S}
    with server_process(env=pool_env()) as (url, key):
        asyncio.run(bursty(url, key, bursts, serial, "pool_", res))
        counts = pool_counts(url, key)
    res["pool_hits"] = counts.get("hit", 0.0)
    res["pool_misses"] = counts.get("miss", 0.0)
    res["pool_hit_ratio"] = ratio(res["pool_hits"], res["pool_hits"] + res["pool_misses"])
    say(f"pool: create p50 {res['pool_create_p50_ms']:.1f} ms p99 "
        f"{res['pool_create_p99_ms']:.1f} ms, first exec p50 "
        f"{res['pool_create_to_first_exec_p50_ms']:.1f} ms, hits {res['pool_hits']:g} / "
        f"misses {res['pool_misses']:g}, {res['pool_cpu_ms_per_create']:.1f} ms CPU a create; "
        f"one at a time: first exec p50 {res['pool_serial_create_to_first_exec_p50_ms']:.2f} ms")
    with server_process(env={"ROLLBOX_POOL": "off"}) as (url, key):
        asyncio.run(bursty(url, key, bursts, serial, "cold_", res))
    say(f"cold: create p50 {res['cold_create_p50_ms']:.1f} ms, first exec p50 "
        f"{res['cold_create_to_first_exec_p50_ms']:.1f} ms, "
        f"{res['cold_cpu_ms_per_create']:.1f} ms CPU a create; one at a time: first exec p50 "
        f"{res['cold_serial_create_to_first_exec_p50_ms']:.2f} ms")
    res["pool_vs_cold_first_exec_p50"] = ratio(res["cold_create_to_first_exec_p50_ms"],
                                               res["pool_create_to_first_exec_p50_ms"])
    res["pool_vs_cold_serial_first_exec_p50"] = ratio(
        res["cold_serial_create_to_first_exec_p50_ms"],
        res["pool_serial_create_to_first_exec_p50_ms"])
    say(f"first exec p50: cold / pool {rounded(res['pool_vs_cold_first_exec_p50'], 2)}x "
        f"(bursts), {rounded(res['pool_vs_cold_serial_first_exec_p50'], 2)}x (one at a time)")
    asyncio.run(edge_serial(serial, res))
    say(f"in-process edge, one at a time: create -> first exec p50 "
        f"{res['pool_edge_create_to_first_exec_p50_ms']:.2f} ms from the pool "
        f"({res['pool_edge_hits']} hits), {res['cold_edge_create_to_first_exec_p50_ms']:.2f} "
        "ms cold")
    return res


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    return emit(run(quick), json_out)
