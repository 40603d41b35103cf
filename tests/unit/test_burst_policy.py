"""The bursting policy (rollbox.placement.burst) over a real shared (posix://) chunk store: each
rule refuses on its own (a spec that passes every other rule), so removing one fails a test."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.config import Settings
from rollbox.images.store import Image
from rollbox.images.stores import open_store
from rollbox.images.stores.base import DEFAULT_CHUNK_SIZE, LayerManifest
from rollbox.models import SandboxSpec
from rollbox.placement import Placement, PlacementConfig
from rollbox.placement.burst import BurstConfig, BurstPolicy, cluster_use, live_sandboxes
from rollbox.placement.view import NodeView

A, B, C = (f"sha256-{c * 64}" for c in "abc")


def node(nid: str, used: float, size: float = 10, *, burst: bool = False,
         health: str = "alive", starting: int = 0) -> NodeView:
    return NodeView(nid, health, frozenset({"container", "microvm"}),  # type: ignore[arg-type]
                    {"sandboxes": size - used, "cpus": 64.0, "memory_mib": 1 << 20},
                    limits={"sandboxes": size, "cpus": 64.0, "memory_mib": 1 << 20},
                    starting=starting, burst=burst)


FULL = (node("n0", 9), node("n1", 8), node("b0", 0, burst=True))  # use 0.85
IDLE = (node("n0", 1), node("n1", 2), node("b0", 0, burst=True))  # use 0.15


@pytest.fixture
async def store(tmp_path: Path):  # noqa: ANN201
    s = open_store(f"posix://{tmp_path / 'shared'}")
    for d in (A, B, C):
        await s.put_manifest(LayerManifest(d, 0, DEFAULT_CHUNK_SIZE))
    await s.put_ref(Image("py:1", [A, B]))
    await s.put_ref(Image("half:1", [A, f"sha256-{'d' * 64}"]))  # its 2nd layer never pushed
    yield s
    await s.close()


def spec(**kw: object) -> SandboxSpec:
    return SandboxSpec(**{"image": "py:1", "qos": "batch", "backend": "container", **kw})


async def ready(p: BurstPolicy, sp: SandboxSpec) -> SandboxSpec:
    await p.prepare(sp)
    return sp


async def test_eligible_spec_bursts_above_threshold(store) -> None:  # noqa: ANN001
    p = BurstPolicy(BurstConfig(), store)
    sp = await ready(p, spec())
    assert p.why_not(sp, FULL) is None and p.allows(sp, FULL)


async def test_latency_never_bursts(store) -> None:  # noqa: ANN001
    p = BurstPolicy(BurstConfig(), store)
    sp = await ready(p, spec(qos="latency"))
    assert not p.allows(sp, FULL)
    assert "qos latency" in (p.why_not(sp, FULL) or "")


async def test_microvm_never_bursts(store) -> None:  # noqa: ANN001
    p = BurstPolicy(BurstConfig(), store)
    sp = await ready(p, spec(backend="microvm"))
    assert not p.allows(sp, FULL)
    assert "backend microvm" in (p.why_not(sp, FULL) or "")


async def test_a_layer_missing_from_the_shared_store_never_bursts(store) -> None:  # noqa: ANN001
    p = BurstPolicy(BurstConfig(), store)
    for sp in (spec(image="half:1"), spec(image="unknown:1"), spec(layers=[f"sha256-{'e' * 64}"]),
               spec(image=f"sha256-{'f' * 64}")):
        assert await p.prepare(sp) is False
        assert not p.allows(sp, FULL), sp
        assert "shared chunk store" in (p.why_not(sp, FULL) or "")
    # the same with every layer there (a digest image, an extra layer that is there)
    for sp in (spec(image=C), spec(layers=[C])):
        assert await p.prepare(sp) is True
        assert p.allows(sp, FULL)


async def test_not_looked_up_is_not_shared(store) -> None:  # noqa: ANN001
    p = BurstPolicy(BurstConfig(), store)
    assert not p.allows(spec(), FULL)  # prepare() never ran for it


async def test_stale_shared_ref_is_not_the_image(store) -> None:  # noqa: ANN001
    p = BurstPolicy(BurstConfig(), store, resolve=lambda name: [A, C] if name == "py:1" else None)
    assert await p.prepare(spec()) is False
    q = BurstPolicy(BurstConfig(), store, resolve=lambda name: [A, B])
    assert await q.prepare(spec()) is True


async def test_below_threshold_never_bursts(store) -> None:  # noqa: ANN001
    p = BurstPolicy(BurstConfig(threshold=0.80), store)
    sp = await ready(p, spec())
    assert not p.allows(sp, IDLE)
    assert "below the burst threshold" in (p.why_not(sp, IDLE) or "")
    at = (node("n0", 8), node("n1", 8))  # exactly 0.80
    assert p.allows(sp, at)
    assert not BurstPolicy(BurstConfig(threshold=0.9), store).over(at)


async def test_no_shared_store_nothing_bursts(tmp_path: Path) -> None:
    p = BurstPolicy(BurstConfig(), None)
    sp = spec()
    assert await p.prepare(sp) is False
    assert not p.allows(sp, FULL) and p.why_not(sp, FULL) == "no shared chunk store"
    local = open_store(f"dir://{tmp_path / 'own'}")
    with pytest.raises(errors.BadRequest, match="not shared"):
        BurstPolicy(BurstConfig(), local)


async def test_from_settings_takes_only_a_shared_store(tmp_path: Path) -> None:
    s = Settings()
    s.chunk_store = f"dir://{tmp_path / 'own'}"
    assert BurstPolicy.from_settings(s).store is None
    s.chunk_store = f"posix://{tmp_path / 'shared'}"
    p = BurstPolicy.from_settings(s)
    assert p.store is not None and p.config.threshold == s.burst_threshold
    await p.close()


async def test_answers_expire(store) -> None:  # noqa: ANN001
    now = [0.0]
    p = BurstPolicy(BurstConfig(layers_ttl_s=30), store, clock=lambda: now[0])
    sp = await ready(p, spec(image="half:1"))
    assert not p.layers_shared(sp)
    await store.put_manifest(LayerManifest(f"sha256-{'d' * 64}", 0, DEFAULT_CHUNK_SIZE))
    assert await p.prepare(sp) is False  # cached
    now[0] = 31.0
    assert not p.layers_shared(sp)  # expired, not yet looked up again
    assert await p.prepare(sp) is True and p.allows(sp, FULL)


def test_cluster_use_counts_own_alive_nodes_tightest_budget() -> None:
    assert cluster_use(FULL) == pytest.approx(0.85)
    # burst nodes and dead nodes do not count (a full burst node does not keep bursting on)
    assert cluster_use((node("n0", 1), node("b0", 10, burst=True))) == pytest.approx(0.1)
    assert cluster_use((node("n0", 1), node("n1", 10, health="dead"))) == pytest.approx(0.1)
    # the tightest budget: CPUs full while sandbox slots are free
    cpu_full = NodeView("n0", "alive", frozenset({"container"}),
                        {"sandboxes": 9, "cpus": 0.5, "memory_mib": 1000},
                        limits={"sandboxes": 10, "cpus": 8, "memory_mib": 1000})
    assert cluster_use((cpu_full,)) == pytest.approx(1 - 0.5 / 8)
    assert cluster_use(()) == 1.0 and cluster_use((node("b0", 0, burst=True),)) == 1.0
    # a node reporting no budget sizes: nothing to be full
    assert cluster_use((NodeView("n0", "alive", frozenset(), {}),)) == 0.0


def test_live_sandboxes() -> None:
    assert live_sandboxes(dataclasses.replace(node("b0", 3, starting=1), sandboxes=3)) == 4
    assert live_sandboxes(node("b0", 0)) == 0


def test_config_bad_input() -> None:
    for kw in ({"threshold": 0}, {"threshold": 1.5}, {"idle_s": -1}, {"max_nodes": -1},
               {"layers_ttl_s": -1}):
        with pytest.raises(errors.BadRequest):
            BurstConfig(**kw)  # type: ignore[arg-type]


# ---- placement's hook: burst nodes take only what the policy allows --------------------------

async def placed(p: BurstPolicy | None, nodes: Sequence[NodeView], sp: SandboxSpec,
                 n: int = 30) -> Counter[str]:
    """Where ``n`` creates of ``sp`` land (real Placement and Chooser over a fixed view; fake
    edges that count)."""
    from tests.unit.test_placement_view import Edge, View

    edges = [Edge(nv.node_id) for nv in nodes]
    pl = Placement(edges, View(nodes), config=PlacementConfig(
        k=3, k_latency=3, max_attempts=3, max_starts=1000, start_wait_s=0, layer_bonus=0),
        burst=p, rng=random.Random(1))
    out: Counter[str] = Counter()
    for _ in range(n):
        try:
            info = await pl.create(sp, "p")
        except errors.CapacityExceeded:
            out["refused"] += 1
            continue
        out[info.node] += 1
    return out


# own nodes at 0.85 of their slots with room left; an empty burst node scores best
BUSY = (node("n0", 85, 100), node("n1", 85, 100), node("b0", 0, 100, burst=True))
CALM = (node("n0", 50, 100), node("n1", 50, 100), node("b0", 0, 100, burst=True))


async def test_placement_sends_eligible_batch_to_burst_nodes(store) -> None:  # noqa: ANN001
    p = BurstPolicy(BurstConfig(), store)
    got = await placed(p, BUSY, spec())
    assert got["b0"] > 0 and got["refused"] == 0


@pytest.mark.parametrize("why", ["latency", "microvm", "layers", "below"])
async def test_placement_keeps_ineligible_off_burst_nodes(store, why: str) -> None:  # noqa: ANN001
    p = BurstPolicy(BurstConfig(), store)
    nodes = CALM if why == "below" else BUSY
    if why == "microvm":
        nodes = tuple(dataclasses.replace(n, backends=frozenset({"container", "microvm"}))
                      for n in nodes)
    sp = {"latency": spec(qos="latency"), "microvm": spec(backend="microvm"),
          "layers": spec(image="half:1"), "below": spec()}[why]
    got = await placed(p, nodes, sp)
    assert got["b0"] == 0 and got["refused"] == 0 and sum(got.values()) == 30, got


async def test_without_a_policy_burst_nodes_take_any_batch(store) -> None:  # noqa: ANN001
    # what the gate changes: without it the same ineligible image lands on b0
    assert (await placed(None, CALM, spec(image="half:1")))["b0"] > 0
