"""Placement sends a sandbox only to nodes whose reports (the watcher's view) say they offer
its backend; a kind no node offers is a BadRequest naming the offered kinds, and no edge is
asked."""
from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.models import SandboxSpec
from rollbox.placement import Placement
from test_api_support import FakeEdge, poll, watched


@pytest.fixture
async def edges(tmp_path: Path) -> AsyncIterator[list[FakeEdge]]:
    es = [FakeEdge("node-a", tmp_path / "a"), FakeEdge("node-b", tmp_path / "b")]
    es[1].kinds = {"container": True, "microvm": True}
    es[0].kinds = {"container": True, "microvm": False}
    try:
        yield es
    finally:
        for e in es:
            await e.close()


@pytest.fixture
async def placement(edges: list[FakeEdge]) -> AsyncIterator[Placement]:
    async with watched(edges) as p:
        yield p


async def test_only_nodes_offering_the_kind_get_it(edges: list[FakeEdge],
                                                   placement: Placement) -> None:
    for _ in range(6):
        info = await placement.create(SandboxSpec(image="x", backend="microvm"), "p")
        assert info.node == "node-b"
    nodes = {(await placement.create(SandboxSpec(image="x"), "p")).node for _ in range(20)}
    assert nodes == {"node-a", "node-b"}


async def test_a_kind_no_node_offers_is_refused(edges: list[FakeEdge],
                                                placement: Placement) -> None:
    before = sum(e.creates for e in edges)
    with pytest.raises(errors.BadRequest) as exc:
        await placement.create(SandboxSpec(image="x", backend="firecracker"), "p")
    assert exc.value.details["offered"] == ["container", "microvm"]
    assert sum(e.creates for e in edges) == before  # no node was asked


async def test_a_kind_taken_away_shows_at_the_next_probe(edges: list[FakeEdge],
                                                        placement: Placement) -> None:
    """The view is what decides: node-b stops offering microVMs; until a probe shows it the
    create still goes there, after one the kind is offered by nobody alive."""
    edges[1].kinds = {"container": True, "microvm": False}
    assert (await placement.create(SandboxSpec(image="x", backend="microvm"), "p")).node \
        == "node-b"
    await poll(placement)
    with pytest.raises(errors.BadRequest):
        await placement.create(SandboxSpec(image="x", backend="microvm"), "p")
