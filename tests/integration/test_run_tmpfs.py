"""The node's run dir on its own tmpfs: mounted over a disk directory only when it holds no
state, reused (not stacked) by a restarted edge, and a full sandbox lifecycle below it; an edge
whose start fails (on its host claim, or later) leaves it unmounted."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbox.backends.container.rootfs import (
    TMPFS_MAGIC, ensure_run_tmpfs, mount_points_under, release_run_tmpfs,
)
from rollbox.config import Settings
from rollbox.edge.edge import Edge
from rollbox.errors import HostResourceConflict, InfraError
from rollbox.events.store import EventLog
from rollbox.isolation import syscalls
from rollbox.models import ExecSpec, SandboxSpec
from tests.conftest import node_settings


@pytest.fixture
def run_dir(tmp_node_dir: Path) -> Iterator[Path]:
    d = tmp_node_dir / "run"
    yield d
    for mp in mount_points_under(d):
        syscalls.umount(mp, syscalls.MNT_DETACH)


def test_dir_with_state_stays_on_disk(run_dir: Path) -> None:
    (run_dir / "runc" / "sbx").mkdir(parents=True)
    (run_dir / "runc" / "sbx" / "state.json").write_text("{}")
    assert ensure_run_tmpfs(run_dir) == "disk"
    assert syscalls.statfs_type(run_dir) != TMPFS_MAGIC
    assert (run_dir / "runc" / "sbx" / "state.json").read_text() == "{}"


def test_empty_dirs_and_lock_files_are_mounted_over_once(run_dir: Path) -> None:
    (run_dir / "runc").mkdir(parents=True)
    (run_dir / "net.lock").touch()
    assert ensure_run_tmpfs(run_dir) == "mounted"
    assert syscalls.statfs_type(run_dir) == TMPFS_MAGIC
    assert ensure_run_tmpfs(run_dir) == "ours"  # e.g. a restarted (or crashed) edge's
    assert mount_points_under(run_dir) == [str(run_dir)]  # not stacked


def test_someone_elses_tmpfs_is_used_but_never_taken_down(
        tmpfs_settings: Settings, run_dir: Path) -> None:
    from rollbox.backends.container.sandbox import ContainerBackend
    from rollbox.images.mounts import LayerMounts
    from rollbox.images.store import ImageStore
    from rollbox.isolation.userns import UidSlots

    run_dir.mkdir(parents=True)
    syscalls.mount("host-run", run_dir, "tmpfs", 0, "size=16m,mode=0711")  # like a host's /run
    assert ensure_run_tmpfs(run_dir) == "tmpfs"
    slots = UidSlots(tmpfs_settings.uid_base, 4)
    try:
        backend = ContainerBackend(tmpfs_settings,
                                   LayerMounts(ImageStore(tmpfs_settings.images_dir)), slots)
        assert not backend.owns_run_tmpfs
        backend.release_node_resources()
    finally:
        slots.close()
    assert mount_points_under(run_dir) == [str(run_dir)]


def test_release_only_without_state(run_dir: Path) -> None:
    assert ensure_run_tmpfs(run_dir) == "mounted"
    (run_dir / "sandboxes" / "sbx").mkdir(parents=True)
    assert release_run_tmpfs(run_dir) is False  # a sandbox's dir: state
    assert syscalls.statfs_type(run_dir) == TMPFS_MAGIC
    (run_dir / "sandboxes" / "sbx").rmdir()
    assert release_run_tmpfs(run_dir) is True
    assert mount_points_under(run_dir) == []
    assert release_run_tmpfs(run_dir) is False  # on disk now: nothing to take down


@pytest.fixture
def tmpfs_settings(tmp_node_dir: Path, run_dir: Path) -> Settings:
    settings = node_settings(tmp_node_dir, run_dir=run_dir)
    settings.run_tmpfs = True
    return settings


@pytest.fixture
def events(tmp_node_dir: Path) -> Iterator[EventLog]:
    log = EventLog(tmp_node_dir / "events.db")
    yield log
    log.close()


async def test_sandbox_lifecycle_and_restart_on_run_tmpfs(
        tmpfs_settings: Settings, run_dir: Path, events: EventLog) -> None:
    edge = Edge(tmpfs_settings, events)
    await edge.start()
    try:
        assert syscalls.statfs_type(run_dir) == TMPFS_MAGIC
        sid = (await edge.create(SandboxSpec(image="busybox:test"), "t")).id
        assert (tmpfs_settings.sandboxes_dir / sid / "merged").is_mount()
        await edge.close(destroy=False)

        edge = Edge(tmpfs_settings, events)  # restart: same tmpfs, sandbox adopted
        await edge.start()
        assert mount_points_under(run_dir)[-1] == str(run_dir)
        assert sum(mp == str(run_dir) for mp in mount_points_under(run_dir)) == 1
        eid = await edge.exec_start(sid, ExecSpec(cmd="echo alive"))
        assert (await edge.exec_wait(sid, eid)).stdout == "alive\n"
        await edge.delete(sid)
        assert edge.leftovers(sid) == []
    finally:
        await edge.close(destroy=True)
    # The restarted edge found rollbox's tmpfs already there: it owns it too, and takes it
    # down once idle (as one would after a crash of the edge that mounted it).
    assert mount_points_under(run_dir) == []


async def test_idle_edge_takes_down_the_tmpfs_it_mounted(
        tmpfs_settings: Settings, run_dir: Path, events: EventLog) -> None:
    edge = Edge(tmpfs_settings, events)
    await edge.start()
    try:
        assert syscalls.statfs_type(run_dir) == TMPFS_MAGIC
        await edge.delete((await edge.create(SandboxSpec(image="busybox:test"), "t")).id)
    finally:
        await edge.close(destroy=True)
    assert mount_points_under(run_dir) == []


async def test_sandbox_an_older_edge_made_in_the_data_dir_is_adopted_and_removed(
        tmp_node_dir: Path, events: EventLog) -> None:
    """Rootfs dirs moved from <data_dir>/sandboxes to <run_dir>/roots: a sandbox an edge of
    the old layout left running is still adopted (exec and files) and torn down cleanly."""
    settings = node_settings(tmp_node_dir)

    class OldLayout(Settings):
        @property
        def sandboxes_dir(self) -> Path:
            return self.data_dir / "sandboxes"

    old = OldLayout(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})
    edge = Edge(old, events)
    await edge.start()
    try:
        sid = (await edge.create(SandboxSpec(image="busybox:test"), "t")).id
        assert (settings.data_dir / "sandboxes" / sid / "merged").is_mount()
        await edge.close(destroy=False)

        edge = Edge(settings, events)
        await edge.start()
        eid = await edge.exec_start(sid, ExecSpec(cmd="echo kept > /f"))
        assert (await edge.exec_wait(sid, eid)).exit_code == 0
        assert await edge.file_read(sid, "/f", 100) == b"kept\n"
        await edge.delete(sid)
        assert edge.leftovers(sid) == []
        assert not (settings.data_dir / "sandboxes" / sid).exists()
    finally:
        await edge.close(destroy=True)


async def test_a_start_refused_on_a_host_claim_mounts_nothing(
        tmpfs_settings: Settings, run_dir: Path, events: EventLog, tmp_node_dir: Path) -> None:
    """An edge asking for the node id of a live edge (HostResourceConflict) leaves its run dir
    as it was, with no close() after the failed start (the cluster's edge actor and the
    cluster benchmark just drop such an edge)."""
    holder = Edge(node_settings(tmp_node_dir / "holder"), events)
    await holder.start()
    try:
        rival = Edge(dataclasses.replace(tmpfs_settings, node_id=holder.node_id), events)
        with pytest.raises(HostResourceConflict) as err:
            await rival.start()
        assert err.value.details["resource"] == "node_id"
        assert mount_points_under(run_dir) == []
        assert rival.host_claim is None
        await rival.close()
    finally:
        await holder.close(destroy=True)


async def test_a_start_that_fails_later_releases_what_it_took_in_reverse(
        tmpfs_settings: Settings, run_dir: Path, events: EventLog,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A start failing after the backends started (its recovery sweep, here made to fail)
    takes down the run dir's tmpfs the container backend mounted and the node's parent cgroup,
    releases the host claim (the node starts again at once) and raises the failure itself."""
    from rollbox.isolation import cgroups

    edge = Edge(tmpfs_settings, events)

    async def unreadable() -> None:
        assert syscalls.statfs_type(run_dir) == TMPFS_MAGIC  # mounted by now
        raise InfraError("journal unreadable")

    monkeypatch.setattr(edge, "_recover", unreadable)
    with pytest.raises(InfraError, match="journal unreadable"):
        await edge.start()
    assert mount_points_under(run_dir) == []
    assert edge.host_claim is None
    assert not any((h / tmpfs_settings.cgroup_parent).exists() for h in cgroups.hierarchies())
    await edge.close()
    again = Edge(tmpfs_settings, events)
    await again.start()
    try:
        assert syscalls.statfs_type(run_dir) == TMPFS_MAGIC
    finally:
        await again.close(destroy=True)
    assert mount_points_under(run_dir) == []
