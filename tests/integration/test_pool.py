"""Warm pools on a real edge (rollbox.edge.pool): a create of a pooled key gets a sandbox made
ahead, with the request's identity, env, labels, owner, TTL and quota applied at hand-out; a
create whose set-up differs in any key field never gets it; pooled sandboxes give their room
back to real creates, follow demand, and are all destroyed when the edge stops; a pool above the
node's capacity stops the edge from starting."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.models import ExecSpec, ForkSpec, NetworkPolicy, Quota, Resources, SandboxSpec
from tests.conftest import node_settings

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]
BB = "busybox:test"
DEB = "debian:bookworm"


@pytest.fixture
def edge_settings() -> dict:
    return {"pool": True, "pool_window_s": 3600.0, "pool_max_total": 8,
            "pool_max_per_key": 4}


async def run(edge, sid: str, cmd: str, **kw) -> str:  # noqa: ANN001, ANN003
    r = await edge.exec_run(sid, ExecSpec(cmd=cmd, timeout_s=30, **kw))
    assert r.exit_code == 0, r
    return r.stdout.strip()


async def test_handout_applies_identity_env_labels_owner_and_ttl(edge) -> None:  # noqa: ANN001
    from rollbox.models import JobSpec

    await edge.pool.stop_refill()
    await edge.leases.open("proj-a", JobSpec(name="job-1", heartbeat_s=600))
    base = SandboxSpec(image=BB)
    made = await edge.pool_fill(base, 2)
    assert len(made) == 2 and edge.pool.size() == 2
    # pooled: running, but no project's: not listed, not counted for anyone
    assert not await edge.list(None, {})
    assert edge.admission.by_owner.get("proj-a") is None
    await asyncio.sleep(0.3)
    t0 = time.time()
    spec = SandboxSpec(image=BB, env={"FOO": "bar-1"}, labels={"task": "t1"}, ttl_s=120,
                       job="job-1")
    info = await edge.create(spec, "proj-a")
    assert info.id in made and edge.pool.size() == 1 and edge.pool.hits == 1
    assert info.owner == "proj-a" and info.labels == {"task": "t1"} and info.job == "job-1"
    assert info.created_at >= t0 and abs(info.expires_at - (info.created_at + 120)) < 1
    assert await run(edge, info.id, "hostname") == info.id[:63]
    assert await run(edge, info.id, "echo $FOO") == "bar-1"
    assert [i.id for i in await edge.list("proj-a", {})] == [info.id]
    assert edge.admission.by_owner["proj-a"].sandboxes == 1
    kinds = [e.kind async for e in edge.events(info.id, 0, False)]
    assert kinds[0] == "sandbox.created", kinds
    # the second hand-out of the same key gets the other one, with its own env
    info2 = await edge.create(SandboxSpec(image=BB, env={"FOO": "other"}), "proj-b")
    assert info2.id in made and info2.id != info.id
    assert await run(edge, info2.id, "echo $FOO") == "other"
    assert await run(edge, info.id, "echo $FOO") == "bar-1"
    # empty now: the next is made cold
    info3 = await edge.create(base, "proj-b")
    assert info3.id not in made and edge.pool.misses == 1


VARIANTS = {
    "image": {"image": DEB},
    "resources": {"resources": Resources(memory_mib=512)},
    "network": {"network": NetworkPolicy(allow=[])},
    "hidden_paths": {"hidden_paths": ["/etc/group"]},
    "disk_tier": {"disk_tier": "memory"},
    "qos": {"qos": "latency"},
    "layers": {"layers": [DEB]},
}


async def test_never_hands_out_a_sandbox_of_another_setup(edge) -> None:  # noqa: ANN001
    await edge.pool.stop_refill()
    made = await edge.pool_fill(SandboxSpec(image=BB), 1)
    assert len(made) == 1
    for name, change in VARIANTS.items():
        info = await edge.create(SandboxSpec(**{"image": BB, **change}), "proj")
        assert info.id not in made, f"{name}: handed out a sandbox of another set-up"
        assert edge.pool.hits == 0 and edge.pool.size() == 1, name
        if name == "hidden_paths":  # the cold one of the hidden path really hides it
            r = await edge.exec_run(info.id, ExecSpec(cmd="cat /etc/group"))
            assert r.exit_code != 0 or not r.stdout, r  # masked: unreadable or empty
        await edge.delete(info.id)
    # ... and the pooled base one does not
    info = await edge.create(SandboxSpec(image=BB), "proj")
    assert info.id in made
    assert await run(edge, info.id, "cat /etc/group")  # the image's file, readable


async def test_quota_is_checked_at_handout_and_the_sandbox_stays_pooled(
        edge) -> None:  # noqa: ANN001
    await edge.pool.stop_refill()

    class Quotas:
        def get(self, project: str) -> Quota:
            return Quota(sandboxes=0) if project == "poor" else Quota()

    edge.quotas = Quotas()
    made = await edge.pool_fill(SandboxSpec(image=BB), 1)
    with pytest.raises(errors.QuotaExceeded):
        await edge.create(SandboxSpec(image=BB), "poor")
    assert edge.pool.size() == 1 and "poor" not in edge.admission.by_owner
    info = await edge.create(SandboxSpec(image=BB), "rich")
    assert info.id == made[0]


async def test_a_real_create_evicts_pooled_sandboxes_before_a_refusal(
        edge) -> None:  # noqa: ANN001
    await edge.pool.stop_refill()
    edge.limits.max_sandboxes = 3
    edge.limits.reserved_share = 0.0
    made = await edge.pool_fill(SandboxSpec(image=BB), 3)
    assert len(made) == 3
    # the node is full of pooled sandboxes: a create of another key still gets room
    a = await edge.create(SandboxSpec(image=BB, qos="latency"), "proj")
    b = await edge.create(SandboxSpec(image=BB, qos="latency"), "proj")
    assert a.id not in made and b.id not in made
    assert edge.pool.evicted["room"] == 2 and edge.pool.size() == 1
    for sid in made:
        if sid not in {i for k in edge.pool.ready.values() for i in (p.sandbox_id for p in k)}:
            assert not edge.leftovers(sid), sid
    c = await edge.create(SandboxSpec(image=BB), "proj")
    assert c.id in made  # the one left is handed out, not evicted
    # full of real sandboxes: refused as before
    with pytest.raises(errors.CapacityExceeded):
        await edge.create(SandboxSpec(image=BB, qos="latency"), "proj")


async def test_refill_follows_demand_and_decays(edge) -> None:  # noqa: ANN001
    edge.settings.pool_window_s = 2.0
    spec = SandboxSpec(image=BB)
    first = [await edge.create(spec, "proj") for _ in range(3)]
    assert edge.pool.misses >= 1
    deadline = time.monotonic() + 30
    while edge.pool.size() < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert edge.pool.size() >= 1, edge.pool.stats()
    pooled = {p.sandbox_id for v in edge.pool.ready.values() for p in v}
    hit = await edge.create(spec, "proj")
    assert hit.id in pooled
    for i in [*first, hit]:
        await edge.delete(i.id)
    # nobody asks any more: the demand decays below 1/2 and the pool is emptied
    deadline = time.monotonic() + 30
    while (edge.pool.size() or edge.pool._making) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert edge.pool.size() == 0, edge.pool.stats()
    assert edge.pool.evicted["demand"] >= 1
    for sid in pooled - {hit.id}:
        assert not edge.leftovers(sid), sid


async def test_pooled_sandboxes_are_destroyed_when_the_edge_stops(tmp_node_dir: Path) -> None:
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog

    s = node_settings(tmp_node_dir)
    s.pool = True
    events = EventLog(tmp_node_dir / "events.db")
    e = Edge(s, events)
    await e.start()
    try:
        made = await e.pool_fill(SandboxSpec(image=BB), 2)
        assert len(made) == 2
        assert all(e.leftovers(sid) for sid in made)  # they are there while pooled
    finally:
        await e.close()
        events.close()
    for sid in made:
        assert not e.leftovers(sid), sid


@pytest.mark.parametrize("change,field", [
    ({"pool_max_total": 4000}, "sandboxes"),
    ({"memory_overcommit": 0.5}, "memory_mib"),
    ({"pool_max_per_key": 40}, "pool_max_per_key"),
])
def test_a_pool_above_the_nodes_capacity_is_refused_at_start(tmp_path: Path, change: dict,
                                                             field: str) -> None:
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog

    s = node_settings(tmp_path)
    s.pool = True
    s.pool_max_total = 32
    for k, v in change.items():
        setattr(s, k, v)
    events = EventLog(tmp_path / "events.db")
    try:
        with pytest.raises(errors.BadRequest) as exc:
            Edge(s, events)
    finally:
        events.close()
    assert exc.value.details["reason"] == "pool_capacity"
    assert exc.value.details["field"] == field
    assert not list(s.data_dir.glob("edge-*.db"))  # nothing made


async def test_pool_metrics(edge) -> None:  # noqa: ANN001
    from prometheus_client.parser import text_string_to_metric_families

    await edge.pool.stop_refill()
    await edge.pool_fill(SandboxSpec(image=BB), 2)
    await edge.create(SandboxSpec(image=BB), "proj")
    fams = {f.name: f for f in text_string_to_metric_families(
        edge.metrics.exposition().decode())}
    size = [s.value for s in fams["rollbox_pool_sandboxes"].samples
            if s.labels["node"] == edge.node_id]
    assert size == [1.0]
    creates = {s.labels["result"]: s.value for s in fams["rollbox_pool_creates"].samples
               if s.labels["node"] == edge.node_id and s.name.endswith("_total")}
    assert creates == {"hit": 1.0, "miss": 0.0}


async def test_refill_waits_while_creates_and_execs_keep_coming(edge) -> None:  # noqa: ANN001
    spec = SandboxSpec(image=BB)
    await edge.pool_fill(spec, 1)
    info = await edge.create(spec, "proj")  # the pool is empty now and wants more
    made = edge.pool.made
    runs = []
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # an exec start every 10 ms: the refill must wait
        runs.append(asyncio.create_task(edge.exec_run(info.id, ExecSpec(cmd="true"))))
        await asyncio.sleep(0.01)
    assert edge.pool.made == made and not edge.pool._making
    assert all(r.exit_code == 0 for r in await asyncio.gather(*runs))
    deadline = time.monotonic() + 30  # quiet: it refills
    while edge.pool.made == made and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert edge.pool.made > made


async def test_refilled_sandboxes_get_their_own_cpu_class(edge) -> None:  # noqa: ANN001
    """The refill spawns the runtime at SCHED_IDLE (best effort); the sandbox it makes still
    gets its key's class: a latency one runs SCHED_OTHER, a batch one SCHED_IDLE."""
    for qos, want in (("latency", os.SCHED_OTHER), ("batch", os.SCHED_IDLE)):
        spec = SandboxSpec(image=BB, qos=qos)
        await edge.create(spec, "proj")  # a miss: the refill makes one for this key
        deadline = time.monotonic() + 60
        pooled: set[str] = set()
        while not pooled and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            pooled = {p.sandbox_id for k, v in edge.pool.ready.items() if k.qos == qos
                      for p in v}
        assert pooled, edge.pool.stats()
        info = await edge.create(spec, "proj")
        assert info.id in pooled
        assert os.sched_getscheduler(edge.live[info.id].box.agent_pid) == want, qos


