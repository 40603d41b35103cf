"""The decision of view-based placement: which node of the watcher's cached view gets a new
sandbox. Synchronous and free of I/O (a decision reads the view, never an edge):

- filter: the node is ``alive``, offers ``spec.backend``, is not a burst node unless the spec
  may burst (:func:`may_burst`, which may look only at the spec's backend and qos: pools are
  cached per both), fits ``spec.resources`` in what the view says is free minus
  this replica's pending placements (and has a sandbox slot), has fewer creates in progress
  than the starts cap (the view's ``starting`` plus this replica's own), and has not refused a
  create since its last probe;
- score: the room left as a share of the node's budgets (the smallest over sandboxes, CPUs and
  memory, pending placements taken off), plus a bounded bonus for the share of the spec's layers
  the node caches;
- power-of-k choices: ``k`` fitting nodes drawn at random (more for ``latency``), the best
  score wins.

A placement is pending on its node from the decision until the view shows it: while its
create runs, then until a probe of the node sent after the create ended (``NodeView.seen_at``
on this clock). So a burst does not pile onto the node that looked emptiest at the last probe.

Owns this replica's pending placements per node and the indexes it builds of each view
snapshot. Does not call edges (``Placement`` does) nor probe nodes (the watcher).
"""
from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from rollbox import errors
from rollbox.config import Settings
from rollbox.models import SandboxSpec
from rollbox.placement.registry import EdgeRegistry
from rollbox.placement.view import ClusterView, NodeView

INF = math.inf
BUDGETS = ("sandboxes", "cpus", "memory_mib")


@dataclass(frozen=True)
class PlacementConfig:
    """The placement settings (``Settings.placement_*``, docs/settings.md)."""

    k: int
    k_latency: int
    max_attempts: int
    max_starts: int
    start_wait_s: float
    layer_bonus: float

    def __post_init__(self) -> None:
        if not (self.k >= 1 and self.k_latency >= 1 and self.max_attempts >= 1
                and self.max_starts >= 1 and self.start_wait_s >= 0
                and 0 <= self.layer_bonus <= 1):
            raise ValueError("placement settings out of range: k, k_latency, max_attempts, "
                             "max_starts >= 1, start_wait_s >= 0, 0 <= layer_bonus <= 1")

    @classmethod
    def from_settings(cls, s: Settings) -> PlacementConfig:
        return cls(k=s.placement_k, k_latency=s.placement_k_latency,
                   max_attempts=s.placement_max_attempts, max_starts=s.placement_max_starts,
                   start_wait_s=s.placement_start_wait_s, layer_bonus=s.placement_layer_bonus)


def named_digests(spec: SandboxSpec) -> tuple[str, ...]:
    """The layer digests a spec names itself (its image or extra layers given as
    ``sha256-...``): what the api knows of a spec's layers without asking a node. An image
    name's layers need a resolver (``Placement(layers_of=...)``)."""
    if not spec.layers:  # the common case, per decision: no set, no generator
        return (spec.image,) if spec.image.startswith("sha256-") else ()
    return tuple(x for x in dict.fromkeys((spec.image, *spec.layers)) if x.startswith("sha256-"))


def may_burst(spec: SandboxSpec) -> bool:
    """Whether ``spec`` may go to a burst node: best-effort (``batch``) only; ``latency``
    creates never do. Cloud bursting narrows it further per decision through the chooser's
    ``burst_gate`` (rollbox.placement.burst: container backend, layers in the shared chunk
    store, cluster use above its threshold)."""
    return spec.qos == "batch"


class StartsCapped(Exception):
    """Internal: nodes fit, but every one of them is at the starts cap (the caller waits)."""


class _Pending:
    """This replica's placements on one node that the view does not show yet."""

    __slots__ = ("starting", "sandboxes", "cpus", "memory_mib", "done", "seen", "refused")

    def __init__(self) -> None:
        self.starting = 0  # creates in progress
        self.sandboxes = 0  # in progress + done after the node's last probe was sent
        self.cpus = 0.0
        self.memory_mib = 0.0
        self.done: deque[tuple[float, float, int]] = deque()  # (ended at, cpus, memory_mib)
        self.seen: NodeView | None = None  # the node's view the counts above are relative to
        self.refused: NodeView | None = None  # refused a create while this view was current

    def forget_seen(self, nv: NodeView) -> None:
        """A new view of the node: creates that ended before its probe was sent are in it
        (a view without ``seen_at`` shows them all)."""
        if nv is self.seen:
            return
        self.seen = nv
        done = self.done
        while done and (nv.seen_at <= 0 or done[0][0] <= nv.seen_at):
            _, cpus, mem = done.popleft()
            self.sandboxes -= 1
            self.cpus -= cpus
            self.memory_mib -= mem
        if self.refused is not None and self.refused is not nv:
            self.refused = None


