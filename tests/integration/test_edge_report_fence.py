"""The edge's side of the watcher (real edges): ``report()`` lists what placement and the
ledger need from memory, and the fence (rollbox.edge.fence): an edge no probe reached for the
fence tears its sandboxes down as node_lost and refuses creates until probed again; after a
restart within the fence it re-adopts its sandboxes with their commands, after a longer gap it
cleans them up as node_lost instead."""
from __future__ import annotations

import asyncio
import time

import pytest

from rollbox import errors
from rollbox.models import NODE_LOST, ExecSpec, Resources, SandboxSpec

FENCE_S = 1.5  # short, so the drills are quick; the watcher's default is 7 s


async def test_report_lists_capacity_sandboxes_layers_and_counts(edge) -> None:  # noqa: ANN001
    a = await edge.create(SandboxSpec(image="busybox:test", labels={"task": "a"},
                                      resources=Resources(cpus=0.5, memory_mib=256)), "p1")
    b = await edge.create(SandboxSpec(image="busybox:test", job=None), "p2")
    before = edge.admission.free()
    r = await edge.report()
    assert r.node_id == edge.node_id and r.incarnation == edge.incarnation
    assert r.fence_s is None and r.starting == 0
    assert "container" in r.backends
    assert {sb.id for sb in r.sandboxes} == {a.id, b.id} and r.sandboxes_total == 2
    sa = next(sb for sb in r.sandboxes if sb.id == a.id)
    assert (sa.owner, sa.backend, sa.state, sa.cpus, sa.memory_mib, sa.image, sa.platform) == (
        "p1", "container", "running", 0.5, 256, "busybox:test", False)
    assert sa.created_at == a.created_at and sa.expires_at == a.expires_at
    assert r.by_project == {"p1": 1, "p2": 1} and r.by_backend == {"container": 2}
    assert set(a.layers) <= set(r.layers)
    assert r.free == before and set(r.free) == {"sandboxes", "cpus", "memory_mib"}
    assert r.free["sandboxes"] == (await edge.capacity())["free"]
    assert r.limits["sandboxes"] == edge.limits.max_sandboxes
    # bounded: counted, not listed
    r1 = await edge.report(max_sandboxes=1)
    assert len(r1.sandboxes) == 1 and r1.sandboxes_total == 2 and r1.truncated
    assert r1.model_dump_json()  # what a remote edge sends
    with pytest.raises(errors.BadRequest):
        await edge.report(max_sandboxes=-1)
    with pytest.raises(errors.BadRequest):
        await edge.report(fence_s=0)
    # a create in progress is counted
    started = asyncio.Event()
    orig = edge.backends["container"].create

    async def slow_create(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        started.set()
        await asyncio.sleep(0.5)
        return await orig(*args, **kw)

    edge.backends["container"].create = slow_create
    try:
        task = asyncio.create_task(edge.create(SandboxSpec(image="busybox:test"), "p1"))
        await started.wait()
        assert (await edge.report()).starting == 1
        await task
    finally:
        edge.backends["container"].create = orig
    assert (await edge.report()).starting == 0


MAX_LABELS = {f"{i:02d}" + "k" * 61: "v" * 256 for i in range(64)}  # SandboxSpec's most
PER_SANDBOX_BYTES = 400  # a listed sandbox's share of a report, whatever its labels


async def test_a_report_stays_small_whatever_the_labels(edge) -> None:  # noqa: ANN001
    # A project's labels (64 of 63 + 256 characters: 20 kB a sandbox) are not in the report:
    # otherwise one project could slow every probe of the node toward its timeout, and a
    # timed-out node is fenced with every project's sandboxes (docs/watcher.md, Reports).
    empty = len((await edge.report()).model_dump_json())
    made = [await edge.create(SandboxSpec(image="busybox:test", labels=MAX_LABELS), "p1")
            for _ in range(4)]
    made.append(await edge.create(SandboxSpec(image="busybox:test", labels={
        "rollbox.backend": "fncall", **{k: v for k, v in list(MAX_LABELS.items())[:60]}}),
        "p1", share="reserved"))
    r = await edge.report()
    assert r.sandboxes_total == 5 and all(len(i.labels) >= 60 for i in made)
    size = len(r.model_dump_json())
    assert size - empty <= PER_SANDBOX_BYTES * 5, size
    assert max(len(sb.model_dump_json()) for sb in r.sandboxes) <= PER_SANDBOX_BYTES
    # what the ledger needs of them: the platform's own (rollbox.*) is told apart
    assert {sb.id: sb.platform for sb in r.sandboxes} == {
        i.id: i.id == made[-1].id for i in made}



async def test_report_is_cheap(edge) -> None:  # noqa: ANN001
    """From memory: no per-sandbox I/O (timed, printed; not asserted)."""
    for _ in range(3):
        await edge.create(SandboxSpec(image="busybox:test"), "p1")
    t0 = time.perf_counter()
    n = 200
    for _ in range(n):
        await edge.report()
    print(f"report() with 3 sandboxes: {(time.perf_counter() - t0) / n * 1e6:.0f} us")


async def test_unprobed_edge_fences_itself(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image="busybox:test"), "p1")
    eid = await edge.exec_start(sb.id, ExecSpec(cmd="sleep 60", background=True))
    r = await edge.report(fence_s=FENCE_S)
    assert r.fence_s == FENCE_S
    await asyncio.sleep(FENCE_S / 2)
    await edge.report(fence_s=FENCE_S)  # probed in time: nothing happens
    await asyncio.sleep(FENCE_S / 2)
    assert sb.id in edge.live
    # no probe for longer than the fence: the edge's own loop tears the sandbox down
    await edge.wait_deleted(sb.id, timeout=FENCE_S + 5)
    info = await edge.get(sb.id)
    assert info.state == "dead" and info.dead_reason == NODE_LOST
    with pytest.raises(errors.SandboxDead) as exc:
        await edge.exec_start(sb.id, ExecSpec(cmd="true"))
    assert exc.value.details["reason"] == NODE_LOST
    with pytest.raises(errors.SandboxDead):
        await edge.exec_wait(sb.id, eid)
    assert edge.leftovers(sb.id) == []
    kinds = [e.kind for e in await edge.event_log.read(sb.id, 0)]
    assert "sandbox.dead" in kinds
    # fenced: creates are refused until a probe comes
    with pytest.raises(errors.CapacityExceeded) as refused:
        await edge.create(SandboxSpec(image="busybox:test"), "p1")
    assert refused.value.details["reason"] == "fenced"
    r = await edge.report(fence_s=FENCE_S)
    assert r.sandboxes == [] and r.free["sandboxes"] > 0
    again = await edge.create(SandboxSpec(image="busybox:test"), "p1")
    await edge.report(fence_s=None)  # disarmed: never fences
    await asyncio.sleep(FENCE_S + 1.2)
    assert again.id in edge.live


