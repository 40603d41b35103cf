"""Cluster fault drills (``-m cluster_slow``), on the session's cluster: a whole node stopped
(its sandboxes reported dead with reason node_lost within 10 s, new creates go elsewhere, the
node joins again and nothing stale comes back), an api replica killed mid-stream (the SDK fails
over to the other and re-attaches: the output whole, in order, once), PostgreSQL restarted
(retryable errors meanwhile, no quota drift afterwards)."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.sdk import AsyncClient
from tests.conftest import have_image

pytestmark = [pytest.mark.root, pytest.mark.cluster_slow,
              pytest.mark.skipif(not have_image("debian:bookworm"),
                                 reason="debian:bookworm not built")]
IMAGE = "debian:bookworm"


def admin(state) -> str:  # noqa: ANN001
    return Path(state.admin_key).read_text().strip()


async def _on(c: AsyncClient, node: str, tries: int = 40):  # noqa: ANN202
    """A sandbox on ``node`` (creates elsewhere are deleted again)."""
    for _ in range(tries):
        sb = await c.create(IMAGE, ttl_s=600)
        if sb.id.startswith(f"{node}-"):
            return sb
        await sb.delete()
    pytest.fail(f"placement never chose {node}")


async def _lost(c: AsyncClient, sid: str) -> bool:
    try:
        sb = await c.get(sid)
    except errors.SandboxDead as exc:
        return exc.details.get("reason") == "node_lost"
    except errors.InfraError:  # EdgeUnreachable: not declared dead yet
        return False
    return sb.info.state == "dead" and sb.info.dead_reason == "node_lost"


async def test_a_stopped_node_s_sandboxes_are_node_lost_within_10_s(cluster) -> None:  # noqa: ANN001
    from rollbox.cluster import local, ray_nodes

    state, s = cluster
    victim = state.nodes[-1]
    async with AsyncClient(state.replica_urls, admin(state)) as c:
        lost = [await _on(c, victim.node_id), await _on(c, victim.node_id)]
        other = await c.create(IMAGE, ttl_s=600)
        while other.id.startswith(f"{victim.node_id}-"):
            await other.delete()
            other = await c.create(IMAGE, ttl_s=600)
        try:
            await asyncio.sleep(1.5)  # the watchers have seen them
            t0 = time.monotonic()
            await asyncio.to_thread(ray_nodes.kill_node, state.ports, victim.node_id)
            while not all([await _lost(c, sb.id) for sb in lost]):
                assert time.monotonic() - t0 < 15, "node loss not reported"
                await asyncio.sleep(0.2)
            detect_s = time.monotonic() - t0
            print(f"node_lost after {detect_s:.2f} s")
            assert detect_s <= 10
            with pytest.raises(errors.SandboxDead) as err:
                await lost[0].exec("true")
            assert err.value.details.get("reason") == "node_lost"
            made = [await c.create(IMAGE, ttl_s=600) for _ in range(4)]
            assert not [sb.id for sb in made if sb.id.startswith(f"{victim.node_id}-")]
            for sb in made:
                await sb.delete()
            assert (await other.exec("echo up")).stdout.strip() == "up"
        finally:
            # The node comes back: it does not resurrect the lost sandboxes.
            await asyncio.to_thread(local.join, state.gcs, s, node_id=victim.node_id)
            deadline = time.monotonic() + 30
            while True:
                st = await asyncio.to_thread(local.status, s)
                health = {n["node_id"]: n["health"] for n in st["nodes"]}
                if health.get(victim.node_id) == "alive" or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            assert health[victim.node_id] == "alive", health
            await asyncio.sleep(2)
            for sb in lost:  # dead or gone, never running again
                assert await _state(c, sb.id) in ("dead", "gone"), sb.id
            await other.delete()


async def _state(c: AsyncClient, sid: str) -> str:
    try:
        return (await c.get(sid)).info.state
    except errors.SandboxDead:
        return "dead"
    except errors.NotFound:
        return "gone"


LINES = 1500
CMD = f"for i in $(seq 1 {LINES}); do echo line $i; sleep 0.002; done"


async def test_an_api_replica_killed_mid_stream_the_sdk_fails_over(cluster) -> None:  # noqa: ANN001
    from rollbox.cluster import local

    state, s = cluster
    async with AsyncClient(state.replica_urls, admin(state)) as c:
        sb = await c.create(IMAGE, ttl_s=600)
        try:
            using = c.base_url
            rec = next(r for r in state.replicas if r.url == using)
            got: list[str] = []
            killed = False

            def out(chunk: str) -> None:
                nonlocal killed
                got.append(chunk)
                if not killed and "line 200\n" in "".join(got):
                    killed = True
                    os.kill(rec.pid, signal.SIGKILL)

            r = await sb.exec(CMD, on_stdout=out)
            assert killed and r.exit_code == 0
            assert "".join(got).split("\n")[:-1] == [f"line {i}" for i in range(1, LINES + 1)]
            assert c.base_url != using
        finally:
            await sb.delete()
            # the replica comes back (its port again)
            i = state.replicas.index(rec)
            state.replicas[i] = local.start_replica(state, s, i)
            state.save(local.state_path(s))
            await asyncio.to_thread(local.wait_replica, state.replicas[i], s)


async def test_postgres_restart_retryable_meanwhile_no_quota_drift_after(cluster) -> None:  # noqa: ANN001
    from rollbox.cluster import local
    from rollbox.cluster.postgres import PostgresServer

    state, s = cluster
    project = f"pg{os.getpid()}"
    async with AsyncClient(state.replica_urls, admin(state)) as op:
        await op.create_project(project)
        await op.set_project_quota(project, sandboxes=2)
        key = (await op.create_key(project)).key
    async with AsyncClient(state.replica_urls, key) as c:
        a = await c.create(IMAGE, ttl_s=600)
        b = await c.create(IMAGE, ttl_s=600)
        with pytest.raises(errors.QuotaExceeded):
            await c.create(IMAGE, ttl_s=600)
        await asyncio.to_thread(local.stop_postgres, Path(state.pg_data))
        try:
            # meanwhile: typed, retryable (the SDK maps 503 to InfraError), never a 500
            with pytest.raises(errors.InfraError):
                await c.create(IMAGE, ttl_s=600)
            # a running sandbox keeps working (the data path needs no database)
            assert (await a.exec("echo alive")).stdout.strip() == "alive"
            await b.delete()  # its release cannot be written now: the reconcile puts it right
        finally:
            await asyncio.to_thread(
                lambda: PostgresServer(Path(state.pg_data), port=state.ports.postgres).start())
        deadline = time.monotonic() + 20
        while True:  # the replicas' pools reconnect; the watchers' reconcile (5 s) releases b
            try:
                c2 = await c.create(IMAGE, ttl_s=600)
                break
            except (errors.InfraError, errors.QuotaExceeded):
                assert time.monotonic() < deadline, "no create after PostgreSQL came back"
                await asyncio.sleep(0.5)
        with pytest.raises(errors.QuotaExceeded):  # exactly 2 again: no drift either way
            await c.create(IMAGE, ttl_s=600)
        await a.delete()
        await c2.delete()
