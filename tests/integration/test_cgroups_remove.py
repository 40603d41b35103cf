"""cgroups.remove_tree on the host's real hierarchies: nested trees go deepest first, leaf
cgroups in every hierarchy go with one rmdir, a cgroup with a live process stays (EBUSY)."""
from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from rollbox.isolation import cgroups
from tests.conftest import TEST_CGROUP


@pytest.fixture
def parent() -> Iterator[str]:
    yield TEST_CGROUP
    for path in cgroups.leftover(TEST_CGROUP):
        if path.name.startswith("rm-"):
            cgroups.kill(path)  # no-op outside v2
            try:
                cgroups.remove_tree(path)
            except OSError:
                pass
    cgroups.remove_parent_if_empty(TEST_CGROUP)


def test_nested_v2_tree_and_leaves_in_every_hierarchy(parent: str) -> None:
    dirs = cgroups.sandbox_dirs(parent, "rm-tree")
    for d in dirs:
        d.mkdir(parents=True)
    v2 = cgroups.v2_dir(parent, "rm-tree")
    (v2 / "x1" / "y").mkdir(parents=True)
    (v2 / "x2").mkdir()
    for d in dirs:
        cgroups.remove_tree(d)
    assert not any(d.exists() for d in dirs)


def test_cgroup_with_a_live_process_is_not_removed(parent: str) -> None:
    v2 = cgroups.v2_dir(parent, "rm-busy")
    v2.mkdir(parents=True)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        (v2 / "cgroup.procs").write_text(str(proc.pid))
        with pytest.raises(OSError):
            cgroups.remove_tree(v2)
        assert v2.exists()
    finally:
        proc.kill()
        proc.wait()
    cgroups.remove_tree(v2)  # its retries cover the exit still being processed
    assert not v2.exists()
