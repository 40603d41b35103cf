"""Two edges on one host (Settings.for_node), as `rollbox cluster` runs simulated nodes: each
one's sandboxes get host uids of its own band, addresses of its own subnet, cgroups under its
own parent, network namespaces and host links of its own names; a sandbox of one can not reach
a sandbox of the other; closing one edge, and its restart with its crash-recovery sweep, leave
the other's sandboxes running and whole; an edge that asks for a resource a live edge holds
does not start (HostResourceConflict) and touches nothing."""
from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from rollbox.config import Settings
from rollbox.edge.admission import host_memory_mib, node_memory_mib, sandboxes_memory_max_mib
from rollbox.edge.edge import Edge
from rollbox.errors import BadRequest, HostResourceConflict
from rollbox.events.store import EventLog
from rollbox.isolation import cgroups, netns
from rollbox.models import ExecSpec, NetworkPolicy, Resources, SandboxSpec
from rollbox.netpolicy import link
from tests.conftest import TEST_NODE, have_image, needs_python, node_settings
from tests.integration.test_netpolicy_targets import CONNECT

pytestmark = [needs_python, pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]
BB = "busybox:test"
# A range of its own (its own nftables table): the test's nodes never meet the host's others.
HOST_RANGE = ipaddress.IPv4Network("10.214.0.0/16")
LISTEN = ("import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
          "socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0', 8080)); s.listen()\nwhile True:\n"
          "    c, _ = s.accept(); c.recv(10); c.sendall(b'hi'); c.close()\n")


def cohosted_nodes(tmp: Path, attempt: int, n: int = 2) -> list[Settings]:
    """``n`` co-hosted nodes' settings beside a base node; ``attempt`` moves them to other
    bands and subnets (a concurrent run of this test holds the first ones)."""
    base = node_settings(tmp / "base")
    base.host_auto = False
    base.net_host_range = HOST_RANGE
    base.net_pool = ipaddress.IPv4Network("10.214.255.0/24")
    base.uid_base = 3_800_000_000 // 65536 * 65536  # far above the auto bands of test edges
    base.uid_slots = 64
    out = []
    for k in range(n):
        s = Settings.for_node(base, f"{TEST_NODE}{secrets.token_hex(2)}{'abcdefgh'[k]}",
                              n * attempt + k)
        s.node_share = 1 / n
        s.vm_templates = False
        out.append(s)
    return out


@contextlib.asynccontextmanager
async def started(settings: Settings, events: EventLog) -> AsyncIterator[Edge]:
    edge = Edge(settings, events)
    await edge.start()
    try:
        yield edge
    finally:
        await edge.close(destroy=True)


async def start_nodes(tmp: Path, events: EventLog, n: int = 2,
                      edge_kw: Callable[[int], dict[str, Any]] = lambda k: {}) -> list[Edge]:
    """``n`` started co-hosted edges (``edge_kw(k)``: more arguments of the k-th Edge); the
    caller closes them."""
    for attempt in range(6):
        edges = [Edge(s, events, **edge_kw(k))
                 for k, s in enumerate(cohosted_nodes(tmp / f"try{attempt}", attempt, n))]
        up: list[Edge] = []
        try:
            for e in edges:
                await e.start()
                up.append(e)
        except HostResourceConflict:  # another run's node holds this band or subnet
            for e in edges:
                await e.close(destroy=e in up)
            continue
        return edges
    raise AssertionError(f"no free band for the test's {n} nodes in 6 attempts")


async def start_pair(tmp: Path, events: EventLog) -> tuple[Edge, Edge]:
    a, b = await start_nodes(tmp, events)
    return a, b


async def run(edge: Edge, sid: str, cmd: list[str] | str, timeout_s: float = 20) -> str:
    res = await edge.exec_wait(sid, await edge.exec_start(sid, ExecSpec(cmd=cmd,
                                                                        timeout_s=timeout_s)))
    return (res.stdout + res.stderr).strip()