class _Node:
    """One alive node of a snapshot, as numbers a decision reads (no mapping lookups)."""

    __slots__ = ("id", "view", "pending", "free_s", "free_c", "free_m", "inv_s", "inv_c",
                 "inv_m", "starting", "layers", "burst")

    def __init__(self, nv: NodeView, pending: _Pending, scale: dict[str, float]) -> None:
        self.id = nv.node_id
        self.view = nv
        self.pending = pending
        (self.free_s, self.inv_s), (self.free_c, self.inv_c), (self.free_m, self.inv_m) = (
            _budget(nv, b, scale[b]) for b in BUDGETS)
        self.starting = nv.starting
        self.layers = nv.layers
        self.burst = nv.burst


def _budget(nv: NodeView, name: str, scale: float) -> tuple[float, float]:
    """(free, 1 / the budget's size) of one budget of a node: a budget the node does not
    report is unbounded (free INF, never the smallest share); one without a size in
    ``limits`` is scaled by the largest free of that budget in the snapshot (so such nodes
    still rank by how much is free)."""
    free = nv.free.get(name)
    if free is None:
        return INF, 1.0
    size = nv.limits.get(name) or scale
    return float(free), 1.0 / size if size > 0 else 1.0


class _Snapshot:
    """Indexes of one ``ClusterView.nodes()`` result (rebuilt when the view hands out another
    sequence): the alive nodes per (backend, may burst), the kinds offered by any node."""

    def __init__(self, nodes: Sequence[NodeView], pending: dict[str, _Pending],
                 members: EdgeRegistry) -> None:
        self.source = nodes
        self.version = members.version
        self.offered_any: set[str] = set()  # by a node of any health
        self.offered_alive: set[str] = set()
        scale = {b: max([1.0] + [float(nv.free[b]) for nv in nodes if b in nv.free
                                 and not nv.limits.get(b)]) for b in BUDGETS}
        self.alive: list[_Node] = []
        self.any_burst = False  # an alive member is a burst node
        for nv in nodes:
            if nv.node_id not in members:
                continue  # left the cluster or not joined yet
            self.offered_any |= nv.backends
            p = pending.get(nv.node_id)
            if p is None:
                p = pending[nv.node_id] = _Pending()
            p.forget_seen(nv)
            if nv.health == "alive":
                self.offered_alive |= nv.backends
                self.alive.append(_Node(nv, p, scale))
                self.any_burst = self.any_burst or nv.burst
        self.pools: dict[tuple[str, str], list[_Node]] = {}

    def pool(self, spec: SandboxSpec) -> list[_Node]:
        """The alive nodes that offer ``spec.backend`` and may take its qos (cached per
        backend and qos)."""
        key = (spec.backend, spec.qos)
        pool = self.pools.get(key)
        if pool is None:
            burst_ok = may_burst(spec)
            pool = self.pools[key] = [n for n in self.alive if spec.backend in n.view.backends
                                      and (burst_ok or not n.burst)]
        return pool

    def no_pool(self, spec: SandboxSpec) -> errors.RollboxError:
        kind = spec.backend
        if kind not in self.offered_any:
            offered = sorted(self.offered_any)
            return errors.BadRequest(f"backend {kind!r} is not offered by any node; offered: "
                                     f"{', '.join(offered) or 'none'}",
                                     backend=kind, offered=offered)
        if kind not in self.offered_alive:
            return errors.CapacityExceeded(f"no healthy node offers backend {kind!r} now; "
                                           "retry later", reason="unhealthy", backend=kind)
        return errors.CapacityExceeded(f"backend {kind!r} is offered only by burst nodes, "
                                       f"which take no {spec.qos} sandbox", reason="burst",
                                       backend=kind)


