"""The container backend's start turns on the cgroup2 mount's ``favordynmods`` (fast
placements of a sandbox's init, isolation.cgroups), keeping the mount's other options.

Host-wide: any edge that starts on the host sets it again, so only "set after our start" is
checked (never "still off"), and runs of this file on one host take turns (a lock file)."""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbox.config import Settings
from rollbox.isolation import cgroups, syscalls
from tests.conftest import node_settings

SAMPLE = (
    "35 24 0:30 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 "
    "cgroup2 rw,nsdelegate,favordynmods\n"
    "36 24 0:31 / /sys/fs/cgroup/pids rw,relatime shared:10 - cgroup cgroup rw,pids\n")
LOCK = "/run/rollbox-test-favordynmods.lock"
MOUNT_FLAGS = {"ro": syscalls.MS_RDONLY, "nosuid": syscalls.MS_NOSUID, "nodev": syscalls.MS_NODEV,
               "noexec": syscalls.MS_NOEXEC, "noatime": syscalls.MS_NOATIME,
               "nodiratime": syscalls.MS_NODIRATIME, "relatime": syscalls.MS_RELATIME}


def test_super_options_of_the_v2_mount() -> None:
    assert cgroups.v2_super_options(SAMPLE, Path("/sys/fs/cgroup/unified")) == [
        "rw", "nsdelegate", "favordynmods"]
    assert cgroups.v2_super_options(SAMPLE, Path("/sys/fs/cgroup/pids")) is None  # v1
    assert cgroups.v2_super_options(SAMPLE, Path("/sys/fs/cgroup")) is None


def _options() -> tuple[list[str], list[str]]:
    """(mount options, superblock options) of the v2 mount now."""
    v2 = str(cgroups.v2_root())
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            lf, rf = left.split(), right.split()
            if lf[4] == v2 and rf[0] == "cgroup2":
                return lf[5].split(","), rf[2].split(",")
    raise AssertionError(f"no cgroup2 mount at {v2}")


@pytest.fixture
def cleared() -> Iterator[list[str]]:
    """The v2 mount with favordynmods cleared (the kernel keeps its per-threadgroup locking
    once on: nothing but the flag changes), its other options kept; on again afterwards.
    Yields the superblock options it had besides favordynmods."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another run's clear between our start and check
    try:
        yield from _cleared()
    finally:
        os.close(lock)


def _cleared() -> Iterator[list[str]]:
    mnt, sup = _options()
    others = [o for o in sup if o not in (cgroups.FAVOR_DYNMODS, "rw", "ro")]
    flags = syscalls.MS_REMOUNT
    for opt in mnt:
        flags |= MOUNT_FLAGS.get(opt, 0)
    # mount(2) itself: mount(8) -o remount merges the options the mount has (favordynmods too)
    syscalls.mount(None, cgroups.v2_root(), None, flags, ",".join(others))
    if cgroups.FAVOR_DYNMODS in _options()[1]:
        cgroups.favor_dynmods()
        pytest.skip("this kernel keeps favordynmods set once on (the one-way fix)")
    try:
        yield others
    finally:
        assert cgroups.favor_dynmods() in ("on", "set")


def _backend(settings: Settings):  # noqa: ANN202 - a ContainerBackend
    from rollbox.backends.container.sandbox import ContainerBackend
    from rollbox.images.mounts import LayerMounts
    from rollbox.images.store import ImageStore
    from rollbox.isolation.userns import UidSlots

    slots = UidSlots(settings.uid_base, 4)
    return ContainerBackend(settings, LayerMounts(ImageStore(settings.images_dir)), slots), slots


async def test_backend_start_turns_it_on(cleared: list[str], tmp_node_dir: Path) -> None:
    backend, slots = _backend(node_settings(tmp_node_dir))
    try:
        await backend.start()
        sup = _options()[1]
        assert cgroups.FAVOR_DYNMODS in sup
        assert all(o in sup for o in cleared)  # nsdelegate & co. kept
        assert await backend.start() is None and cgroups.favor_dynmods() == "on"  # once
    finally:
        backend.release_node_resources()
        slots.close()


