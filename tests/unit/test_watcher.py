"""The watcher's state machine over fake edges (rollbox.watcher): alive -> suspect -> dead by
the age of the last answered probe, a dead node's sandboxes reported node_lost and declared
lost to it when it answers again, a slow edge never delaying the others' probes, the view
rebuilt by a new watcher from the edges alone, reconciliation with complete nodes only, the
registry's joins and leaves, scoped status."""
from __future__ import annotations

import asyncio
import time

import pytest

from rollbox import errors
from rollbox.models import NODE_LOST, NodeReport, NodeSandbox, SandboxInfo
from rollbox.placement.registry import EdgeRegistry
from rollbox.watcher import Watcher, info_of


def sandbox(sid: str, owner: str = "p1", backend: str = "container") -> NodeSandbox:
    now = time.time()
    return NodeSandbox(id=sid, owner=owner, backend=backend, state="running", cpus=1.0,
                       memory_mib=512, created_at=now, expires_at=now + 3600,
                       image="debian:bookworm")


def listed(sbs: list[NodeSandbox], node_id: str) -> list[SandboxInfo]:
    """What an edge's list answer gives of them (labels: reports have none)."""
    return [info_of(sb, node_id, sb.state, {"task": sb.id}) for sb in sbs]


class FakeEdge:
    """An edge's probe side: answers report() from its list, or fails, hangs or is slow."""

    def __init__(self, node_id: str, sandboxes: list[NodeSandbox] = (), *,  # type: ignore[assignment]
                 truncated: bool = False) -> None:
        self.node_id = node_id
        self.sandboxes = list(sandboxes)
        self.truncated = truncated
        self.mode = "ok"  # ok | fail | hang
        self.delay = 0.0
        self.reports = 0
        self.fence_args: list[float | None] = []
        self.declared: list[list[str]] = []
        self.incarnation = "i1"

    async def report(self, max_sandboxes: int = 10000,
                     fence_s: float | None = None) -> NodeReport:
        self.fence_args.append(fence_s)
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.mode == "fail":
            raise errors.InfraError("connection refused")
        self.reports += 1
        by_b: dict[str, int] = {}
        by_p: dict[str, int] = {}
        for sb in self.sandboxes:
            by_b[sb.backend] = by_b.get(sb.backend, 0) + 1
            by_p[sb.owner] = by_p.get(sb.owner, 0) + 1
        listed = self.sandboxes[:max_sandboxes]
        return NodeReport(
            node_id=self.node_id, incarnation=self.incarnation, started_at=0.0, at=time.time(),
            backends=["container"], free={"sandboxes": 100.0, "cpus": 50.0,
                                          "memory_mib": 1e5},
            limits={"sandboxes": 110.0}, memory_available_mib=1000, starting=1,
            sandboxes=listed, sandboxes_total=len(self.sandboxes),
            truncated=self.truncated or len(listed) < len(self.sandboxes),
            layers=["sha256-" + "a" * 64], by_backend=by_b, by_project=by_p, fence_s=fence_s)

    async def declare_lost(self, sandbox_ids: list[str]) -> list[str]:
        self.declared.append(list(sandbox_ids))
        torn = [sb.id for sb in self.sandboxes if sb.id in sandbox_ids]
        self.sandboxes = [sb for sb in self.sandboxes if sb.id not in sandbox_ids]
        return torn


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def advance(w: Watcher, clock: Clock, seconds: int) -> None:
    """``seconds`` of the watcher's loop: a round of probes every second."""
    for _ in range(seconds):
        clock.t += 1.0
        await w.poll()


def watcher(edges, clock: Clock, **kw) -> Watcher:  # noqa: ANN001
    opts = dict(interval_s=1.0, probe_timeout_s=0.5, suspect_s=3.0, dead_s=7.0,
                reconcile_s=5.0, clock=clock)
    opts.update(kw)
    return Watcher(edges, **opts)


