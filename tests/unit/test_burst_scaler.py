"""The burst scaler's decisions (rollbox.cluster.burst.BurstScaler) over a view the test sets and
a fake node side (an autoscaler that brings asked-for nodes up on the next tick): one more node
asked for above the threshold, none while one is coming or has room, edges started and
registered when nodes come up, release only after the idle time below the threshold, drained
first and kept if a create landed meanwhile. The real Ray run is
tests/integration/test_burst_ray.py."""
from __future__ import annotations

from collections.abc import Sequence

import pytest

from rollbox import errors
from rollbox.cluster.burst import BurstScaler, burst_node_types
from rollbox.placement.burst import BurstConfig
from rollbox.placement.registry import EdgeRegistry
from rollbox.placement.view import NodeView


def node(nid: str, used: float, size: float = 10, *, burst: bool = False) -> NodeView:
    return NodeView(nid, "alive", frozenset({"container"}), {"sandboxes": size - used},
                    limits={"sandboxes": size}, burst=burst, sandboxes=int(used))


class View:
    def __init__(self) -> None:
        self.list: tuple[NodeView, ...] = ()

    def set(self, *nodes: NodeView) -> None:
        self.list = nodes

    def nodes(self) -> Sequence[NodeView]:
        return self.list

    def node(self, node_id: str) -> NodeView | None:
        return None


class Handle:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id


class Nodes:
    def __init__(self) -> None:
        self.asked = 0
        self.alive: set[str] = set()
        self.log: list[str] = []
        self.left_on_drain = 0

    def request(self, count: int) -> None:
        self.asked = count
        # the autoscaler: nodes beyond the request that have no edge are ended; asked-for
        # ones come up (on the tick after)

    def grow(self) -> None:
        while len(self.alive) < self.asked:
            self.alive.add(f"rb{len(self.alive)}")

    def up(self) -> set[str]:
        return set(self.alive)

    def start_edge(self, node_id: str) -> Handle:
        self.log.append(f"start {node_id}")
        return Handle(node_id)

    def drain(self, node_id: str) -> int:
        self.log.append(f"drain {node_id}")
        return self.left_on_drain

    def undrain(self, node_id: str) -> None:
        self.log.append(f"undrain {node_id}")

    def stop_edge(self, node_id: str) -> None:
        self.log.append(f"stop {node_id}")
        self.alive.discard(node_id)  # its Ray node goes after the autoscaler's idle timeout


@pytest.fixture
def rig():  # noqa: ANN201
    now = [0.0]
    view, nodes, reg = View(), Nodes(), EdgeRegistry()
    s = BurstScaler(view, reg, nodes, BurstConfig(threshold=0.8, idle_s=10, max_nodes=2),
                    clock=lambda: now[0])
    return s, view, nodes, reg, now


async def test_asks_above_threshold_starts_edge_releases_when_idle(rig) -> None:  # noqa: ANN001
    s, view, nodes, reg, now = rig
    view.set(node("n0", 5))
    await s.tick()
    assert nodes.asked == 0  # 0.5 < 0.8
    view.set(node("n0", 8))
    await s.tick()
    assert nodes.asked == 1
    await s.tick()
    assert nodes.asked == 1  # one is coming: not another
    nodes.grow()
    await s.tick()
    assert nodes.log == ["start rb0"] and "rb0" in reg
    view.set(node("n0", 9), node("rb0", 2, burst=True))
    await s.tick()
    assert nodes.asked == 1  # the burst node has room below the threshold
    view.set(node("n0", 9), node("rb0", 9, burst=True))
    await s.tick()
    assert nodes.asked == 2  # it is full too: one more
    nodes.grow()
    await s.tick()
    assert "rb1" in reg
    # below the threshold, rb0 empty: released only after idle_s
    view.set(node("n0", 1), node("rb0", 0, burst=True), node("rb1", 3, burst=True))
    await s.tick()
    now[0] = 9.0
    await s.tick()
    assert "drain rb0" not in nodes.log
    now[0] = 10.0
    await s.tick()
    assert nodes.log[-2:] == ["drain rb0", "stop rb0"] and "rb0" not in reg
    assert nodes.asked == 1 and s.state.edges == {"rb1"}
    # the node ended by the autoscaler is never started again
    await s.tick()
    assert nodes.log.count("start rb0") == 1


async def test_a_create_after_the_view_keeps_the_node(rig) -> None:  # noqa: ANN001
    s, view, nodes, reg, now = rig
    view.set(node("n0", 9))
    await s.tick()
    nodes.grow()
    await s.tick()
    view.set(node("n0", 1), node("rb0", 0, burst=True))
    await s.tick()
    now[0] = 11.0
    nodes.left_on_drain = 1
    await s.tick()
    assert nodes.log[-2:] == ["drain rb0", "undrain rb0"] and "rb0" in reg
    assert nodes.asked == 1


async def test_over_threshold_keeps_idle_burst_nodes_and_caps(rig) -> None:  # noqa: ANN001
    s, view, nodes, reg, now = rig
    view.set(node("n0", 9))
    for _ in range(6):
        await s.tick()
        nodes.grow()
        ids = sorted(s.state.edges)
        view.set(node("n0", 9), *(node(i, 10, burst=True) for i in ids))
        now[0] += 100
    assert nodes.asked == 2 and len(s.state.edges) == 2  # max_nodes
    view.set(node("n0", 9), *(node(i, 0, burst=True) for i in sorted(s.state.edges)))
    now[0] += 100
    await s.tick()
    now[0] += 100
    await s.tick()
    assert not any(x.startswith("drain") for x in nodes.log)  # still over: kept


def test_burst_node_types() -> None:
    t = burst_node_types("t", 2)
    assert t["rollbox.burst.1"]["resources"]["rollbox_node:tb1"] == 1
    assert t["rollbox.burst.0"]["resources"]["rollbox_burst"] == 1
    assert all(v["max_workers"] == 1 and v["min_workers"] == 0 for v in t.values())
    with pytest.raises(errors.BadRequest):
        burst_node_types("t", 65)


async def test_without_a_registry_the_edges_register_themselves() -> None:
    """In a cluster (cluster.burst_actor) the edge actors register in the GCS: the scaler
    starts and stops edges and holds no registry."""
    now = [0.0]
    view, nodes = View(), Nodes()
    s = BurstScaler(view, None, nodes, BurstConfig(threshold=0.8, idle_s=1, max_nodes=1),
                    clock=lambda: now[0])
    view.set(node("n0", 9))
    await s.tick()
    nodes.grow()
    await s.tick()
    assert nodes.log == ["start rb0"] and s.state.edges == {"rb0"}
    view.set(node("n0", 1), node("rb0", 0, burst=True))
    await s.tick()
    now[0] = 2.0
    await s.tick()
    assert nodes.log[-2:] == ["drain rb0", "stop rb0"] and nodes.asked == 0