async def test_refusals_an_eviction_can_not_cure_keep_the_pool(edge) -> None:  # noqa: ANN001
    """Grades waiting for room or memory pressure refuse a create whatever the pool holds:
    no pooled sandbox is destroyed for it."""
    await edge.pool.stop_refill()
    made = await edge.pool_fill(SandboxSpec(image=BB), 2)
    assert len(made) == 2
    psi_max = edge.limits.memory_psi_max
    for reason in ("reserved", "memory_pressure"):
        if reason == "reserved":
            edge.admission._reserved_waiting += 1  # a grade waits for room
        else:
            edge.limits.memory_psi_max = -1.0  # any PSI reading is above it
            edge.admission.memory.forget()
        try:
            with pytest.raises(errors.CapacityExceeded) as exc:
                await edge.create(SandboxSpec(image=BB, qos="latency"), "proj")
        finally:
            edge.admission._reserved_waiting = 0
            edge.limits.memory_psi_max = psi_max
        assert exc.value.details["reason"] == reason
        assert edge.pool.size() == 2 and edge.pool.evicted["room"] == 0, reason


async def test_a_grade_share_create_evicts_without_waiting(edge) -> None:  # noqa: ANN001
    """A reserved create (grades, fncall workers) on a node full of pooled sandboxes gets
    their room at once, not after waiting out the create queue timeout; the refill does not
    take the room back meanwhile (it waits while a create is in admission)."""
    await edge.pool.stop_refill()
    edge.limits.max_sandboxes = 2
    edge.limits.reserved_share = 0.0
    edge.limits.create_queue_timeout_s = 30.0
    made = await edge.pool_fill(SandboxSpec(image=BB), 2)
    assert len(made) == 2
    refill_held = []
    destroy = edge.pool._destroy

    async def evicting(p):  # noqa: ANN001, ANN202
        edge._last_request = 0.0  # as if the eviction took longer than POOL_QUIET_S
        refill_held.append(edge._pool_busy() > 0)
        await destroy(p)

    edge.pool._destroy = evicting
    async with asyncio.timeout(10):
        info = await edge.create(SandboxSpec(image=BB, qos="latency"), "proj",
                                 share="reserved")
    assert info.id not in made and edge.pool.evicted["room"] == 1
    assert refill_held == [True]


