"""Cloud bursting on this host with Ray's fake multi-node provider (issue 14 item 8): a real Ray
head with the autoscaler (``RAY_FAKE_CLUSTER=1``, provider ``fake_multinode``: the nodes it
starts are real raylets on this host) and burst node types from
``rollbox.cluster.burst.burst_node_types``; the cluster's own node is a real edge in this
process, full at 2 sandboxes; a real watcher and a real Placement with the bursting policy over
a real shared (posix://) chunk store holding busybox:test; the real BurstScaler.

Use above the threshold -> the autoscaler starts a burst node, its edge starts (the stand-in
actor of tests/integration/burst_standin.py, holding the node's rollbox_burst unit), batch
container sandboxes land there and run; latency ones and images not in the shared store never
do. Below the threshold and idle -> drained, edge stopped, the Ray node ended by the
autoscaler, and nothing of it left: no process, mount, netns or cgroup."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollbox import errors
from rollbox.cluster import local, ray_nodes
from rollbox.cluster.burst import (
    BURST_RESOURCE,
    NODE_RESOURCE,
    BurstScaler,
    RayBurstNodes,
    burst_node_id,
    burst_node_types,
)
from rollbox.cluster.ray_nodes import ClusterPorts
from rollbox.config import Settings
from rollbox.edge.edge import Edge
from rollbox.events.store import EventLog
from rollbox.images import chunks
from rollbox.images.store import ImageStore
from rollbox.images.stores import open_store
from rollbox.isolation import cgroups
from rollbox.models import SandboxSpec
from rollbox.placement import Placement
from rollbox.placement.burst import BurstConfig, BurstPolicy
from rollbox.placement.registry import EdgeRegistry
from rollbox.watcher import Watcher
from tests.conftest import TEST_NODE, TEST_RUN, have_image, node_settings, register_run_owner
from tests.integration.burst_standin import ActorEdge, StandInEdge

pytestmark = [pytest.mark.cluster_slow, pytest.mark.root]

IMAGE = "busybox:test"
LOCAL_ONLY = "debian:bookworm"  # built on this host, never pushed to the shared store
# a port range of this run's own, apart from `rollbox cluster up`'s and lane R's test ranges
PORTS = ClusterPorts(24000 + 400 * (int(TEST_RUN, 16) % 8))
SLOT_INDEX = 12 + int(TEST_RUN, 16) % 4  # the burst node's uid band and subnet (node_env)
BURST_ID = burst_node_id(TEST_NODE, 0)
HEAD_ID = f"{TEST_NODE}bh"
SRC = Path(__file__).resolve().parents[2]


def autoscaling_config() -> dict[str, Any]:
    return {
        "cluster_name": f"rollbox-burst-{TEST_RUN}", "max_workers": 2,
        "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1,
        "provider": {"type": "fake_multinode", "gcs_address": f"127.0.0.1:{PORTS.gcs}",
                     "disable_launch_config_check": True, "disable_node_updaters": True,
                     "use_node_id_as_ip": True},
        "auth": {"ssh_user": "root"},
        "available_node_types": {
            "ray.head.default": {"resources": {}, "node_config": {}, "max_workers": 0},
            **burst_node_types(TEST_NODE, 1)},
        "head_node_type": "ray.head.default",
        **{k: [] for k in ("cluster_synced_files", "rsync_exclude", "rsync_filter",
                           "initialization_commands", "setup_commands", "head_setup_commands",
                           "worker_setup_commands", "head_start_ray_commands",
                           "worker_start_ray_commands")},
        "file_mounts": {}, "file_mounts_sync_continuously": False,
    }


@pytest.fixture(scope="module")
def ray_head() -> Iterator[Path]:
    """A Ray head with the fake multi-node autoscaler in a cgroup of its own (every process of
    it and of the nodes its autoscaler starts); killed with its cgroup and temp dir after."""
    import ray

    if os.geteuid() != 0:
        pytest.skip("edges need root")
    register_run_owner()
    root = Path(tempfile.mkdtemp(prefix=f"rollbox-test-{TEST_RUN}-burst-"))
    root.chmod(0o711)
    cfg = root / "autoscaler.json"
    cfg.write_text(json.dumps(autoscaling_config()))
    cg = ray_nodes.node_cgroup(PORTS, HEAD_ID)
    cg.mkdir(parents=True, exist_ok=True)
    env = ray_nodes.ray_env({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env["PYTHONPATH"]])  # tests.integration
    args = [str(ray_nodes.ray_bin()), "start", "--head", "--disable-usage-stats",
            "--port", str(PORTS.gcs), "--node-ip-address", "127.0.0.1", "--num-cpus", "0",
            "--object-store-memory", str(256 << 20), "--include-dashboard", "false",
            "--dashboard-port", str(PORTS.dashboard), "--temp-dir",
            str(ray_nodes.temp_dir(PORTS)), "--autoscaling-config", str(cfg),
            *ray_nodes.node_args(PORTS, 0)]
    try:
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120,
                              preexec_fn=lambda: (cg / "cgroup.procs").write_text("0"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        ray.init(address=f"127.0.0.1:{PORTS.gcs}", namespace="rollbox", log_to_driver=False,
                 logging_level="warning")
        yield root
    finally:
        ray.shutdown()
        ray_nodes.stop_all(PORTS)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(f"/run/rollbox-cluster-{PORTS.base}", ignore_errors=True)
        assert not ray_nodes.local_nodes(PORTS)


class StandIns:
    """The edges of burst nodes as stand-in actors (see burst_standin.py)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.actors: dict[str, Any] = {}

    def env(self, node_id: str) -> dict[str, str]:
        s = node_settings(self.root, node_id)  # the test run's settings, then the node's own
        s.cluster_dir = self.root / "cluster"
        s.cluster_port_base = PORTS.base
        e = local.node_env(s, node_id, SLOT_INDEX)
        e["ROLLBOX_NODE_BURST"] = "1"
        e["ROLLBOX_WATCH_FENCE"] = "0"
        return e

    def start_edge(self, node_id: str) -> ActorEdge:
        import ray

        actor = ray.remote(StandInEdge).options(
            num_cpus=0, resources={BURST_RESOURCE: 1, NODE_RESOURCE + node_id: 1},
            max_restarts=0, max_concurrency=16).remote(self.env(node_id))
        assert ray.get(actor.node_id.remote(), timeout=300) == node_id
        self.actors[node_id] = actor
        return ActorEdge(node_id, actor)

    def drain(self, node_id: str) -> int:
        import ray

        return int(ray.get(self.actors[node_id].drain.remote(), timeout=60))

    def undrain(self, node_id: str) -> None:
        import ray

        ray.get(self.actors[node_id].undrain.remote(), timeout=60)

    def stop_edge(self, node_id: str) -> None:
        import ray

        actor = self.actors.pop(node_id)
        try:
            ray.get(actor.shutdown.remote(), timeout=120)
        finally:
            ray.kill(actor, no_restart=True)


