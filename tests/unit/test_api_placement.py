"""Placement over edges watched in this process: id routing, choice by free capacity as the
watcher's view shows it, fallback when an edge refuses."""
from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.models import SandboxSpec
from rollbox.placement import Placement, split_sandbox_id
from test_api_support import FakeEdge, poll, watched


@pytest.fixture
async def edges(tmp_path: Path) -> AsyncIterator[list[FakeEdge]]:
    es = [FakeEdge("node-a", tmp_path / "a", 100), FakeEdge("node-b", tmp_path / "b", 100)]
    try:
        yield es
    finally:
        for e in es:
            await e.close()


@pytest.fixture
async def p(edges: list[FakeEdge]) -> AsyncIterator[Placement]:
    async with watched(edges) as placement:
        yield placement


def test_split_and_route(edges: list[FakeEdge], p: Placement) -> None:
    assert split_sandbox_id("node-a-0123abcd") == ("node-a", "0123abcd")
    assert p.edge_for("node-b-00ff00ff00ff") is edges[1]
    for bad in ("node-c-0123abcd", "node-a", "node-a-XYZ", "", "-0123abcd", "a" * 300):
        with pytest.raises(errors.NotFound):
            p.edge_for(bad)
    with pytest.raises(ValueError):
        Placement([edges[0], edges[0]], p.view)


async def test_prefers_free_edge_and_falls_back(edges: list[FakeEdge], p: Placement) -> None:
    spec = SandboxSpec(image="x")
    edges[0].max_sandboxes = 2
    await poll(p)
    infos = [await p.create(spec, "proj") for _ in range(10)]
    # With two edges both are compared each time: the freer one (b) wins every time but when
    # equal; a's two slots fill at most.
    assert sum(i.node == "node-a" for i in infos) <= 2
    assert all(p.edge_for(i.id).node_id == i.node for i in infos)
    edges[1].max_sandboxes = len(edges[1].sandboxes)  # b is full now; a has one slot left
    edges[0].max_sandboxes = len(edges[0].sandboxes) + 1
    await poll(p)
    info = await p.create(spec, "proj")
    assert info.node == "node-a"
    with pytest.raises(errors.CapacityExceeded) as ei:
        await p.create(spec, "proj")
    assert ei.value.retryable
    assert {i.id for i in await p.list("proj", {})} == {i.id for i in infos} | {info.id}


async def test_infra_errors_are_retried_elsewhere(edges: list[FakeEdge], p: Placement) -> None:
    edges[0].inject["create"] = errors.InfraError("disk gone")
    for _ in range(5):
        assert (await p.create(SandboxSpec(image="x"), "p")).node == "node-b"
    edges[1].inject["create"] = errors.InfraError("also gone")
    with pytest.raises(errors.InfraError):
        await p.create(SandboxSpec(image="x"), "p")
    edges[1].inject["create"] = errors.BadRequest("no such image")
    await poll(p)  # the refusals above keep both nodes out until their next probe
    with pytest.raises(errors.BadRequest):  # not retried elsewhere: the request is wrong
        await p.create(SandboxSpec(image="x"), "p")
