"""Placement: route a sandbox id to its edge and choose an edge for a new sandbox.

Sandbox ids are ``<node_id>-<random hex>`` so any api replica can route them without shared
state. A create is decided from a :class:`~rollbox.placement.view.ClusterView` (the
watcher's cached view) alone, never an edge call per decision (``placement.choice``: filter,
score, power-of-k, this replica's pending placements, the starts cap) and sent to the chosen
edge; a refusal is retried on the next choice, boundedly. There is no other way to decide: a
process that holds its edges itself (the embedded node, tests) watches them with a
``rollbox.watcher.Watcher`` too (``rollbox.watcher.placement_over``).

Owns the set of edges (``add_edge``/``remove_edge`` while running) and this replica's pending
placements; does not create ids (edges do) nor track health (the watcher does).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
from collections.abc import Callable, Collection, Mapping, Sequence

from rollbox import errors
from rollbox.config import Settings
from rollbox.edge.interface import EdgeAPI
from rollbox.models import SandboxInfo, SandboxSpec
from rollbox.placement.burst import BurstPolicy
from rollbox.placement.choice import Chooser, PlacementConfig, StartsCapped, named_digests
from rollbox.placement.registry import EdgeRegistry, as_registry
from rollbox.placement.view import ClusterView

__all__ = ["Placement", "PlacementConfig", "named_digests", "split_sandbox_id"]

log = logging.getLogger(__name__)

_ID_RE = re.compile(r"^(?P<node>[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*)-(?P<rand>[0-9a-f]{8,64})$")


def split_sandbox_id(sandbox_id: str) -> tuple[str, str]:
    """``"n0-3fa2..." -> ("n0", "3fa2...")``; BadRequest-free: NotFound for anything malformed."""
    m = _ID_RE.match(sandbox_id) if len(sandbox_id) <= 200 else None
    if m is None:
        raise errors.NotFound(f"no sandbox {sandbox_id[:80]!r}")
    return m["node"], m["rand"]


async def _capacity(edge: EdgeAPI) -> object:
    """What an edge's ``capacity()`` (EdgeAPI, local or remote) says; None when it fails."""
    try:
        cap = await edge.capacity()
    except Exception:
        log.warning("capacity() of %s failed", edge.node_id, exc_info=True)
        return None
    return cap