async def test_reports_count_pooled_room_as_free(edge) -> None:  # noqa: ANN001
    await edge.pool.stop_refill()
    before = (await edge.report()).free
    made = await edge.pool_fill(SandboxSpec(image=BB), 2)
    assert len(made) == 2
    assert (await edge.report()).free == before  # placement sees room a create would get
    info = await edge.create(SandboxSpec(image=BB, qos="latency"), "proj")
    assert (await edge.report()).free["sandboxes"] == before["sandboxes"] - 1
    await edge.delete(info.id)


async def test_a_draining_node_destroys_its_pool_and_makes_none(edge) -> None:  # noqa: ANN001
    await edge.pool.stop_refill()
    made = await edge.pool_fill(SandboxSpec(image=BB), 2)
    assert len(made) == 2
    try:
        edge.drain(True)
        assert edge.pool.size() == 0 and edge.pool.evicted["drain"] == 2
        assert await edge.pool_fill(SandboxSpec(image=BB), 1) == []
        deadline = time.monotonic() + 30
        while any(edge.leftovers(sid) for sid in made) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for sid in made:
            assert not edge.leftovers(sid), sid
        assert edge.admission.total.sandboxes == 0
    finally:
        edge.drain(False)


async def test_a_failed_handout_destroys_the_sandbox(edge, monkeypatch) -> None:  # noqa: ANN001
    await edge.pool.stop_refill()
    made = await edge.pool_fill(SandboxSpec(image=BB), 1)
    assert len(made) == 1
    put = edge.journal.put
    calls = []

    def failing_put(info, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(info.state)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return put(info, *a, **kw)

    monkeypatch.setattr(edge.journal, "put", failing_put)
    with pytest.raises(OSError):
        await edge.create(SandboxSpec(image=BB), "proj")
    assert edge.pool.size() == 0 and made[0] not in edge.live
    assert not edge.leftovers(made[0])
    assert edge.admission.total.sandboxes == 0 and "proj" not in edge.admission.by_owner


async def test_a_fork_holds_the_refill_back(edge) -> None:  # noqa: ANN001
    await edge.pool.stop_refill()
    src = await edge.create(SandboxSpec(image=BB), "proj")
    edge._last_request = 0.0
    res = await edge.fork(src.id, ForkSpec(n=1), "proj")
    assert edge._last_request > 0.0
    for kid in [src.id, *[c.id for c in res.children]]:
        await edge.delete(kid)


async def test_a_fenced_node_destroys_its_pool_and_makes_none(edge) -> None:  # noqa: ANN001
    await edge.pool.stop_refill()
    made = await edge.pool_fill(SandboxSpec(image=BB), 2)
    assert len(made) == 2
    await edge.report(fence_s=1.0)  # armed; no probe comes: the node fences itself
    deadline = time.monotonic() + 10
    while edge.pool.size() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert edge.pool.size() == 0 and edge.pool.evicted["fence"] == 2
    assert await edge.pool_fill(SandboxSpec(image=BB), 1) == []  # fenced: nothing pooled
    while any(edge.leftovers(sid) for sid in made) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for sid in made:
        assert not edge.leftovers(sid), sid
    await edge.report(fence_s=None)  # disarmed


async def test_reports_give_pooled_memory_apart_as_reclaimable(edge, monkeypatch) -> None:  # noqa: ANN001
    """The pool's live memory is not memory of sandboxes the node keeps: the report counts it
    in ``memory_available_mib`` (a create evicts before it is refused) and names it in
    ``pooled_memory_mib``; capacity() says how much of its counts is the pool's."""
    await edge.pool.stop_refill()
    empty = await edge.report()
    assert empty.pooled == 0 and empty.pooled_memory_mib == 0
    adm = edge.admission
    made = await edge.pool_fill(SandboxSpec(image=BB), 2)
    assert len(made) == 2
    # Held still for the comparisons (a loaded host may take seconds between the lines): one
    # host memory sample, and promises that do not settle meanwhile.
    now = adm.clock()
    monkeypatch.setattr(adm, "clock", lambda: now)
    adm.memory.forget()
    monkeypatch.setattr(adm.memory, "interval_s", 3600.0)
    r = await edge.report()
    assert r.pooled == 2 and r.sandboxes_total == empty.sandboxes_total
    used = sum(p.backend.usage(p.box).memory_bytes or 0 for p in edge.pool.sandboxes()) >> 20
    promised = adm.promised_mib(p.ticket for p in edge.pool.sandboxes())
    assert promised > 0  # just started: admission still counts their headroom as pending
    assert abs(r.pooled_memory_mib - (used + promised)) <= 2  # their cgroups' pages move
    # the same sample: what the node's sandboxes and creates hold, but the pool's back
    assert r.memory_available_mib == adm.live_memory_free_mib(
        reclaimable_mib=r.pooled_memory_mib)
    assert r.memory_available_mib >= adm.live_memory_free_mib() + promised
    cap = await edge.capacity()
    assert cap["pooled"] == 2 and abs(cap["pooled_memory_mib"] - r.pooled_memory_mib) <= 2
    assert cap["pooled_requested_memory_mib"] == 2 * Resources().memory_mib
    assert await edge.pool.evict_one() and await edge.pool.evict_one()
    after = await edge.report()
    assert after.pooled == 0 and after.pooled_memory_mib == 0
