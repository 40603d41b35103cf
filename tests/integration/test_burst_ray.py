"""Cloud bursting end to end on this host (issue 14 item 8): ``cluster.local.up(burst_nodes=1)``
-- a Ray head whose autoscaler runs this host's provider (``cluster.burst_provider``: Ray's fake
multi-node provider, nodes started as every rollbox node here), PostgreSQL, the cluster's own
node (its edge actor, full at 2 sandboxes), an api replica, and the cluster's burst scaler (the
detached actor of ``cluster.burst_actor``); a shared posix:// chunk store holding busybox:test.

Through the replica's api: 2 latency sandboxes fill the own node (use 1.0 >= 0.8) -> the
scaler asks the autoscaler, the burst node's Ray node comes up with its fixed ports and cgroup,
its edge -- the real edge actor, ``ROLLBOX_NODE_BURST=1`` -- starts and registers; a batch
container sandbox lands there and runs a command over the data path; a latency one and one of an
image not in the shared store never do. All deleted -> drained, the edge stopped (teardown
verified on the node), the autoscaler ends the Ray node: nothing of it left. ``down`` then
leaves nothing of the cluster."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollbox import errors
from rollbox.cluster import local, ray_nodes
from rollbox.cluster.burst import BURST_RESOURCE, NODE_RESOURCE, burst_node_id
from rollbox.cluster.burst_actor import scaler_state, start_scaler
from rollbox.cluster.edge_actor import ray_node_of
from rollbox.cluster.ray_nodes import ClusterPorts
from rollbox.config import VARS, Settings
from rollbox.images import chunks
from rollbox.images.store import ImageStore
from rollbox.images.stores import open_store
from rollbox.isolation import cgroups, netns
from rollbox.models import SandboxInfo
from rollbox.sdk import AsyncClient
from rollbox.sdk._async import AsyncSandbox
from tests.conftest import (
    TEST_NODE,
    TEST_RUN,
    forget_run_cluster,
    have_image,
    register_run_cluster,
    register_run_owner,
)

pytestmark = [pytest.mark.cluster_slow, pytest.mark.root]

IMAGE = "busybox:test"
LOCAL_ONLY = "debian:bookworm"  # built on this host, never pushed to the shared store
PREFIX = f"{TEST_NODE}x"  # node ids t<run>xc0, t<run>xb0: apart from tests/cluster's t<run>c<i>
OWN_ID = f"{PREFIX}c0"
BURST_ID = burst_node_id(PREFIX, 0)


def free_port_base() -> int:
    """A cluster port range no other cluster on this host uses (one of 8 from 24000, this
    run's first): no Ray cgroup or temp dir of it, its GCS and api ports free."""
    for k in range(8):
        base = 24000 + 400 * ((int(TEST_RUN, 16) + k) % 8)
        ports = ClusterPorts(base)
        if ray_nodes.local_nodes(ports) or ray_nodes.temp_dir(ports).exists():
            continue
        try:
            for port in (ports.gcs, ports.api, ports.postgres):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    pytest.skip("no free cluster port range from 24000")


def burst_ray_nodes() -> list[dict[str, Any]]:
    """The cluster's alive Ray nodes of burst slots (this process is a driver of it)."""
    import ray

    return [n for n in ray.nodes() if n["Alive"] and BURST_RESOURCE in n["Resources"]]


def leftovers(s: Settings, node_id: str, ports: ClusterPorts) -> dict[str, Any]:
    """What node ``node_id`` left on the host: mounts below its data or run dir, network
    namespaces named for it, its sandbox cgroups and cgroup parents, its Ray node's cgroup."""
    n = local.node_settings(s, node_id, 0)
    dirs = (str(n.data_dir) + "/", str(n.run_dir) + "/")
    mounts = [mp for ln in Path("/proc/self/mountinfo").read_text().splitlines()
              if (mp := ln.split()[4] + "/").startswith(dirs)]
    return {"mounts": mounts,
            "netns": [x for x in netns.list_rollbox() if x.startswith(f"rollbox-{node_id}-")],
            "cgroups": [str(p) for p in cgroups.leftover(n.cgroup_parent)],
            "cgroup parents": [str(h / n.cgroup_parent) for h in cgroups.hierarchies()
                               if (h / n.cgroup_parent).exists()],
            "ray node": [x for x in ray_nodes.local_nodes(ports) if x == node_id]}


@pytest.fixture(scope="module")
def burst_cluster() -> Iterator[tuple[local.ClusterState, Settings]]:
    """The cluster of the module docstring; ``down`` at the end, with a check that nothing of
    it (own node, burst node, Ray, PostgreSQL) is left."""
    if os.geteuid() != 0:
        pytest.skip("edges need root")
    if not have_image(IMAGE):
        pytest.skip(f"{IMAGE} not built (make images)")
    register_run_owner()
    root = Path(tempfile.mkdtemp(prefix=f"rollbox-test-{TEST_RUN}-burst-"))
    root.chmod(0o711)  # runc resolves rootfs paths as the sandbox's unprivileged host uid
    s = Settings()
    s.cluster_dir = root / "cluster"
    s.cluster_port_base = free_port_base()
    s.node_id = PREFIX
    s.burst_idle_s = 2.0
    ports = ClusterPorts(s.cluster_port_base)
    shared = f"posix://{root / 'shared'}"

    async def push() -> None:
        store = open_store(shared)
        try:
            await chunks.push_image(ImageStore(Settings().images_dir), IMAGE, store)
        finally:
            await store.close()

    asyncio.run(push())
    # Read by the processes `up` starts (they inherit this environment): the replicas' burst
    # policy takes the shared store; every edge holds 2 sandboxes at most.
    env = {VARS["chunk_store"].env: shared, VARS["max_sandboxes"].env: "2"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    register_run_cluster(s)  # a killed run's cluster is taken down by the next run's sweep
    try:
        state = local.up(s, replicas=1, nodes=1, burst_nodes=1)
        import ray

        ray.init(address=state.gcs, namespace=ray_nodes.RAY_NAMESPACE, log_to_driver=False,
                 logging_level="warning")
        yield state, s
    finally:
        import ray

        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        local.down(s)
        left = {nid: {k: v for k, v in leftovers(s, nid, ports).items() if v}
                for nid in (OWN_ID, BURST_ID)}
        left = {k: v for k, v in left.items() if v}
        cluster = {"ray cgroups": ray_nodes.local_nodes(ports),
                   "ray temp dir": ray_nodes.temp_dir(ports).exists(),
                   "postgres": (s.cluster_dir / "pg" / "postmaster.pid").exists()}
        for nid in (OWN_ID, BURST_ID):
            shutil.rmtree(local.node_settings(s, nid, 0).run_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path(f"/run/rollbox-cluster-{ports.base}").rmdir()
        shutil.rmtree(root, ignore_errors=True)
        forget_run_cluster(s)
        assert not left and not any(cluster.values()), f"the cluster left: {left} {cluster}"


async def wait_for(what: str, cond: Any, timeout: float, every: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await cond()
        if got:
            return got
        await asyncio.sleep(every)
    raise AssertionError(f"not within {timeout}s: {what}")


async def test_burst_up_place_and_release(burst_cluster) -> None:  # noqa: ANN001
    state, s = burst_cluster
    ports = state.ports
    key = Path(state.admin_key).read_text().strip()
    made: list[str] = []
    async with AsyncClient(state.replica_urls[0], key) as client:

        async def node(nid: str) -> dict[str, Any] | None:
            st = (await client._t.request("GET", "/v1/cluster/status")).json()
            return next((n for n in st["nodes"] if n["node_id"] == nid), None)

        async def create(**kw: Any) -> SandboxInfo:
            r = await client._t.request("POST", "/v1/sandboxes", long=True,
                                        json={"image": IMAGE, "ttl_s": 600, **kw})
            info = SandboxInfo.model_validate(r.json())
            made.append(info.id)
            return info

        try:
            async def own_free(n: int) -> bool:
                got = await _alive(node(OWN_ID))
                return got is not None and got["starting"] == 0 and \
                    got["free"].get("sandboxes") == n and got["free"].get("cpus", 0) >= 1 \
                    and got["free"].get("memory_mib", 0) >= 1024

            await wait_for("the own node alive with room for 2", lambda: own_free(2), timeout=60)
            assert not burst_ray_nodes()
            # exactly one scaler per cluster: a second one is refused by its name
            with pytest.raises(errors.BadRequest):
                start_scaler(state.gcs, state.token_file, {}, {"threshold": 0.8},
                             s.cluster_address, ray_node_of(OWN_ID))
            assert (await asyncio.to_thread(scaler_state))["target"] == 0
            # fill the own node with latency sandboxes: use 1.0 >= 0.8 (each create waits
            # for a probe that shows the one before)
            for i in range(2):
                assert (await create(qos="latency")).node == OWN_ID
                await wait_for("the view shows the create", lambda: own_free(1 - i), timeout=30)
            t0 = time.monotonic()
            burst = await wait_for("the burst node's edge alive in the replica's view",
                                   lambda: _alive(node(BURST_ID)), timeout=240, every=0.5)
            up_s = time.monotonic() - t0
            assert burst["burst"] and not burst["draining"]
            # one Ray node of the slot, started by this host's provider: in a cgroup of its
            # own and on its fixed ports (the cluster's platform ports)
            [rn] = burst_ray_nodes()
            assert rn["Resources"][NODE_RESOURCE + BURST_ID] == 1
            assert BURST_ID in ray_nodes.local_nodes(ports)
            assert rn["NodeManagerPort"] == ports.node_block(1)
            registered = await asyncio.to_thread(_registered, state.gcs)
            assert registered[BURST_ID] == f"http://{s.cluster_address}:{ports.edge(1)}"

            # a batch container sandbox of an image in the shared store lands there and runs
            # (exec over the data path: api -> the burst edge actor's HTTP)
            b = await create(qos="batch")
            assert b.node == BURST_ID
            res = await AsyncSandbox(client, b).exec(["echo", "burst"])
            assert (res.exit_code, res.stdout.strip()) == (0, "burst")
            # latency never (the own node is full), nor an image whose layers are not shared
            with pytest.raises(errors.CapacityExceeded):
                await create(qos="latency")
            if have_image(LOCAL_ONLY):
                with pytest.raises(errors.CapacityExceeded):
                    await create(qos="batch", image=LOCAL_ONLY)  # the burst node has room
            assert (await node(BURST_ID))["free"]["sandboxes"] > 0

            # all gone: below the threshold and idle -> released, nothing of it left
            for sid in list(made):
                await client._t.request("DELETE", f"/v1/sandboxes/{sid}")
                made.remove(sid)
            t1 = time.monotonic()

            async def released() -> bool:
                return await node(BURST_ID) is None and not burst_ray_nodes()

            await wait_for("the burst node released and its Ray node ended", released,
                           timeout=120, every=0.5)
            down_s = time.monotonic() - t1

            async def clean() -> bool:
                return not any(leftovers(s, BURST_ID, ports).values())

            try:
                await wait_for("nothing of the burst node left", clean, timeout=30)
            except AssertionError:
                raise AssertionError(f"the burst node left: {leftovers(s, BURST_ID, ports)}") \
                    from None
            print(json.dumps({"burst_up_s": round(up_s, 1), "burst_release_s": round(down_s, 1),
                              "load": os.getloadavg()[0],
                              "start_retries": _provider_retries(ports)}))
        finally:
            for sid in made:
                with contextlib.suppress(errors.RollboxError):
                    await client._t.request("DELETE", f"/v1/sandboxes/{sid}")


async def _alive(got: Any) -> dict[str, Any] | None:
    n = await got
    return n if n is not None and n["health"] == "alive" else None


def _registered(gcs: str) -> dict[str, str]:
    from rollbox.cluster.edge_actor import registered_edges

    return registered_edges(gcs)


def _provider_retries(ports: ClusterPorts) -> int:
    """Burst node starts this host's provider tried again (it logs each in the autoscaler's
    log: a start that missed Ray's registration, killed whole first)."""
    logs = ray_nodes.temp_dir(ports) / "session_latest" / "logs"
    return sum(f.read_text(errors="replace").count("missed Ray's registration")
               for f in logs.glob("monitor*") if f.is_file())
