"""A cluster run from this host: ``rollbox cluster up|join|status|down``.

Owns the cluster's processes on this host and their record (``<cluster_dir>/state.json``): the
Ray head and worker nodes (``cluster.ray_nodes``; ``--nodes K`` > 1 simulates K machines with
K Ray nodes here), one edge actor per node (``cluster.edge_actor``) with the node's own host
resources (data and run dir, cgroup parent, uid band, sandbox subnet: :func:`node_env`), the api
replicas (``cluster.replica``) behind one port, the cluster token (generated once, root-only),
the admin key; with ``--burst-nodes N`` the head's autoscaler config (``cluster.autoscaler``)
and the cluster's one burst scaler (``cluster.burst_actor``), each burst slot a node id
``<prefix>b<k>`` with host resources of its own like every node. ``down`` stops all of them:
the scaler, the burst nodes' edges and the other edges (their sandboxes destroyed, a burst
edge's teardown verified on its node), replicas, every Ray process (burst nodes' too) and its
temp dir. Does not serve requests itself.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollbox import errors
from rollbox.cluster import ray_nodes
from rollbox.cluster.autoscaler import LOCAL_HEAD_ENV
from rollbox.cluster.burst import burst_node_id
from rollbox.cluster.ray_nodes import ClusterPorts
from rollbox.config import UID_BAND_EXTRA, VARS, Settings, env_text
from rollbox.edge.server import wait_healthy

# Cluster nodes' host uid bands start above the embedded node's, its image builds' and the test
# runs' bands (tests/conftest.py), 1024 slots of 65536 ids per node.
UID_FIRST_SLOT = 20_000
UID_SLOTS_PER_NODE = 1024


@dataclass
class NodeRecord:
    node_id: str
    index: int
    head: bool
    edge_url: str


@dataclass
class ReplicaRecord:
    name: str
    pid: int
    url: str


@dataclass
class ClusterState:
    port_base: int
    address: str
    api_url: str
    admin_key: str
    token_file: str
    dsn_file: str = ""  # the PostgreSQL DSN (with its password), root-only
    pg_data: str = ""
    nodes: list[NodeRecord] = field(default_factory=list)
    replicas: list[ReplicaRecord] = field(default_factory=list)
    burst: list[str] = field(default_factory=list)  # burst slots' node ids (none: no bursting)

    @property
    def ports(self) -> ClusterPorts:
        return ClusterPorts(self.port_base)

    @property
    def gcs(self) -> str:
        return f"{self.address}:{self.ports.gcs}"

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise errors.NotFound(f"no cluster is up from this host ({path} missing)") from None
        raw["nodes"] = [NodeRecord(**n) for n in raw.get("nodes", [])]
        raw["replicas"] = [ReplicaRecord(**r) for r in raw.get("replicas", [])]
        return cls(**raw)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)


def state_path(settings: Settings) -> Path:
    return settings.cluster_dir / "state.json"


def write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode is only a new file's: an old one keeps its own
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def ensure_token(settings: Settings) -> Path:
    """The cluster token (edges accept only api replicas that present it), made once."""
    path = settings.cluster_dir / "cluster.token"
    if not path.exists():
        write_secret(path, secrets.token_urlsafe(32))
    else:
        path.chmod(0o600)  # root's alone, also one made before (or copied in) more open
    return path


def node_settings(settings: Settings, node_id: str, index: int, *,
                  nodes: int | None = None) -> Settings:
    """Settings of cluster node ``node_id`` (its ``index`` on this host): its own data dir,
    run dir, cgroup parent, host uid band and sandbox subnet, so co-hosted edges never share a
    host resource (each edge claims them at start: rollbox.isolation.hostclaims); the host's
    image store (read-only layers); the cluster's port range as platform ports (sandboxes
    reach none of them); with ``nodes`` (all on this host) each its 1/nodes of the host's
    CPUs and memory for admission."""
    ports = ClusterPorts(settings.cluster_port_base)
    # the /16s (say) next to the embedded node's pool, never that one
    others = [p for p in settings.net_pool.supernet(
        new_prefix=max(settings.net_pool.prefixlen - 5, 8)).subnets(
        new_prefix=settings.net_pool.prefixlen) if p != settings.net_pool]
    n = copy.copy(settings)
    n.node_id = node_id
    n.data_dir = settings.cluster_dir / "nodes" / node_id
    n.run_dir = Path(f"/run/rollbox-cluster-{ports.base}/{node_id}")
    n.cgroup_parent = f"rollbox-{node_id}"
    n.uid_base = settings.uid_base + (UID_FIRST_SLOT + UID_SLOTS_PER_NODE * index) * 65536
    n.uid_slots = UID_SLOTS_PER_NODE - UID_BAND_EXTRA  # the band: slots + the builds' 64
    n.images_root = settings.images_dir
    n.net_pool = others[index % len(others)]
    # the range of the nodes' pools (its own nftables table; the policy forbids all of it)
    n.net_host_range = settings.net_pool.supernet(
        new_prefix=max(settings.net_pool.prefixlen - 5, 8))
    # Free ones from there up at its start (claimed host-wide): a second cluster on this host
    # (tests beside a running one) takes the next bands and subnets instead of failing.
    n.host_auto = True
    if nodes is not None:
        n.node_share = settings.node_share / nodes
    n.platform_ports = (*settings.platform_ports, *range(ports.base, ports.last + 1))
    return n


def node_env(settings: Settings, node_id: str, index: int, *,
             nodes: int | None = None) -> dict[str, str]:
    """The ``ROLLBOX_*`` variables of :func:`node_settings` (what the edge actor reads)."""
    n = node_settings(settings, node_id, index, nodes=nodes)
    env = n.environ()
    env[VARS["net_pool"].env] = env_text(n.net_pool)
    env[VARS["platform_ports"].env] = ports_text(n.platform_ports)
    return env


def ports_text(ports: tuple[int, ...]) -> str:
    """Ports as ``ROLLBOX_PLATFORM_PORTS`` text, runs of consecutive ports as ``LOW-HIGH``."""
    out: list[str] = []
    for p in sorted(set(ports)):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == p - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{p}"
        elif out and "-" not in out[-1] and int(out[-1]) == p - 1:
            out[-1] = f"{out[-1]}-{p}"
        else:
            out.append(str(p))
    return ",".join(out)


def _ray_init(address: str) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=ray_nodes.RAY_NAMESPACE, log_to_driver=False,
                 logging_level="warning")


def _ray_shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def node_token_path(settings: Settings, node_id: str, index: int) -> Path:
    """Where node ``node_id``'s edge actor reads the cluster token: a root-only (0600) file
    in the node's own dir on this host (its data dir), never an actor argument (those sit in
    Ray's GCS, which anyone who reaches the GCS port reads)."""
    return node_settings(settings, node_id, index).data_dir / "cluster.token"