def uid_map(pid: int) -> tuple[int, int]:
    """(first host uid, count) of the process's user namespace (one line: "0 HOST COUNT")."""
    inner, host, count = Path(f"/proc/{pid}/uid_map").read_text().split()[:3]
    assert inner == "0"
    return int(host), int(count)


def in_band(settings: Settings, first: int, count: int = 1) -> bool:
    lo, hi = settings.uid_band
    return lo <= first and first + count <= hi


async def test_two_edges_on_one_host_share_no_host_resource(tmp_node_dir: Path) -> None:
    events = EventLog(tmp_node_dir / "events.db")
    a, b = await start_pair(tmp_node_dir, events)
    a2: Edge | None = None
    try:
        sa, sb = a.settings, b.settings
        net = NetworkPolicy(allow=["0.0.0.0/0:8080"])
        boxes = {}
        for edge in (a, b):
            boxes[edge.node_id] = [(await edge.create(SandboxSpec(
                image="python:3.11", network=net), "t")).id for _ in range(2)]
        vms: dict[str, str] = {}
        if have_image(BB) and (await a.capacity())["backends"]["microvm"]["offered"]:
            # a VM may have the host's memory, but not more than its node's half of it
            with pytest.raises(BadRequest, match="above what node"):
                await a.create(SandboxSpec(image=BB, backend="microvm", resources=Resources(
                    cpus=1, memory_mib=node_memory_mib(sa) + 256, disk_mib=64)), "t")
            for edge in (a, b):
                vms[edge.node_id] = (await edge.create(SandboxSpec(
                    image=BB, backend="microvm", network=net,
                    resources=Resources(cpus=1, memory_mib=256, disk_mib=64)), "t")).id

        def facts(edge: Edge) -> dict[str, object]:
            """Each host resource of the edge's sandboxes, checked against its settings."""
            s = edge.settings
            uids, ips, parents, spaces, links = [], [], set(), [], []
            for sid in boxes[edge.node_id] + ([vms[edge.node_id]] if vms else []):
                box = edge.live[sid].box
                if box.kind == "container":
                    first, count = uid_map(box.agent_pid)  # type: ignore[attr-defined]
                    assert count == 65536 and first == box.host_uid
                    parents.add(box.v2_cgroup.parent.name)  # type: ignore[attr-defined]
                else:  # QEMU runs as an unprivileged uid of the sandbox's range
                    first = os.stat(f"/proc/{box.pid}").st_uid  # type: ignore[attr-defined]
                    count = 1
                    parents.add(box.jail.v2.parent.name)  # type: ignore[attr-defined]
                assert in_band(s, first, count), (sid, first, s.uid_band)
                uids.append((first, first + count))
                lk = link.find(sid)
                assert lk is not None and ipaddress.IPv4Address(lk.sandbox_ip) in s.net_pool
                ips.append(lk.sandbox_ip)
                name = f"{netns.PREFIX}{sid}"
                assert name.startswith(s.netns_prefix) and netns.netns_path(name).exists()
                spaces.append(name)
                assert Path(f"/sys/class/net/{lk.host_if}/ifalias").read_text().strip() == \
                    f"{link.ALIAS_PREFIX}{sid}"
                links.append(lk.host_if)
            assert parents == {s.cgroup_parent}
            return {"uids": uids, "ips": ips, "netns": spaces, "links": links}

        fa, fb = facts(a), facts(b)
        # Disjoint, one resource at a time (each would fail alone if for_node shared it).
        assert not any(x0 < y1 and y0 < x1 for x0, x1 in fa["uids"] for y0, y1 in fb["uids"])
        assert not (sa.uid_band[0] < sb.uid_band[1] and sb.uid_band[0] < sa.uid_band[1])
        assert not sa.net_pool.overlaps(sb.net_pool)
        assert sa.cgroup_parent != sb.cgroup_parent
        assert not sa.netns_prefix.startswith(sb.netns_prefix) and \
            not sb.netns_prefix.startswith(sa.netns_prefix)
        assert not set(fa["links"]) & set(fb["links"])
        assert sa.data_dir != sb.data_dir and sa.run_dir != sb.run_dir
        # Each admits by its half of the host, its parent memory cgroup limited to that.
        for e in (a, b):
            assert cgroups.memory_limit(e.settings.cgroup_parent) == sandboxes_memory_max_mib(
                e.settings, node_memory_mib(e.settings)) << 20
            assert node_memory_mib(e.settings) == host_memory_mib() // 2
            assert e.admission.budgets()["cpus"] == e.limits.cpu_overcommit * (
                os.cpu_count() or 1) / 2

        # A sandbox of edge A can not reach one of edge B (B's listener answers B itself).
        target, peer = boxes[b.node_id][0], boxes[a.node_id][0]
        await b.exec_start(target, ExecSpec(cmd=["python3", "-c", LISTEN], timeout_s=120))
        for _ in range(50):
            if await run(b, target, ["python3", "-c", CONNECT, "127.0.0.1", "8080"]) == "ok hi":
                break
        else:
            raise AssertionError("B's listener never answered")
        b_ip = link.find(target).sandbox_ip  # type: ignore[union-attr]
        assert (await run(a, peer, ["python3", "-c", CONNECT, b_ip, "8080"])).startswith(
            ("err", "timeout"))

        # Edge A crashes (closes with its sandboxes left) and a stray leftover of its node is
        # on the host: its restart's recovery sweep takes that, and nothing of B's.
        mine_left = f"{netns.PREFIX}{sa.sandbox_id_prefix}{'0' * 12}"
        netns.create(mine_left)
        await a.close(destroy=False)
        a2 = Edge(sa, events)
        await a2.start()
        assert not netns.netns_path(mine_left).exists()
        assert (await a2.get(boxes[a.node_id][0])).state == "running"

        # An edge asking for A's node id (other dirs, no band or subnet of anyone's) or for
        # B's uid band does not start, and its would-be sweep touched nothing.
        rival = Settings.scratch(tmp_node_dir / "rival")
        rival.host_auto, rival.vm_templates = False, False
        rival.node_id, rival.net_host_range = sa.node_id, HOST_RANGE
        rival.net_pool = ipaddress.IPv4Network("10.214.254.0/24")
        rival.uid_base, rival.uid_slots = 4_100_000_000 // 65536 * 65536, 1
        rival.cgroup_parent = f"{sa.cgroup_parent}x"
        for change, resource in (({}, "node_id"), ({"node_id": "x" + sa.node_id,
                                                    "uid_base": sb.uid_base}, "uid_band")):
            bad = Edge(dataclasses.replace(rival, **change), events)
            with pytest.raises(HostResourceConflict) as err:
                await bad.start()
            assert err.value.details["resource"] == resource
            await bad.close()

        # B's sandboxes came through A's close, restart and sweep, and the rivals, whole.
        assert facts(b) == fb
        for sid in boxes[b.node_id] + ([vms[b.node_id]] if vms else []):
            assert (await b.get(sid)).state == "running"
            assert await run(b, sid, "echo alive") == "alive"
        assert await run(b, target, ["python3", "-c", CONNECT, "127.0.0.1", "8080"]) == "ok hi"
        assert cgroups.populated(b.live[target].box.v2_cgroup)  # type: ignore[attr-defined]

        # A destroys its sandboxes and goes; B's stay.
        a2, closing = None, a2
        await closing.close(destroy=True)
        for sid in boxes[a.node_id]:
            assert not netns.netns_path(f"{netns.PREFIX}{sid}").exists()
        assert facts(b) == fb
        for sid in boxes[b.node_id]:  # the layers A's last close unmounted were not B's
            assert await run(b, sid, ["python3", "-c", "import json; print('ok')"]) == "ok"
    finally:
        try:
            if a2 is not None:
                await a2.close(destroy=True)
            elif a.host_claim is not None:  # not closed yet
                await a.close(destroy=True)
        finally:
            await b.close(destroy=True)
            events.close()