class Placement:
    """``edges``: the nodes creates may go to, a shared :class:`EdgeRegistry` (its owner, the
    cluster's membership, adds and removes nodes; the watcher follows the same one) or a
    sequence of edges (a registry of its own; :meth:`add_edge` and :meth:`remove_edge` change
    either); ``view``: the watcher's cached view every decision reads (required: no decision
    calls an edge); ``config``: default from ``Settings()``; ``layers_of``: the layer digests
    of a spec's image, for the bonus of nodes caching them (default: only the digests the spec
    names itself, :func:`named_digests`: the api does not know an image name's layers);
    ``clock``: the clock of ``NodeView.seen_at`` (time.monotonic); ``burst``: cloud
    bursting's policy (burst nodes take only the specs it allows, when it allows them; None:
    any batch spec)."""

    def __init__(self, edges: EdgeRegistry | Sequence[EdgeAPI],
                 view: ClusterView, *,
                 config: PlacementConfig | None = None,
                 layers_of: Callable[[SandboxSpec], Collection[str]] | None = None,
                 clock: Callable[[], float] | None = None,
                 rng: random.Random | None = None,
                 burst: BurstPolicy | None = None) -> None:
        if not isinstance(edges, EdgeRegistry):
            ids = [e.node_id for e in edges]
            if len(set(ids)) != len(ids):
                raise ValueError(f"duplicate node id in {ids!r}")
        self.edges = as_registry(edges)
        self.view = view
        self.config = config or PlacementConfig.from_settings(Settings())
        # cloud bursting (rollbox.placement.burst): which specs burst nodes take, and when
        self.burst = burst
        self.chooser = Chooser(view, self.config, self.edges, layers_of, clock, rng,
                               burst_gate=burst.allows if burst is not None else None)
        # Set (and replaced) when a create ends: what a create waiting at the starts cap waits on.
        self._ended = asyncio.Event()
        self._waiting = 0

    def add_edge(self, edge: EdgeAPI) -> None:
        """A node joins (into the registry): creates may go to it once the view shows it
        alive. BadRequest if another edge has its id."""
        self.edges.add(edge)

    def remove_edge(self, node_id: str) -> EdgeAPI:
        """A node leaves (the registry): no create goes to it any more and its ids route
        nowhere (NotFound from :meth:`edge_for`). Creates in flight to it end as they end.
        NotFound if it is not a member."""
        edge = self.edges.remove(node_id)
        if edge is None:
            raise errors.NotFound(f"no node {node_id[:80]!r}", node=node_id)
        self.chooser.forget(node_id)
        return edge

    def edge_for(self, sandbox_id: str) -> EdgeAPI:
        node, _ = split_sandbox_id(sandbox_id)
        edge = self.edges.get(node)
        if edge is None:
            raise errors.NotFound(f"no sandbox {sandbox_id[:80]!r} (unknown node {node!r})")
        return edge

    # ---- create ---------------------------------------------------------------------------
    async def create(self, spec: SandboxSpec, owner: str,
                     requested: str | None = None) -> SandboxInfo:
        """Create on a chosen node of those offering ``spec.backend``; a node that refuses
        (capacity / infra) is skipped and the next choice tried, ``max_attempts`` nodes in all.
        BadRequest when no node offers the backend; CapacityExceeded when none has room (or
        every one that has is at the starts cap for ``start_wait_s``); the last refusal's
        error when every attempt was refused. ``requested``: the api's sandbox.requested
        event, passed to the edge's create (``EdgeAPI.create``; not passed when None)."""
        extra = {} if requested is None else {"requested": requested}
        chooser, tried = self.chooser, []
        last: errors.InfraError | None = None
        if self.burst is not None:
            await self.burst.prepare(spec)  # the shared store's answer for its layers, cached
        for _ in range(self.config.max_attempts):
            try:
                node = chooser.choose(spec, tried)
            except StartsCapped:
                node = await self._wait_for_start(spec, tried)
            except errors.CapacityExceeded:
                if last is None:
                    raise
                break  # no other node fits: say what the nodes tried said
            edge = self.edges.get(node)
            try:
                if edge is None:
                    raise errors.InfraError(f"node {node!r} left the cluster", node=node)
                info = await edge.create(spec, owner, **extra)
            except errors.InfraError as exc:  # CapacityExceeded is an InfraError
                chooser.ended(node, spec, ok=False)
                chooser.refused(node)
                self._wake()
                log.info("node %s refused a sandbox: %s", node, exc)
                last = exc
                tried.append(node)
                continue
            except BaseException:
                chooser.ended(node, spec, ok=False)
                self._wake()
                raise
            chooser.ended(node, spec, ok=True)
            self._wake()
            return info
        assert last is not None
        if isinstance(last, errors.CapacityExceeded):
            raise errors.CapacityExceeded(f"{len(tried)} nodes refused: full; retry later",
                                          nodes=tried)
        raise last

    def _wake(self) -> None:
        """A create ended: a start slot may be free (for creates waiting at the starts cap)."""
        if self._waiting:
            self._ended.set()
            self._ended = asyncio.Event()

    async def _wait_for_start(self, spec: SandboxSpec, tried: Collection[str]) -> str:
        """Every node that fits is at the starts cap: decide again when a create of this
        replica ends or the view may have changed (every 100 ms), for up to start_wait_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.start_wait_s
        while (left := deadline - loop.time()) > 0:
            self._waiting += 1
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(0.1, left)):
                        await self._ended.wait()
            finally:
                self._waiting -= 1
            try:
                return self.chooser.choose(spec, tried)
            except StartsCapped:
                continue
        raise errors.CapacityExceeded(
            f"every node with room is starting {self.config.max_starts} sandboxes; retry "
            "later", reason="starts", max_starts=self.config.max_starts)

    async def node_limits(self) -> dict[str, float]:
        """The most any one node can hold, per budget (``capacity()["limits"]`` of the edges:
        sandboxes, cpus, memory_mib, layer_mib); what a project quota may not exceed. Asks the
        edges (an operator's call, not a create's), but not those the view says are dead."""
        out: dict[str, float] = {}
        dead = {nv.node_id for nv in self.view.nodes() if nv.health == "dead"}
        edges = [e for n, e in self.edges.items() if n not in dead]
        for cap in await asyncio.gather(*(_capacity(e) for e in edges)):
            limits = cap.get("limits") if isinstance(cap, Mapping) else None
            if isinstance(limits, Mapping):
                for k, v in limits.items():
                    if isinstance(v, (int, float)):
                        out[k] = max(out.get(k, 0.0), float(v))
        return out

    async def list(self, owner: str | None, labels: dict[str, str]) -> list[SandboxInfo]:
        edges = dict(self.edges)  # as it is now: nodes may join or leave meanwhile
        results = await asyncio.gather(
            *(e.list(owner, labels) for e in edges.values()), return_exceptions=True
        )
        out: list[SandboxInfo] = []
        for node, res in zip(edges, results):
            if isinstance(res, BaseException):
                # A dead node must not hide the others' sandboxes; the watcher reports it.
                log.warning("listing node %s failed: %r", node, res)
                continue
            out.extend(res)
        out.sort(key=lambda i: i.created_at)
        return out
