"""The edges of the cluster by node id, updated while it runs: nodes join and leave.

One :class:`EdgeRegistry` is shared by the parts that reach edges (the watcher probes each one,
placement routes sandbox ids and creates through them); the cluster's membership (Ray's node
list, ``rollbox.cluster``) or the embedded node fills it. Owns the mapping only: no health (the
watcher's), no choice between edges (placement's).
"""
from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView

from rollbox import errors
from rollbox.edge.interface import EdgeAPI


class EdgeRegistry(Mapping[str, EdgeAPI]):
    """node id -> edge; ``version`` counts the changes (a reader caches by it). A change
    replaces the inner dict (never changes it in place): an iteration that spans an await
    (a route asking every node) goes on over the membership it started with."""

    def __init__(self, edges: Iterable[EdgeAPI] = ()) -> None:
        self._edges: dict[str, EdgeAPI] = {}
        self.version = 0
        for e in edges:
            self.add(e)

    def __getitem__(self, node_id: str) -> EdgeAPI:
        return self._edges[node_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._edges)

    def __len__(self) -> int:
        return len(self._edges)

    # Views of the membership as it is now (a later change does not show in them).
    def keys(self) -> KeysView[str]:
        return self._edges.keys()

    def items(self) -> ItemsView[str, EdgeAPI]:
        return self._edges.items()

    def values(self) -> ValuesView[EdgeAPI]:
        return self._edges.values()

    def add(self, edge: EdgeAPI) -> None:
        """A node joins; BadRequest if its id is taken by another edge (a node that joins
        with a duplicate id). Adding the same edge again is a no-op."""
        have = self._edges.get(edge.node_id)
        if have is edge:
            return
        if have is not None:
            raise errors.BadRequest(f"node id {edge.node_id!r} is already in the cluster",
                                    node=edge.node_id)
        self._edges = {**self._edges, edge.node_id: edge}
        self.version += 1

    def remove(self, node_id: str) -> EdgeAPI | None:
        """A node leaves (None: it was not there)."""
        edge = self._edges.get(node_id)
        if edge is not None:
            self._edges = {n: e for n, e in self._edges.items() if n != node_id}
            self.version += 1
        return edge

    def replace(self, edges: Iterable[EdgeAPI]) -> None:
        """Make the registry exactly ``edges`` (the membership as Ray lists it now); an edge
        object that changed for a node id (e.g. a restarted actor's handle) replaces it."""
        new: dict[str, EdgeAPI] = {}
        for e in edges:
            if e.node_id in new and new[e.node_id] is not e:
                raise errors.BadRequest(f"duplicate node id {e.node_id!r}", node=e.node_id)
            new[e.node_id] = e
        if new.keys() != self._edges.keys() or any(new[k] is not v
                                                   for k, v in self._edges.items()):
            self._edges = new
            self.version += 1


def as_registry(edges: EdgeRegistry | Mapping[str, EdgeAPI] | Iterable[EdgeAPI]) -> EdgeRegistry:
    """``edges`` as a registry: a registry itself (shared, so its updates are seen), else a new
    one of the given edges."""
    if isinstance(edges, EdgeRegistry):
        return edges
    if isinstance(edges, Mapping):
        return EdgeRegistry(edges.values())
    return EdgeRegistry(edges)