async def test_alive_suspect_dead_and_back() -> None:
    clock = Clock()
    a = FakeEdge("a", [sandbox("a-01")])
    b = FakeEdge("b", [sandbox("b-01"), sandbox("b-02", owner="p2"), sandbox("b-03")])
    w = watcher([a, b], clock)
    w.remember(listed(b.sandboxes[:2], "b"))  # an api list answer (b-03 was never listed)
    await w.poll()
    assert [(v.node_id, v.health) for v in w.nodes()] == [("a", "alive"), ("b", "alive")]
    view = w.node("b")
    assert view is not None and view.backends == {"container"} and view.free["cpus"] == 50.0
    assert view.starting == 1 and view.layers == {"sha256-" + "a" * 64}
    assert view.limits == {"sandboxes": 110.0} and view.seen_at == clock.t  # sent then
    assert w.nodes() is w.nodes()  # the same snapshot until the view changes
    snap = w.nodes()
    clock.t += 0.5
    await w.poll()
    assert w.nodes() is not snap and w.node("b").seen_at == clock.t

    b.mode = "fail"
    healths = []
    for _ in range(8):  # one probe a second, b answers none of them
        clock.t += 1.0
        await w.poll()
        healths.append(w.health("b"))
        assert w.health("a") == "alive"
    # silent for more than 3 s: suspect; more than 7 s: dead
    assert healths == ["alive"] * 3 + ["suspect"] * 4 + ["dead"]
    assert w.dead_nodes() == {"b"}
    assert w.node("b").backends == frozenset()  # a dead node offers nothing
    lost = w.lost("b-01", "b")
    assert lost is not None and lost.owner == "p1"
    assert w.lost("a-01", "a") is None  # alive
    infos = w.lost_infos()
    assert sorted(i.id for i in infos) == ["b-01", "b-02", "b-03"]
    assert all(i.state == "dead" and i.dead_reason == NODE_LOST and i.node == "b"
               for i in infos)
    assert [i.id for i in w.lost_infos("p2")] == ["b-02"]
    assert w.lost_infos("p2")[0].labels == {"task": "b-02"}
    # A list with labels filters a dead node's sandboxes by the labels remembered from list
    # (and create) answers; one never seen there matches no label filter, has labels {}.
    assert [i.id for i in w.lost_infos(None, {"task": "b-01"})] == ["b-01"]
    assert w.lost_infos("p2", {"task": "b-01"}) == []
    assert w.lost_infos(None, {"task": "b-03"}) == []
    assert [i.labels for i in w.lost_infos() if i.id == "b-03"] == [{}]
    assert [i.id for i in w.last_known_infos("b", None, {"task": "b-02"})] == ["b-02"]
    assert len(w.last_known_infos("b")) == 3

    b.mode = "ok"  # it answers again: first told what was declared lost, then alive
    clock.t += 1.0
    await w.poll()
    assert b.declared == [["b-01", "b-02", "b-03"]]
    assert w.labels_of("b-01") is None  # torn down: forgotten
    assert w.health("b") == "alive" and w.lost_infos() == []
    assert w.report("b").sandboxes == [] and w.report("b").by_project == {}
    clock.t += 1.0
    await w.poll()
    assert b.declared == [["b-01", "b-02", "b-03"]]  # once


async def test_dead_stays_dead_until_declare_lost_succeeds() -> None:
    clock = Clock()
    b = FakeEdge("b", [sandbox("b-01")])
    w = watcher([b], clock)
    await w.poll()
    b.mode = "fail"
    await advance(w, clock, 8)
    assert w.health("b") == "dead"

    async def broken(ids: list[str]) -> list[str]:
        raise errors.InfraError("reset by peer")

    b.mode = "ok"
    b.declare_lost = broken  # type: ignore[method-assign]
    clock.t += 1.0
    await w.poll()
    assert w.health("b") == "dead" and [i.id for i in w.lost_infos()] == ["b-01"]


async def test_never_answering_node_goes_suspect_then_dead() -> None:
    clock = Clock()
    a = FakeEdge("a")
    a.mode = "hang"
    w = watcher([a], clock, probe_timeout_s=0.05)
    await w.poll()  # bounded by the probe timeout (real time), though it hangs
    assert w.health("a") == "suspect" and w.node("a").backends == frozenset()
    await advance(w, clock, 8)
    assert w.health("a") == "dead" and w.lost_infos() == []


async def test_slow_edge_does_not_delay_the_others() -> None:
    slow = FakeEdge("slow")
    slow.mode = "hang"
    fast = [FakeEdge(f"f{i}") for i in range(3)]
    w = Watcher([slow, *fast], interval_s=0.05, probe_timeout_s=0.4, suspect_s=0.4,
                dead_s=0.6, reconcile_s=5.0)
    t0 = time.monotonic()
    await w.start()  # its first round waits for the slow probe's timeout only
    first = time.monotonic() - t0
    try:
        await asyncio.sleep(1.0)
        for f in fast:  # ~20 intervals, none held by the hanging probe
            assert f.reports >= 8, f.reports
            assert w.health(f.node_id) == "alive"
        # one probe out at a time: a new one only after the timeout ended the last
        assert len(slow.fence_args) <= 1 + 1.0 / 0.4 + 1
        assert w.health("slow") == "dead"
    finally:
        await w.stop()
    print(f"first round with a hanging edge: {first:.2f} s (probe timeout 0.4 s)")


