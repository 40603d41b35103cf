"""``rollbox bench ledger [--quick] [--json]``: the quota ledger's cost per sandbox.

One cycle is what a sandbox costs the ledger over its life through the api: ``reserve`` (the
project chain checked in one transaction), ``commit`` (the edge made it), ``release`` (it was
deleted). Measured on SQLite (the embedded store: one file, one connection) and on a real
PostgreSQL (``rollbox.cluster.postgres.PostgresServer`` in a scratch dir, unix socket), at
concurrency 1 and 32, for a top-level project without limits (no sums: the fast path) and for
a project three levels deep with limits at every level (each reserve sums the subtree of
every ancestor); on PostgreSQL also two replicas (two pools) racing into one project. Also
``reconcile`` of one node with 1,000 live sandboxes. The peer is SQLite in the same run
(``pg_vs_sqlite_c32``). The last line of ``--json`` is one JSON object.
"""
from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import emit, ratio, say
from rollbox.iam import LiveSandbox, Principal, SQLiteIam, SQLiteLedger, Usage
from rollbox.iam.sql import SqlLedger
from rollbox.models import Quota

OPERATOR = Principal("admin", True, "op", "")
NEED = Usage(1, 0.1, 64)
DEEP = "org/team/run"


async def setup(iam: Any) -> None:  # noqa: ANN401 - either store
    await iam.create_project(OPERATOR, "flat")
    for name, n in (("org", 100_000), ("org/team", 50_000), (DEEP, 10_000)):
        await iam.create_project(OPERATOR, name, Quota(sandboxes=n, cpus=n, memory_mib=n * 64))


async def cycles(ledgers: list[SqlLedger], project: str, conc: int, total: int) -> float:
    """reserve + commit + release cycles per second, ``conc`` at a time over ``ledgers``."""
    done = 0
    counter = iter(range(total))

    async def worker(w: int) -> None:
        nonlocal done
        ledger = ledgers[w % len(ledgers)]
        for i in counter:
            r = await ledger.reserve(project, NEED)
            sid = f"n0-{w:04x}{i:08x}"
            await ledger.commit(r, sid, "n0")
            await ledger.release(sid)
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(conc)))
    return done / (time.perf_counter() - t0)


async def reconcile_s(ledger: SqlLedger, n: int) -> float:
    live = [LiveSandbox(f"n9-{i:012x}", "flat", 0.1, 64) for i in range(n)]
    await ledger.reconcile({"n9": live}, ["n9"])  # charges them
    t0 = time.perf_counter()
    await ledger.reconcile({"n9": live}, ["n9"])  # the steady state: nothing to change
    took = time.perf_counter() - t0
    await ledger.reconcile({"n9": []}, [])
    return took


async def measure(ledgers: list[SqlLedger], tag: str, n1: int, n32: int,
                  out: dict[str, Any]) -> None:
    for project, what in (("flat", "flat"), (DEEP, "nested")):
        out[f"{tag}_{what}_c1_per_s"] = await cycles(ledgers[:1], project, 1, n1)
        out[f"{tag}_{what}_c32_per_s"] = await cycles(ledgers[:1], project, 32, n32)
        say(f"{tag} {what}: c1 {out[f'{tag}_{what}_c1_per_s']:.0f}/s, "
            f"c32 {out[f'{tag}_{what}_c32_per_s']:.0f}/s")
    if len(ledgers) > 1:
        out[f"{tag}_2replicas_nested_c32_per_s"] = await cycles(ledgers, DEEP, 32, n32)
        say(f"{tag} two replicas, nested: c32 {out[f'{tag}_2replicas_nested_c32_per_s']:.0f}/s")
    out[f"{tag}_reconcile_1000_ms"] = await reconcile_s(ledgers[0], 1000) * 1000


async def run(root: Path, quick: bool) -> dict[str, Any]:
    from rollbox.cluster.postgres import PostgresServer
    from rollbox.iam.postgres import PostgresIam, PostgresLedger

    n1, n32 = (200, 800) if quick else (1000, 4000)
    out: dict[str, Any] = {}
    iam = SQLiteIam(root / "keys.db")
    try:
        await setup(iam)
        await measure([SQLiteLedger.of(iam)], "sqlite", n1, n32, out)
    finally:
        iam.close()
    srv = PostgresServer(root / "pg", port=None, socket_dir=root / "pg.sock")
    srv.start()
    try:
        pg = await PostgresIam.open(srv.dsn)
        a = await PostgresLedger.open(srv.dsn, max_size=16)
        b = await PostgresLedger.open(srv.dsn, max_size=16)
        try:
            await setup(pg)
            await measure([a, b], "pg", n1, n32, out)
        finally:
            await b.close()
            await a.close()
            await pg.close()
    finally:
        srv.stop()
    out["pg_vs_sqlite_c32"] = ratio(out["pg_nested_c32_per_s"], out["sqlite_nested_c32_per_s"])
    return out


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="rollbox-bench-ledger-"))
    root.chmod(0o755)  # the postgres user walks into it
    try:
        res = asyncio.run(run(root, quick))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return emit(res, json_out, digits=3)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
