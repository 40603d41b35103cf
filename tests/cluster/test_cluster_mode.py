"""Cluster mode on this host, the default tier's subset (one cluster per session: conftest):
creates, commands and files through each api replica and the shared port, a sandbox made via one
replica served via the other, ``rollbox cluster status``, edges refusing calls without the
cluster token, a duplicate node id refused, and kill -9 of an edge actor (Ray restarts it; its
sandboxes and their commands are re-adopted)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rollbox import errors
from rollbox.sdk import AsyncClient
from tests.conftest import have_image

pytestmark = [pytest.mark.root, pytest.mark.skipif(not have_image("debian:bookworm"),
                                                   reason="debian:bookworm not built")]
IMAGE = "debian:bookworm"


def admin(state) -> str:  # noqa: ANN001
    return Path(state.admin_key).read_text().strip()


async def test_create_exec_files_through_each_replica_and_the_shared_port(cluster) -> None:  # noqa: ANN001
    state, _ = cluster
    nodes = set()
    for url in [*state.replica_urls, state.api_url]:
        async with AsyncClient(url, admin(state)) as c:
            for _ in range(2):
                sb = await c.create(IMAGE, ttl_s=300)
                try:
                    nodes.add(sb.id.split("-")[0])
                    r = await sb.exec("echo hi from $(hostname)")
                    assert r.exit_code == 0 and r.stdout.strip() == f"hi from {sb.id}"
                    await sb.files.write("/tmp/f", b"x" * 70000)
                    assert await sb.files.read("/tmp/f") == b"x" * 70000
                finally:
                    await sb.delete()
    assert nodes <= {n.node_id for n in state.nodes} and len(nodes) >= 2, nodes


async def test_a_sandbox_made_via_one_replica_is_served_via_the_other(cluster) -> None:  # noqa: ANN001
    state, _ = cluster
    a_url, b_url = state.replica_urls[:2]
    async with AsyncClient(a_url, admin(state)) as a, AsyncClient(b_url, admin(state)) as b:
        made = await a.create(IMAGE, ttl_s=300, labels={"via": "a"})
        try:
            await made.files.write("/work.txt", b"from a")
            sb = await b.get(made.id)
            assert sb.info.node == made.id.split("-")[0]
            assert await sb.files.read("/work.txt") == b"from a"
            r = await sb.exec("cat /work.txt; echo; echo $((6*7))")
            assert r.stdout.split() == ["from", "a", "42"]
            assert made.id in {i.id for i in await b.list(labels={"via": "a"})}
            await sb.delete()
            with pytest.raises((errors.NotFound, errors.SandboxDead)):
                await (await a.get(made.id)).exec("true")
        finally:
            try:
                await made.delete()
            except errors.NotFound:
                pass


def _cli(s, *args: str) -> subprocess.CompletedProcess[str]:  # noqa: ANN001
    env = {**os.environ, "ROLLBOX_CLUSTER_DIR": str(s.cluster_dir),
           "ROLLBOX_CLUSTER_PORT_BASE": str(s.cluster_port_base), "ROLLBOX_NODE": s.node_id}
    return subprocess.run([sys.executable, "-m", "rollbox.cli", "cluster", *args], env=env,
                          capture_output=True, text=True, timeout=120)


async def test_status_shows_the_nodes_and_their_sandboxes(cluster) -> None:  # noqa: ANN001
    state, s = cluster
    async with AsyncClient(state.api_url, admin(state)) as c:
        made = [await c.create(IMAGE, ttl_s=300) for _ in range(3)]
        try:
            deadline = time.monotonic() + 15
            while True:  # the watcher's next probe (every second) counts them
                p = await asyncio.to_thread(_cli, s, "status", "--json")
                assert p.returncode == 0, p.stderr
                st = json.loads(p.stdout)
                if st["sandboxes"] >= 3 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            assert sorted(n["node_id"] for n in st["nodes"]) == sorted(
                n.node_id for n in state.nodes)
            assert all(n["health"] == "alive" for n in st["nodes"]), st["nodes"]
            assert st["sandboxes"] == 3 and st["by_backend"] == {"container": 3}
            per_node: dict[str, int] = {}
            for sb in made:
                per_node[sb.id.split("-")[0]] = per_node.get(sb.id.split("-")[0], 0) + 1
            assert {n["node_id"]: n["sandboxes"] for n in st["nodes"] if n["sandboxes"]} \
                == per_node
            text = await asyncio.to_thread(_cli, s, "status")
            assert text.returncode == 0 and "alive" in text.stdout, text.stderr
        finally:
            for sb in made:
                await sb.delete()


async def test_an_edge_refuses_calls_without_the_cluster_token(cluster) -> None:  # noqa: ANN001
    from rollbox.cluster import local

    state, s = cluster
    token = Path(state.token_file).read_text().strip()
    assert Path(state.token_file).stat().st_mode & 0o777 == 0o600
    # Each edge actor read it from its node's own root-only file (its arguments, which Ray's
    # GCS keeps, are that file's path, not the token).
    for n in state.nodes:
        f = local.node_token_path(s, n.node_id, n.index)
        assert f.stat().st_mode & 0o777 == 0o600 and f.stat().st_uid == 0
        assert f.read_text().strip() == token
    async with httpx.AsyncClient(timeout=10) as h:
        for n in state.nodes:
            url = f"{n.edge_url}/edge/v1/call/capacity"
            for headers in ({}, {"authorization": "Bearer " + "x" * len(token)},
                            {"authorization": f"Bearer {admin(state)}"}):
                r = await h.post(url, json={}, headers=headers)
                assert r.status_code == 401, (n.node_id, headers, r.text)
            # Twin: with the token the same call is answered.
            r = await h.post(url, json={}, headers={"authorization": f"Bearer {token}"})
            assert r.status_code == 200, r.text


def test_a_node_that_joins_with_a_taken_id_is_refused(cluster) -> None:  # noqa: ANN001
    from rollbox.cluster import local, ray_nodes

    state, s = cluster
    before = ray_nodes.local_nodes(state.ports)
    with pytest.raises(errors.BadRequest, match="already in the cluster"):
        local.join(state.gcs, s, node_id=state.nodes[1].node_id, index=len(state.nodes))
    assert ray_nodes.local_nodes(state.ports) == before  # no Ray node started for it


@pytest.fixture
def ray_driver(cluster):  # noqa: ANN001, ANN201
    import ray

    state, _ = cluster
    ray.init(address=state.gcs, namespace="rollbox", log_to_driver=False,
             logging_level="warning")
    try:
        yield ray
    finally:
        ray.shutdown()


COUNT = "for i in $(seq 1 40); do echo line $i; sleep 0.1; done"


async def test_kill_9_of_an_edge_actor_restarts_it_and_readopts_its_sandboxes(
        cluster, ray_driver) -> None:  # noqa: ANN001
    from rollbox.cluster.edge_actor import edge_actor

    state, _ = cluster
    async with AsyncClient(state.replica_urls[0], admin(state)) as c:
        boxes = []
        try:
            boxes.append(await c.create(IMAGE, ttl_s=300))
            node = boxes[0].id.split("-")[0]  # its node's edge is the one killed
            for _ in range(20):  # and another sandbox there, if placement puts one there
                sb = await c.create(IMAGE, ttl_s=300)
                if sb.id.startswith(f"{node}-"):
                    boxes.append(sb)
                    break
                await sb.delete()
            actor = edge_actor(node)
            pid = (await actor.info.remote())["pid"]
            proc = await boxes[0].exec_background(COUNT)
            await asyncio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            deadline = t0 + 60
            while True:
                try:
                    info = await actor.info.remote()
                    if info["pid"] != pid:
                        break
                except Exception:  # noqa: BLE001 - ActorUnavailable while it restarts
                    pass
                assert time.monotonic() < deadline, "Ray did not restart the edge actor"
                await asyncio.sleep(0.2)
            # Re-adopted: the command's whole output, in order, and its exit; files kept.
            result = await proc.wait()
            assert result.exit_code == 0
            assert result.stdout.split("\n")[:40] == [f"line {i}" for i in range(1, 41)]
            for sb in boxes:
                r = await sb.exec("echo still $(hostname)")
                assert r.stdout.strip() == f"still {sb.id}"
        finally:
            for sb in boxes:
                await sb.delete()
