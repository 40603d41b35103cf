"""Fork of container sandboxes (``Edge.fork`` -> ``ContainerBackend.fork``) on real sandboxes:
children see the source's tree as at the freeze (written files, deletions, env, hidden
paths, network policy, labels + fork_of, job, deadline), the source keeps running and no later
write of the source reaches a child (also through a descriptor opened before the fork); each
child has its own hostname and machine-id; a fork of a paused sandbox leaves it paused; of a
child (a fork of a fork); of a sandbox made from a snapshot. Bad input is typed and leaves
nothing: n out of range, above the project's quota or the node's room, a deleted source, a
memory-tier source. The shared lower goes with its last child."""
from __future__ import annotations

import asyncio
import os

import pytest

from rollbox.backends.container.disk import FORK_PREFIX
from rollbox.errors import (
    BadRequest, CapacityExceeded, IdempotencyConflict, NotFound, QuotaExceeded, SandboxDead,
)
from rollbox.models import (
    ExecSpec, ForkSpec, NetworkPolicy, Quota, Resources, SandboxSpec, SnapshotSpec,
)

BB = "busybox:test"


async def run(edge, sid: str, cmd: str, timeout_s: float = 30):  # noqa: ANN001, ANN201
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=timeout_s))
    return await edge.exec_wait(sid, eid)


async def out(edge, sid: str, cmd: str) -> str:  # noqa: ANN001
    r = await run(edge, sid, cmd)
    assert r.exit_code == 0, (cmd, r)
    return r.stdout


def lowers(edge) -> set[str]:  # noqa: ANN001
    return {n for n in os.listdir(edge.backend.disk.mnt) if n.startswith(FORK_PREFIX)}


async def delete_all(edge, ids: list[str]) -> None:  # noqa: ANN001
    await asyncio.gather(*(edge.delete(i) for i in ids), return_exceptions=True)


async def test_fork_children_see_the_frozen_tree_and_never_the_sources_later_writes(
        edge) -> None:  # noqa: ANN001
    src = await edge.create(SandboxSpec(
        image=BB, labels={"task": "t1"}, env={"SEED": "42"}, hidden_paths=["/secret"],
        network=NetworkPolicy(allow=[]), ttl_s=600), "proj")
    made: list[str] = [src.id]
    try:
        await out(edge, src.id, "mkdir -p /work && echo before > /work/f && echo gone > /work/g"
                  " && rm /bin/vi && head -c 1048576 /dev/urandom > /work/blob")
        # A process of the source holds /work/f open (appending) across the fork.
        await edge.exec_start(src.id, ExecSpec(
            cmd="exec 3>>/work/f; while [ ! -e /work/go ]; do sleep 0.05; done; "
                "echo late >&3; touch /work/done; sleep 600", timeout_s=120))
        await out(edge, src.id, "rm /work/g")
        await edge.file_write(src.id, "/secret/answer", b"hidden", 0o644)
        # Written just before the fork and never synced: still dirty in the page cache (the
        # snapshot itself must flush it), a rename among them.
        fresh = await out(edge, src.id, "head -c 8388608 /dev/urandom > /work/fresh.tmp && "
                          "mv /work/fresh.tmp /work/fresh && md5sum /work/fresh | cut -d' ' -f1")
        assert (await run(edge, src.id, "cat /secret/answer")).exit_code != 0
        res = await edge.fork(src.id, ForkSpec(n=3, labels={"group": "g1"}), "proj")
        kids = [c.id for c in res.children]
        made += kids
        assert len(kids) == 3 and len(set(kids)) == 3
        assert 0 < res.frozen_s < 5
        # The source keeps running, with its processes; its late write stays its own.
        await out(edge, src.id, "touch /work/go; for i in $(seq 100); do [ -e /work/done ] "
                  "&& break; sleep 0.05; done; test -e /work/done")
        assert await out(edge, src.id, "cat /work/f") == "before\nlate\n"
        await out(edge, src.id, "echo after > /work/h")
        blob = await out(edge, src.id, "md5sum /work/blob | cut -d' ' -f1")
        names = set()
        machine_ids = set()
        for kid, info in zip(kids, res.children):
            assert info.labels == {"task": "t1", "group": "g1", "fork_of": src.id}
            assert info.owner == "proj" and info.image == src.image
            assert info.layers == src.layers and info.hidden_paths == ["/secret"]
            assert info.network == NetworkPolicy(allow=[])
            assert info.expires_at == src.expires_at
            assert await out(edge, kid, "cat /work/f") == "before\n"
            assert await out(edge, kid, "md5sum /work/blob | cut -d' ' -f1") == blob
            assert await out(edge, kid, "md5sum /work/fresh | cut -d' ' -f1") == fresh
            assert (await run(edge, kid, "test -e /work/fresh.tmp")).exit_code == 1
            assert (await run(edge, kid, "test -e /work/g")).exit_code == 1  # deleted before
            assert (await run(edge, kid, "test -e /bin/vi")).exit_code == 1  # a whiteout
            assert (await run(edge, kid, "test -e /work/h")).exit_code == 1  # written after
            assert (await run(edge, kid, "test -e /work/go")).exit_code == 1
            assert await out(edge, kid, "echo $SEED") == "42\n"
            assert (await run(edge, kid, "cat /secret/answer")).exit_code != 0  # still hidden
            assert await edge.file_read(kid, "/secret/answer", 100) == b"hidden"  # but there
            assert await out(edge, kid, "ls -ln /work/f | awk '{print $3}'") == "0\n"
            assert (await run(edge, kid, "ps | grep -c 'sleep 60[0]'")).stdout == "0\n"
            names.add(await out(edge, kid, "hostname"))
            machine_ids.add(await out(edge, kid, "cat /etc/machine-id"))
            # The child's writes are its own.
            await out(edge, kid, f"echo {kid} > /work/f")
        assert len(names) == 3 and len(machine_ids) == 3
        for kid in kids:
            assert await out(edge, kid, "cat /work/f") == f"{kid}\n"
        assert await out(edge, src.id, "cat /work/f") == "before\nlate\n"
        assert len(lowers(edge)) == 1
        # A fork of a child: its own lower over the one it has.
        grand = await edge.fork(kids[0], ForkSpec(n=1), "proj")
        made.append(grand.children[0].id)
        assert await out(edge, grand.children[0].id, "cat /work/f; md5sum /work/blob | "
                         "cut -d' ' -f1") == f"{kids[0]}\n{blob}"
        assert grand.children[0].labels["fork_of"] == kids[0]
        assert len(lowers(edge)) == 2
        # The lowers go with their last user, not before.
        await edge.delete(src.id)
        await delete_all(edge, kids)
        assert await out(edge, grand.children[0].id, "cat /work/f") == f"{kids[0]}\n"
        assert len(lowers(edge)) == 2
        await edge.delete(grand.children[0].id)
        assert lowers(edge) == set()
        for sid in made:
            assert edge.leftovers(sid) == []
    finally:
        await delete_all(edge, made)


