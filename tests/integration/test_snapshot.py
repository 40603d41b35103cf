"""Snapshots (pack_diff): a sandbox's writable layer, scrubbed, becomes a new image layer.

The agent's sandbox plants everything a host-side copy could trip on (symlinks to /etc/shadow
and to ../../.., a FIFO, a hard link, an opaque directory, a deleted base file, caches, an
excluded path); a fresh sandbox of the snapshot image must see exactly the intended tree, the
source sandbox must keep running (thawed), and bad input must give typed errors."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.images.sources import build_from_directory
from rollbox.images.snapshot import is_frozen
from rollbox.images.store import ImageStore
from rollbox.models import ExecSpec, GradeSpec, SandboxSpec, SnapshotSpec
from tests.conftest import new_name

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"




@pytest.fixture
def workspace(edge, names: list[str]) -> str:  # noqa: ANN001
    """A layer over busybox with a directory the agent will replace (-> opaque in the upper)."""
    store: ImageStore = edge.store
    name = new_name(names, "snap-ws")
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        (ws / "data/sub").mkdir(parents=True)
        (ws / "data/a.txt").write_text("base-a\n")
        (ws / "data/sub/b.txt").write_text("base-b\n")
        (ws / "keep.txt").write_text("base-keep\n")
        (ws / "gone.txt").write_text("base-gone\n")
        build_from_directory(store, ws, name)
    return name


async def sh(edge, sid: str, cmd: str, ok: bool = True) -> str:  # noqa: ANN001
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=30))
    res = await edge.exec_wait(sid, eid)
    if ok:
        assert res.exit_code == 0, (cmd, res)
    return res.stdout.decode() if isinstance(res.stdout, bytes) else res.stdout


# Landlock grants a top-level directory made by a command from the next command on.
AGENT_MKDIRS = "mkdir /work && rm /gone.txt && rm -rf /data && mkdir /data"
AGENT_CHANGES = " && ".join([
    "mkdir -p /work/pkg/__pycache__ /work/.pytest_cache/v /work/secret /root/.cache/pip",
    "echo hello > /work/new.txt",
    "busybox ln /work/new.txt /work/hard.txt",
    "busybox ln -s /etc/shadow /work/shadow_link",
    "busybox ln -s ../../.. /work/up",
    "busybox mkfifo /work/fifo",
    "echo cached > /work/pkg/__pycache__/m.cpython-311.pyc",
    "echo lastfailed > /work/.pytest_cache/v/lastfailed",
    "echo wheel > /root/.cache/pip/w.whl",
    "echo junk > /tmp/junk",
    "echo answer > /work/secret/answer.txt",
    "echo noise > /work/build.log",
    "echo new-c > /data/c.txt",
])

EXPECTED = " && ".join([
    "test \"$(cat /work/new.txt)\" = hello",
    "test \"$(cat /work/hard.txt)\" = hello",
    # same inode: the hard link survived as a hard link
    "test \"$(busybox stat -c %i /work/new.txt)\" = \"$(busybox stat -c %i /work/hard.txt)\"",
    "test -L /work/shadow_link && test \"$(busybox readlink /work/shadow_link)\" = /etc/shadow",
    "test -L /work/up && test \"$(busybox readlink /work/up)\" = ../../..",
    "test -p /work/fifo",
    "test ! -e /gone.txt",
    "test \"$(cat /keep.txt)\" = base-keep",
    "test \"$(ls /data)\" = c.txt",
    "test \"$(cat /data/c.txt)\" = new-c",
    "test ! -e /work/pkg/__pycache__ && test -d /work/pkg",
    "test ! -e /work/.pytest_cache",
    "test ! -e /root/.cache",
    "test ! -e /tmp/junk && test -d /tmp",
    "test ! -e /work/secret",
    "test ! -e /work/build.log",
    # created by the sandbox's root: owned by root (id 0) in the image, not a host uid
    "test \"$(busybox stat -c %u:%g /work/new.txt)\" = 0:0",
])


async def test_snapshot_restores_the_tree(edge, workspace: str, names: list[str]) -> None:  # noqa: ANN001
    src = await edge.create(SandboxSpec(image=BB, layers=[workspace]), "p")
    await sh(edge, src.id, AGENT_MKDIRS)
    await sh(edge, src.id, AGENT_CHANGES)
    name = new_name(names)
    res = await edge.snapshot(src.id, SnapshotSpec(name=name, exclude=["/work/secret", "*.log"]),
                              "p")
    assert res.image == name
    assert res.layers == list(src.layers) + [res.layer]
    assert edge.store.resolve(name).layers == res.layers
    assert res.whiteouts >= 1 and res.scrubbed >= 6 and res.files > 5
    assert res.paused_s > 0
    # The source sandbox keeps running, thawed, with its changes.
    assert not is_frozen(edge.live[src.id].box.v2_cgroup)
    assert (await sh(edge, src.id, "cat /work/secret/answer.txt")).strip() == "answer"
    # A new sandbox from the image sees exactly the captured tree.
    copy = await edge.create(SandboxSpec(image=name), "p")
    assert copy.layers == res.layers
    await sh(edge, copy.id, EXPECTED)
    # Snapshot of a snapshot: layers stack, the first snapshot's content stays.
    await sh(edge, copy.id, "echo second > /work/second.txt && rm /work/new.txt")
    name2 = new_name(names)
    res2 = await edge.snapshot(copy.id, SnapshotSpec(name=name2), "p")
    assert res2.layers == res.layers + [res2.layer]
    third = await edge.create(SandboxSpec(image=name2), "p")
    await sh(edge, third.id, "test \"$(cat /work/second.txt)\" = second && test ! -e "
             "/work/new.txt && test \"$(cat /work/hard.txt)\" = hello && test -p /work/fifo "
             "&& test \"$(ls /data)\" = c.txt && test ! -e /gone.txt")
    for sid in (src.id, copy.id, third.id):
        await edge.delete(sid)


async def test_snapshot_without_pause_and_no_scrub(edge, names: list[str]) -> None:  # noqa: ANN001
    # pack_diff reads the memory tier's tmpfs upper here (the other tests: the disk tier's).
    src = await edge.create(SandboxSpec(image=BB, disk_tier="memory"), "p")
    await sh(edge, src.id, "mkdir -p /w/__pycache__")
    await sh(edge, src.id, "echo x > /w/__pycache__/c.pyc && echo t > /tmp/t")
    name = new_name(names)
    res = await edge.snapshot(src.id, SnapshotSpec(name=name, pause=False, scrub=False), "p")
    assert res.paused_s == 0
    copy = await edge.create(SandboxSpec(image=name), "p")
    await sh(edge, copy.id, "test -f /w/__pycache__/c.pyc && test -f /tmp/t")


async def test_snapshot_bad_input(edge, names: list[str]) -> None:  # noqa: ANN001
    src = await edge.create(SandboxSpec(image=BB), "p")
    with pytest.raises(errors.BadRequest):
        await edge.snapshot(src.id, SnapshotSpec(name="Bad Name!"), "p")
    taken = new_name(names)
    await edge.snapshot(src.id, SnapshotSpec(name=taken), "p")
    with pytest.raises(errors.BadRequest):  # never replaces an existing image
        await edge.snapshot(src.id, SnapshotSpec(name=taken), "p")
    with pytest.raises(errors.BadRequest):  # operator namespace: names without a "/"
        await edge.snapshot(src.id, SnapshotSpec(name="python:3.13"), "p")
    with pytest.raises(errors.BadRequest):  # a caller-chosen dir:// would write on the host
        await edge.snapshot(src.id, SnapshotSpec(name=new_name(names), push="dir:///tmp/x"),
                            "p")
    with pytest.raises(errors.NotFound):
        await edge.snapshot(f"{edge.node_id}-000000000000", SnapshotSpec(name=new_name(names)),
                            "p")
    # Too big: a sparse file counts at its full size; too many entries.
    await sh(edge, src.id, "mkdir /many && busybox truncate -s 1G /tmp/sparse")
    await sh(edge, src.id, "cd /many && for i in $(seq 1 50); do echo $i > f$i; done")
    with pytest.raises(errors.PayloadTooLarge):
        await edge.snapshot(src.id, SnapshotSpec(name=new_name(names), max_bytes=100 << 20,
                                                 scrub=False),
                            "p")
    with pytest.raises(errors.PayloadTooLarge):
        await edge.snapshot(src.id, SnapshotSpec(name=new_name(names), scrub=True,
                                                 max_entries=20), "p")
    # Failed snapshots thaw the sandbox and tag nothing.
    assert not is_frozen(edge.live[src.id].box.v2_cgroup)
    await sh(edge, src.id, "true")
    assert [n for n in names if edge.store.exists(n)] == [taken]
    await edge.delete(src.id)
    with pytest.raises(errors.SandboxDead):
        await edge.snapshot(src.id, SnapshotSpec(name=new_name(names)), "p")


async def test_snapshot_image_belongs_to_its_project(edge, names: list[str]) -> None:  # noqa: ANN001
    """An environment an agent built may hold its project's secrets: other projects can't
    start from it, stack it as a layer, or grade with it; to them it does not exist."""
    src = await edge.create(SandboxSpec(image=BB), "team-a")
    name = new_name(names)
    await edge.snapshot(src.id, SnapshotSpec(name=name), "team-a")
    mine = await edge.create(SandboxSpec(image=name), "team-a")
    with pytest.raises(errors.NotFound):
        await edge.create(SandboxSpec(image=name), "team-b")
    with pytest.raises(errors.NotFound):
        await edge.create(SandboxSpec(image=BB, layers=[name]), "team-b")
    other = await edge.create(SandboxSpec(image=BB), "team-b")
    with pytest.raises(errors.NotFound):
        await edge.grade(other.id, GradeSpec(files=["/etc/hostname"], layers=[name],
                                             cmd="true"), "team-b")
    for sid in (src.id, mine.id, other.id):
        await edge.delete(sid)
