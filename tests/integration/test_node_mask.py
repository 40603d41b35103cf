"""The node's mask filesystem (backends/container/masks.py) on the host: made read-only with
its fixed content, reused only when sound (a restart), made again when altered, refused where
something else is mounted, and taken down by the backend only with no sandbox of the node
left (an image build's backend shares the run dir)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollbox.backends.container.masks import LAYOUT, NodeMask
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
