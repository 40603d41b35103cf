"""A container's network namespace is made on its own thread while the prepare thread mounts
its tree (isolation.netns.start_create, backends/container/sandbox.py): the namespace is
whole when the create goes on, a failure of its thread is the create's error with nothing
left, and a create whose tree fails while the namespace is being made leaves no namespace
(the prepare thread waits for it, so the teardown sees it)."""
from __future__ import annotations

import os
import secrets
import threading
import time

import pytest

from rollbox.backends.container import rootfs as rootfs_mod
from rollbox.errors import InfraError
from rollbox.isolation import netns
from rollbox.models import Resources, SandboxSpec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, mounts)")]
SPEC = SandboxSpec(image="busybox:test", resources=Resources(cpus=1, memory_mib=128,
                                                             disk_mib=64))


def name() -> str:
    return f"{netns.PREFIX}t-alongside-{secrets.token_hex(3)}"


def test_a_namespace_started_is_whole_at_its_result() -> None:
    n = name()
    pending = netns.start_create(n)
    try:
        path = pending.result()
        assert path == netns.netns_path(n) and netns._is_mounted(path)
        # a network namespace of its own, not the caller's
        assert os.stat(path).st_ino != os.stat("/proc/self/ns/net").st_ino
        assert pending.result() == path  # asked again: the same, nothing made twice
    finally:
        netns.delete(n)
    assert not netns.netns_path(n).exists()


def test_a_failure_on_the_namespaces_thread_is_raised_and_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise OSError(19, "no loopback")

    monkeypatch.setattr(netns, "_loopback_up", broken)
    n = name()
    pending = netns.start_create(n)
    with pytest.raises(OSError, match="no loopback"):
        pending.result()
    assert not netns.netns_path(n).exists()


async def test_a_tree_failing_while_its_namespace_is_made_leaves_no_namespace(
        edge, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    def compose_fails(self, *a, **kw) -> None:  # noqa: ANN001, ANN002, ANN003
        raise InfraError("overlay refused (test)")

    monkeypatch.setattr(rootfs_mod.Rootfs, "compose", compose_fails)
    started: list[str] = []
    real = netns.start_create

    def tracking(n: str) -> netns.PendingNetns:
        started.append(n)
        return real(n)

    monkeypatch.setattr(netns, "start_create", tracking)
    real_unshare = netns.syscalls.unshare

    def slow_unshare(flags: int) -> None:  # the namespace still being made at the failure
        time.sleep(0.3)
        real_unshare(flags)

    monkeypatch.setattr(netns.syscalls, "unshare", slow_unshare)
    with pytest.raises(InfraError, match="overlay refused"):
        await edge.create(SPEC)
    assert len(started) == 1  # it was under way beside the failing mounts
    # nothing of the create runs on after it failed (its teardown saw all it made)
    assert not [t for t in threading.enumerate() if t.name == f"netns-{started[0]}"]
    assert not netns.netns_path(started[0]).exists()
    assert started[0] not in netns.list_rollbox()