async def test_fork_of_a_paused_sandbox_and_of_one_made_from_a_snapshot(edge) -> None:  # noqa: ANN001
    src = await edge.create(SandboxSpec(image=BB), "proj")
    made = [src.id]
    name = f"proj/fork-{src.id[-6:]}:1"
    try:
        await out(edge, src.id, "echo snap > /snap")
        await edge.snapshot(src.id, SnapshotSpec(name=name), "proj")
        await edge.pause(src.id)
        res = await edge.fork(src.id, ForkSpec(n=2), "proj")
        made += [c.id for c in res.children]
        assert (await edge.get(src.id)).state == "paused"  # left as it was
        for c in res.children:
            assert await out(edge, c.id, "cat /snap") == "snap\n"
        await edge.resume(src.id)
        # From the snapshot: a sandbox of that image, forked.
        base = await edge.create(SandboxSpec(image=name), "proj")
        made.append(base.id)
        await out(edge, base.id, "echo more >> /snap")
        res2 = await edge.fork(base.id, ForkSpec(n=2), "proj")
        made += [c.id for c in res2.children]
        for c in res2.children:
            assert await out(edge, c.id, "cat /snap") == "snap\nmore\n"
    finally:
        await delete_all(edge, made)
        edge.store.remove(name)


async def test_fork_bad_input_is_typed_and_leaves_nothing(edge) -> None:  # noqa: ANN001
    src = await edge.create(SandboxSpec(image=BB, resources=Resources(memory_mib=64)), "proj")
    mem = await edge.create(SandboxSpec(image=BB, disk_tier="memory"), "proj")
    try:
        before = set(edge.live)
        with pytest.raises(BadRequest):
            await edge.fork(src.id, ForkSpec.model_construct(n=0, labels={}), "proj")
        edge.settings.fork_max_children = 4
        with pytest.raises(BadRequest) as exc:
            await edge.fork(src.id, ForkSpec(n=5), "proj")
        assert exc.value.details["limit"] == 4
        with pytest.raises(BadRequest):  # the memory tier has no clone
            await edge.fork(mem.id, ForkSpec(n=1), "proj")
        with pytest.raises(BadRequest):
            await edge.fork(src.id, ForkSpec(n=1, labels={"rollbox.grader": "x"}), "proj")
        # Above the project's quota: none made (all n are counted at once).
        edge.quotas = type("Q", (), {"get": lambda self, p: Quota(sandboxes=4)})()
        with pytest.raises(QuotaExceeded):
            await edge.fork(src.id, ForkSpec(n=3), "proj")
        edge.quotas = None
        # Above the node's room.
        edge.admission.limits.max_sandboxes = len(edge.live) + 2
        edge.admission.limits.reserved_share = 0.0
        with pytest.raises(CapacityExceeded):
            await edge.fork(src.id, ForkSpec(n=3), "proj")
        assert set(edge.live) == before
        assert lowers(edge) == set()
        edge.admission.limits.max_sandboxes = 4096
        with pytest.raises(NotFound):
            await edge.fork(f"{edge.node_id}-0123456789ab", ForkSpec(n=1), "proj")
        await edge.delete(src.id)
        with pytest.raises(SandboxDead):
            await edge.fork(src.id, ForkSpec(n=1), "proj")
        assert set(edge.live) == before - {src.id}
        assert edge.admission.total.sandboxes == len(edge.live)
    finally:
        await delete_all(edge, [src.id, mem.id])


