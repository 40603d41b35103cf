"""One api replica of a cluster: a stateless process serving the whole ``/v1`` api.

Owns the replica's wiring: it finds the edges in the Ray GCS (each edge actor registers
``(node id, url)``; re-read every second, so nodes that join or leave are picked up), holds a
:class:`~rollbox.edge.remote.RemoteEdge` per edge (HTTP with the cluster token), a
:class:`~rollbox.watcher.Watcher` probing them (health, node_lost, ``/v1/cluster/status``), a
:class:`~rollbox.placement.Placement` over them (with the cluster's
:class:`~rollbox.placement.burst.BurstPolicy`: which specs burst nodes may take), the cluster's
shared IAM and its job leases (:class:`~rollbox.jobs.postgres.PostgresLeaseStore`: a job
opened through one replica is heartbeated and listed through any). Any replica
serves any request: a sandbox id names its node, placement routes it. Replicas share one port
with ``SO_REUSEPORT`` (the kernel spreads new connections over the live listeners: no extra
hop or balancer process; a dead replica's listener is gone at once and new connections go to the
others) and each also listens on a port of its own (the SDK's fail-over list, tests).
Holds no state of its own: killing a replica loses nothing but its open connections.
Does not start edges, Ray nodes or PostgreSQL (``cluster.local``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DISCOVERY_PERIOD_S = 1.0


def listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


class EdgeDirectory:
    """The cluster's edges as this replica knows them, kept in an
    :class:`~rollbox.placement.registry.EdgeRegistry` (which the watcher probes and placement
    routes through), refreshed from the GCS registry every second."""

    def __init__(self, gcs: str, token: str) -> None:
        from rollbox.placement.registry import EdgeRegistry

        self.gcs, self.token = gcs, token
        self.urls: dict[str, str] = {}
        self.registry = EdgeRegistry()
        self._client: Any = None  # the GCS client, kept between reads (made anew after a failure)

    def _read(self) -> dict[str, str]:
        """The registered edges (in a thread). One kept GCS client: a new one per read cost
        ~3.6 ms of CPU a second per replica, a kept one ~0.3 ms (measured on this host)."""
        from rollbox.cluster.edge_actor import gcs_client, registered_edges

        if self._client is None:
            self._client = gcs_client(self.gcs)
        try:
            return registered_edges(self.gcs, self._client)
        except Exception:
            self._client = None
            raise

    async def refresh(self) -> None:
        from rollbox.edge.remote import RemoteEdge

        try:
            urls = await asyncio.to_thread(self._read)
        except Exception as exc:  # noqa: BLE001 - GCS down: keep the edges we know
            log.warning("edge registry not readable: %r", exc)
            return
        if urls == self.urls:
            return
        # An edge that deregistered (cluster down) leaves; one that died without it stays
        # registered (the watcher declares it dead and its sandboxes node_lost).
        edges = {n: self.registry[n] for n in urls
                 if n in self.registry and self.urls.get(n) == urls[n]}
        gone = [self.registry[n] for n in self.registry if edges.get(n) is not self.registry[n]]
        for node, url in urls.items():
            if node not in edges:
                edges[node] = RemoteEdge(node, url, self.token)
        self.registry.replace(edges.values())  # placement's and the watcher's, shared
        self.urls = dict(urls)
        for edge in gone:
            await edge.close()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(DISCOVERY_PERIOD_S)
            await self.refresh()

    async def aclose(self) -> None:
        for edge in list(self.registry.values()):
            await edge.close()


async def _wait_for_edges(directory: EdgeDirectory, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while True:
            await directory.refresh()
            if directory.registry:
                return
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def replica_app(gcs: str, token: str, dsn: str, state_dir: Path,
                      name: str) -> AsyncIterator[Any]:
    from rollbox.api.app import create_app
    from rollbox.api.ports import PortConfig
    from rollbox.compat.frontdoors import FRONT_DOORS
    from rollbox.config import Settings
    from rollbox.events.store import EventLog
    from rollbox.iam.postgres import PostgresIam, PostgresLedger
    from rollbox.jobs.postgres import PostgresLeaseStore
    from rollbox.placement import Placement
    from rollbox.placement.burst import BurstPolicy
    from rollbox.watcher import Watcher

    directory = EdgeDirectory(gcs, token)
    await _wait_for_edges(directory, 120)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(directory.aclose)
        iam = await PostgresIam.open(dsn)
        stack.push_async_callback(iam.close)
        ledger = await PostgresLedger.open(dsn)
        stack.push_async_callback(ledger.close)
        leases = await PostgresLeaseStore.connect(dsn)
        stack.push_async_callback(leases.close)
        burst = BurstPolicy.from_settings(Settings())
        stack.push_async_callback(burst.close)
        own = state_dir / "replicas" / name
        own.mkdir(parents=True, exist_ok=True)
        events = EventLog(own / "events.db")
        stack.callback(events.close)
        # The watcher reconciles the shared ledger with the edges' live sets (every replica
        # does: a reconcile is idempotent).
        watcher = Watcher(directory.registry, ledger=ledger)
        # Placement decides from the watcher's view.
        placement = Placement(directory.registry, watcher, burst=burst)
        await watcher.start()
        stack.push_async_callback(watcher.stop)
        task = asyncio.create_task(directory.run())
        stack.push_async_callback(asyncio.gather, task, return_exceptions=True)
        stack.callback(task.cancel)
        # The port tokens' key: one file in the replicas' shared state dir (or the setting).
        yield create_app(placement, iam, leases=leases, ledger=ledger,
                         front_doors=FRONT_DOORS, watcher=watcher,
                         port_config=PortConfig.from_settings(Settings(), key_dir=state_dir))


async def serve(gcs: str, token: str, dsn: str, state_dir: Path, host: str,
                shared_port: int, own_port: int, name: str) -> None:
    import uvicorn

    socks = [listen(host, shared_port, reuse_port=True), listen(host, own_port, False)]
    async with replica_app(gcs, token, dsn, state_dir, name) as app:
        config = uvicorn.Config(app, http="httptools", loop="asyncio", lifespan="on",
                                access_log=False, log_level="warning",
                                limit_concurrency=65536, backlog=4096, timeout_keep_alive=30,
                                timeout_graceful_shutdown=5)
        await uvicorn.Server(config).serve(sockets=socks)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rollbox.cluster.replica")
    p.add_argument("--gcs", required=True, help="Ray GCS address host:port")
    p.add_argument("--token-file", required=True, type=Path)
    p.add_argument("--dsn-file", required=True, type=Path, help="the PostgreSQL DSN (0600)")
    p.add_argument("--state-dir", required=True, type=Path)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", required=True, type=int, help="the replicas' shared port")
    p.add_argument("--own-port", required=True, type=int)
    p.add_argument("--name", required=True)
    a = p.parse_args(argv)
    from rollbox.config import Settings
    from rollbox.terminal import escaped_logging

    escaped_logging(logging.WARNING, json_lines=Settings().log_format == "json")
    from rollbox.isolation import oom

    oom.protect()
    import uvloop

    token = a.token_file.read_text().strip()
    dsn = a.dsn_file.read_text().strip()
    uvloop.run(serve(a.gcs, token, dsn, a.state_dir, a.host, a.port, a.own_port, a.name))


if __name__ == "__main__":
    main()
