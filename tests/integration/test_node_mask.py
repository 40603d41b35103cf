"""The node's mask filesystem (backends/container/masks.py) on the host: made read-only with
its fixed content, reused only when sound (a restart), made again when altered, refused where
something else is mounted, and taken down by the backend only with no sandbox of the node
left (an image build's backend shares the run dir)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollbox.backends.container.masks import LAYOUT, NodeMask, fill
from rollbox.errors import InfraError
from rollbox.isolation import syscalls

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


def content(mask: NodeMask) -> set[str]:
    return {os.path.relpath(os.path.join(top, n), mask.path)
            for top, dirs, files in os.walk(mask.path) for n in dirs + files}


def test_made_read_only_reused_when_sound_and_made_again_when_altered(tmp_path: Path) -> None:
    mask = NodeMask(tmp_path / "mask")
    try:
        assert mask.ensure() == "made"
        assert content(mask) == {name for name, _ in LAYOUT}
        assert os.statvfs(mask.path).f_flag & os.ST_RDONLY
        with pytest.raises(OSError):
            (mask.empty / "x").write_text("x")
        assert NodeMask(mask.path).ensure() == "found"  # e.g. the edge restarted
        # altered by someone who could (the host's root): detached, made again
        syscalls.mount(None, mask.path, None, syscalls.MS_REMOUNT)  # the superblock writable
        (mask.empty / "planted").write_text("x")
        assert mask.problems()
        again = NodeMask(mask.path)
        assert again.ensure() == "made"  # (its device id may be the freed one's again)
        assert content(again) == {name for name, _ in LAYOUT} and not again.problems()
        # one stat before each boot: a mask taken down meanwhile is made again
        again.release()
        assert not mask.path.exists()
        again.ready()
        assert again.mounted() and not again.problems()
    finally:
        NodeMask(mask.path).release()
    assert not mask.path.exists()
    assert str(mask.path) not in Path("/proc/self/mountinfo").read_text()


def test_something_else_mounted_there_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "mask"
    path.mkdir()
    syscalls.mount("other", path, "tmpfs", 0, "size=4k")
    try:
        with pytest.raises(InfraError, match="not rollbox's mask"):
            NodeMask(path).ensure()
    finally:
        syscalls.umount(path)


async def test_the_backend_keeps_the_mask_while_a_sandbox_dir_of_the_node_is_left(
        edge) -> None:  # noqa: ANN001
    """release_node_resources runs when the backend has no sandbox; another backend of the
    node (an image build's, same run dir) may still have one: its dir keeps the mask."""
    backend = edge.backends["container"]
    mask = backend.mask
    assert mask.mounted()  # made at start (prepare_run_dir)
    other = backend.sandboxes_dir / "build-other"
    other.mkdir()
    try:
        backend.release_node_resources()
        assert mask.mounted() and not mask.problems()
    finally:
        other.rmdir()
    backend.release_node_resources()
    assert not mask.mounted() and not mask.path.exists()
    backend.prepare_run_dir()  # as the next create would: back
    assert mask.mounted()


def test_a_read_only_bind_of_a_writable_mask_is_not_taken_for_one(tmp_path: Path) -> None:
    """Read-only must hold at the superblock: a sandbox's bind copies the mount's flags, but
    whoever holds the writable superblock elsewhere could still write into every sandbox's
    /sys and masked dirs."""
    writable, path = tmp_path / "writable", tmp_path / "mask"
    writable.mkdir()
    path.mkdir()
    syscalls.mount("rollbox-mask", writable, "tmpfs", 0, "size=4k,mode=0555")
    try:
        fill(writable)  # the right content, on a superblock left writable
        syscalls.mount(str(writable), path, None, syscalls.MS_BIND)
        syscalls.mount(None, path, None, syscalls.MS_BIND | syscalls.MS_REMOUNT
                       | syscalls.MS_RDONLY)
        assert os.statvfs(path).f_flag & os.ST_RDONLY  # the bind is read-only ...
        mask = NodeMask(path)
        assert mask.problems() == ["superblock not read-only"]  # ... its superblock is not
        assert mask.ensure() == "made"
        assert not mask.problems()
        assert os.stat(path).st_dev != os.stat(writable).st_dev
    finally:
        NodeMask(path).release()
        syscalls.umount(writable, syscalls.MNT_DETACH)


def test_processes_ensuring_at_once_make_one_mask_and_leave_no_staging(tmp_path: Path) -> None:
    """The edge and an image build share the run dir: each ensures the mask (flock), the
    first makes it, the rest find it, and the new one appears at the path only finished."""
    path = tmp_path / "run" / "mask"
    go = tmp_path / "go"
    code = ("import os, sys; from pathlib import Path; "
            "from rollbox.backends.container.masks import NodeMask; "
            "mask = NodeMask(Path(sys.argv[1])); print('ready', flush=True)\n"
            "while not os.path.exists(sys.argv[2]): pass\n"
            "print(mask.ensure())")
    try:
        procs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(go)],
                                  stdout=subprocess.PIPE, text=True) for _ in range(4)]
        for p in procs:  # all imported: then they start at once
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        go.touch()
        results = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
        assert results == ["found", "found", "found", "made"]
        assert [m for m in syscalls.read_mountinfo() if m[0] == str(path)] \
            == [(str(path), "tmpfs", "rollbox-mask")]
        assert sorted(os.listdir(path.parent)) == ["mask"]  # no staging dir left
        assert not NodeMask(path).problems()
    finally:  # every mount there, should several have been stacked
        while NodeMask(path).mounted():
            syscalls.umount(path, syscalls.MNT_DETACH)
        NodeMask(path).release()