async def test_fork_children_are_readopted_after_an_edge_restart(restarts) -> None:  # noqa: ANN001
    """A child's lowers are in its journaled state and the references on disk: after a
    restart it runs on, a fork of it stacks on them, and the lower goes with its last user."""
    e1 = await restarts.start()
    src = await e1.create(SandboxSpec(image=BB), "proj")
    await out(e1, src.id, "echo one > /f")
    kid = (await e1.fork(src.id, ForkSpec(n=1, idempotency_key="rk"), "proj")).children[0].id
    await e1.delete(src.id)  # the child alone holds the lower now
    await restarts.stop()
    e2 = await restarts.start()
    assert await out(e2, kid, "cat /f") == "one\n"
    # The fork's key came back with the child (its journaled fork_key): a retry is that child.
    again = await e2.fork(src.id, ForkSpec(n=1, idempotency_key="rk"), "proj")
    assert [c.id for c in again.children] == [kid]
    assert e2.live[kid].box.fork_lowers and len(lowers(e2)) == 1
    await out(e2, kid, "echo two >> /f")
    grand = (await e2.fork(kid, ForkSpec(n=1), "proj")).children[0].id
    assert await out(e2, grand, "cat /f") == "one\ntwo\n"
    await e2.delete(kid)
    assert len(lowers(e2)) == 2  # both held by the grandchild
    await e2.delete(grand)
    assert lowers(e2) == set()


def children_of(edge, src: str) -> set[str]:  # noqa: ANN001
    return {i for i, x in edge.live.items() if x.info.labels.get("fork_of") == src}


async def test_a_keyed_fork_retried_returns_the_same_children_never_2n(edge) -> None:  # noqa: ANN001
    src = await edge.create(SandboxSpec(image=BB, resources=Resources(memory_mib=64)), "proj")
    other = await edge.create(SandboxSpec(image=BB, resources=Resources(memory_mib=64)), "proj")
    try:
        first = await edge.fork(src.id, ForkSpec(n=2, idempotency_key="k1"), "proj")
        ids = [c.id for c in first.children]
        again = await edge.fork(src.id, ForkSpec(n=2, idempotency_key="k1"), "proj")
        assert [c.id for c in again.children] == ids and again.frozen_s == first.frozen_s
        assert children_of(edge, src.id) == set(ids)
        assert all(c.fork_key == "k1" for c in again.children)
        # Two at once with one key (a retry racing the first attempt): one fork of 3.
        a, b = await asyncio.gather(
            edge.fork(src.id, ForkSpec(n=3, idempotency_key="k2"), "proj"),
            edge.fork(src.id, ForkSpec(n=3, idempotency_key="k2"), "proj"))
        assert [c.id for c in a.children] == [c.id for c in b.children]
        assert len(children_of(edge, src.id)) == 5
        # The key with another n, labels or source: refused, nothing made.
        for bad_src, bad in ((src.id, ForkSpec(n=1, idempotency_key="k1")),
                             (src.id, ForkSpec(n=2, labels={"x": "1"}, idempotency_key="k1")),
                             (other.id, ForkSpec(n=2, idempotency_key="k1"))):
            with pytest.raises(IdempotencyConflict):
                await edge.fork(bad_src, bad, "proj")
        assert len(children_of(edge, src.id)) == 5 and children_of(edge, other.id) == set()
        # Keys are per project: another project's k1 is a fork of its own.
        theirs = await edge.fork(other.id, ForkSpec(n=1, idempotency_key="k1"), "other")
        assert len(theirs.children) == 1
        # One child gone: the retry answers the live one; all gone: the key forks anew.
        await edge.delete(ids[0])
        assert [c.id for c in (await edge.fork(
            src.id, ForkSpec(n=2, idempotency_key="k1"), "proj")).children] == ids[1:]
        await edge.delete(ids[1])
        fresh = await edge.fork(src.id, ForkSpec(n=2, idempotency_key="k1"), "proj")
        assert len(fresh.children) == 2 and not {c.id for c in fresh.children} & set(ids)
        # A fork that failed leaves its key free: the retry is a fork of its own.
        await edge.delete(other.id)
        with pytest.raises(SandboxDead):
            await edge.fork(other.id, ForkSpec(n=1, idempotency_key="k3"), "proj")
        kids = await edge.fork(src.id, ForkSpec(n=1, idempotency_key="k3"), "proj")
        assert len(kids.children) == 1
    finally:
        await delete_all(edge, [*children_of(edge, src.id), *children_of(edge, other.id),
                                src.id, other.id])
    assert lowers(edge) == set()


