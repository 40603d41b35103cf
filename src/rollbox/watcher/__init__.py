"""Watcher: the cluster's view of its nodes, kept by probing every edge every second.

Owns the per-node view placement decides from (``rollbox.placement.view.ClusterView``): health
(alive, suspect, dead), capacity, live counts per node, backend and project, cached layers; a
node that stops answering becomes suspect, then dead, and its sandboxes are reported dead with
reason ``node_lost``. Rebuilds everything by re-polling after its own restart: holds no state
that is not on an edge. Reconciles the quota ledger with the edges' live sets. Does not create,
place or delete sandboxes itself, except telling a returning edge which of its sandboxes were
declared lost meanwhile.

How (docs/watcher.md):

- Every ``interval_s`` each edge of the registry (``placement.registry.EdgeRegistry``: nodes
  join and leave at run time) gets one probe, ``EdgeAPI.report()``, as a task of its own,
  bounded by ``probe_timeout_s``; an edge whose probe is still out is not probed again, so a
  slow edge never delays the others.
- Health by the age of a node's last answered probe: ``alive`` up to ``suspect_s``, then
  ``suspect`` (a node not answered yet is suspect too), ``dead`` past ``dead_s``. Dead sticks:
  the sandboxes of the node's last report are declared lost (``lost``, ``lost_info``: dead,
  ``node_lost``); when the node answers again it is told to tear them down
  (``EdgeAPI.declare_lost``) before it is alive again, so none comes back stale.
- Fencing (``fence``): each probe carries ``dead_s`` as the edge's fence. An edge no probe
  reached for that long tears its sandboxes down itself, and an edge that starts after such a
  gap does not re-adopt them (``rollbox.edge.fence``); a quick restart (kill -9, back within
  seconds) still re-adopts them. This is what holds when this watcher restarted meanwhile and
  forgot what it declared lost. Off for an edge in the watcher's own process (embedded): they
  stop together, nobody else declares it lost.
- Reports carry no labels (``NodeSandbox``: bounded facts, a few hundred bytes a sandbox, so
  no project can slow a probe toward its timeout with its labels). Label filters over a dead
  or silent node's sandboxes (``lost_infos``, ``last_known_infos``) answer from the labels
  this process saw of each sandbox in a create or list answer (``remember``: kept up to
  ``LABELS_KEPT_BYTES``, oldest dropped first); one whose labels it never saw is listed only
  by a list without a label filter (labels ``{}``).
- Every ``reconcile_s``, and at once when a node turns dead, the ledger (:class:`Ledger`, if given) gets the live sets of the nodes
  whose last probe answered in full (alive, not truncated), and of the dead nodes (empty: their
  sandboxes are lost).
- Placement decides from this view only (``rollbox.placement``); a process that holds its edges
  itself gets both over one registry from :func:`placement_over` (the api app started over
  such a placement runs its watcher for its lifetime, ``rollbox.api.create_app``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rollbox import errors
from rollbox.config import Settings
from rollbox.edge.interface import EdgeAPI
from rollbox.models import (
    NODE_LOST, ClusterStatus, NodeHealth, NodeReport, NodeSandbox, NodeStatus, Resources,
    SandboxInfo,
)
from rollbox.placement import Placement, PlacementConfig
from rollbox.placement.registry import EdgeRegistry, as_registry
from rollbox.placement.view import NodeView

log = logging.getLogger(__name__)
# Telling a returning edge its lost sandboxes (a teardown each) may take longer than a probe.
DECLARE_LOST_TIMEOUT_S = 60.0
# Labels of sandboxes remembered from create and list answers (Watcher.remember), in
# characters of keys and values (+ LABELS_ENTRY_BYTES each): the oldest go first beyond it.
LABELS_KEPT_BYTES = 32 << 20
LABELS_ENTRY_BYTES = 64


class Ledger(Protocol):
    """The quota ledger the watcher reconciles (rollbox.iam's): ``live`` maps each node of
    ``complete_nodes`` to its live sandboxes (a dead node: none); reservations of those nodes'
    sandboxes not in it are released. Returns the number of corrections made."""

    async def reconcile(self, live: Mapping[str, Sequence[NodeSandbox]],
                        complete_nodes: Collection[str]) -> int: ...


@dataclass
class _Node:
    edge: EdgeAPI
    added_at: float
    fence: bool
    report: NodeReport | None = None
    last_ok: float | None = None  # clock() of the last answered probe
    sent_at: float = 0.0  # clock() when that probe was sent (NodeView.seen_at)
    # what health counts silence from: the last answer (or the join), moved on by the time
    # the watcher itself stalled (a stalled watcher is no evidence against a node)
    quiet_since: float = 0.0
    last_error: str | None = None
    health: NodeHealth = "suspect"
    probe: asyncio.Task[None] | None = None
    lost: dict[str, NodeSandbox] = field(default_factory=dict)  # declared lost, not yet torn
    probes: int = 0
    failures: int = 0
    view: NodeView | None = None

    @property
    def node_id(self) -> str:
        return self.edge.node_id


class Watcher:
    """See the module docstring. ``edges``: a registry (shared: joins and leaves are seen at
    the next probe) or the edges themselves; ``settings`` gives the thresholds not passed
    (rollbox.config, group watcher); ``local``: node ids in this process, never fenced."""

    def __init__(self, edges: EdgeRegistry | Mapping[str, EdgeAPI] | Iterable[EdgeAPI], *,
                 interval_s: float | None = None, probe_timeout_s: float | None = None,
                 suspect_s: float | None = None, dead_s: float | None = None,
                 reconcile_s: float | None = None, max_sandboxes: int | None = None,
                 fence: bool | None = None, local: Collection[str] = (),
                 ledger: Ledger | None = None, settings: Settings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        s = settings or Settings()
        self.registry = as_registry(edges)
        self.interval_s = s.watch_interval_s if interval_s is None else interval_s
        self.probe_timeout_s = (s.watch_probe_timeout_s if probe_timeout_s is None
                                else probe_timeout_s)
        self.suspect_s = s.watch_suspect_s if suspect_s is None else suspect_s
        self.dead_s = s.watch_dead_s if dead_s is None else dead_s
        self.reconcile_s = s.watch_reconcile_s if reconcile_s is None else reconcile_s
        self.max_sandboxes = (s.watch_report_max_sandboxes if max_sandboxes is None
                              else max_sandboxes)
        self.fence = s.watch_fence if fence is None else fence
        if not (0 < self.interval_s and 0 < self.probe_timeout_s <= self.suspect_s
                and 0 < self.suspect_s < self.dead_s and self.reconcile_s > 0
                and self.max_sandboxes >= 0):
            raise errors.BadRequest(
                "watcher settings out of range: interval, reconcile > 0, 0 < probe timeout <= "
                "suspect < dead, max sandboxes >= 0",
                interval_s=self.interval_s, suspect_s=self.suspect_s, dead_s=self.dead_s)
        self.local = frozenset(local)
        self.ledger = ledger
        self.clock = clock
        self._nodes: dict[str, _Node] = {}
        self._registry_version = -1
        self._views: tuple[NodeView, ...] | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_tick: float | None = None
        self._reconcile_task: asyncio.Task[None] | None = None
        # set when a node turns dead: its sandboxes' reservations go at once, not up to a
        # reconcile interval later (node loss: zero drift within 10 s)
        self._reconcile_soon = asyncio.Event()
        self.reconciles = 0  # ledger reconciliations done (tests, status)
        # sandbox id -> its labels (and their size) as a create or list answer gave them
        self._labels: OrderedDict[str, tuple[dict[str, str], int]] = OrderedDict()
        self._labels_bytes = 0

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """One round of probes (the view is built before anyone reads it), then the loops."""
        if self._task is not None:
            return
        await self.poll()
        self._task = asyncio.create_task(self._run(), name="watcher")
        if self.ledger is not None:
            self._reconcile_task = asyncio.create_task(self._reconcile_loop(),
                                                       name="watcher-reconcile")

    @property
    def running(self) -> bool:
        """Started and not stopped since (its probe loop runs)."""
        return self._task is not None

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._reconcile_task) if t is not None]
        tasks += [n.probe for n in self._nodes.values() if n.probe is not None]
        self._task = self._reconcile_task = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> Watcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- probing --------------------------------------------------------------------------
    async def _run(self) -> None:
        next_at = self.clock()
        while True:
            next_at += self.interval_s
            self.tick()
            await asyncio.sleep(max(0.0, next_at - self.clock()))
            if self.clock() - next_at > self.interval_s:  # fell behind (a stalled loop)
                next_at = self.clock()

    def tick(self) -> list[asyncio.Task[None]]:
        """Follow the registry, update health, and start a probe of every node that has none
        out; returns the probes started (not awaited)."""
        self._sync_registry()
        now = self.clock()
        if self._last_tick is not None and now - self._last_tick > 2 * self.interval_s:
            stalled = now - self._last_tick - self.interval_s
            log.warning("watcher: stalled for %.1f s; not counted against the nodes", stalled)
            for node in self._nodes.values():
                node.quiet_since += stalled
        self._last_tick = now
        started = []
        for node in self._nodes.values():
            self._update_health(node, now)
            if node.probe is None:
                node.probe = asyncio.create_task(self._probe(node),
                                                 name=f"watcher-probe-{node.node_id}")
                started.append(node.probe)
        return started

    async def poll(self) -> None:
        """One round: probe every node (each bounded by the probe timeout) and wait for the
        answers; what the loop does every interval, for start-up and tests."""
        self.tick()
        out = [n.probe for n in self._nodes.values() if n.probe is not None]
        if out:  # each probe updates its node's health as it ends
            await asyncio.gather(*out, return_exceptions=True)

    def _sync_registry(self) -> None:
        if self.registry.version == self._registry_version:
            return
        self._registry_version = self.registry.version
        now = self.clock()
        for node_id in list(self._nodes):
            edge = self.registry.get(node_id)
            node = self._nodes[node_id]
            if edge is None:  # left the cluster
                log.info("watcher: node %s left", node_id)
                if node.probe is not None:
                    node.probe.cancel()
                del self._nodes[node_id]
            elif edge is not node.edge:  # a new handle (restarted actor): same node
                node.edge = edge
        for node_id, edge in self.registry.items():
            if node_id not in self._nodes:
                log.info("watcher: node %s joined", node_id)
                self._nodes[node_id] = _Node(edge, now, self.fence and node_id not in self.local,
                                             quiet_since=now)
        self._views = None

    async def _probe(self, node: _Node) -> None:
        edge = node.edge
        sent = self.clock()
        try:
            try:
                async with asyncio.timeout(self.probe_timeout_s):
                    report = await edge.report(self.max_sandboxes,
                                               self.dead_s if node.fence else None)
                if report.node_id != node.node_id:
                    raise errors.InfraError(f"node {node.node_id} answered as "
                                            f"{report.node_id!r}")
                if node.health == "dead" and node.lost:
                    report = await self._returned(node, report)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is a missed probe
                node.failures += 1
                node.last_error = f"{type(exc).__name__}: {exc}"[:300]
                if node.failures == 1 or node.health != "dead":
                    log.debug("watcher: probe of %s failed: %s", node.node_id, node.last_error)
                self._update_health(node, self.clock())
                return
            node.probes += 1
            node.last_error = None
            if node.report is not None and node.report.incarnation != report.incarnation:
                log.info("watcher: node %s restarted (incarnation %s -> %s)", node.node_id,
                         node.report.incarnation, report.incarnation)
            node.report = report
            node.last_ok = node.quiet_since = self.clock()
            node.sent_at = sent
            node.view = None
            self._views = None
            self._update_health(node, node.last_ok)
        finally:
            if self._nodes.get(node.node_id) is node:
                node.probe = None

    async def _returned(self, node: _Node, report: NodeReport) -> NodeReport:
        """A dead node answers again: its sandboxes declared lost go first (the edge tears
        down those still live); the report without them."""
        ids = list(node.lost)
        async with asyncio.timeout(DECLARE_LOST_TIMEOUT_S):
            torn = await node.edge.declare_lost(ids)
        log.warning("watcher: node %s is back; %d of its %d sandboxes declared lost were "
                    "still live and are torn down", node.node_id, len(torn), len(ids))
        node.lost.clear()
        for sid in ids:
            self.forget(sid)
        gone = set(ids)
        kept = [sb for sb in report.sandboxes if sb.id not in gone]
        if len(kept) == len(report.sandboxes):
            return report
        counts_b: dict[str, int] = {}
        counts_p: dict[str, int] = {}
        for sb in kept:
            counts_b[sb.backend] = counts_b.get(sb.backend, 0) + 1
            counts_p[sb.owner] = counts_p.get(sb.owner, 0) + 1
        return report.model_copy(update={
            "sandboxes": kept, "sandboxes_total": report.sandboxes_total - (
                len(report.sandboxes) - len(kept)),
            "by_backend": counts_b if not report.truncated else report.by_backend,
            "by_project": counts_p if not report.truncated else report.by_project})

    def _update_health(self, node: _Node, now: float) -> None:
        if node.health == "dead" and node.lost:
            return  # stays dead until the edge took its lost sandboxes down (_returned)
        age = now - node.quiet_since
        if age > self.dead_s:
            health: NodeHealth = "dead"
        elif node.last_ok is None or age > self.suspect_s:
            health = "suspect"
        else:
            health = "alive"
        if health == node.health:
            return
        if health == "dead":
            node.lost = {sb.id: sb for sb in (node.report.sandboxes if node.report else [])}
            log.warning("watcher: node %s is dead (no answer for %.1f s; %s); %d sandboxes "
                        "reported %s", node.node_id, age, node.last_error, len(node.lost),
                        NODE_LOST)
            self._reconcile_soon.set()
        elif node.health == "dead":
            log.warning("watcher: node %s is back (%s)", node.node_id, health)
        else:
            log.info("watcher: node %s is %s", node.node_id, health)
        node.health = health
        node.view = None
        self._views = None

    # ---- the view (ClusterView) -----------------------------------------------------------
    def _view_of(self, node: _Node) -> NodeView:
        if node.view is None:
            r = node.report
            if r is None or node.health == "dead":
                node.view = NodeView(node.node_id, node.health, frozenset(), {},
                                     seen_at=node.sent_at)
            else:
                node.view = NodeView(
                    node.node_id, node.health, frozenset(r.backends), dict(r.free),
                    limits=dict(r.limits), starting=r.starting, layers=frozenset(r.layers),
                    burst=r.burst, sandboxes=r.sandboxes_total, seen_at=node.sent_at)
        return node.view

    def nodes(self) -> Sequence[NodeView]:
        """Every known node as its last probe saw it (no I/O): the same tuple until a probe
        answers, a health changes or a node joins or leaves."""
        if self._views is None:
            self._views = tuple(self._view_of(n) for n in self._nodes.values())
        return self._views

    def node(self, node_id: str) -> NodeView | None:
        node = self._nodes.get(node_id)
        return self._view_of(node) if node is not None else None

    def health(self, node_id: str) -> NodeHealth | None:
        node = self._nodes.get(node_id)
        return node.health if node is not None else None

    def report(self, node_id: str) -> NodeReport | None:
        """The node's last answered report (None: none yet, or unknown node)."""
        node = self._nodes.get(node_id)
        return node.report if node is not None else None

    # ---- labels (not in reports) ----------------------------------------------------------
    def remember(self, infos: Iterable[SandboxInfo]) -> None:
        """Keep the labels of sandboxes a create or list answer gave (what label filters of a
        dead or silent node's sandboxes answer from); labels never change after create."""
        for info in infos:
            size = LABELS_ENTRY_BYTES + sum(len(k) + len(v) for k, v in info.labels.items())
            old = self._labels.pop(info.id, None)
            if old is not None:
                self._labels_bytes -= old[1]
            self._labels[info.id] = (dict(info.labels), size)
            self._labels_bytes += size
        while self._labels_bytes > LABELS_KEPT_BYTES and self._labels:
            self._labels_bytes -= self._labels.popitem(last=False)[1][1]

    def forget(self, sandbox_id: str) -> None:
        """Drop a sandbox's remembered labels (it is gone)."""
        old = self._labels.pop(sandbox_id, None)
        if old is not None:
            self._labels_bytes -= old[1]

    def labels_of(self, sandbox_id: str) -> dict[str, str] | None:
        """The sandbox's labels as remembered (None: never seen in a create or list answer,
        or dropped since)."""
        known = self._labels.get(sandbox_id)
        return known[0] if known is not None else None

    def _infos(self, sandboxes: Iterable[NodeSandbox], node_id: str, owner: str | None,
               labels: Mapping[str, str] | None, dead: bool) -> list[SandboxInfo]:
        out = []
        for sb in sandboxes:
            if owner is not None and sb.owner != owner:
                continue
            known = self.labels_of(sb.id)
            if labels and (known is None
                           or any(known.get(k) != v for k, v in labels.items())):
                continue
            out.append(info_of(sb, node_id, "dead" if dead else sb.state, known or {}))
        return out

    # ---- sandboxes of dead nodes ----------------------------------------------------------
    def dead_nodes(self) -> frozenset[str]:
        return frozenset(n for n, node in self._nodes.items() if node.health == "dead")

    def lost(self, sandbox_id: str, node_id: str) -> NodeSandbox | None:
        """The sandbox as its dead node last reported it (None: the node is not dead, or its
        last report did not list it)."""
        node = self._nodes.get(node_id)
        if node is None or node.health != "dead":
            return None
        return node.lost.get(sandbox_id)

    def lost_infos(self, owner: str | None = None,
                   labels: Mapping[str, str] | None = None) -> list[SandboxInfo]:
        """The sandboxes of dead nodes (owner None: all; with each of ``labels``, as
        ``EdgeAPI.list`` filters, by the labels remembered of them: one never seen in a
        create or list answer matches no label filter), each ``dead`` with reason
        ``node_lost`` (what list shows instead of dropping them)."""
        out = []
        for node_id, node in self._nodes.items():
            if node.health == "dead":
                out += self._infos(node.lost.values(), node_id, owner, labels, dead=True)
        return out

    def last_known_infos(self, node_id: str, owner: str | None = None,
                         labels: Mapping[str, str] | None = None) -> list[SandboxInfo]:
        """A node's sandboxes as its last report listed them (for a list the node does not
        answer now; filtered as ``lost_infos``)."""
        node = self._nodes.get(node_id)
        if node is None or node.report is None:
            return []
        return self._infos(node.report.sandboxes, node_id, owner, labels, dead=False)

    # ---- ledger ---------------------------------------------------------------------------
    def live_sets(self) -> tuple[dict[str, list[NodeSandbox]], list[str]]:
        """(live sandboxes per node, complete nodes): the nodes whose last probe answered in
        full (alive: within the suspect threshold; not truncated), and the dead ones (empty:
        their sandboxes are lost)."""
        live: dict[str, list[NodeSandbox]] = {}
        for node_id, node in self._nodes.items():
            if node.health == "dead":
                live[node_id] = []
            elif node.health == "alive" and node.report is not None \
                    and not node.report.truncated:
                live[node_id] = list(node.report.sandboxes)
        return live, list(live)

    async def reconcile(self) -> int:
        """One reconciliation of the ledger (0 without one)."""
        if self.ledger is None:
            return 0
        live, complete = self.live_sets()
        fixed = await self.ledger.reconcile(live, complete)
        self.reconciles += 1
        if fixed:
            log.info("watcher: ledger reconciled, %d corrections", fixed)
        return fixed

    async def _reconcile_loop(self) -> None:
        while True:
            try:  # every reconcile_s, or at once when a node turned dead
                async with asyncio.timeout(self.reconcile_s):
                    await self._reconcile_soon.wait()
            except TimeoutError:
                pass
            self._reconcile_soon.clear()
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("watcher: ledger reconciliation failed")

    # ---- status ---------------------------------------------------------------------------
    def status(self, project: str | None = None) -> ClusterStatus:
        """Nodes, health and live counts per node, backend and project (``rollbox cluster
        status``); with ``project``, only that project's sandboxes are counted and named."""
        now = self.clock()
        nodes = []
        total_b: dict[str, int] = {}
        total_p: dict[str, int] = {}
        for node_id, node in sorted(self._nodes.items()):
            r = node.report
            by_b: dict[str, int] = {}
            by_p: dict[str, int] = {}
            count = 0
            if r is not None and node.health != "dead":
                if project is None:
                    by_b, by_p, count = dict(r.by_backend), dict(r.by_project), r.sandboxes_total
                else:
                    for sb in r.sandboxes:
                        if sb.owner == project:
                            by_b[sb.backend] = by_b.get(sb.backend, 0) + 1
                    count = r.by_project.get(project, 0)
                    if count:
                        by_p = {project: count}
            lost = sum(1 for sb in node.lost.values()
                       if node.health == "dead" and (project is None or sb.owner == project))
            for k, v in by_b.items():
                total_b[k] = total_b.get(k, 0) + v
            for k, v in by_p.items():
                total_p[k] = total_p.get(k, 0) + v
            nodes.append(NodeStatus(
                node_id=node_id, health=node.health,
                incarnation=r.incarnation if r is not None else None,
                last_seen_s=round(now - node.last_ok, 3) if node.last_ok is not None else None,
                backends=list(r.backends) if r is not None else [],
                free=dict(r.free) if r is not None and node.health != "dead" else {},
                starting=r.starting if r is not None and node.health != "dead" else 0,
                sandboxes=count, lost=lost, by_backend=by_b, by_project=by_p,
                burst=r.burst if r is not None else False,
                draining=r.draining if r is not None and node.health != "dead" else False))
        return ClusterStatus(project=project, nodes=nodes,
                             sandboxes=sum(n.sandboxes for n in nodes),
                             by_backend=total_b, by_project=total_p)


def placement_over(edges: EdgeRegistry | Iterable[EdgeAPI], *,
                   settings: Settings | None = None,
                   config: PlacementConfig | None = None) -> Placement:
    """A :class:`Placement` over edges this process holds (the embedded node's, a test's), and
    the :class:`Watcher` its decisions read (``placement.view``) over the same registry; the
    edges count as in this process (never fenced). The watcher is not started here: an api
    app created over the placement runs it for its lifetime (``create_app``), or the caller
    does (``async with placement.view``) before its first create."""
    s = settings or Settings()
    registry = as_registry(edges)
    watcher = Watcher(registry, local=set(registry), settings=s)
    return Placement(registry, watcher, config=config or PlacementConfig.from_settings(s))


def info_of(sb: NodeSandbox, node_id: str, state: str,
            labels: Mapping[str, str] | None = None) -> SandboxInfo:
    """A reported sandbox as a SandboxInfo (what the node's report carries, with ``labels``
    known otherwise: reports have none; a dead one with reason node_lost)."""
    return SandboxInfo(
        id=sb.id, node=node_id, image=sb.image, layers=[], state=state,  # type: ignore[arg-type]
        created_at=sb.created_at, expires_at=sb.expires_at, labels=dict(labels or {}),
        resources=Resources(cpus=sb.cpus, memory_mib=sb.memory_mib), owner=sb.owner,
        dead_reason=NODE_LOST if state == "dead" else None, job=sb.job, backend=sb.backend)


__all__ = ["Ledger", "Watcher", "info_of", "placement_over"]