def burst_ray_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive") and BURST_RESOURCE in n["Resources"]]


def raylets() -> list[int]:
    """Raylet processes of this test's Ray (the head's and those of the nodes its autoscaler
    started: every one is in the head's cgroup)."""
    out = []
    for pid in ray_nodes.node_pids(PORTS, HEAD_ID):
        try:
            if b"/raylet" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:
                out.append(pid)
        except OSError:
            pass
    return out


def leftovers(node_id: str, env: dict[str, str]) -> dict[str, Any]:
    """What burst node ``node_id`` left on the host: mounts below its data or run dir, network
    namespaces named for it, its sandbox cgroups, its Ray node and raylet."""
    data, run = env["ROLLBOX_DATA"], env["ROLLBOX_RUN"]
    mounts = [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines()
              if data in ln or run in ln]
    netns = [p.name for p in Path("/run/netns").glob("*")
             if node_id in p.name] if Path("/run/netns").exists() else []
    return {"mounts": mounts, "netns": netns,
            "cgroups": [str(p) for p in cgroups.leftover(env["ROLLBOX_CGROUP"])],
            "ray nodes": [n["NodeID"] for n in burst_ray_nodes()],
            "raylets": raylets()[1:]}  # the head's own is the first


@pytest.fixture
async def rig(ray_head: Path) -> AsyncIterator[dict[str, Any]]:
    """The cluster's own node (a real edge here, 2 sandbox slots), the shared store with
    busybox:test pushed, watcher, placement with the policy, the scaler running."""
    if not have_image(IMAGE):
        pytest.skip(f"{IMAGE} not built (make images)")
    root = ray_head
    shared = open_store(f"posix://{root / 'shared'}")
    await chunks.push_image(ImageStore(Settings().images_dir), IMAGE, shared)
    s = node_settings(root / "own")
    s.max_sandboxes = 2
    s.watch_fence = False
    events = EventLog(root / "own-events.db")
    own = Edge(s, events)
    await own.start()
    registry = EdgeRegistry([own])
    watcher = Watcher(registry, interval_s=0.5, fence=False)
    await watcher.start()
    policy = BurstPolicy(BurstConfig(threshold=0.8), shared)
    placement = Placement(registry, view=watcher, burst=policy)
    standins = StandIns(root)
    scaler = BurstScaler(watcher, registry, RayBurstNodes(standins),
                         BurstConfig(threshold=0.8, idle_s=2.0, max_nodes=1), interval_s=0.5)
    task = asyncio.create_task(scaler.run())
    made: list[str] = []
    try:
        yield {"placement": placement, "made": made, "own": own, "scaler": scaler,
               "standins": standins, "watcher": watcher}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        try:
            for sid in made:
                with contextlib.suppress(Exception):
                    await placement.edge_for(sid).delete(sid)
            for nid in list(standins.actors):
                with contextlib.suppress(Exception):
                    standins.stop_edge(nid)
        finally:
            await watcher.stop()
            await own.close(destroy=True)
            events.close()
            await policy.close()
            shutil.rmtree(s.run_dir, ignore_errors=True)