async def test_fork_children_take_the_nodes_create_concurrency_cap(edge) -> None:  # noqa: ANN001
    """A fork's children go through the node's create-concurrency cap like creates (one
    permit per child, at most the whole cap): with the cap held by others it waits, and
    past the create queue's timeout it is refused, typed, with nothing half-made."""
    src = await edge.create(SandboxSpec(image=BB, resources=Resources(memory_mib=64)), "proj")
    held = 0
    timeout = edge.limits.create_queue_timeout_s
    try:
        before = set(edge.live)
        for _ in range(edge._create_sem_size - 1):  # all but one permit, as running creates
            await edge._create_sem.acquire()
            held += 1
        task = asyncio.create_task(edge.fork(src.id, ForkSpec(n=3), "proj"))
        await asyncio.sleep(0.5)
        assert not task.done() and set(edge.live) == before
        while held:
            edge._create_sem.release()
            held -= 1
        res = await task
        assert len(res.children) == 3
        await delete_all(edge, [c.id for c in res.children])
        # The whole cap held past the queue's timeout: capacity_exceeded, nothing made.
        edge.limits.create_queue_timeout_s = 0.3
        for _ in range(edge._create_sem_size):
            await edge._create_sem.acquire()
            held += 1
        with pytest.raises(CapacityExceeded) as exc:
            await edge.fork(src.id, ForkSpec(n=2), "proj")
        assert exc.value.details["reason"] == "create_queue"
        assert set(edge.live) == before and lowers(edge) == set()
        assert edge.admission.total.sandboxes == len(edge.live)
    finally:
        edge.limits.create_queue_timeout_s = timeout
        while held:
            edge._create_sem.release()
            held -= 1
        await delete_all(edge, [*children_of(edge, src.id), src.id])
    assert lowers(edge) == set()


async def test_a_fork_whose_child_fails_leaves_nothing_half_made(edge) -> None:  # noqa: ANN001
    """One child of three can not get a uid range (the node's slots are taken): the fork
    is refused, typed; the children made are torn down (verified), their references and
    the shared lower are gone, and every slot is free again."""
    src = await edge.create(SandboxSpec(image=BB, resources=Resources(memory_mib=64)), "proj")
    slots = edge.backend.slots
    taken: list[int] = []
    try:
        before = set(edge.live)
        free = slots.slots - len(slots.in_use())
        taken = [slots.acquire() for _ in range(free - 2)]  # room for 2 children, not 3
        with pytest.raises(CapacityExceeded):
            await edge.fork(src.id, ForkSpec(n=3), "proj")
        assert set(edge.live) == before and lowers(edge) == set()
        refs = edge.backend.disk.refs
        assert not refs.is_dir() or [p.name for p in refs.iterdir() if p.name != ".lock"] == []
        assert edge.backend.host_sandbox_ids(edge.node_id) == set(before)
        assert edge.admission.total.sandboxes == len(edge.live)
        for slot in taken:
            slots.release(slot)
        taken = []
        assert slots.slots - len(slots.in_use()) == free
        res = await edge.fork(src.id, ForkSpec(n=3), "proj")  # room again: all three
        assert len(res.children) == 3
        await delete_all(edge, [c.id for c in res.children])
    finally:
        for slot in taken:
            slots.release(slot)
        await delete_all(edge, [*children_of(edge, src.id), src.id])
    assert lowers(edge) == set()