async def test_new_watcher_rebuilds_the_view_from_the_edges() -> None:
    clock = Clock()
    edges = [FakeEdge("a", [sandbox("a-01"), sandbox("a-02", owner="p2")]),
             FakeEdge("b", [sandbox("b-01", backend="microvm")])]
    w1 = watcher(edges, clock)
    await w1.poll()
    before = w1.status()
    del w1  # a restart: nothing kept
    w2 = watcher(edges, clock)
    await w2.poll()
    after = w2.status()
    assert after == before
    assert after.sandboxes == 3
    assert after.by_backend == {"container": 2, "microvm": 1}
    assert after.by_project == {"p1": 2, "p2": 1}
    assert [(n.node_id, n.health, n.sandboxes) for n in after.nodes] == [
        ("a", "alive", 2), ("b", "alive", 1)]


async def test_status_scoped_to_a_project_names_only_its_sandboxes() -> None:
    clock = Clock()
    a = FakeEdge("a", [sandbox("a-01", owner="p1"), sandbox("a-02", owner="p2")])
    b = FakeEdge("b", [sandbox("b-01", owner="p2", backend="microvm")])
    w = watcher([a, b], clock)
    await w.poll()
    s = w.status("p1")
    assert s.project == "p1" and s.sandboxes == 1
    assert s.by_project == {"p1": 1} and s.by_backend == {"container": 1}
    assert all(set(n.by_project) <= {"p1"} for n in s.nodes)
    assert "p2" not in s.model_dump_json()
    b.mode = "fail"
    await advance(w, clock, 8)
    s = w.status("p2")
    assert [(n.node_id, n.health, n.sandboxes, n.lost) for n in s.nodes] == [
        ("a", "alive", 1, 0), ("b", "dead", 0, 1)]
    assert w.status("p1").nodes[1].lost == 0


class FakeLedger:
    def __init__(self) -> None:
        self.calls: list[tuple[dict, list]] = []

    async def reconcile(self, live, complete_nodes) -> int:  # noqa: ANN001
        self.calls.append(({k: [s.id for s in v] for k, v in live.items()},
                           sorted(complete_nodes)))
        return 0


async def test_reconcile_gets_complete_nodes_only() -> None:
    clock = Clock()
    ok = FakeEdge("ok", [sandbox("ok-01")])
    suspect = FakeEdge("sus", [sandbox("sus-01")])
    truncated = FakeEdge("trunc", [sandbox("trunc-01"), sandbox("trunc-02")])
    gone = FakeEdge("gone", [sandbox("gone-01")])
    ledger = FakeLedger()
    w = watcher([ok, suspect, truncated, gone], clock, ledger=ledger, max_sandboxes=1)
    await w.poll()
    gone.mode = "fail"
    for _ in range(5):
        clock.t += 1
        await w.poll()
    suspect.mode = "fail"
    for _ in range(4):
        clock.t += 1
        await w.poll()
    assert (w.health("sus"), w.health("gone"), w.health("trunc")) == ("suspect", "dead",
                                                                       "alive")
    assert w.report("trunc").truncated
    assert await w.reconcile() == 0
    live, complete = ledger.calls[-1]
    # the dead node: complete and empty (its sandboxes are lost); suspect and truncated: not
    assert complete == ["gone", "ok"]
    assert live == {"ok": ["ok-01"], "gone": []}


async def test_reconcile_loop_runs_every_interval() -> None:
    ledger = FakeLedger()
    w = Watcher([FakeEdge("a", [sandbox("a-01")])], interval_s=0.05, probe_timeout_s=0.5,
                suspect_s=1.0, dead_s=2.0, reconcile_s=0.1, ledger=ledger)
    async with w:
        await asyncio.sleep(0.55)
    assert len(ledger.calls) >= 3
    assert ledger.calls[-1] == ({"a": ["a-01"]}, ["a"])


async def test_a_node_turning_dead_reconciles_at_once() -> None:
    ledger = FakeLedger()
    gone = FakeEdge("gone", [sandbox("gone-01")])
    w = Watcher([FakeEdge("a"), gone], interval_s=0.05, probe_timeout_s=0.1, suspect_s=0.2,
                dead_s=0.4, reconcile_s=600.0, ledger=ledger)
    async with w:
        await asyncio.sleep(0.2)
        assert ledger.calls == []  # the interval is long
        gone.mode = "fail"
        t0 = time.monotonic()
        while not ledger.calls:
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(0.02)
    assert w.health("gone") == "dead"
    assert ledger.calls[0] == ({"a": [], "gone": []}, ["a", "gone"])


