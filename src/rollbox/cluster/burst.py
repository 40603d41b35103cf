"""Cloud bursting's node side (DSec §3.4): ask Ray's autoscaler for burst nodes above the
cluster's use threshold, start an edge on each that comes up, and give them back when idle.

- Burst node types: each burst slot is an autoscaler node type of its own
  (:func:`burst_node_types`) carrying the ``rollbox_burst`` resource and the
  ``rollbox_node:<id>`` resource of its rollbox node id, so a Ray node that comes up names its
  edge; its edge runs with ``ROLLBOX_NODE_BURST=1`` (reports say ``burst``, placement sends it
  only what :class:`~rollbox.placement.burst.BurstPolicy` allows).
- Demand: while :func:`~rollbox.placement.burst.cluster_use` of the watcher's view is at or
  above the threshold and no burst node has room below it (and none asked for is still
  coming), one more burst node is asked for, up to ``burst_nodes``, as
  ``ray.autoscaler.sdk.request_resources(bundles=[{"rollbox_burst": 1}] * n)`` (the request
  replaces the previous one).
- The edge of a burst node holds the node's ``rollbox_burst`` unit while it runs (sandboxes are
  no Ray work, so this is what keeps Ray from calling the node idle).
- Release: a burst node with no sandbox and no create in its view for ``burst_idle_s`` while the
  cluster is below the threshold is drained (its edge refuses creates), checked empty on the
  edge itself (a create that landed after the probe keeps the node), left by placement and the
  watcher (the registry), its edge stopped (a verified teardown), and the request lowered: the
  node is then idle for Ray, and the autoscaler ends it after its own idle timeout.

Owns the burst nodes' lifecycle decisions (:class:`BurstScaler`) and the Ray side of them
(:class:`RayBurstNodes`). Does not decide which sandbox may burst (``placement.burst``), place
sandboxes (``placement``) nor probe edges (``watcher``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from rollbox import errors
from rollbox.edge.interface import EdgeAPI
from rollbox.placement.burst import BurstConfig, cluster_use, live_sandboxes
from rollbox.placement.registry import EdgeRegistry
from rollbox.placement.view import ClusterView

log = logging.getLogger(__name__)

BURST_RESOURCE = "rollbox_burst"
NODE_RESOURCE = "rollbox_node:"  # as rollbox.cluster.ray_nodes.NODE_RESOURCE


def burst_node_id(prefix: str, slot: int) -> str:
    return f"{prefix}b{slot}"


def burst_node_types(prefix: str, slots: int, *, cpus: float = 0,
                     object_store_mib: int = 256) -> dict[str, Any]:
    """The autoscaler's ``available_node_types`` entries of ``slots`` burst nodes (one type per
    slot, at most one node each; ``min_workers`` 0: none runs until asked for)."""
    if not 0 <= slots <= 64:
        raise errors.BadRequest("burst slots: 0..64", slots=slots)
    return {f"rollbox.burst.{slot}": {
        "resources": {"CPU": cpus, BURST_RESOURCE: 1,
                      NODE_RESOURCE + burst_node_id(prefix, slot): 1,
                      "object_store_memory": object_store_mib << 20},
        "node_config": {}, "min_workers": 0, "max_workers": 1,
    } for slot in range(slots)}


class BurstNodes(Protocol):
    """The node side the scaler drives (blocking calls; the scaler runs them in a thread)."""

    def request(self, count: int) -> None:
        """Ask the autoscaler for ``count`` burst nodes in all."""

    def up(self) -> set[str]:
        """Rollbox node ids of the burst nodes whose Ray node is alive."""

    def start_edge(self, node_id: str) -> EdgeAPI | None:
        """Start the edge of burst node ``node_id`` (holding its ``rollbox_burst`` unit), or
        adopt the one it has, and return the handle placement and the watcher reach it by
        (None when the edge registers itself: ``BurstScaler(registry=None)``)."""

    def drain(self, node_id: str) -> int:
        """Make ``node_id``'s edge refuse creates; its live sandboxes and creates under way
        now, as the edge itself counts them."""

    def undrain(self, node_id: str) -> None: ...

    def stop_edge(self, node_id: str) -> None:
        """Stop ``node_id``'s edge (its sandboxes destroyed, teardown verified) for good."""