def start_edge(settings: Settings, address: str, node_id: str, index: int, token: str,
               head: bool, nodes: int | None = None) -> NodeRecord:
    """Node ``node_id``'s edge actor on this host: the token is written to the node's token
    file (0600, :func:`node_token_path`) and the actor is given its path."""
    ports = ClusterPorts(settings.cluster_port_base)
    from rollbox.cluster.edge_actor import create_edge

    port = ports.edge(index)
    token_file = node_token_path(settings, node_id, index)
    write_secret(token_file, token)
    dsn = dsn_path(settings)  # the job leases its reaper reads (none if not on this host)
    create_edge(node_id, node_env(settings, node_id, index, nodes=nodes), address, port,
                str(token_file), dsn_file=str(dsn) if dsn.exists() else None)
    return NodeRecord(node_id, index, head, f"http://{address}:{port}")


def dsn_path(settings: Settings) -> Path:
    """The cluster's PostgreSQL DSN file (root-only), written by ``up``."""
    return settings.cluster_dir / "pg.dsn"


def start_postgres(settings: Settings, ports: ClusterPorts) -> tuple[Path, Path]:
    """The cluster's PostgreSQL (IAM, projects, keys, quotas, the quota ledger) on the
    cluster's port, loopback only; (data dir, DSN file)."""
    from rollbox.cluster.postgres import PostgresServer

    data = settings.cluster_dir / "pg"
    server = PostgresServer(data, port=ports.postgres).start()
    dsn_file = dsn_path(settings)
    write_secret(dsn_file, server.dsn)
    return data, dsn_file


