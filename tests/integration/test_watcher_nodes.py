"""Node loss through the api (real edges, the real api over HTTP, a real watcher): two nodes,
one stops answering (its link cut: every call to it hangs, as a stopped node's do) ->
within 10 s the api answers its sandboxes sandbox_dead with reason node_lost (get, exec,
files), lists them dead, counts them lost; when it answers again its lost sandboxes are torn
down on it (no process, mount or cgroup left) and never listed alive again: by the edge's own
fence, or, with fencing off, by the watcher telling it (declare_lost). Also across a restart
of the watcher while the node was away."""
from __future__ import annotations

import asyncio
import inspect
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer, create_app
from rollbox.edge.edge import Edge
from rollbox.events.store import EventLog
from rollbox.iam import KeyStore, SQLiteLedger
from rollbox.models import NODE_LOST, SandboxSpec
from rollbox.placement import Placement
from rollbox.placement.registry import EdgeRegistry
from rollbox.watcher import Watcher
from tests.conftest import TEST_RUN, node_settings


class Link:
    """A real edge behind a link that can be cut: while cut, every coroutine call to it waits
    (a stopped node: SIGSTOP, a partition); the edge itself runs on (its own loop, e.g. its
    fence, still ticks)."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge
        self.node_id = edge.node_id
        self.up = asyncio.Event()
        self.up.set()

    def cut(self) -> None:
        self.up.clear()

    def heal(self) -> None:
        self.up.set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._edge, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def call(*args: Any, **kw: Any) -> Any:
            await self.up.wait()
            return await attr(*args, **kw)

        return call


class Nodes:
    """Two started edges, the second behind a Link; the api over both with a watcher."""

    def __init__(self) -> None:
        self.dirs = [Path(tempfile.mkdtemp(prefix=f"rollbox-test-{TEST_RUN}-")) for _ in "ab"]
        for d in self.dirs:
            d.chmod(0o711)
        self.events = EventLog(self.dirs[0] / "events.db")
        self.edges = [Edge(node_settings(d), self.events) for d in self.dirs]
        self.link = Link(self.edges[1])
        self.registry = EdgeRegistry([self.edges[0], self.link])  # type: ignore[list-item]
        self.keys = KeyStore(self.dirs[0] / "keys.db")
        self.ledger: SQLiteLedger | None = None  # the quota ledger, with_ledger()
        self.made: list[tuple[Edge, str]] = []
        self.watcher: Watcher | None = None
        self.server: BackgroundServer | None = None

    async def start(self, **watch: Any) -> None:
        for e in self.edges:
            await e.start()
        await self.start_watcher(**watch)

    async def start_watcher(self, **watch: Any) -> None:
        """The api replica (its watcher, placement over the watcher's view, the app), started
        anew (a restart) if it runs."""
        if self.server is not None:
            await self.server.stop()
        self.watcher = Watcher(self.registry, ledger=self.ledger, **watch)
        await self.watcher.start()
        self.placement = Placement(self.registry, self.watcher)
        self.app = create_app(self.placement, self.keys, ledger=self.ledger,
                              watcher=self.watcher)
        self.server = BackgroundServer(self.app)
        await self.server.start()

    async def create_on(self, i: int, project: str, labels: dict[str, str] | None = None) -> str:
        info = await self.edges[i].create(SandboxSpec(image="busybox:test",
                                                      labels=labels or {}), project)
        self.made.append((self.edges[i], info.id))
        return info.id

    async def close(self) -> None:
        self.link.heal()
        if self.server is not None:
            await self.server.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        leaks = {}
        for e in self.edges:
            await e.close(destroy=True)
        for e, sid in self.made:
            if e.leftovers(sid):
                leaks[sid] = e.leftovers(sid)
        if self.ledger is not None:
            self.ledger.close()
        self.keys.close()
        self.events.close()
        for e, d in zip(self.edges, self.dirs):
            shutil.rmtree(e.settings.run_dir, ignore_errors=True)
            shutil.rmtree(d, ignore_errors=True)
        assert not leaks, f"sandbox resources leaked: {leaks}"


@pytest.fixture
async def nodes() -> AsyncIterator[Nodes]:
    n = Nodes()
    try:
        yield n
    finally:
        await n.close()


def client(nodes: Nodes, key: str) -> httpx.AsyncClient:
    assert nodes.server is not None
    return httpx.AsyncClient(base_url=nodes.server.url, timeout=30,
                             headers={"Authorization": f"Bearer {key}"})


async def wait_for(cond, timeout: float, step: float = 0.1) -> float:  # noqa: ANN001
    """Seconds until ``cond()`` (async) holds; fails after ``timeout``."""
    t0 = time.monotonic()
    while not await cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s")
        await asyncio.sleep(step)
    return time.monotonic() - t0


def error_of(r: httpx.Response) -> dict:
    return r.json()["error"]


async def check_lost_via_api(c: httpx.AsyncClient, sid: str, node: str) -> None:
    """get, exec, files of a sandbox of a dead node: sandbox_dead, reason node_lost."""
    for r in (await c.get(f"/v1/sandboxes/{sid}"),
              await c.post(f"/v1/sandboxes/{sid}/exec", params={"wait": 1},
                           json={"cmd": "true"}),
              await c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/etc/hostname"}),
              await c.get(f"/v1/sandboxes/{sid}/exec")):
        assert r.status_code == 410, r.text
        err = error_of(r)
        assert err["code"] == "sandbox_dead" and err["details"]["reason"] == NODE_LOST
        assert err["details"]["node"] == node


async def listed(c: httpx.AsyncClient) -> dict[str, tuple[str, str | None]]:
    r = await c.get("/v1/sandboxes")
    assert r.status_code == 200, r.text
    return {i["id"]: (i["state"], i["dead_reason"]) for i in r.json()}


@pytest.mark.parametrize("fence", [True, False], ids=["edge-fences", "watcher-declares"])
async def test_node_loss_is_reported_and_never_resurrected(nodes: Nodes, fence: bool) -> None:
    # fenced: the watcher's defaults (the 10 s contract); declared: short thresholds
    watch = {"fence": True} if fence else {"fence": False, "suspect_s": 0.5, "dead_s": 1.5,
                                           "probe_timeout_s": 0.3}
    await nodes.start(**watch)
    w = nodes.watcher
    assert w is not None
    node_b = nodes.link.node_id
    mine = await nodes.create_on(1, "p1", {"run": "r1"})
    theirs = await nodes.create_on(1, "p2", {"run": "r1"})
    on_a = await nodes.create_on(0, "p1", {"run": "r1"})
    await w.poll()
    key = nodes.keys.create("p1")
    admin = nodes.keys.create("admin", admin=True)
    async with client(nodes, key) as c, client(nodes, admin) as ca:
        assert (await c.get(f"/v1/sandboxes/{mine}")).json()["state"] == "running"
        assert mine in await listed(c)  # a list answer: the api remembers its labels
        assert (await c.post(f"/v1/sandboxes/{mine}/exec", params={"wait": 1},
                             json={"cmd": "echo hi"})).json()["stdout"] == "hi\n"

        nodes.link.cut()
        t_cut = time.monotonic()

        async def reported_dead() -> bool:
            # (a call to the node while it is only suspect waits for it: asked briefly)
            try:
                r = await c.get(f"/v1/sandboxes/{mine}", timeout=0.3)
            except httpx.TimeoutException:
                return False
            return r.status_code == 410 and error_of(r)["details"].get("reason") == NODE_LOST

        detect = await wait_for(reported_dead, 10.0, step=0.05)
        print(f"node loss detected and reported via the api in {detect:.2f} s "
              f"(suspect {w.suspect_s} s, dead {w.dead_s} s)")
        assert w.health(node_b) == "dead"
        await check_lost_via_api(c, mine, node_b)
        async with rollbox.AsyncClient(nodes.server.url, api_key=key) as sdk:
            with pytest.raises(errors.SandboxDead) as exc:  # the SDK's typed error
                await sdk.get(mine)
            assert exc.value.details["reason"] == NODE_LOST
        # another project's sandbox on the lost node looks absent
        r = await c.get(f"/v1/sandboxes/{theirs}")
        assert r.status_code == 404 and "p2" not in r.text and NODE_LOST not in r.text
        # list: dead with the reason, never missing; only the caller's own
        got = await listed(c)
        assert got[mine] == ("dead", NODE_LOST) and got[on_a] == ("running", None)
        assert theirs not in got
        assert (await listed(ca))[theirs] == ("dead", NODE_LOST)
        r = await c.get("/v1/sandboxes", params={"state": "dead"})
        assert [i["id"] for i in r.json()] == [mine]
        # a label filter: by the labels remembered from that list (reports carry none)
        r = await c.get("/v1/sandboxes", params={"label": "run=r1"})
        got = {i["id"]: (i["state"], i["labels"]) for i in r.json()}
        assert got == {mine: ("dead", {"run": "r1"}), on_a: ("running", {"run": "r1"})}
        assert (await c.get("/v1/sandboxes", params={"label": "run=r2"})).json() == []
        # status: the node dead, its sandboxes counted lost, scoped to the caller's project
        st = (await c.get("/v1/cluster/status")).json()
        assert st["project"] == "p1"
        by_node = {n["node_id"]: n for n in st["nodes"]}
        assert by_node[node_b]["health"] == "dead" and by_node[node_b]["lost"] == 1
        assert by_node[nodes.edges[0].node_id]["sandboxes"] == 1
        assert "p2" not in str(st)
        st = (await ca.get("/v1/cluster/status")).json()
        assert {n["node_id"]: n["lost"] for n in st["nodes"]}[node_b] == 2
        # a delete of a lost sandbox is a no-op, as for any dead one
        assert (await c.delete(f"/v1/sandboxes/{mine}")).status_code == 204
        # new creates go to the node that answers (placement decides from the view)
        for _ in range(4):
            r = await c.post("/v1/sandboxes", json={"image": "busybox:test"})
            assert r.status_code == 201, r.text
            assert r.json()["node"] == nodes.edges[0].node_id
            nodes.made.append((nodes.edges[0], r.json()["id"]))

        if fence:  # the edge, unprobed past its fence, tore them down itself meanwhile
            await nodes.edges[1].wait_deleted(mine, timeout=10)
            assert nodes.edges[1].leftovers(mine) == []
        else:  # nothing reached it: its sandboxes run on until it is told
            assert mine in nodes.edges[1].live

        nodes.link.heal()
        seen: list[dict] = []

        async def back() -> bool:
            got = await listed(c)
            seen.append(got)
            return w.health(node_b) == "alive"

        await wait_for(back, 10.0, step=0.05)
        for e, sid in nodes.made[:2]:
            await e.wait_deleted(sid, timeout=10)
            assert e.leftovers(sid) == []  # no process (cgroup), mount, netns, disk left
        # never listed alive again, at any moment of the return
        assert all(s.get(mine, ("dead", NODE_LOST)) == ("dead", NODE_LOST) for s in seen)
        assert mine not in await listed(c)  # the edge lists live sandboxes only
        r = await c.get(f"/v1/sandboxes/{mine}")  # its journal answers: dead, node_lost
        assert r.status_code == 200 and r.json()["state"] == "dead"
        assert r.json()["dead_reason"] == NODE_LOST
        r = await c.post(f"/v1/sandboxes/{mine}/exec", params={"wait": 1}, json={"cmd": "true"})
        assert r.status_code == 410 and error_of(r)["details"]["reason"] == NODE_LOST
        assert (await c.get(f"/v1/sandboxes/{on_a}")).json()["state"] == "running"
        assert time.monotonic() - t_cut < 60


async def test_watcher_restart_while_the_node_is_away(nodes: Nodes) -> None:
    """The watcher keeps nothing: restarted while a node is away, it rebuilds from probes; the
    node never answers, so it is dead after the threshold and its sandboxes (which the new
    watcher never saw) still answer node_lost; the edge fenced itself meanwhile, so when it
    answers again nothing of them comes back."""
    watch = {"suspect_s": 0.5, "dead_s": 1.5, "probe_timeout_s": 0.3}
    await nodes.start(**watch)
    assert nodes.watcher is not None
    node_b = nodes.link.node_id
    sid = await nodes.create_on(1, "p1")
    await nodes.watcher.poll()
    key = nodes.keys.create("p1")
    async with client(nodes, key) as c:
        assert (await c.get(f"/v1/sandboxes/{sid}")).status_code == 200
    await nodes.watcher.stop()  # the replica's process goes away ...
    nodes.link.cut()  # ... and the node with it
    await nodes.start_watcher(**watch)  # back: knows nothing of the node's sandboxes
    w = nodes.watcher
    async with client(nodes, key) as c:
        assert w.health(node_b) == "suspect" and w.report(node_b) is None

        async def dead() -> bool:
            try:
                r = await c.get(f"/v1/sandboxes/{sid}", timeout=0.3)
            except httpx.TimeoutException:
                return False
            return r.status_code == 410 and error_of(r)["details"]["reason"] == NODE_LOST

        await wait_for(dead, 10.0)
        await nodes.edges[1].wait_deleted(sid, timeout=10)  # the edge's fence
        nodes.link.heal()
        await wait_for(lambda: _alive(w, node_b), 10.0)
        assert sid not in await listed(c)
        r = await c.get(f"/v1/sandboxes/{sid}")
        assert r.json()["state"] == "dead" and r.json()["dead_reason"] == NODE_LOST
        assert nodes.edges[1].leftovers(sid) == []


async def _alive(w: Watcher, node: str) -> bool:
    return w.health(node) == "alive"


async def test_node_loss_leaves_no_quota_drift(nodes: Nodes) -> None:
    """The ledger (SQLite, as embedded) charges a lost node's sandboxes no longer than 10 s
    after the node stopped answering: the watcher reconciles at once when a node turns dead,
    passing it as complete with no live sandbox (at its default thresholds)."""
    nodes.ledger = SQLiteLedger.of(nodes.keys)
    await nodes.start()
    w = nodes.watcher
    assert w is not None
    key = nodes.keys.create("team")
    async with client(nodes, key) as c:
        made = []
        for _ in range(6):  # through the api: reserved and committed in the ledger
            r = await c.post("/v1/sandboxes", json={"image": "busybox:test",
                                                    "resources": {"memory_mib": 64}})
            assert r.status_code == 201, r.text
            made.append((r.json()["id"], r.json()["node"]))
        for sid, node in made:
            nodes.made.append((nodes.edges[0] if node == nodes.edges[0].node_id
                               else nodes.edges[1], sid))
        on_b = sum(1 for _, n in made if n == nodes.link.node_id)
        if not on_b:  # placement chose node a each time: one on b directly (charged by a
            # reconcile from b's live set)
            nodes.made.append((nodes.edges[1], await nodes.create_on(1, "team")))
            on_b = 1
        total = len(nodes.made)  # each charged once
        t0 = time.monotonic()
        while (await nodes.ledger.usage("team")).sandboxes != total:
            assert time.monotonic() - t0 < 10
            await asyncio.sleep(0.1)
        nodes.link.cut()
        t_cut = time.monotonic()
        while (await nodes.ledger.usage("team")).sandboxes != total - on_b:
            assert time.monotonic() - t_cut < 10, await nodes.ledger.usage("team")
            await asyncio.sleep(0.1)
        took = time.monotonic() - t_cut
        assert w.health(nodes.link.node_id) == "dead"
        print(f"ledger released the lost node's {on_b} sandboxes {took:.2f} s after it "
              "stopped answering")
        await asyncio.sleep(1.5)  # and stays so
        assert (await nodes.ledger.usage("team")).sandboxes == total - on_b


async def test_a_suspect_nodes_sandboxes_fail_fast_and_creates_go_elsewhere(nodes: Nodes) -> None:
    """A node that stops answering is suspect before it is dead: a call to one of its
    sandboxes meanwhile is EdgeUnreachable (503, retryable; the node is not asked) at once
    instead of waiting on the silent node, a create goes to another node, another project's
    sandbox there still looks absent; once the node answers again its sandbox is served."""
    await nodes.start(fence=False, suspect_s=0.5, dead_s=60.0, probe_timeout_s=0.3)
    w = nodes.watcher
    assert w is not None
    node_b = nodes.link.node_id
    mine = await nodes.create_on(1, "p1")
    theirs = await nodes.create_on(1, "p2")
    key = nodes.keys.create("p1")
    async with client(nodes, key) as c:
        assert (await c.get(f"/v1/sandboxes/{mine}")).json()["state"] == "running"
        nodes.link.cut()
        await wait_for(lambda: _async(w.health(node_b) == "suspect"), 10.0)
        for call in (lambda: c.get(f"/v1/sandboxes/{mine}"),
                     lambda: c.post(f"/v1/sandboxes/{mine}/exec", params={"wait": 1},
                                    json={"cmd": "true"}),
                     lambda: c.get(f"/v1/sandboxes/{mine}/files",
                                   params={"path": "/etc/hostname"}),
                     lambda: c.delete(f"/v1/sandboxes/{mine}")):
            t0 = time.monotonic()
            r = await call()
            assert time.monotonic() - t0 < 2.0  # not held by the silent node
            assert r.status_code == 503, r.text
            err = error_of(r)
            assert err["code"] == "edge_unreachable" and err["retryable"]
            assert err["details"] == {"node": node_b, "reason": "suspect"}
        # another project's sandbox on it: absent, as ever (its owner is not known here:
        # asked of the node before, so the owner cache has it only for the caller's own)
        r = await c.get(f"/v1/sandboxes/{theirs}")
        assert r.status_code in (404, 503) and "p2" not in r.text
        r = await c.post("/v1/sandboxes", json={"image": "busybox:test"})
        assert r.status_code == 201, r.text
        made = r.json()["id"]
        nodes.made.append((nodes.edges[0], made))
        assert made.startswith(nodes.edges[0].node_id + "-")
        assert (await c.delete(f"/v1/sandboxes/{made}")).status_code == 204
        nodes.link.heal()
        await wait_for(lambda: _async(w.health(node_b) == "alive"), 10.0)
        assert (await c.get(f"/v1/sandboxes/{mine}")).json()["state"] == "running"


async def _async(value: bool) -> bool:
    return value