async def test_fence_is_the_dead_threshold_except_for_local_nodes() -> None:
    clock = Clock()
    a, b = FakeEdge("a"), FakeEdge("b")
    await watcher([a, b], clock, local={"a"}).poll()
    assert a.fence_args == [None] and b.fence_args == [7.0]
    await watcher([FakeEdge("c")], clock, fence=False).poll()
    c = FakeEdge("c")
    await watcher([c], clock, fence=False).poll()
    assert c.fence_args == [None]


async def test_registry_joins_and_leaves() -> None:
    clock = Clock()
    reg = EdgeRegistry([FakeEdge("a")])
    w = watcher(reg, clock)
    await w.poll()
    assert [v.node_id for v in w.nodes()] == ["a"]
    b = FakeEdge("b", [sandbox("b-01")])
    reg.add(b)
    await w.poll()
    assert [(v.node_id, v.health) for v in w.nodes()] == [("a", "alive"), ("b", "alive")]
    assert reg.remove("a") is not None and reg.remove("a") is None
    await w.poll()
    assert [v.node_id for v in w.nodes()] == ["b"] and w.node("a") is None
    with pytest.raises(errors.BadRequest, match="already in the cluster"):
        reg.add(FakeEdge("b"))
    reg.add(b)  # the same edge again: no-op
    v = reg.version
    reg.replace([b])
    assert reg.version == v
    with pytest.raises(errors.BadRequest, match="duplicate node id"):
        reg.replace([FakeEdge("x"), FakeEdge("x")])


async def test_a_node_answering_under_another_id_is_not_alive() -> None:
    clock = Clock()
    imposter = FakeEdge("a")

    async def report(max_sandboxes: int = 10000, fence_s: float | None = None) -> NodeReport:
        r = await FakeEdge.report(imposter, max_sandboxes, fence_s)
        return r.model_copy(update={"node_id": "b"})

    imposter.report = report  # type: ignore[method-assign]
    w = watcher([imposter], clock)
    await w.poll()
    assert w.health("a") == "suspect" and w.report("a") is None


async def test_a_stalled_watcher_does_not_kill_its_nodes() -> None:
    clock = Clock()
    a = FakeEdge("a", [sandbox("a-01")])
    w = watcher([a], clock)
    await w.poll()
    clock.t += 30  # the watcher's own loop stalled (or its process was stopped)
    w.tick()
    assert w.health("a") == "alive"
    await w.poll()
    assert w.health("a") == "alive" and a.declared == []


def test_bad_thresholds_are_refused() -> None:
    for kw in ({"suspect_s": 5.0, "dead_s": 5.0}, {"interval_s": 0.0},
               {"probe_timeout_s": -1.0}, {"probe_timeout_s": 4.0}, {"max_sandboxes": -1}):
        with pytest.raises(errors.BadRequest):
            Watcher([], **kw)


def test_remembered_labels_are_bounded_oldest_first(monkeypatch) -> None:  # noqa: ANN001
    import rollbox.watcher as watcher_mod
    monkeypatch.setattr(watcher_mod, "LABELS_KEPT_BYTES", 3 * (watcher_mod.LABELS_ENTRY_BYTES
                                                              + 5))
    w = Watcher([FakeEdge("a")])
    sbs = [sandbox(f"a-0{i}") for i in range(5)]  # labels {"task": "a-0i"}: 8 characters
    w.remember(listed(sbs, "a"))
    # 72 bytes each against 207: the three oldest are dropped
    assert [w.labels_of(sb.id) is not None for sb in sbs] == [False, False, False, True, True]
    w.remember(listed(sbs[3:4], "a"))  # seen again: newest, same size counted once
    w.remember(listed(sbs[:1], "a"))
    assert [w.labels_of(sb.id) is not None for sb in sbs] == [True, False, False, True, False]
    w.forget("a-00")
    assert w.labels_of("a-00") is None


def test_a_node_sandbox_holds_only_bounded_facts() -> None:
    # No dict or list in a report's sandbox: its size does not depend on the project's labels.
    assert set(NodeSandbox.model_fields) == {
        "id", "owner", "backend", "state", "cpus", "memory_mib", "created_at", "expires_at",
        "image", "platform", "job"}