def stop_postgres(data: Path, timeout: float = 30) -> None:
    """Stop the cluster's PostgreSQL started by another process (its postmaster.pid): fast
    shutdown, SIGKILL of its process group after ``timeout``."""
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return
    if not _alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.05)


def _admin_key(settings: Settings, dsn: str) -> Path:
    """The cluster's operator key (admin of every project), root-only in the cluster dir;
    made in PostgreSQL unless the file holds one it still accepts."""
    import asyncio

    from rollbox.iam.postgres import PostgresIam

    path = settings.cluster_dir / "admin.key"

    async def ensure() -> None:
        iam = await PostgresIam.open(dsn, max_size=2)
        try:
            if path.exists():
                try:
                    await iam.authenticate(path.read_text().strip())
                    return
                except errors.RollboxError:
                    pass
            write_secret(path, await iam.create_operator_key())
        finally:
            await iam.close()

    asyncio.run(ensure())
    return path


def start_replica(state: ClusterState, settings: Settings, i: int) -> ReplicaRecord:
    ports = state.ports
    name = f"r{i}"
    log = settings.cluster_dir / "replicas" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollbox.cluster.replica", "--gcs", state.gcs,
             "--token-file", state.token_file, "--dsn-file", state.dsn_file,
             "--state-dir", str(settings.cluster_dir),
             "--host", state.address, "--port", str(ports.api), "--own-port",
             str(ports.replica(i)), "--name", name],
            stdout=subprocess.DEVNULL, stderr=out, env=ray_nodes.ray_env(),
            start_new_session=True)
    return ReplicaRecord(name, proc.pid, f"http://{state.address}:{ports.replica(i)}")


