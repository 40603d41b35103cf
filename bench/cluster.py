"""A cluster on this host vs the embedded server (`rollbox bench cluster [--json] [--quick]`):
create -> exec ``true`` -> destroy throughput at c8 and c32, and how long a stopped node takes
to be reported lost.

Topology (``topology`` in the JSON). ``ray`` (the default): ``rollbox cluster up``'s path,
``cluster.local.up(replicas=2, nodes=3)`` in a scratch cluster dir and a free port range: a Ray
head and 2 simulated worker nodes on this host, an edge actor on each (HTTP, cluster token),
PostgreSQL, 2 api replicas each with a watcher (default thresholds) reconciling the PostgreSQL
quota ledger, placement over its view and PostgreSQL IAM; torn down with ``local.down``.
``assembled`` (``--assembled``: the same shape without Ray, from the parts): one real PostgreSQL
(``cluster.postgres.PostgresServer``), 3 co-hosted edges (``Settings.for_node``, each its own
data/run dir, cgroup parent, uid band, subnet, 1/3 of the host for admission), each in its own
process served by ``edge.service.serve_edge``, and 2 api replica processes, each with a
``RemoteEdge`` per edge, a ``Watcher`` reconciling the ledger, ``Placement(registry, view)`` and
``iam.postgres.open_postgres``. The peer: ``rollbox serve`` at its defaults (its own process,
SQLite), up during the same run; the two are measured alternately in halves.

Load: two SDK clients, each given both replica URLs (fail-over order reversed for the second),
the cycles alternating between them, so both replicas serve. ``node_loss_detect_s``: one
edge's process is SIGSTOPped while it holds a sandbox; the time until the api answers that
sandbox's GET with sandbox_dead / node_lost. Then SIGCONT and every process is stopped (the
edges destroy their sandboxes), PostgreSQL too, also on failure. Ends with one JSON line.

This file is also the edge and replica processes' entry (``python bench/cluster.py
_edge|_replica ...``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import emit, ratio, run_cycles, say

EDGES = 3
REPLICAS = 2
NODE_INDEX0 = 4  # co-hosted node indices 4..6 (tests use the low ones)
UID_SLOTS = 960  # sandbox uid ranges per node (as cluster.local gives its nodes)
TOPOLOGY_RAY = ("ray: rollbox cluster up's path (cluster.local.up): a Ray head and 2 simulated "
                "worker nodes, an edge actor on each serving HTTP, PostgreSQL, 2 api "
                "replicas (watcher, Placement(registry, view), PostgreSQL IAM + ledger)")
TOPOLOGY = ("assembled: 3 edges (Settings.for_node, serve_edge, one process each), 2 api "
            "replica processes (RemoteEdge x3, Watcher, Placement(registry, view), "
            "PostgreSQL IAM + quota ledger), no Ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_base() -> int:
    """A cluster port base (below the ephemeral range, apart from the tests' 20000-23199 and
    `cluster up`'s default) whose whole range nothing listens on now."""
    from rollbox.cluster.ray_nodes import ClusterPorts

    for base in secrets.SystemRandom().sample(range(24000, 32000, 400), 20):
        last = ClusterPorts(base).last
        try:
            for port in range(base, last + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free cluster port range in 24000-32000")


def node_settings(data_root: Path, node_id: str, index: int, ports: list[int]) -> Any:
    from rollbox.config import Settings

    base = Settings()  # the host's node: its image store, uid band and pool stay its own
    s = Settings.for_node(base, node_id, index, uid_slots=UID_SLOTS)
    s.data_dir = data_root / node_id
    s.node_share = base.node_share / EDGES
    s.platform_ports = (*s.platform_ports, *ports)  # no sandbox reaches the cluster's ports
    return s


# ---- the child processes ----------------------------------------------------------------------


async def edge_main(a: argparse.Namespace) -> None:
    from rollbox.edge.edge import Edge
    from rollbox.edge.service import serve_edge
    from rollbox.events.store import EventLog

    s = node_settings(a.data_root, a.node_id, a.index, a.ports)
    s.data_dir.mkdir(parents=True, exist_ok=True)
    events = EventLog(s.data_dir / "events.db")
    edge = Edge(s, events)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await edge.start()
    try:
        async with serve_edge(edge, "127.0.0.1", a.port, a.token_file.read_text().strip()):
            print("ready", flush=True)
            await stop.wait()
    finally:
        await edge.close(destroy=True)
        events.close()


async def replica_main(a: argparse.Namespace) -> None:
    import uvicorn

    from rollbox.api.app import create_app
    from rollbox.compat.frontdoors import FRONT_DOORS
    from rollbox.config import Settings
    from rollbox.edge.remote import RemoteEdge
    from rollbox.events.store import EventLog
    from rollbox.iam.postgres import open_postgres
    from rollbox.placement import Placement, PlacementConfig
    from rollbox.placement.registry import EdgeRegistry
    from rollbox.watcher import Watcher

    s = Settings()
    token = a.token_file.read_text().strip()
    remotes = [RemoteEdge(node, url, token) for node, url in
               (e.split("=", 1) for e in a.edges.split(","))]
    registry = EdgeRegistry(remotes)
    iam, ledger = await open_postgres(a.dsn_file.read_text().strip())
    a.state_dir.mkdir(parents=True, exist_ok=True)
    events = EventLog(a.state_dir / "events.db")
    watcher = Watcher(registry, settings=s, ledger=ledger)
    await watcher.start()
    try:
        placement = Placement(registry, watcher, config=PlacementConfig.from_settings(s))
        app = create_app(placement, iam, ledger=ledger, front_doors=FRONT_DOORS,
                         watcher=watcher)
        config = uvicorn.Config(app, host="127.0.0.1", port=a.port, http="httptools",
                                loop="asyncio", lifespan="on", access_log=False,
                                log_level="warning", backlog=4096, timeout_keep_alive=30,
                                timeout_graceful_shutdown=5)
        await uvicorn.Server(config).serve()
    finally:
        await watcher.stop()
        for r in remotes:
            await r.close()
        await iam.close()
        await ledger.close()
        events.close()


def child_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench/cluster.py")
    p.add_argument("role", choices=["_edge", "_replica"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-file", type=Path, required=True)
    p.add_argument("--data-root", type=Path)
    p.add_argument("--node-id")
    p.add_argument("--index", type=int)
    p.add_argument("--ports", type=lambda t: [int(x) for x in t.split(",")], default=[])
    p.add_argument("--edges")
    p.add_argument("--dsn-file", type=Path, help="the DSN (it holds the password: not argv)")
    p.add_argument("--state-dir", type=Path)
    a = p.parse_args(argv)
    import uvloop

    uvloop.run(edge_main(a) if a.role == "_edge" else replica_main(a))


# ---- the benchmark ----------------------------------------------------------------------------


class Procs:
    """The child processes, each in its own session; all stopped by :meth:`stop_all`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[1] / "src"),
                        os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv],
                                stdout=log, stderr=log, env=env, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-2000:]

    def wait_line(self, name: str, line: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited: {self.log_tail(name)}")
            if line in (self.root / f"{name}.log").read_text(errors="replace"):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{name} not ready after {timeout}s: {self.log_tail(name)}")

    def stop_all(self) -> None:
        for name, proc in reversed(list(self.procs.items())):  # replicas before edges
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                say(f"  {name} did not stop in 60 s: killed")
                proc.kill()
                proc.wait()


async def cycles(clients: list[Any], image: str, n: int, conc: int,
                 raise_errors: bool = False) -> dict[str, Any]:
    """create -> exec true -> destroy, cycle i through clients[i % len]."""
    counter = iter(range(n))

    async def cycle() -> bool:
        client = clients[next(counter) % len(clients)]
        sb = await client.create(image, ttl_s=300)
        try:
            r = await sb.exec(["true"])
        finally:
            await sb.delete()
        return r.exit_code == 0

    return await run_cycles(cycle, n, conc, raise_errors=raise_errors)


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = sum(r["n"] - r["errors"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    return {"per_s": ok / wall if wall else 0.0, "n": sum(r["n"] for r in runs),
            "errors": sum(r["errors"] for r in runs), "wall_s": wall,
            "p50_ms": sorted(r["p50_ms"] for r in runs)[len(runs) // 2],
            "p99_ms": max(r["p99_ms"] for r in runs)}


async def node_loss(pids: dict[str, int], clients: list[Any], urls: list[str], key: str,
                    image: str) -> dict[str, Any]:
    """SIGSTOP the edge of a sandbox's node; seconds until the api reports it node_lost."""
    import httpx

    sb = await clients[0].create(image, ttl_s=300)
    node = sb.id.rsplit("-", 1)[0]
    pid = pids[node]
    async with httpx.AsyncClient(base_url=urls[1], timeout=5,
                                 headers={"Authorization": f"Bearer {key}"}) as c:
        assert (await c.get(f"/v1/sandboxes/{sb.id}")).json()["state"] == "running"
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 60:
                try:
                    r = await c.get(f"/v1/sandboxes/{sb.id}", timeout=0.3)
                except httpx.TimeoutException:
                    continue
                if r.status_code == 410 and \
                        r.json()["error"]["details"].get("reason") == "node_lost":
                    return {"node_loss_detect_s": time.monotonic() - t0,
                            "node_loss_node": node}
                await asyncio.sleep(0.05)
            return {"node_loss_detect_s": None, "node_loss_node": node}
        finally:
            os.kill(pid, signal.SIGCONT)  # its fence tears the sandbox down; stop later


async def measure(quick: bool, cluster_urls: list[str], cluster_key: str, emb_url: str,
                  emb_key: str, image: str, pids: dict[str, int]) -> dict[str, Any]:
    import rollbox

    sizes = {8: 8, 32: 32} if quick else {8: 48, 32: 96}  # cycles per half
    out: dict[str, Any] = {}
    async with rollbox.AsyncClient(cluster_urls, cluster_key) as c0, \
            rollbox.AsyncClient(cluster_urls[::-1], cluster_key) as c1, \
            rollbox.AsyncClient(emb_url, emb_key) as e:
        say("warm-up")
        await cycles([c0, c1], image, 4, 4, raise_errors=True)
        await cycles([e], image, 4, 4, raise_errors=True)
        for conc, n in sizes.items():
            runs: dict[str, list[dict[str, Any]]] = {"cluster": [], "embedded": []}
            for half in range(2):
                for side, clients in (("embedded", [e]), ("cluster", [c0, c1]))[
                        ::1 if half == 0 else -1]:
                    say(f"c{conc} {side} half {half + 1}: {n} create/exec/destroy")
                    runs[side].append(await cycles(clients, image, n, conc))
            for side, rs in runs.items():
                m = merge(rs)
                out[f"{side}_c{conc}_ops_per_s"] = m["per_s"]
                out[f"{side}_c{conc}_p50_ms"] = m["p50_ms"]
                out[f"{side}_c{conc}_p99_ms"] = m["p99_ms"]
                out[f"{side}_c{conc}_errors"] = m["errors"]
                out[f"{side}_c{conc}_n"] = m["n"]
            out[f"cluster_vs_embedded_c{conc}"] = ratio(out[f"cluster_c{conc}_ops_per_s"],
                                                        out[f"embedded_c{conc}_ops_per_s"])
        say("node loss: SIGSTOP one edge")
        out.update(await node_loss(pids, [c0, c1], cluster_urls, cluster_key, image))
    return out


def run_ray(quick: bool) -> dict[str, Any]:
    """The real cluster: ``cluster.local.up(replicas=2, nodes=3)`` (Ray head + 2 simulated
    worker nodes, an edge actor each, PostgreSQL, 2 replicas with watcher and ledger)."""
    import ray

    from rollbox.cluster import local
    from rollbox.cluster.edge_actor import edge_actor
    from rollbox.config import Settings
    from rollbox.embedded import server_process

    root = Path(tempfile.mkdtemp(prefix="rollbox-bench-clusterr-"))
    root.chmod(0o711)  # runc resolves rootfs paths as the sandbox's unprivileged host uid
    s = Settings()
    s.cluster_dir = root
    s.cluster_port_base = free_port_base()
    s.node_id = f"bc{secrets.token_hex(2)}"
    out: dict[str, Any] = {"quick": quick, "topology": TOPOLOGY_RAY, "edges": EDGES,
                           "replicas": REPLICAS, "loadavg_start": os.getloadavg()}
    image = "busybox:test"
    try:
        say("cluster up (3 Ray nodes, 3 edge actors, PostgreSQL, 2 replicas)")
        t0 = time.monotonic()
        state = local.up(s, replicas=REPLICAS, nodes=EDGES)
        out["cluster_up_s"] = time.monotonic() - t0
        ray.init(address=state.gcs, namespace="rollbox", log_to_driver=False,
                 logging_level="warning")
        try:
            pids = {n.node_id: int(ray.get(edge_actor(n.node_id).info.remote())["pid"])
                    for n in state.nodes}
        finally:
            ray.shutdown()
        key = Path(state.admin_key).read_text().strip()
        say("embedded server (rollbox serve, defaults)")
        with server_process() as (emb_url, emb_key):
            out.update(asyncio.run(measure(quick, state.replica_urls, key, emb_url, emb_key,
                                           image, pids)))
        out["image"] = image
        out["loadavg_end"] = os.getloadavg()
    finally:
        say("cluster down (replicas, edges and their sandboxes, Ray, PostgreSQL)")
        local.down(s)
        # the nodes' run dirs and their parent (/run/rollbox-cluster-<base>: this run's own
        # port range), also when an edge never started (an edge whose start failed after
        # mounting its run dir's tmpfs leaves it mounted: HostResourceConflict, seen here)
        for i in range(EDGES):
            run_dir = local.node_settings(s, f"{s.node_id}c{i}", i, nodes=EDGES).run_dir
            if os.path.ismount(run_dir):
                subprocess.run(["umount", str(run_dir)], check=False)
        shutil.rmtree(local.node_settings(s, f"{s.node_id}c0", 0, nodes=EDGES).run_dir.parent,
                      ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    return out


def run(quick: bool) -> dict[str, Any]:
    from rollbox.cluster.postgres import PostgresServer
    from rollbox.embedded import server_process
    from rollbox.iam.postgres import PostgresIam

    root = Path(tempfile.mkdtemp(prefix="rollbox-bench-clusterb-"))
    root.chmod(0o711)  # the postgres user and runc's unprivileged uids traverse it
    procs = Procs(root)
    token_file = root / "cluster.token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, secrets.token_urlsafe(32).encode())
    os.close(fd)
    tag = secrets.token_hex(2)
    edge_nodes = [f"bc{tag}n{i}" for i in range(EDGES)]
    edge_ports = [free_port() for _ in range(EDGES)]
    replica_ports = [free_port() for _ in range(REPLICAS)]
    ports = ",".join(str(p) for p in (*edge_ports, *replica_ports))
    pg = PostgresServer(root / "pg", port=None, socket_dir=root / "pg.sock")
    out: dict[str, Any] = {"quick": quick, "topology": TOPOLOGY, "edges": EDGES,
                           "replicas": REPLICAS, "loadavg_start": os.getloadavg()}
    image = "busybox:test"
    try:
        say("PostgreSQL")
        pg.start()
        say("3 edges, 2 api replicas")
        for i, (node, port) in enumerate(zip(edge_nodes, edge_ports)):
            procs.start(f"edge-{i}", ["_edge", "--port", str(port), "--token-file",
                                      str(token_file), "--data-root", str(root / "nodes"),
                                      "--node-id", node, "--index", str(NODE_INDEX0 + i),
                                      "--ports", ports])
        for i in range(EDGES):
            procs.wait_line(f"edge-{i}", "ready")

        async def operator_key() -> str:
            iam = await PostgresIam.open(pg.dsn)
            try:
                return await iam.create_operator_key("admin")
            finally:
                await iam.close()

        key = asyncio.run(operator_key())
        dsn_file = root / "pg.dsn"
        fd = os.open(dsn_file, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, pg.dsn.encode())
        os.close(fd)
        edges = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(edge_nodes, edge_ports))
        for i, port in enumerate(replica_ports):
            procs.start(f"replica-{i}", ["_replica", "--port", str(port), "--token-file",
                                         str(token_file), "--edges", edges, "--dsn-file",
                                         str(dsn_file), "--state-dir",
                                         str(root / f"replica-{i}")])
        urls = [f"http://127.0.0.1:{p}" for p in replica_ports]
        from rollbox.edge.server import wait_healthy

        for i, url in enumerate(urls):
            proc = procs.procs[f"replica-{i}"]
            wait_healthy(url, lambda: proc.poll() is None, root / f"replica-{i}.log")
        say("embedded server (rollbox serve, defaults)")
        with server_process() as (emb_url, emb_key):
            pids = {n: procs.procs[f"edge-{i}"].pid for i, n in enumerate(edge_nodes)}
            out.update(asyncio.run(measure(quick, urls, key, emb_url, emb_key, image, pids)))
        out["image"] = image
        out["loadavg_end"] = os.getloadavg()
    finally:
        say("stopping replicas, edges (their sandboxes destroyed), PostgreSQL")
        procs.stop_all()
        pg.stop()
        for node in edge_nodes:  # the nodes' run dirs are siblings of the default one
            shutil.rmtree(node_settings(root / "nodes", node, 0, []).run_dir,
                          ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    return out


def main(quick: bool = False, json_out: bool = False, topology: str = "ray") -> dict[str, Any]:
    if topology not in ("ray", "assembled"):
        from rollbox import errors

        raise errors.BadRequest("--topology: ray or assembled", topology=topology)
    res = run_ray(quick) if topology == "ray" else run(quick)
    if not json_out:
        for k, v in res.items():
            say(f"  {k}: {v}")
    return emit(res, json_out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        child_main(sys.argv[1:])
    else:
        main(quick="--quick" in sys.argv, json_out="--json" in sys.argv,
             topology="assembled" if "--assembled" in sys.argv else "ray")
