"""Placement decided from a cluster view (issue 14 item 3): every filter and rule, the retry
bound, pending placements under concurrency, the starts cap, the layer bonus's bound, qos.
The edges are test fakes (a create is a counter, or waits on a gate); the view is a list of
NodeViews this test sets."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence

import pydantic
import pytest

from rollbox import errors
from rollbox.config import Settings
from rollbox.models import Resources, SandboxInfo, SandboxSpec
from rollbox.placement import Placement, PlacementConfig, named_digests
from rollbox.placement.view import NodeView


class View:
    """A ClusterView whose snapshot the test replaces (a new tuple per refresh)."""

    def __init__(self, nodes: Sequence[NodeView]) -> None:
        self._nodes = tuple(nodes)

    def set(self, nodes: Sequence[NodeView]) -> None:
        self._nodes = tuple(nodes)

    def nodes(self) -> Sequence[NodeView]:
        return self._nodes

    def node(self, node_id: str) -> NodeView | None:
        return next((n for n in self._nodes if n.node_id == node_id), None)


EDGES: list[Edge] = []


@pytest.fixture(autouse=True)
def no_capacity_calls() -> Iterator[None]:
    """A decision from the view never calls an edge's capacity() (node_limits may)."""
    EDGES.clear()
    yield
    assert [e.node_id for e in EDGES if e.capacity_calls] == []