def wait_replica(rec: ReplicaRecord, settings: Settings, timeout: float = 120) -> None:
    """Until the replica answers its health check; InfraError with its log if it exits."""
    wait_healthy(rec.url, lambda: _alive(rec.pid),
                 settings.cluster_dir / "replicas" / f"{rec.name}.log", timeout,
                 what=f"api replica {rec.name}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def stop_pid(pid: int, timeout: float = 15) -> None:
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def up(settings: Settings | None = None, replicas: int = 2, nodes: int = 1,
       burst_nodes: int | None = None, autoscaler_config: Path | None = None) -> ClusterState:
    """Start a cluster on this host: Ray head (node ``<prefix>0``) and ``nodes - 1``
    simulated worker nodes, an edge on each, ``replicas`` api replicas behind one port; with
    ``burst_nodes`` (default ``Settings.burst_nodes``) > 0 the head runs Ray's autoscaler with
    that many burst slots (``autoscaler_config``, default ``Settings.burst_autoscaler_config``:
    an operator's YAML for a real cloud; none: burst nodes are Ray nodes on this host) and the
    cluster's burst scaler runs."""
    s = settings or Settings()
    burst = s.burst_nodes if burst_nodes is None else burst_nodes
    operator = autoscaler_config or s.burst_autoscaler_config
    if not 1 <= nodes <= ray_nodes.MAX_NODES:
        raise errors.BadRequest(f"--nodes: 1..{ray_nodes.MAX_NODES}", nodes=nodes)
    if not 0 <= burst <= ray_nodes.MAX_NODES - nodes:
        raise errors.BadRequest(f"--burst-nodes: 0..{ray_nodes.MAX_NODES} - --nodes (each "
                                "takes a node block of the cluster's port range)",
                                burst_nodes=burst, nodes=nodes)
    if operator is not None and not burst:
        raise errors.BadRequest("an autoscaler config without --burst-nodes")
    if not 1 <= replicas <= 5:
        raise errors.BadRequest("--replicas: 1..5", replicas=replicas)
    ports = ClusterPorts(s.cluster_port_base)
    slots = {burst_node_id(s.node_id, k): nodes + k for k in range(burst)}
    if state_path(s).exists() or ray_nodes.local_nodes(ports):
        raise errors.BadRequest(f"a cluster is already up from this host ({s.cluster_dir}); "
                                "`rollbox cluster down` first")
    s.cluster_dir.mkdir(parents=True, exist_ok=True)
    scaling = _autoscaler_config(s, ports, slots, operator) if burst else None
    token_file = ensure_token(s)
    token = token_file.read_text().strip()
    state = ClusterState(port_base=ports.base, address=s.cluster_address,
                         api_url=f"http://{s.cluster_address}:{ports.api}",
                         admin_key=str(s.cluster_dir / "admin.key"),
                         token_file=str(token_file), pg_data=str(s.cluster_dir / "pg"))
    ids = [f"{s.node_id}c{i}" for i in range(nodes)]
    try:
        state.save(state_path(s))  # first: a failed start is undone by down()
        _, dsn_file = start_postgres(s, ports)
        state.dsn_file = str(dsn_file)
        _admin_key(s, dsn_file.read_text().strip())
        state.save(state_path(s))
        state.burst = list(slots)
        head_env = LOCAL_HEAD_ENV if scaling is not None and operator is None else None
        ray_nodes.start_node(ports, ids[0], 0, head=True, address=s.cluster_address,
                             object_store_mib=s.cluster_object_store_mib, env=head_env,
                             autoscaling_config=scaling)
        _join_nodes(ports, s, ids[1:], start=1)
        _ray_init(state.gcs)
        for i, node in enumerate(ids):
            state.nodes.append(start_edge(s, s.cluster_address, node, i, token, head=i == 0,
                                          nodes=nodes))
            state.save(state_path(s))
        if slots:
            _start_scaler(s, state, slots, token, ids[0], nodes)
        _ray_shutdown()
        for i in range(replicas):
            state.replicas.append(start_replica(state, s, i))
            state.save(state_path(s))
        for rec in state.replicas:
            wait_replica(rec, s)
    except BaseException:
        _ray_shutdown()  # a driver whose GCS goes away aborts its process after 60 s
        down(s)
        raise
    return state


def _autoscaler_config(s: Settings, ports: ClusterPorts, slots: dict[str, int],
                       operator: Path | None) -> Path:
    """The head's autoscaler config in the cluster dir (``cluster.autoscaler``): burst nodes
    on this host, or the operator's YAML with the burst node types merged in."""
    from rollbox.cluster.autoscaler import local_config, operator_config

    if operator is None:
        cfg = local_config(ports, s.node_id, slots, address=s.cluster_address,
                           object_store_mib=s.cluster_object_store_mib)
    else:
        cfg = operator_config(operator, s.node_id, len(slots),
                              object_store_mib=s.cluster_object_store_mib)
    path = s.cluster_dir / "autoscaler.json"  # JSON is YAML: what ray start reads
    path.write_text(json.dumps(cfg, indent=2))
    return path


def burst_slots(s: Settings, slots: dict[str, int], nodes: int) -> dict[str, dict[str, Any]]:
    """Each burst slot's edge port, ``ROLLBOX_*`` variables (the node's own dirs, cgroup
    parent, uid band and subnet: :func:`node_env` at its index after the cluster's own nodes;
    the same share of the host as an own node; ``ROLLBOX_NODE_BURST=1``) and token file
    (:func:`node_token_path`: on a burst node of another host, the operator's image puts the
    token there)."""
    ports = ClusterPorts(s.cluster_port_base)
    return {nid: {"port": ports.edge(index),
                  "env": {**node_env(s, nid, index, nodes=nodes), VARS["node_burst"].env: "1"},
                  "token_file": str(node_token_path(s, nid, index))}
            for nid, index in slots.items()}


def _start_scaler(s: Settings, state: ClusterState, slots: dict[str, int], token: str,
                  head: str, nodes: int) -> None:
    from rollbox.cluster.burst_actor import start_scaler
    from rollbox.cluster.edge_actor import ray_node_of

    dsn = dsn_path(s)
    config = {"threshold": s.burst_threshold, "idle_s": s.burst_idle_s,
              "max_nodes": len(slots), "layers_ttl_s": s.burst_layers_ttl_s}
    burst = burst_slots(s, slots, nodes)
    for slot in burst.values():  # burst nodes on this host read the token here
        write_secret(Path(slot["token_file"]), token)
    start_scaler(state.gcs, state.token_file, burst, config, s.cluster_address,
                 ray_node_of(head), dsn_file=str(dsn) if dsn.exists() else None)


def _join_nodes(ports: ClusterPorts, s: Settings, ids: list[str], start: int) -> None:
    """Start worker Ray nodes one after another (two raylets starting at once on one host
    time out registering under load)."""
    for k, node in enumerate(ids):
        ray_nodes.start_node(ports, node, start + k, head=False, address=s.cluster_address,
                             object_store_mib=s.cluster_object_store_mib)


def join(address: str, settings: Settings | None = None, node_id: str | None = None,
         index: int | None = None, token_file: Path | None = None) -> NodeRecord:
    """Join the cluster whose head is at ``address`` (host or host:port) with a Ray worker
    node on this host and its edge. BadRequest if ``node_id`` is already in the cluster."""
    s = settings or Settings()
    host, _, port = address.partition(":")
    ports = ClusterPorts(int(port) if port else s.cluster_port_base)
    state: ClusterState | None = None
    if state_path(s).exists():
        state = ClusterState.load(state_path(s))
    taken = {n.index for n in state.nodes} if state else set()
    again = [n.index for n in (state.nodes if state else []) if n.node_id == node_id]
    idx = index if index is not None else again[0] if again else next(
        i for i in range(ray_nodes.MAX_NODES) if i not in taken)
    node = node_id or f"{s.node_id}c{idx}"
    tf = token_file or s.cluster_dir / "cluster.token"
    try:
        token = tf.read_text().strip()
    except FileNotFoundError:
        raise errors.BadRequest(f"no cluster token at {tf} (copy the head's "
                                f"cluster.token, 0600)") from None
    gcs = f"{host}:{ports.gcs}"
    _ray_init(gcs)
    try:
        from rollbox.cluster.edge_actor import registered_node_alive, edge_actor

        try:
            edge_actor(node)
            if node in ray_nodes.local_nodes(ports):  # its Ray node runs here: a duplicate
                raise errors.BadRequest(f"node id {node!r} is already in the cluster",
                                        node=node)
            # Its Ray node is gone from this host: until the GCS has seen it die (health
            # checks, a few seconds), its record still looks alive.
            deadline = time.monotonic() + 60
            while registered_node_alive(node):
                if time.monotonic() > deadline:
                    raise errors.BadRequest(f"node id {node!r} is already in the cluster",
                                            node=node)
                time.sleep(0.5)
        except errors.NotFound:
            pass
        ray_nodes.start_node(ports, node, idx, head=False, address=host,
                             object_store_mib=s.cluster_object_store_mib)
        try:
            rec = start_edge(s, s.cluster_address, node, idx, token, head=False,
                             nodes=len({*taken, idx}) if state else None)
        except BaseException:
            ray_nodes.kill_node(ports, node)
            raise
    finally:
        _ray_shutdown()
    if state is not None:  # a node that joins again replaces its record
        state.nodes = [n for n in state.nodes if n.node_id != rec.node_id] + [rec]
        state.save(state_path(s))
    return rec


def down(settings: Settings | None = None, destroy: bool = True) -> None:
    """Stop the cluster run from this host: replicas, edges (sandboxes destroyed unless not
    ``destroy``), every Ray process, the Ray temp dir, PostgreSQL (its data stays: projects,
    keys and quotas outlive a restart of the cluster). Idempotent."""
    s = settings or Settings()
    path = state_path(s)
    try:
        state: ClusterState | None = ClusterState.load(path)
    except errors.NotFound:
        state = None
    ports = state.ports if state else ClusterPorts(s.cluster_port_base)
    if state is not None:
        for rec in state.replicas:
            stop_pid(rec.pid)
        if (state.nodes or state.burst) and ray_nodes.local_nodes(ports):
            _stop_edges(state, destroy)
    ray_nodes.stop_all(ports)
    stop_postgres(Path(state.pg_data) if state and state.pg_data else s.cluster_dir / "pg")
    path.unlink(missing_ok=True)


def _stop_edges(state: ClusterState, destroy: bool) -> None:
    """The burst scaler first (no burst node starts meanwhile), then each burst node's edge
    (its sandboxes destroyed and their teardown verified on the node), then the others."""
    import logging

    from rollbox.cluster.burst_actor import stop_scaler
    from rollbox.cluster.edge_actor import edge_actor, stop_edge

    log = logging.getLogger(__name__)
    try:
        _ray_init(state.gcs)
    except Exception:  # noqa: BLE001 - no GCS: the Ray processes go below anyway
        return
    try:
        if state.burst:
            try:
                stop_scaler()
            except Exception:  # noqa: BLE001 - the edges still go
                log.warning("stopping the burst scaler failed", exc_info=True)
        for nid in state.burst:
            try:
                edge_actor(nid)
            except errors.NotFound:
                continue  # not up (or released)
            try:
                stop_edge(nid, destroy=True, verify=True)
            except Exception:  # noqa: BLE001 - one edge that fails does not keep the others
                log.warning("stopping burst edge %s failed", nid, exc_info=True)
        for n in state.nodes:
            try:
                stop_edge(n.node_id, destroy=destroy)
            except Exception:  # noqa: BLE001 - one edge that fails does not keep the others
                log.warning("stopping edge %s failed", n.node_id, exc_info=True)
    finally:
        _ray_shutdown()


def status(settings: Settings | None = None) -> dict[str, Any]:
    """The watcher's summary as an api replica has it (``GET /v1/cluster/status``: nodes,
    health, burst or not, sandboxes per node, backend and project), asked of the first
    replica that answers; plus where the cluster's api, replicas and admin key are and its
    burst slots' node ids."""
    import httpx

    s = settings or Settings()
    state = ClusterState.load(state_path(s))
    key = Path(state.admin_key).read_text().strip()
    last: Exception | None = None
    for url in [*state.replica_urls, state.api_url]:
        try:
            r = httpx.get(f"{url}/v1/cluster/status", timeout=5,
                          headers={"authorization": f"Bearer {key}"})
        except httpx.HTTPError as exc:
            last = exc
            continue
        if r.status_code != 200:
            raise errors.error_from_payload(r.json(), r.status_code)
        return {"api": state.api_url, "replicas": state.replica_urls,
                "admin_key": state.admin_key, "gcs": state.gcs, "burst_slots": state.burst,
                "metrics_targets": metrics_targets(state), **r.json()}
    raise errors.InfraError(f"no api replica answers: {last!r}")


def metrics_targets(state: ClusterState) -> list[dict[str, Any]]:
    """Prometheus ``file_sd`` groups of the cluster's ``/metrics``: every api replica's (an
    admin key as bearer token) and every edge's (``/edge/v1/metrics``, the cluster token as
    bearer token); docs/operations.md has the scrape configs that use them. Burst nodes come
    and go: ``rollbox cluster status --prometheus-targets FILE`` rewrites the file."""
    from urllib.parse import urlsplit

    from rollbox.edge.wire import PREFIX

    def target(url: str) -> str:
        return urlsplit(url).netloc

    return [
        {"targets": [target(u) for u in state.replica_urls],
         "labels": {"job": "rollbox-api", "__metrics_path__": "/metrics"}},
        *({"targets": [target(n.edge_url)],
           "labels": {"job": "rollbox-edge", "node": n.node_id,
                      "__metrics_path__": f"{PREFIX}/metrics"}} for n in state.nodes),
    ]