class Chooser:
    """Decisions from a :class:`ClusterView` (see the module's docstring). ``members``: the
    nodes placement can send creates to (a node of the view that is not one is skipped)."""

    def __init__(self, view: ClusterView, config: PlacementConfig,
                 members: EdgeRegistry,
                 layers_of: Callable[[SandboxSpec], Collection[str]] | None = None,
                 clock: Callable[[], float] | None = None,
                 rng: random.Random | None = None,
                 burst_gate: Callable[[SandboxSpec, Sequence[NodeView]], bool] | None = None,
                 ) -> None:
        self.view = view
        self.config = config
        self.members = members
        # cloud bursting's hook (rollbox.placement.burst.BurstPolicy.allows): whether a spec
        # whose qos may burst may go to a burst node of this snapshot now (None: it may)
        self.burst_gate = burst_gate
        self.layers_of = layers_of or named_digests
        self.clock = clock or time.monotonic
        self.rng = rng or random.Random()
        self.pending: dict[str, _Pending] = {}
        self._snap: _Snapshot | None = None

    def forget(self, node_id: str) -> None:
        self.pending.pop(node_id, None)
        self._snap = None

    def snapshot(self) -> _Snapshot:
        nodes = self.view.nodes()
        snap = self._snap
        if snap is None or snap.source is not nodes or snap.version != self.members.version:
            snap = self._snap = _Snapshot(nodes, self.pending, self.members)
        return snap

    def choose(self, spec: SandboxSpec, tried: Collection[str] = ()) -> str:
        """The node for ``spec`` (counted pending there: call :meth:`ended` after its create);
        ``tried``: nodes that refused it already. BadRequest when no node offers the backend,
        CapacityExceeded when none fits, StartsCapped when those that fit are all starting
        their cap of creates."""
        snap = self.snapshot()
        pool = snap.pools.get((spec.backend, spec.qos))
        if pool is None:
            pool = snap.pool(spec)
        if not pool:
            raise snap.no_pool(spec)
        cfg = self.config
        k = cfg.k_latency if spec.qos == "latency" else cfg.k
        r = spec.resources
        cpus, mem, cap = r.cpus, r.memory_mib, cfg.max_starts
        capped = 0
        gate = self.burst_gate
        no_burst = snap.any_burst and gate is not None and not gate(spec, snap.source)

        def fits(x: _Node) -> bool:
            nonlocal capped
            p = x.pending
            if (p.refused is not None or (no_burst and x.burst) or x.free_s - p.sandboxes < 1
                    or x.free_c - p.cpus < cpus or x.free_m - p.memory_mib < mem
                    or (tried and x.id in tried)):
                return False
            if x.starting + p.starting >= cap:
                capped += 1
                return False
            return True

        n = len(pool)
        picks: list[_Node] = []
        if n > 4 * k:  # draw at random, skipping what does not fit (uniform over what fits)
            rand = self.rng.random
            drawn: list[int] = []
            for _ in range(4 * k):
                i = int(rand() * n)
                if i in drawn:
                    continue
                drawn.append(i)
                if fits(pool[i]):
                    picks.append(pool[i])
                    if len(picks) == k:
                        break
        if len(picks) < k:  # a small pool, or most of it does not fit: look at every node
            capped = 0
            fitting = [x for x in pool if fits(x)]
            if not fitting:
                if capped:
                    raise StartsCapped()
                raise errors.CapacityExceeded(
                    f"no node has room for a {spec.backend} sandbox of {cpus:g} CPUs and "
                    f"{mem} MiB now; retry later", reason="full", nodes=len(pool))
            picks = fitting if len(fitting) <= k else self.rng.sample(fitting, k)
        best = picks[0]
        if len(picks) > 1:
            keys = self.layers_of(spec) if cfg.layer_bonus else ()
            best_score = -INF
            for x in picks:
                s = self.score(x, keys)
                if s > best_score:
                    best, best_score = x, s
        p = best.pending
        p.starting += 1
        p.sandboxes += 1
        p.cpus += cpus
        p.memory_mib += mem
        return best.id

    def score(self, x: _Node, keys: Collection[str]) -> float:
        """The share of node ``x`` left after this replica's pending placements (its tightest
        budget), plus ``layer_bonus`` times the share of ``keys`` (layer digests) it caches."""
        p = x.pending
        s = (x.free_s - p.sandboxes) * x.inv_s
        c = (x.free_c - p.cpus) * x.inv_c
        m = (x.free_m - p.memory_mib) * x.inv_m
        if c < s:
            s = c
        if m < s:
            s = m
        if keys and x.layers:
            cached = x.layers
            hits = 0
            for d in keys:
                if d in cached:
                    hits += 1
            s += self.config.layer_bonus * hits / len(keys)
        return s

    def ended(self, node_id: str, spec: SandboxSpec, ok: bool) -> None:
        """The create :meth:`choose` sent to ``node_id`` ended: made (pending until a probe
        shows it) or not (no longer pending)."""
        p = self.pending.get(node_id)
        if p is None:
            return  # the node left meanwhile
        p.starting -= 1
        r = spec.resources
        if ok:
            p.done.append((self.clock(), r.cpus, r.memory_mib))
        else:
            p.sandboxes -= 1
            p.cpus -= r.cpus
            p.memory_mib -= r.memory_mib

    def refused(self, node_id: str) -> None:
        """``node_id`` refused a create: no decision picks it until its next probe."""
        p = self.pending.get(node_id)
        if p is not None and p.seen is not None:
            p.refused = p.seen