class Edge:
    """Counts creates and capacity() calls; ``refuse``: the error every create raises;
    ``gate``: creates wait on it."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.creates = 0
        self.capacity_calls = 0
        self.refuse: Exception | None = None
        self.gate: asyncio.Event | None = None
        self.running = 0
        EDGES.append(self)

    async def capacity(self) -> dict[str, object]:
        self.capacity_calls += 1
        return {"limits": {"sandboxes": 100, "layer_mib": 4096}}

    async def create(self, spec: SandboxSpec, owner: str) -> SandboxInfo:
        self.creates += 1
        if self.refuse is not None:
            raise self.refuse
        self.running += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.running -= 1
        now = time.time()
        return SandboxInfo(id=f"{self.node_id}-{self.creates:08x}", node=self.node_id,
                           image=spec.image, layers=spec.layers, state="running",
                           created_at=now, expires_at=now + spec.ttl_s, labels={},
                           resources=spec.resources)


def node(node_id: str, free: float = 100, size: float = 100, *, health: str = "alive",
         backends: tuple[str, ...] = ("container",), cpus: float | None = None,
         memory_mib: float | None = None, starting: int = 0, layers: tuple[str, ...] = (),
         burst: bool = False, seen_at: float = 1.0) -> NodeView:
    f: dict[str, float] = {"sandboxes": free}
    if cpus is not None:
        f["cpus"] = cpus
    if memory_mib is not None:
        f["memory_mib"] = memory_mib
    return NodeView(node_id, health, frozenset(backends), f,  # type: ignore[arg-type]
                    limits={"sandboxes": size}, starting=starting, layers=frozenset(layers),
                    burst=burst, seen_at=seen_at)


def config(**kw: object) -> PlacementConfig:
    return dataclasses.replace(PlacementConfig.from_settings(Settings()), **kw)  # type: ignore[arg-type]


def setup(views: list[NodeView], **kw: object) -> tuple[Placement, View, dict[str, Edge]]:
    edges = {v.node_id: Edge(v.node_id) for v in views}
    view = View(views)
    p = Placement(list(edges.values()), view, config=config(**kw), clock=lambda: 5.0,
                  rng=random.Random(7))
    return p, view, edges


SPEC = SandboxSpec(image="x")


async def place(p: Placement, n: int, spec: SandboxSpec = SPEC) -> Counter[str]:
    return Counter([(await p.create(spec, "proj")).node for _ in range(n)])


# ---- filters --------------------------------------------------------------------------------

async def test_only_alive_nodes() -> None:
    p, _, _ = setup([node("a", 10), node("s", 100, health="suspect"),
                     node("d", 100, health="dead")])
    assert await place(p, 8) == {"a": 8}


async def test_backend_offered() -> None:
    p, _, _ = setup([node("a", 10, backends=("container", "microvm")), node("b", 100)])
    assert await place(p, 6, SandboxSpec(image="x", backend="microvm")) == {"a": 6}
    with pytest.raises(errors.BadRequest) as ei:
        await p.create(SandboxSpec(image="x", backend="firecracker"), "proj")
    assert ei.value.details["offered"] == ["container", "microvm"]


async def test_backend_offered_only_by_unhealthy_nodes_is_retryable() -> None:
    p, _, edges = setup([node("a"), node("d", backends=("microvm",), health="dead")])
    with pytest.raises(errors.CapacityExceeded) as ei:
        await p.create(SandboxSpec(image="x", backend="microvm"), "proj")
    assert ei.value.details["reason"] == "unhealthy"
    assert sum(e.creates for e in edges.values()) == 0


@pytest.mark.parametrize("budget", ["cpus", "memory_mib", "sandboxes"])
async def test_resources_fit(budget: str) -> None:
    # "small" has the most room by share but not enough of one budget for this spec.
    tight = {"cpus": dict(cpus=1.5), "memory_mib": dict(memory_mib=1000),
             "sandboxes": dict(free=0)}[budget]
    small = node("small", **{"free": 100, **tight})  # type: ignore[arg-type]
    p, _, _ = setup([small, node("big", 50)])
    spec = SandboxSpec(image="x", resources=Resources(cpus=2, memory_mib=2048))
    assert await place(p, 4, spec) == {"big": 4}


async def test_all_full_is_capacity_exceeded_without_asking_an_edge() -> None:
    p, _, edges = setup([node("a", 0), node("b", 100, cpus=0.5)])
    with pytest.raises(errors.CapacityExceeded) as ei:
        await p.create(SandboxSpec(image="x", resources=Resources(cpus=1)), "proj")
    assert ei.value.details["reason"] == "full" and ei.value.retryable
    assert sum(e.creates for e in edges.values()) == 0


async def test_pending_placements_count_against_free() -> None:
    p, _, _ = setup([node("a", 3), node("b", 3)])
    assert await place(p, 6) == {"a": 3, "b": 3}  # the view still says 3 free on each
    with pytest.raises(errors.CapacityExceeded):
        await p.create(SPEC, "proj")


# ---- score ----------------------------------------------------------------------------------

async def test_score_is_the_share_left_of_the_node() -> None:
    # a has more free slots (100 of 1000) but b more of itself free (50 of 100).
    p, _, _ = setup([node("a", 100, 1000), node("b", 50, 100)])
    assert (await p.create(SPEC, "proj")).node == "b"


async def test_score_takes_the_tightest_budget() -> None:
    # Both have half their slots free; a's CPUs are nearly gone (share of its free CPUs).
    a = dataclasses.replace(node("a", 50), free={"sandboxes": 50, "cpus": 2.0},
                            limits={"sandboxes": 100, "cpus": 100})
    b = dataclasses.replace(node("b", 40), free={"sandboxes": 40, "cpus": 90.0},
                            limits={"sandboxes": 100, "cpus": 100})
    p, _, _ = setup([a, b])
    assert (await p.create(SPEC, "proj")).node == "b"


async def test_power_of_k_draws_distinct_nodes() -> None:
    # 9 nodes of distinct room (more than 4k: drawn at random): two distinct draws never pick
    # the fullest one.
    views = [node(f"n{i}", 10 + i) for i in range(9)]
    p, _, _ = setup(views, k=2)
    chosen: Counter[str] = Counter()
    for _ in range(2000):
        nid = p.chooser.choose(SPEC)  # type: ignore[union-attr]
        p.chooser.ended(nid, SPEC, ok=False)  # type: ignore[union-attr]
        chosen[nid] += 1
    assert chosen["n0"] == 0 and chosen["n8"] > 0
    p1, _, _ = setup(views, k=1)
    seen = set()
    for _ in range(2000):
        nid = p1.chooser.choose(SPEC)  # type: ignore[union-attr]
        p1.chooser.ended(nid, SPEC, ok=False)  # type: ignore[union-attr]
        seen.add(nid)
    assert "n0" in seen  # k=1 is a random choice


async def test_k_covering_the_pool_takes_the_best() -> None:
    views = [node(f"n{i}", 10 + i) for i in range(8)]
    p, _, _ = setup(views, k=8)
    for _ in range(5):
        assert p.chooser.choose(SPEC) == "n7"  # type: ignore[union-attr]
        p.chooser.ended("n7", SPEC, ok=False)  # type: ignore[union-attr]


async def test_layer_bonus_is_bounded() -> None:
    digests = ("sha256-" + "a" * 64, "sha256-" + "b" * 64)
    spec = SandboxSpec(image=digests[0], layers=[digests[1]])
    assert named_digests(spec) == digests and named_digests(SandboxSpec(image="py")) == ()
    # a caches every layer and has 50% free; b none, 54%: the bonus (0.05) wins it for a.
    p, _, _ = setup([node("a", 50, layers=digests), node("b", 54)], layer_bonus=0.05)
    assert (await p.create(spec, "proj")).node == "a"
    # ... but not against 56%: the bonus is at most 0.05 of a node.
    p, _, _ = setup([node("a", 50, layers=digests), node("b", 56)], layer_bonus=0.05)
    assert (await p.create(spec, "proj")).node == "b"
    # half the layers: half the bonus (0.025 < 0.04)
    p, _, _ = setup([node("a", 50, layers=digests[:1]), node("b", 54)], layer_bonus=0.05)
    assert (await p.create(spec, "proj")).node == "b"


async def test_layers_of_resolver() -> None:
    p0, _, _ = setup([node("a", 50, layers=("sha256-" + "c" * 64,)), node("b", 52)])
    assert (await p0.create(SandboxSpec(image="py"), "proj")).node == "b"
    edges = {n: Edge(n) for n in "ab"}
    p = Placement(list(edges.values()),
                  View([node("a", 50, layers=("sha256-" + "c" * 64,)), node("b", 52)]),
                  config=config(), layers_of=lambda s: ["sha256-" + "c" * 64])
    assert (await p.create(SandboxSpec(image="py"), "proj")).node == "a"


# ---- pending placements, concurrency, starts cap -------------------------------------------

async def test_pending_under_concurrency_spreads_a_burst() -> None:
    p, _, edges = setup([node("a", 100), node("b", 90)])
    gate = asyncio.Event()
    for e in edges.values():
        e.gate = gate
    tasks = [asyncio.create_task(p.create(SPEC, "proj")) for _ in range(40)]
    await asyncio.sleep(0.05)
    # all 40 are in flight: without pending counts every one would go to a (100 > 90)
    assert abs(edges["a"].running - 25) <= 1 and abs(edges["b"].running - 15) <= 1
    gate.set()
    await asyncio.gather(*tasks)


async def test_done_creates_stay_pending_until_a_probe_after_them() -> None:
    p, view, _ = setup([node("a", 100, seen_at=1.0), node("b", 90, seen_at=1.0)])
    got = await place(p, 20)  # clock 5.0: done after the probes at 1.0
    assert abs(got["a"] - 15) <= 1 and abs(got["b"] - 5) <= 1
    pend = p.chooser.pending  # type: ignore[union-attr]
    assert pend["a"].sandboxes + pend["b"].sandboxes == 20
    view.set([node("a", 100 - got["a"], seen_at=4.0), node("b", 90 - got["b"], seen_at=6.0)])
    p.chooser.snapshot()  # type: ignore[union-attr]
    # a's probe was sent before the creates ended (still pending); b's after (in the view)
    assert pend["a"].sandboxes == got["a"] and pend["b"].sandboxes == 0


async def test_starts_cap_counts_the_view_and_this_replica() -> None:
    p, _, edges = setup([node("a", 100, starting=2), node("b", 10)], max_starts=3)
    gate = asyncio.Event()
    for e in edges.values():
        e.gate = gate
    tasks = [asyncio.create_task(p.create(SPEC, "proj")) for _ in range(4)]
    await asyncio.sleep(0.05)
    # a (2 starting at the probe) takes 1 more, b 3; the 4th waits for a slot
    assert (edges["a"].running, edges["b"].running) == (1, 3)
    assert sum(t.done() for t in tasks) == 0
    gate.set()
    got = Counter(i.node for i in await asyncio.gather(*tasks))
    assert sum(got.values()) == 4


async def test_starts_cap_wait_is_bounded() -> None:
    p, _, edges = setup([node("a", 100, starting=3)], max_starts=3, start_wait_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(errors.CapacityExceeded) as ei:
        await p.create(SPEC, "proj")
    assert ei.value.details["reason"] == "starts"
    assert 0.15 <= time.monotonic() - t0 < 2 and edges["a"].creates == 0


# ---- refusals -------------------------------------------------------------------------------

async def test_refusal_tries_the_next_node_and_skips_it_until_its_next_probe() -> None:
    p, view, edges = setup([node("a", 100), node("b", 50)])
    edges["a"].refuse = errors.CapacityExceeded("really full")
    assert (await p.create(SPEC, "proj")).node == "b"
    assert edges["a"].creates == 1
    edges["a"].refuse = None
    assert await place(p, 3) == {"b": 3}  # a is not asked again on the same view
    assert edges["a"].creates == 1
    view.set([node("a", 100, seen_at=6.0), node("b", 47, seen_at=6.0)])
    assert (await p.create(SPEC, "proj")).node == "a"


async def test_retries_are_bounded() -> None:
    views = [node(f"n{i}", 100) for i in range(10)]
    p, _, edges = setup(views, max_attempts=3)
    for e in edges.values():
        e.refuse = errors.CapacityExceeded("full")
    with pytest.raises(errors.CapacityExceeded) as ei:
        await p.create(SPEC, "proj")
    assert sum(e.creates for e in edges.values()) == 3 and len(ei.value.details["nodes"]) == 3
    pend = p.chooser.pending  # type: ignore[union-attr]
    assert all(x.starting == 0 and x.sandboxes == 0 for x in pend.values())


async def test_infra_error_raised_when_all_refuse_and_bad_request_not_retried() -> None:
    p, _, edges = setup([node("a"), node("b")])
    for e in edges.values():
        e.refuse = errors.InfraError("disk gone")
    with pytest.raises(errors.InfraError) as ei:
        await p.create(SPEC, "proj")
    assert not isinstance(ei.value, errors.CapacityExceeded)
    p, _, edges = setup([node("a"), node("b")])
    for e in edges.values():
        e.refuse = errors.BadRequest("no such image")
    with pytest.raises(errors.BadRequest):
        await p.create(SPEC, "proj")
    assert sum(e.creates for e in edges.values()) == 1


# ---- membership -----------------------------------------------------------------------------

async def test_add_and_remove_edges_while_running() -> None:
    edges = {n: Edge(n) for n in "abc"}
    view = View([node("a", 10), node("b", 10), node("c", 100)])
    p = Placement([edges["a"], edges["b"]], view, config=config(k=3))
    assert set(await place(p, 6)) <= {"a", "b"}  # c is in the view, not a member yet
    p.add_edge(edges["c"])
    assert (await p.create(SPEC, "proj")).node == "c"
    with pytest.raises(errors.BadRequest):
        p.add_edge(Edge("c"))
    members = p.edges.items()
    assert p.remove_edge("c") is edges["c"]
    assert "c" in dict(members)  # what is being iterated is never changed
    assert "c" not in p.edges
    assert set(await place(p, 4)) <= {"a", "b"}
    with pytest.raises(errors.NotFound):
        p.edge_for("c-0123abcd")
    with pytest.raises(errors.NotFound):
        p.remove_edge("c")
    view.set([node("a", 10), node("b", 10, health="dead")])
    assert await p.node_limits() == {"sandboxes": 100, "layer_mib": 4096}
    assert (edges["a"].capacity_calls, edges["b"].capacity_calls) == (1, 0)  # b is dead
    edges["a"].capacity_calls = 0


async def test_no_edges_yet_with_a_view() -> None:
    p = Placement([], View([]), config=config())
    with pytest.raises(errors.BadRequest):
        await p.create(SPEC, "proj")


# ---- qos ------------------------------------------------------------------------------------

def test_qos_default_and_validation() -> None:
    assert SandboxSpec(image="x").qos == "batch"
    assert SandboxSpec(image="x", qos="latency").qos == "latency"
    with pytest.raises(pydantic.ValidationError):
        SandboxSpec(image="x", qos="urgent")  # type: ignore[arg-type]


async def test_latency_never_goes_to_a_burst_node_batch_may() -> None:
    p, _, _ = setup([node("a", 10), node("burst", 100, burst=True)])
    assert await place(p, 4, SandboxSpec(image="x", qos="latency")) == {"a": 4}
    assert (await p.create(SandboxSpec(image="x", qos="batch"), "proj")).node == "burst"
    p, _, _ = setup([node("burst", 100, burst=True)])
    with pytest.raises(errors.CapacityExceeded) as ei:
        await p.create(SandboxSpec(image="x", qos="latency"), "proj")
    assert ei.value.details["reason"] == "burst"


async def test_latency_compares_more_nodes() -> None:
    views = [node(f"n{i}", 10 + i) for i in range(8)]
    p, _, _ = setup(views, k=1, k_latency=8)
    lat = SandboxSpec(image="x", qos="latency")
    for _ in range(5):
        assert p.chooser.choose(lat) == "n7"  # type: ignore[union-attr]
        p.chooser.ended("n7", lat, ok=False)  # type: ignore[union-attr]
    batch = set()
    for _ in range(200):
        nid = p.chooser.choose(SPEC)  # type: ignore[union-attr]
        p.chooser.ended(nid, SPEC, ok=False)  # type: ignore[union-attr]
        batch.add(nid)
    assert len(batch) > 1


def test_config_is_validated() -> None:
    for bad in ({"k": 0}, {"max_attempts": 0}, {"max_starts": 0}, {"layer_bonus": 2.0},
                {"start_wait_s": -1.0}):
        with pytest.raises(ValueError):
            config(**bad)
