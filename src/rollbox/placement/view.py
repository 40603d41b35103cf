"""What placement decides from: a cached view of the nodes, filled by the watcher.

A decision reads a snapshot of this view and never calls an edge. The watcher
(``rollbox.watcher``) implements :class:`ClusterView`; tests and the placement benchmark may
build :class:`NodeView` lists directly.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

NodeHealth = Literal["alive", "suspect", "dead"]


@dataclass(frozen=True)
class NodeView:
    """One node as its last probe saw it."""

    node_id: str
    health: NodeHealth
    # backend kinds the node offers now (its capacity()["backends"][kind]["offered"])
    backends: frozenset[str]
    # room left per budget after overcommit, as the edge's admission counts it: "sandboxes",
    # "cpus", "memory_mib" (a budget the node does not report is not bounded)
    free: Mapping[str, float]
    # the most one sandbox may ask there, per budget (capacity()["limits"])
    limits: Mapping[str, float] = field(default_factory=dict)
    # creates in progress on the node at the probe
    starting: int = 0
    # layer digests present in the node's cache (a bounded bonus for images already there)
    layers: frozenset[str] = frozenset()
    # a burst node (started by the autoscaler above the cluster's use threshold)
    burst: bool = False
    # live sandboxes on the node at the probe (NodeReport.sandboxes_total; what releasing an
    # idle burst node looks at: ``free`` is not limits minus these, other budgets bound it)
    sandboxes: int = 0
    # time.monotonic() of this process when the probe this came from was sent: placement
    # counts its own creates that ended after it as not in the view yet (0: unknown, every
    # create that ended before the view was handed out is taken to be in it)
    seen_at: float = 0.0


class ClusterView(Protocol):
    """A snapshot of every known node; cheap (no I/O), safe to call per decision."""

    # The same sequence object until the view changes (placement rebuilds its indexes of a
    # snapshot when it is handed another one: a new list per call works, but costs a rebuild
    # per decision); a node probed again is a new NodeView.
    def nodes(self) -> Sequence[NodeView]: ...

    def node(self, node_id: str) -> NodeView | None: ...