async def test_late_probe_fences_before_it_reports(edge) -> None:  # noqa: ANN001
    """A probe that arrives after the gap (a stopped node resumed) finds the sandboxes torn
    down, whichever of it and the edge's own loop comes first."""
    sb = await edge.create(SandboxSpec(image="busybox:test"), "p1")
    await edge.report(fence_s=FENCE_S)
    edge._ttl_task.cancel()  # only the probe can notice the gap
    await asyncio.sleep(FENCE_S + 0.3)
    r = await edge.report(fence_s=FENCE_S)
    assert sb.id not in {s.id for s in r.sandboxes}
    await edge.wait_deleted(sb.id)
    assert (await edge.get(sb.id)).dead_reason == NODE_LOST
    assert edge.leftovers(sb.id) == []


async def test_declare_lost_tears_down_the_live_ones(edge) -> None:  # noqa: ANN001
    a = await edge.create(SandboxSpec(image="busybox:test"), "p1")
    b = await edge.create(SandboxSpec(image="busybox:test"), "p1")
    torn = await edge.declare_lost([a.id, "nope-0123456789ab", a.id])
    assert torn == [a.id]
    assert a.id not in edge.live and b.id in edge.live
    assert (await edge.get(a.id)).dead_reason == NODE_LOST
    assert edge.leftovers(a.id) == []
    assert await edge.declare_lost([a.id]) == []  # already dead: no-op


async def test_restart_within_the_fence_readopts_after_it_cleans_up(restarts) -> None:  # noqa: ANN001
    e1 = await restarts.start()
    keep = await e1.create(SandboxSpec(image="busybox:test"), "p1")
    eid = await e1.exec_start(keep.id, ExecSpec(cmd="sleep 1; echo done", background=True))
    await e1.report(fence_s=FENCE_S * 2)
    await restarts.stop()  # as kill -9 leaves it: the sandbox runs on
    e2 = await restarts.start()  # back at once: re-adopted with its command
    assert keep.id in e2.live
    assert (await e2.exec_wait(keep.id, eid)).stdout == "done\n"
    assert e2.fence.fence_s == FENCE_S * 2
    await e2.report(fence_s=FENCE_S)
    await restarts.stop()
    await asyncio.sleep(FENCE_S + 0.5)  # down longer than the fence: declared lost
    e3 = await restarts.start()
    assert keep.id not in e3.live
    info = await e3.get(keep.id)
    assert info.state == "dead" and info.dead_reason == NODE_LOST
    assert e3.leftovers(keep.id) == []  # no process, mount, cgroup left
    assert (await e3.report()).sandboxes == []
