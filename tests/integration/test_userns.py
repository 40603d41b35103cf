"""User namespaces made by ``userns.make_userns_fd`` (a clone(CLONE_NEWUSER | CLONE_VM) child
that only pauses): the mapping holds for an idmapped mount (files stored owned by ``inside``
show as owned by ``host_uid``), each call is a namespace of its own, the helper child is
reaped (no zombie, no process left), also with many threads at once."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from rollbox.isolation import syscalls
from rollbox.isolation.userns import UidSlots, make_userns_fd

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (idmapped mounts)")]


def _children() -> set[int]:
    me = str(os.getpid())
    kids = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = (p / "stat").read_text().rsplit(")", 1)[1].split()[1]
            except (OSError, IndexError):
                continue
            if ppid == me:
                kids.add(int(p.name))
    return kids


def test_the_mapping_shifts_an_idmapped_mount_and_no_helper_is_left(tmp_path: Path) -> None:
    src, target = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    target.mkdir()
    inside, host = 2_000_000_000, 3_000_000_000
    f = src / "f"
    f.write_text("x")
    os.chown(f, inside + 7, inside + 9)
    before = _children()
    fd = make_userns_fd(host, 65536, inside=inside)
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("user:[")
        assert os.fstat(fd).st_ino != os.stat("/proc/self/ns/user").st_ino
        tree = syscalls.open_tree(-100, src, syscalls.OPEN_TREE_CLONE | syscalls.OPEN_TREE_CLOEXEC)
        try:
            syscalls.mount_setattr(tree, "", syscalls.AT_EMPTY_PATH,
                                   syscalls.MOUNT_ATTR_IDMAP | syscalls.MOUNT_ATTR_RDONLY,
                                   userns_fd=fd)
            syscalls.move_mount(tree, "", -100, target, syscalls.MOVE_MOUNT_F_EMPTY_PATH)
        finally:
            os.close(tree)
        try:
            st = os.stat(target / "f")
            assert (st.st_uid, st.st_gid) == (host + 7, host + 9)
        finally:
            syscalls.umount(target)
    finally:
        os.close(fd)
    assert _children() - before == set()


def test_many_threads_at_once_each_get_their_own_namespace() -> None:
    fds: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    before = _children()

    def one(i: int) -> None:
        try:
            fd = make_userns_fd(3_000_000_000 + i * 65536, 65536, inside=2_000_000_000)
            with lock:
                fds.append(fd)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        assert len({os.fstat(fd).st_ino for fd in fds}) == 16
    finally:
        for fd in fds:
            os.close(fd)
    assert _children() - before == set()


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_uid_slots_keep_a_bounded_number_of_namespace_fds() -> None:
    """UidSlots keeps the user namespace fds of the ``cached`` most recently used slots, never
    one per slot ever used (that capped the node at the edge's RLIMIT_NOFILE), never closes a
    fd while a ``with`` block uses it, and a slot whose fd went gets a working one again."""
    base = _fd_count()
    slots = UidSlots(3_100_000_000, 64, cached=4)
    try:
        held = [slots.acquire() for _ in range(10)]
        with slots.userns_fd(held[0]) as first:
            inode = os.fstat(first).st_ino
            keep = os.dup(first)  # the namespace outlives its cached fd: no inode reuse
            for s in held[1:]:  # nine more while the first is in use
                with slots.userns_fd(s) as fd:
                    assert os.readlink(f"/proc/self/fd/{fd}").startswith("user:[")
            os.fstat(first)  # still open: in use, though the oldest
            assert slots.cached_fds() == 4
        assert slots.cached_fds() == 4 and _fd_count() == base + 4 + 1
        with slots.userns_fd(held[-1]):  # cached: no new fd
            assert _fd_count() == base + 4 + 1
        with slots.userns_fd(held[1]):  # not cached: made; the oldest unused (held[0]) goes
            pass
        with slots.userns_fd(held[0]) as fd:  # a new namespace, mapped like the first
            assert os.fstat(fd).st_ino != inode
            assert os.readlink(f"/proc/self/fd/{fd}").startswith("user:[")
        os.close(keep)
        assert slots.cached_fds() == 4
        with pytest.raises(ValueError):
            UidSlots(0, 1, cached=0)
    finally:
        slots.close()
    assert _fd_count() == base