async def wait_for(what: str, cond: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        await asyncio.sleep(0.25)
    raise AssertionError(f"not within {timeout}s: {what}")


async def test_burst_up_place_and_release(rig: dict[str, Any]) -> None:
    import ray

    placement, made, watcher = rig["placement"], rig["made"], rig["watcher"]

    async def create(**kw: Any) -> Any:
        info = await placement.create(SandboxSpec(**{"image": IMAGE, "ttl_s": 600, **kw}), "p")
        made.append(info.id)
        return info

    # fill the own node with latency sandboxes: use 1.0 >= 0.8
    own_id = rig["own"].node_id
    await wait_for("the own node alive in the view", lambda: (
        (nv := watcher.node(own_id)) is not None and nv.health == "alive"), timeout=30)
    for i in range(2):
        assert (await create(qos="latency")).node == own_id
        # the next decision after a probe that shows it (one sent while the create ran
        # counts it twice: in the edge's free and in placement's pending)
        await wait_for("the view shows the create", lambda: (
            (nv := watcher.node(own_id)) is not None and nv.starting == 0
            and nv.free["sandboxes"] == 1 - i), timeout=30)
        await asyncio.sleep(0.6)
    assert not burst_ray_nodes()
    t0 = time.monotonic()
    await wait_for("the burst node's edge alive in the view", lambda: (
        (nv := watcher.node(BURST_ID)) is not None and nv.health == "alive" and nv.burst),
        timeout=180)
    up_s = time.monotonic() - t0
    [rn] = burst_ray_nodes()
    assert len(raylets()) == 2
    assert rn["Resources"][NODE_RESOURCE + BURST_ID] == 1

    # batch container sandboxes of an image in the shared store land there, and run
    b = await create(qos="batch")
    assert b.node == BURST_ID
    code, out = ray.get(rig["standins"].actors[BURST_ID].run.remote(b.id, ["echo", "burst"]))
    assert (code, out.strip()) == (0, "burst")
    # latency never (the own node is full), nor an image whose layers are not shared
    with pytest.raises(errors.CapacityExceeded):
        await create(qos="latency")
    with pytest.raises(errors.CapacityExceeded):
        await create(qos="batch", image=LOCAL_ONLY)  # the burst node has room: never there
    nv = watcher.node(BURST_ID)
    assert nv is not None and nv.free["sandboxes"] > 0

    # all gone: below the threshold and idle -> released, nothing of it left
    env = rig["standins"].env(BURST_ID)
    for sid in list(made):
        await placement.edge_for(sid).delete(sid)
        made.remove(sid)
    t1 = time.monotonic()
    await wait_for("the burst node released", lambda: BURST_ID not in rig["standins"].actors,
                   timeout=60)
    assert BURST_ID not in placement.edges
    await wait_for("the autoscaler ended the Ray node", lambda: not burst_ray_nodes(),
                   timeout=120)
    down_s = time.monotonic() - t1
    try:
        await wait_for("nothing of the burst node left",
                       lambda: not any(leftovers(BURST_ID, env).values()), timeout=30)
    except AssertionError:
        raise AssertionError(f"the burst node left: {leftovers(BURST_ID, env)}") from None
    print(json.dumps({"burst_up_s": round(up_s, 1), "burst_release_s": round(down_s, 1)}))
