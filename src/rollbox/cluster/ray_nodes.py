"""Ray nodes of a cluster on this host: the head and its workers, their ports, their processes.

Owns ``ray start`` of a head or of a worker (a real Ray node; several on one host simulate
several machines), the fixed ports each uses (so the cluster's whole port range can be closed to
sandboxes, see :func:`ClusterPorts.platform_ports`), and stopping them: every Ray process of a
node runs in a v2 cgroup of its own (``rollbox-ray-<port base>/<node>``), so stopping a node is
``cgroup.kill`` of that cgroup (raylet, workers, agents, the edge actor; a sandbox lives in its
own cgroup and is not touched), and ``stop_all`` also removes the Ray temp dir (sessions, logs,
sockets). Never ``ray stop``: that kills every Ray process on the host, other clusters' too.
Does not create edges (``cluster.edge_actor``) nor api replicas (``cluster.replica``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rollbox import errors
from rollbox.isolation import cgroups

RAY_NAMESPACE = "rollbox"
# The custom resource each Ray node of a rollbox node carries: the edge actor is pinned to the
# Ray node that has it (rollbox node id -> Ray node id), never to any other.
NODE_RESOURCE = "rollbox_node:"
# Ports per node block: node manager, object manager, runtime env agent, dashboard agent grpc
# and http, metrics export, the edge's HTTP port, then the worker ports.
NODE_BLOCK = 20
MAX_NODES = 16
START_ATTEMPTS = 3


def ray_bin() -> Path:
    """The ``ray`` command of this interpreter's environment."""
    return Path(sys.executable).with_name("ray")


@dataclass(frozen=True)
class ClusterPorts:
    """Every port of a cluster on one host, from one base: the GCS at ``base``, Ray client
    server ``base+1``, dashboard ``base+2``, PostgreSQL ``base+3``, the api's shared port
    ``base+4`` and the replicas' own ports ``base+5..base+9``, then one block of
    ``NODE_BLOCK`` ports per node (index 0 = the head's)."""

    base: int

    @property
    def gcs(self) -> int:
        return self.base

    @property
    def ray_client(self) -> int:
        return self.base + 1

    @property
    def dashboard(self) -> int:
        return self.base + 2

    @property
    def postgres(self) -> int:
        return self.base + 3

    @property
    def api(self) -> int:
        return self.base + 4

    def replica(self, i: int) -> int:
        if not 0 <= i < 5:
            raise errors.BadRequest("at most 5 api replicas per host", replicas=i + 1)
        return self.base + 5 + i

    def node_block(self, index: int) -> int:
        if not 0 <= index < MAX_NODES:
            raise errors.BadRequest(f"node index {index}: at most {MAX_NODES} nodes per host",
                                    index=index)
        return self.base + 10 + NODE_BLOCK * index

    def edge(self, index: int) -> int:
        return self.node_block(index) + 6

    @property
    def last(self) -> int:
        return self.base + 10 + NODE_BLOCK * MAX_NODES - 1

    def platform_ports(self) -> str:
        """The cluster's whole range as ``ROLLBOX_PLATFORM_PORTS`` text: no network rule of a
        sandbox opens any of them on a host address."""
        return f"{self.base}-{self.last}"


def node_args(ports: ClusterPorts, index: int) -> list[str]:
    b = ports.node_block(index)
    return ["--node-manager-port", str(b), "--object-manager-port", str(b + 1),
            "--runtime-env-agent-port", str(b + 2), "--dashboard-agent-grpc-port", str(b + 3),
            "--dashboard-agent-listen-port", str(b + 4), "--metrics-export-port", str(b + 5),
            "--min-worker-port", str(b + 7), "--max-worker-port", str(b + NODE_BLOCK - 1)]


def temp_dir(ports: ClusterPorts) -> Path:
    """Ray's temp dir of this cluster (sessions, logs, sockets): short, as Ray's unix socket
    paths must fit in 107 bytes."""
    return Path(f"/tmp/rbray-{ports.base}")


def cgroup_root(ports: ClusterPorts) -> Path:
    return cgroups.v2_root() / f"rollbox-ray-{ports.base}"


def node_cgroup(ports: ClusterPorts, node_id: str) -> Path:
    return cgroup_root(ports) / node_id


def _enter(cg: Path) -> None:
    (cg / "cgroup.procs").write_text("0")


