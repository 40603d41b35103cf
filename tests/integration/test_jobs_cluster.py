"""Job leases cluster-wide: three co-hosted edges (``Settings.for_node``) and two api replicas
share one real PostgreSQL (``rollbox.jobs.postgres`` for the leases, ``rollbox.iam.postgres``
for keys and the quota ledger). A job's sandboxes on all three edges live while heartbeats
come through either replica, the project's sandbox limit counts them on every edge, and when
the heartbeats stop each edge's reaper ends the job's sandbox on its own node: the job reads
expired through either replica and nothing is left on any edge."""
from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer, create_app
from rollbox.edge.edge import Edge
from rollbox.events.store import EventLog
from rollbox.iam.postgres import PostgresIam, PostgresLedger
from rollbox.jobs.postgres import PostgresLeaseStore
from rollbox.watcher import placement_over
from tests.integration.test_cohosted_edges import start_nodes

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]
BB = "busybox:test"
HEARTBEAT_S = 0.5  # the lease expires 1.5 s after the last heartbeat


async def test_a_jobs_lease_and_limits_hold_across_three_edges(tmp_node_dir: Path,
                                                               pg_dsn: str) -> None:
    async with contextlib.AsyncExitStack() as stack:
        events = EventLog(tmp_node_dir / "events.db")
        stack.callback(events.close)
        edge_leases = []
        for _ in range(3):  # each node its own pool, as on its own machine
            store = await PostgresLeaseStore.connect(pg_dsn)
            stack.push_async_callback(store.close)
            edge_leases.append(store)
        edges = await start_nodes(tmp_node_dir, events, 3, lambda k: {"leases": edge_leases[k]})
        for e in edges:  # room for one sandbox each: the job's three land on the three edges
            e.limits.max_sandboxes = 1
        made: list[tuple[Any, Edge]] = []  # (sandbox, its edge)

        async def close_edges() -> None:
            for e in edges:
                await e.close(destroy=True)
            leaks = {sb.id: e.leftovers(sb.id) for sb, e in made}
            assert not {k: v for k, v in leaks.items() if v}, f"leaked: {leaks}"

        stack.push_async_callback(close_edges)
        urls = []
        for _ in range(2):  # two api replicas over the three edges
            iam = await PostgresIam.open(pg_dsn)
            stack.push_async_callback(iam.close)
            ledger = await PostgresLedger.open(pg_dsn)
            stack.push_async_callback(ledger.close)
            leases = await PostgresLeaseStore.connect(pg_dsn)
            stack.push_async_callback(leases.close)
            srv = BackgroundServer(create_app(placement_over(edges), iam, ledger=ledger,
                                              leases=leases))
            await srv.start()
            stack.push_async_callback(srv.stop)
            urls.append(srv.url)
        async with rollbox.AsyncClient(urls[0], await iam.create_operator_key()) as op:
            await op.create_project("team", sandboxes=3, cpus=3, memory_mib=3 * 128)
            team_key = (await op.create_key("team")).key
        t0 = await stack.enter_async_context(rollbox.AsyncClient(urls[0], team_key))
        t1 = await stack.enter_async_context(rollbox.AsyncClient(urls[1], team_key))

        opened = (await t0._t.request("POST", "/v1/jobs", json={
            "name": "run-1", "heartbeat_s": HEARTBEAT_S})).json()
        assert opened["state"] == "live"
        beats: list[float] = [opened["heartbeat_at"]]

        async def heartbeats() -> None:  # the trainer's, alternating between the replicas
            for k in range(10_000):
                await asyncio.sleep(HEARTBEAT_S)
                beat = (await (t0, t1)[k % 2]._t.request("POST",
                                                         "/v1/jobs/run-1/heartbeat")).json()
                assert beat["state"] == "live" and beat["heartbeat_at"] > beats[-1]
                beats.append(beat["heartbeat_at"])

        trainer = asyncio.create_task(heartbeats())
        try:
            for client in (t0, t1, t0):  # the job is the same job through either replica
                sb = await client.create(BB, job="run-1", cpus=0.1, memory_mib=64)
                made.append((sb, next(e for e in edges if sb.id in e.live)))
            homes = {e.settings.node_id for _, e in made}
            assert len(homes) == 3, f"the job's 3 sandboxes landed on {homes}, not on 3 edges"
            # The project's limit (3 sandboxes) counts the three edges together (one each: no
            # edge alone is at it); the quota refuses before any edge is asked.
            with pytest.raises(errors.QuotaExceeded):
                await t1.create(BB, job="run-1", cpus=0.1, memory_mib=64)
            listed = (await t1._t.request("GET", "/v1/jobs/run-1/sandboxes")).json()
            assert sorted(i["id"] for i in listed) == sorted(sb.id for sb, _ in made)
            # Heartbeats for 2 more lease intervals (and through both replicas): nothing ends.
            await asyncio.sleep(2 * 3 * HEARTBEAT_S)
            if trainer.done():
                trainer.result()  # its failed heartbeat's error
            assert not trainer.done() and len(beats) >= 5
            assert all(sb.id in e.live for sb, e in made)
        finally:
            trainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await trainer

        # No more heartbeats: each edge's reaper ends the job's sandbox on its node.
        for sb, e in made:
            await e.wait_deleted(sb.id, 10)
            info = await e.get(sb.id)
            assert info.state == "deleted" and "heartbeats missed" in (info.dead_reason or "")
            assert e.leftovers(sb.id) == []
        for client in (t0, t1):
            job = (await client._t.request("GET", "/v1/jobs/run-1")).json()
            assert job["state"] == "expired" and "heartbeats missed" in job["reason"]
            with pytest.raises(errors.NotFound):
                await client._t.request("POST", "/v1/jobs/run-1/heartbeat")
            with pytest.raises(errors.NotFound):
                await client.create(BB, job="run-1")
        assert not any(i.info.owner == "team" for e in edges for i in e.live.values())
