"""The cluster's one burst scaler: a detached Ray actor on the head running
:class:`~rollbox.cluster.burst.BurstScaler`.

Why an actor and not one elected api replica: the scaler needs a Ray driver (it asks the
autoscaler with ``ray.autoscaler.sdk.request_resources``, reads ``ray.nodes()`` and creates
edge actors), which replicas are built not to be (they read the edge registry with a GCS client
only, and keep serving while the GCS restarts). A named actor (``burst-scaler`` in namespace
``rollbox``) is exactly one per cluster by Ray's own naming, with no election or lease of ours
to get wrong; Ray restarts it if its process dies (``max_restarts=-1``) and it is pinned to the
head (``NodeAffinitySchedulingStrategy``: the node whose loss ends the cluster anyway).

The actor runs, on an event loop thread of its own: an
:class:`~rollbox.cluster.replica.EdgeDirectory` (the edges as they registered in the GCS), a
:class:`~rollbox.watcher.Watcher` over them (the view the scaler decides from) and the scaler
with :class:`ClusterBurstNodes` (no registry of its own: a burst edge actor registers itself
like every edge, and every replica picks it up). A restarted scaler adopts the burst edges
that run (``start_edge`` of a node whose edge actor is alive returns it) and asks for as many
nodes as it has.

Owns the scaler's process and the burst edges' start, drain and stop. Does not decide who may
burst (``placement.burst``), what a decision is (``cluster.burst``) nor start Ray nodes (the
autoscaler; ``cluster.burst_provider`` on this host).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from rollbox import errors
from rollbox.cluster.burst import BURST_RESOURCE
from rollbox.cluster.edge_actor import LoopThread, read_token

log = logging.getLogger(__name__)

ACTOR_NAME = "burst-scaler"


class ClusterBurstNodes:
    """:class:`~rollbox.cluster.burst.BurstNodes` of a cluster (blocking; the scaler runs each
    call in a thread). ``slots``: rollbox node id -> ``{"port": edge port, "env": the node's
    ROLLBOX_* variables, "token_file": where the node's edge reads the cluster token}``
    (``cluster.local.burst_slots``: the node's own dirs, cgroup parent, uid band and subnet,
    ``ROLLBOX_NODE_BURST=1``)."""

    def __init__(self, slots: Mapping[str, Mapping[str, Any]], address: str,
                 dsn_file: str | None) -> None:
        self.slots = {k: dict(v) for k, v in slots.items()}
        self.address, self.dsn_file = address, dsn_file

    def request(self, count: int) -> None:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[{BURST_RESOURCE: 1}] * count)

    def up(self) -> set[str]:
        from rollbox.cluster.burst import RayBurstNodes

        return RayBurstNodes(None).up() & set(self.slots)

    def start_edge(self, node_id: str) -> None:
        from rollbox.cluster.edge_actor import create_edge, edge_actor, registered_node_alive

        try:
            edge_actor(node_id)
            if registered_node_alive(node_id):
                log.info("burst node %s: its edge runs, adopted", node_id)
                return
        except errors.NotFound:
            pass
        slot = self.slots[node_id]
        create_edge(node_id, slot["env"], self.address, int(slot["port"]),
                    str(slot["token_file"]), dsn_file=self.dsn_file,
                    resources={BURST_RESOURCE: 1})

    def drain(self, node_id: str) -> int:
        import ray

        from rollbox.cluster.edge_actor import edge_actor

        return int(ray.get(edge_actor(node_id).drain.remote(True), timeout=60))

    def undrain(self, node_id: str) -> None:
        import ray

        from rollbox.cluster.edge_actor import edge_actor

        ray.get(edge_actor(node_id).drain.remote(False), timeout=60)

    def stop_edge(self, node_id: str) -> None:
        from rollbox.cluster.edge_actor import stop_edge

        stop_edge(node_id, destroy=True, verify=True)


class BurstScalerActor(LoopThread):
    """The actor (see the module docstring); made by :func:`start_scaler`."""

    def __init__(self, gcs: str, token_file: str, slots: Mapping[str, Mapping[str, Any]],
                 config: Mapping[str, float], address: str, dsn_file: str | None = None,
                 interval_s: float = 1.0) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from rollbox.placement.burst import BurstConfig

        # the token from its root-only file on the head (never an actor argument: those sit
        # in Ray's GCS), read again when Ray restarts the actor
        self.gcs, self.token = gcs, read_token(token_file)
        self.nodes = ClusterBurstNodes(slots, address, dsn_file)
        self.config = BurstConfig(**config)  # type: ignore[arg-type]
        self.interval_s = interval_s
        self.scaler: Any = None
        self._stop: asyncio.Event | None = None
        self._start_loop("rollbox-burst", 120)

    async def _main(self) -> None:
        from rollbox.cluster.burst import BurstScaler
        from rollbox.cluster.replica import EdgeDirectory
        from rollbox.watcher import Watcher

        directory = EdgeDirectory(self.gcs, self.token)
        await directory.refresh()
        watcher = Watcher(directory.registry)
        await watcher.start()
        self.scaler = BurstScaler(watcher, None, self.nodes, self.config,
                                  interval_s=self.interval_s)
        # a restarted scaler: the burst nodes that run keep their edges and their request
        self.scaler.state.target = len(await asyncio.to_thread(self.nodes.up))
        self._stop = asyncio.Event()
        tasks = [asyncio.create_task(directory.run()), asyncio.create_task(self.scaler.run())]
        self._ready.set_result(None)
        try:
            await self._stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await watcher.stop()
            await directory.aclose()

    def state(self) -> dict[str, Any]:
        """What the scaler holds: burst nodes asked for, with an edge, released, idle since."""
        st = self.scaler.state
        return {"target": st.target, "edges": sorted(st.edges), "released": sorted(st.released),
                "idle": sorted(st.idle_since)}

    def stop(self, timeout: float = 30) -> None:
        """Stop the loop (no more requests or edge starts); the caller kills the actor."""
        assert self.loop is not None and self._stop is not None and self._thread is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)


def start_scaler(gcs: str, token_file: str, slots: Mapping[str, Mapping[str, Any]],
                 config: Mapping[str, float], address: str, head_node: str,
                 dsn_file: str | None = None, interval_s: float = 1.0,
                 timeout: float = 180) -> Any:
    """Create the cluster's burst scaler on the head's Ray node ``head_node`` (a Ray node id)
    and wait until it runs; BadRequest if the cluster has one. ``token_file``: the cluster
    token's root-only file on the head's host. Needs ``ray.init``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rollbox.cluster.edge_actor import NAMESPACE, started

    try:
        actor = ray.remote(BurstScalerActor).options(
            name=ACTOR_NAME, namespace=NAMESPACE, lifetime="detached", max_restarts=-1,
            max_task_retries=0, num_cpus=0, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(head_node, soft=False),
        ).remote(gcs, token_file, dict(slots), dict(config), address, dsn_file, interval_s)
    except ValueError as exc:
        raise errors.BadRequest("the cluster already has a burst scaler") from exc
    return started(actor, actor.state, timeout)


def stop_scaler(timeout: float = 60) -> bool:
    """Stop the cluster's burst scaler for good (no restart); False if it has none."""
    import ray

    from rollbox.cluster.edge_actor import NAMESPACE

    try:
        actor = ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return False
    try:
        ray.get(actor.stop.remote(), timeout=timeout)
    except Exception:  # noqa: BLE001 - killed below either way
        log.warning("the burst scaler did not stop cleanly", exc_info=True)
    finally:
        ray.kill(actor, no_restart=True)
    return True


def scaler_state(timeout: float = 10) -> dict[str, Any] | None:
    """The burst scaler's :meth:`BurstScalerActor.state` (None: the cluster has none)."""
    import ray

    from rollbox.cluster.edge_actor import NAMESPACE

    try:
        actor = ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return None
    return dict(ray.get(actor.state.remote(), timeout=timeout))