def ray_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of ``ray start``, which its workers (the edge actor) inherit: rollbox
    importable from where this process imports it, no usage stats."""
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([src, *[p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p and p != src]])
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def start_node(ports: ClusterPorts, node_id: str, index: int, *, head: bool,
               address: str = "127.0.0.1", object_store_mib: int = 256,
               env: dict[str, str] | None = None, timeout: float = 90,
               resources: dict[str, float] | None = None,
               attempts: int = START_ATTEMPTS, autoscaling_config: Path | None = None) -> None:
    """``ray start`` of rollbox node ``node_id`` in its cgroup: the head (GCS at
    ``ports.gcs``) or a worker joining ``address:ports.gcs``. Ray's own processes bind every
    address (gRPC listens on 0.0.0.0 whatever --node-ip-address says): the cluster's ports are
    kept from sandboxes by netpolicy (platform ports), not by the bind. ``resources``: custom
    resources besides the node's ``rollbox_node:<id>``; ``attempts``: starts tried when Ray's
    registration times out (each failed one killed whole first); ``autoscaling_config``: the
    head runs Ray's autoscaler with it (``cluster.autoscaler``)."""
    cg = node_cgroup(ports, node_id)
    # No log monitor: it tails every Ray process's log files into the GCS for drivers to
    # print, and rollbox's drivers never do (log_to_driver=False); idle, each node's cost
    # ~9 ms of CPU a second (bench cluster, 3 nodes on 2 cores: 27 ms/s of 154 ms/s idle).
    args = [str(ray_bin()), "start", "--disable-usage-stats", "--log-style", "record",
            "--include-log-monitor", "false",
            "--node-ip-address", address, "--num-cpus", "0",
            "--object-store-memory", str(object_store_mib << 20),
            "--resources", json.dumps({**(resources or {}), NODE_RESOURCE + node_id: 1}),
            *node_args(ports, index)]
    env = dict(env or {})
    if head:
        # The GCS declares a raylet that stopped answering dead after ~10 s of failed checks
        # (1 s apart, 3 s each: a loaded host's slow answer is not a death), sooner than
        # Ray's default; rollbox's own node loss is the watcher's, this is for a rejoin.
        env.update(RAY_health_check_period_ms="1000", RAY_health_check_timeout_ms="3000",
                   RAY_health_check_failure_threshold="10")
        args += ["--head", "--port", str(ports.gcs), "--include-dashboard", "false",
                 "--dashboard-port",
                 str(ports.dashboard), "--temp-dir", str(temp_dir(ports))]
        if autoscaling_config is not None:
            args += ["--autoscaling-config", str(autoscaling_config)]
    else:
        args += ["--address", f"{address}:{ports.gcs}"]
    for attempt in range(attempts):
        cg.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(args, env=ray_env(env), capture_output=True, text=True,
                              timeout=timeout, preexec_fn=lambda: _enter(cg))
        if proc.returncode == 0:
            return
        # Ray gives a raylet 30 s to register (fixed in ray._private.node): on a loaded host
        # that is not always enough; the node's processes go and it is started again.
        kill_node(ports, node_id)
        if attempt + 1 == attempts or "timed out during startup" not in proc.stderr:
            raise errors.InfraError(f"ray start of node {node_id} failed: "
                                    f"{(proc.stderr or proc.stdout)[-1500:]}", node=node_id)


def kill_node(ports: ClusterPorts, node_id: str, timeout: float = 10) -> None:
    """SIGKILL every process of a node's Ray (as a host that dies), then remove its cgroup."""
    cg = node_cgroup(ports, node_id)
    if not cg.exists():
        return
    cgroups.kill(cg)
    deadline = time.monotonic() + timeout
    while cgroups.populated(cg) and time.monotonic() < deadline:
        time.sleep(0.02)
    cgroups.remove_tree(cg)


def node_pids(ports: ClusterPorts, node_id: str) -> list[int]:
    cg = node_cgroup(ports, node_id)
    out: list[int] = []
    for d in [cg, *[p for p in cg.rglob("*") if p.is_dir()]] if cg.exists() else []:
        out += cgroups.procs(d)
    return out


def local_nodes(ports: ClusterPorts) -> list[str]:
    """Rollbox node ids with a Ray node (a cgroup) of this cluster on this host."""
    root = cgroup_root(ports)
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


def stop_all(ports: ClusterPorts) -> None:
    """Every Ray process of the cluster on this host, then its cgroups and temp dir."""
    for n in local_nodes(ports):
        kill_node(ports, n)
    root = cgroup_root(ports)
    if root.exists():
        cgroups.remove_tree(root)
    shutil.rmtree(temp_dir(ports), ignore_errors=True)
