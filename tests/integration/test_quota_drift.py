"""Quota drift on the embedded node (SQLite ledger, its reconcile task over the real edge's
live set): zero within 10 s after a TTL expiry, and after an api replica that dies between
reserve and create, or between the edge's create and its commit."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox.embedded import EmbeddedNode
from rollbox.iam import SQLiteLedger, Usage
from rollbox.models import Quota, Resources, SandboxSpec
from tests.conftest import node_settings

BB = "busybox:test"
DRIFT_S = 10.0


@pytest.fixture
async def node(tmp_node_dir: Path) -> AsyncIterator[EmbeddedNode]:
    n = EmbeddedNode(node_settings(tmp_node_dir))
    app = await n.start()
    n.api = app.state.api  # type: ignore[attr-defined]
    assert n.keys is not None
    n.keys.create("team")
    op = n.keys.verify(n.ensure_admin_key())
    await n.keys.set_quota(op, "team", Quota(sandboxes=3))
    try:
        yield n
    finally:
        await n.stop(destroy=True)


async def _settles(ledger: SQLiteLedger, want: int, within: float) -> float:
    """Seconds until the ledger holds ``want`` sandboxes of team (AssertionError after
    ``within``)."""
    t0 = time.monotonic()
    while (await ledger.usage("team")).sandboxes != want:
        assert time.monotonic() - t0 < within, f"ledger {await ledger.usage('team')}"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def test_a_ttl_expiry_leaves_no_drift(node: EmbeddedNode) -> None:
    assert node.ledger is not None and node.edge is not None
    info = await node.api.create_sandbox(  # type: ignore[attr-defined]
        SandboxSpec(image=BB, ttl_s=1, resources=Resources(memory_mib=64)), "team")
    assert (await node.ledger.usage("team")).sandboxes == 1
    while info.id in node.edge.live:  # the edge ends it, not the api
        await asyncio.sleep(0.1)
    took = await _settles(node.ledger, 0, DRIFT_S)
    print(f"ledger released the expired sandbox {took:.1f} s after the edge ended it")


async def test_a_replica_dying_after_reserve_leaves_no_drift(node: EmbeddedNode) -> None:
    """A replica reserves and dies before it asks any edge (nothing renews its reservation),
    and another dies after the edge made its sandbox but before it committed."""
    assert node.ledger is not None and node.edge is not None
    dead = SQLiteLedger(node.settings.data_dir / "keys.db")  # the doomed replica's
    try:
        await dead.reserve("team", Usage(1, 1.0, 64))
        spec = SandboxSpec(image=BB, resources=Resources(memory_mib=64))
        await dead.reserve("team", Usage.of(spec.resources))
        made = await node.edge.create(spec, "team")
    finally:
        dead.close()  # kill -9: no commit, no cancel, no renew
    assert (await node.ledger.usage("team")).sandboxes == 2
    took = await _settles(node.ledger, 1, DRIFT_S)  # the live one stays charged, once
    await asyncio.sleep(6)  # a reconcile round later: still exactly the live sandbox
    assert await node.ledger.usage("team") == Usage(1, 1.0, 64)
    print(f"two dead reservations: right after {took:.1f} s")
    await node.edge.delete(made.id)
    await _settles(node.ledger, 0, DRIFT_S)


async def test_a_job_lease_expiry_leaves_no_drift(node: EmbeddedNode) -> None:
    """The trainer stops heartbeating: the edge's lease sweep deletes the job's sandboxes (not
    the api), and the ledger follows within 10 s."""
    from rollbox.models import JobSpec

    assert node.ledger is not None and node.edge is not None and node.leases is not None
    await node.leases.open("team", JobSpec(name="run-1", heartbeat_s=0.3))
    info = await node.api.create_sandbox(  # type: ignore[attr-defined]
        SandboxSpec(image=BB, job="run-1", resources=Resources(memory_mib=64)), "team")
    assert (await node.ledger.usage("team")).sandboxes == 1
    while info.id in node.edge.live:  # no heartbeat: the lease expires after ~0.9 s
        await asyncio.sleep(0.1)
    took = await _settles(node.ledger, 0, DRIFT_S)
    print(f"ledger released the job's sandbox {took:.1f} s after the lease sweep ended it")
