"""A container create cancelled anywhere ends cancelled and leaves nothing on the host.

The create is the edge's (its journal record, its admission ticket) over the real container
backend. Each point is seen from the host as the create gets there (its subvolume, its rootfs,
its overlay mounted, its netns, the agent's socket, runc's state, its cgroup, the agent's pid,
its network link), and the create is cancelled then: it must raise CancelledError, its record
must say deleted, its ticket and uid slot must be back, and nothing of it may be left (mounts,
subvolume, cgroups v1 and v2, netns and link, BPF objects, runc state, files, processes
below the edge, zombies too, fds of the edge), neither at once nor 0.5 s later, when a
step still running in a thread or a runc still starting would have made something behind the
teardown's back. Before the fix a cancel met a thread (``to_thread``) or ``runc run -d`` that
went on, and a teardown that then failed raised its InfraError in place of the cancellation.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from rollbox.backends.container.rootfs import mount_points_under
from rollbox.isolation import cgroups, netns
from rollbox.models import NetworkPolicy, Resources, SandboxSpec
from rollbox.netpolicy import link as netlink

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"
# Loopback-only creates end at the agent's handshake; the last points need a network policy.
PLAIN = SandboxSpec(image=BB, resources=Resources(cpus=1, memory_mib=128, disk_mib=64))
NETWORKED = PLAIN.model_copy(update={"network": NetworkPolicy(allow=[])})


def descendants(pid: int) -> set[int]:
    """Processes below ``pid``, zombies too. The edge is the sandboxes' subreaper, so every
    process of a container (its init, what it runs) and every runc it started is one of its
    descendants, and one nobody reaped stays one."""
    parent: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])

    def below(p: int) -> bool:
        while p in parent and p != pid:
            p = parent[p]
        return p == pid

    return {p for p in parent if p != pid and below(p)}


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def points(edge) -> list[tuple[str, SandboxSpec, Callable[[str], bool]]]:  # noqa: ANN001
    backend = edge.backends["container"]
    parent = edge.settings.cgroup_parent
    run_root = backend.run_root
    return [
        ("subvolume made", PLAIN, lambda sid: os.path.lexists(backend.disk.path(sid))),
        ("rootfs dir made", PLAIN, lambda sid: (backend.sandboxes_dir / sid).exists()),
        ("overlay mounted", PLAIN,
         lambda sid: bool(mount_points_under(backend.sandboxes_dir / sid))),
        ("netns made", PLAIN, lambda sid: netns.netns_path(netns.PREFIX + sid).exists()),
        ("agent socket bound", PLAIN, lambda sid: (run_root / sid / "agent.sock").exists()),
        # runc keeps state of its own (the native launcher none: the cgroup point covers it)
        ("runc started", PLAIN, lambda sid: (backend.runtime.state_dir(sid) or cgroups.v2_dir(
            parent, sid)).exists()),
        ("cgroup made", PLAIN, lambda sid: cgroups.v2_dir(parent, sid).exists()),
        ("agent pid written", PLAIN, lambda sid: (run_root / sid / "pid").exists()),
        ("network link made", NETWORKED, lambda sid: netlink.exists(sid)),
    ]


def creating(edge) -> list[str]:  # noqa: ANN001
    return [info.id for info, _, _ in edge.journal.live() if info.state == "creating"]


async def cancel_at(edge, point: str, spec: SandboxSpec,  # noqa: ANN001
                    reached: Callable[[str], bool]) -> None:
    backend = edge.backends["container"]
    processes, fds = descendants(os.getpid()), open_fds()
    create = asyncio.ensure_future(edge.create(spec, "t"))
    sid = None
    for _ in range(20000):
        ids = creating(edge)
        sid = ids[0] if ids else sid
        if create.done() or (sid is not None and reached(sid)):
            break
        await asyncio.sleep(0.001)
    assert sid is not None and not create.done(), f"{point}: the create ended before it"
    create.cancel()
    with pytest.raises(asyncio.CancelledError):
        await create
    for when in ("at once", "0.5 s later"):
        what = f"{point}, {when}"
        assert edge.journal.get(sid)[0].state == "deleted", what
        assert edge.admission.total.sandboxes == 0, what
        assert backend.slots.in_use() == set(), what
        assert edge.leftovers(sid) == [], what
        assert sid not in backend.host_sandbox_ids(), what
        assert descendants(os.getpid()) <= processes, what
        assert open_fds() <= fds, what
        await asyncio.sleep(0.5)


async def test_a_create_cancelled_anywhere_stays_cancelled_and_leaves_nothing(edge) -> None:  # noqa: ANN001
    # one create first: what the node opens once (the pool, the layer mounts, a slot's user
    # namespace) is then open before the fds are counted
    info = await edge.create(NETWORKED, "t")
    await edge.delete(info.id)
    for point, spec, reached in points(edge):
        await cancel_at(edge, point, spec, reached)
    info = await edge.create(PLAIN, "t")  # the node still makes sandboxes afterwards
    await edge.delete(info.id)


async def test_an_api_client_gone_mid_create_leaves_a_whole_sandbox_of_its_project(
        api_server, edge) -> None:  # noqa: ANN001
    """A client that disconnects mid-create does not cancel it (uvicorn runs the request to
    its end; the api's middleware is plain ASGI): the sandbox is made whole, listed for the
    client's project (to find again and delete, or its TTL ends it), never half-made. Only a
    server's shutdown cancels a create still running, the path of the test above."""
    import httpx

    url, keys = api_server
    headers = {"X-API-Key": keys.create("proj")}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as h:
        post = asyncio.ensure_future(h.post("/v1/sandboxes", json={
            "image": BB, "resources": {"cpus": 1, "memory_mib": 128, "disk_mib": 64}}))
        for _ in range(20000):
            if creating(edge) or post.done():
                break
            await asyncio.sleep(0.001)
        assert creating(edge) and not post.done(), "the create was not seen under way"
        post.cancel()  # the client's connection closes mid-request
        with pytest.raises(asyncio.CancelledError):
            await post
        for _ in range(1000):
            listed = (await h.get("/v1/sandboxes")).json()
            if listed and listed[0]["state"] == "running":
                break
            await asyncio.sleep(0.01)
        assert [s["state"] for s in listed] == ["running"] and creating(edge) == []
        sid = listed[0]["id"]
        r = await h.post(f"/v1/sandboxes/{sid}/exec", params={"wait": 1},
                         json={"cmd": ["echo", "whole"]})
        assert (r.status_code, r.json()["exit_code"], r.json()["stdout"]) == (200, 0, "whole\n")
        assert (await h.delete(f"/v1/sandboxes/{sid}")).status_code in (200, 204)
    assert edge.leftovers(sid) == []
