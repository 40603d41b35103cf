"""Placement sends a sandbox only to nodes whose capacity says they offer its backend; a kind
no node offers is a BadRequest naming the offered kinds (an edge that does not list its
backends is still tried: it refuses by itself)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.models import SandboxSpec
from rollbox.placement import Placement
from test_api_support import FakeEdge


class KindsEdge(FakeEdge):
    def __init__(self, node_id: str, root: Path, kinds: dict[str, bool]) -> None:
        super().__init__(node_id, root)
        self.kinds = kinds

    async def capacity(self) -> dict[str, object]:  # type: ignore[override]
        return {"free": float(self.max_sandboxes - len(self.sandboxes)),
                "backends": {k: {"kind": k, "offered": v} for k, v in self.kinds.items()}}


@pytest.fixture
async def edges(tmp_path: Path) -> AsyncIterator[list[FakeEdge]]:
    es = [KindsEdge("node-a", tmp_path / "a", {"container": True, "microvm": False}),
          KindsEdge("node-b", tmp_path / "b", {"container": True, "microvm": True})]
    try:
        yield es
    finally:
        for e in es:
            await e.close()


async def test_only_nodes_offering_the_kind_get_it(edges: list[FakeEdge]) -> None:
    p = Placement(edges)
    for _ in range(6):
        assert (await p.create(SandboxSpec(image="x", backend="microvm"), "p")).node == "node-b"
    nodes = {(await p.create(SandboxSpec(image="x"), "p")).node for _ in range(20)}
    assert nodes == {"node-a", "node-b"}


async def test_a_kind_no_node_offers_is_refused(edges: list[FakeEdge]) -> None:
    p = Placement(edges)
    before = sum(e.creates for e in edges)
    with pytest.raises(errors.BadRequest) as exc:
        await p.create(SandboxSpec(image="x", backend="firecracker"), "p")
    assert exc.value.details["offered"] == ["container", "microvm"]
    assert sum(e.creates for e in edges) == before  # no node was asked


async def test_edges_that_do_not_list_backends_stay_candidates(tmp_path: Path) -> None:
    es = [FakeEdge("node-a", tmp_path / "a"), FakeEdge("node-b", tmp_path / "b")]
    try:
        info = await Placement(es).create(SandboxSpec(image="x", backend="microvm"), "p")
        assert info.node in ("node-a", "node-b")
    finally:
        for e in es:
            await e.close()