class RayBurstNodes:
    """:class:`BurstNodes` on a Ray cluster (``ray.init`` done by the caller): demand through
    ``ray.autoscaler.sdk.request_resources``; the edge's start, drain and stop are given
    (``edges``: an object with ``start_edge``, ``drain``, ``undrain``, ``stop_edge`` of a node
    id, e.g. the edge actors of ``rollbox.cluster.edge_actor``)."""

    def __init__(self, edges: Any) -> None:
        self.edges = edges

    def request(self, count: int) -> None:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[{BURST_RESOURCE: 1}] * count)

    def up(self) -> set[str]:
        import ray

        out: set[str] = set()
        for n in ray.nodes():
            res = n.get("Resources", {})
            if n.get("Alive") and BURST_RESOURCE in res:
                out |= {k[len(NODE_RESOURCE):] for k in res if k.startswith(NODE_RESOURCE)}
        return out

    def start_edge(self, node_id: str) -> EdgeAPI | None:
        return self.edges.start_edge(node_id)  # type: ignore[no-any-return]

    def drain(self, node_id: str) -> int:
        return int(self.edges.drain(node_id))

    def undrain(self, node_id: str) -> None:
        self.edges.undrain(node_id)

    def stop_edge(self, node_id: str) -> None:
        self.edges.stop_edge(node_id)


@dataclasses.dataclass
class BurstState:
    """What the scaler knows between ticks (``BurstScaler.state``)."""

    target: int = 0  # burst nodes asked of the autoscaler
    edges: set[str] = dataclasses.field(default_factory=set)  # burst nodes with an edge
    idle_since: dict[str, float] = dataclasses.field(default_factory=dict)
    released: set[str] = dataclasses.field(default_factory=set)  # edge stopped, node going
    started_at: float | None = None  # when the last request for one more node was made


class BurstScaler:
    """One control loop per cluster (in a cluster: the detached actor of
    ``cluster.burst_actor``): :meth:`tick` once per ``interval_s`` (:meth:`run`).
    ``registry``: the nodes placement and the watcher follow (burst edges join and leave it
    here); None: the edges' own registration is the membership (a cluster's edge actors
    register in the GCS, where every replica reads them)."""

    def __init__(self, view: ClusterView, registry: EdgeRegistry | None, nodes: BurstNodes,
                 config: BurstConfig, *, interval_s: float = 1.0, start_timeout_s: float = 300,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.view = view
        self.registry = registry
        self.nodes = nodes
        self.config = config
        self.interval_s = interval_s
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self.state = BurstState()

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one failed tick (Ray, an edge) is retried
                log.exception("burst tick failed")
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> None:
        st, cfg, now = self.state, self.config, self.clock()
        up = await asyncio.to_thread(self.nodes.up)
        st.released &= up  # a released node the autoscaler ended is gone for good
        for nid in sorted(up - st.edges - st.released):  # a burst node came up: its edge
            handle = await asyncio.to_thread(self.nodes.start_edge, nid)
            if self.registry is not None and handle is not None:
                self.registry.add(handle)
            st.edges.add(nid)
            st.started_at = None
            log.info("burst node %s up, its edge started", nid)
        nodes = self.view.nodes()
        over = cluster_use(nodes) >= cfg.threshold
        views = {n.node_id: n for n in nodes if n.node_id in st.edges}
        for nid in st.edges:
            nv = views.get(nid)
            busy = nv is None or nv.health != "alive" or live_sandboxes(nv) > 0
            if busy or over:
                st.idle_since.pop(nid, None)
            else:
                st.idle_since.setdefault(nid, now)
        for nid, since in sorted(st.idle_since.items()):
            if now - since >= cfg.idle_s:
                await self._release(nid)
        # asked for and not up yet, or up with an edge the view does not show alive yet
        coming = st.target > len(st.edges) or any(
            nid not in views or views[nid].health != "alive" for nid in st.edges)
        if coming and st.started_at is not None and now - st.started_at > self.start_timeout_s:
            log.warning("a burst node asked for %.0f s ago did not come up", now - st.started_at)
            st.target, coming, st.started_at = len(st.edges), False, None
        if over and not coming and st.target < cfg.max_nodes and not any(
                cluster_use([dataclasses.replace(nv, burst=False)]) < cfg.threshold
                for nv in views.values() if nv.health == "alive"):
            st.target = len(st.edges) + 1
            st.started_at = now
            log.info("cluster over its burst threshold: asking for burst node %d", st.target)
        await asyncio.to_thread(self.nodes.request, st.target)

    async def _release(self, nid: str) -> None:
        st = self.state
        left = await asyncio.to_thread(self.nodes.drain, nid)
        if left:  # a create landed after the view was taken: the node stays
            await asyncio.to_thread(self.nodes.undrain, nid)
            st.idle_since.pop(nid, None)
            return
        if self.registry is not None and self.registry.remove(nid) is None:
            log.warning("burst node %s was not in the registry", nid)
        await asyncio.to_thread(self.nodes.stop_edge, nid)
        st.edges.discard(nid)
        st.idle_since.pop(nid, None)
        st.released.add(nid)
        st.target = max(0, st.target - 1)
        log.info("burst node %s idle: drained, its edge stopped, given back", nid)
