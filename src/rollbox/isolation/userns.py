"""Uid ranges for sandboxes and user namespaces that carry their mappings.

Each sandbox gets a slot: host uids/gids ``[base + slot*65536, +65536)``, with sandbox root at
the first one (an unprivileged host uid). A user namespace with that mapping is created once per
slot and kept as an fd (for the most recently used slots, ``USERNS_CACHED``): it is what
idmapped layer mounts are made with (root-owned image files appear owned by the sandbox's mapped
root, without rewriting the image).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from rollbox.errors import CapacityExceeded
from rollbox.isolation import syscalls

RANGE = 65536
# User namespace fds UidSlots keeps open at most (the slots used most recently).
USERNS_CACHED = 256


def _mapped(pid: int, inside: int, host_uid: int, count: int) -> int:
    """Map the new user namespace of ``pid`` (uids and gids alike); an fd of it."""
    mapping = f"{inside} {host_uid} {count}\n".encode()
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "wb") as f:
            f.write(mapping)
    return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)


def make_userns_fd(host_uid: int, count: int = RANGE, inside: int = 0) -> int:
    """Return an fd of a new user namespace mapping inside..inside+count-1 to host_uid..
    (uid and gid). ``inside`` other than 0: an idmapped mount with it shifts files stored
    owned by one sandbox's host uids to another's (a fork's shared lower).

    The namespace is held by a child made with clone(CLONE_NEWUSER | CLONE_VM) that only
    waits in pause(2) (``syscalls.clone_paused``): it is in its namespace when clone returns,
    nothing of this process is copied and nothing is exec'd, so it costs ~0.4 ms from any
    thread, at once from many (forking the edge process was ~38 ms at load and serialised;
    spawning ``unshare --user cat`` 10-40 ms per fork child, two execs each). Mapped, the fd
    opened, the child is killed and reaped: the fd keeps the namespace."""
    pid, stack = syscalls.clone_paused(syscalls.CLONE_NEWUSER)
    try:
        return _mapped(pid, inside, host_uid, count)
    finally:
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        del stack  # only now: the child ran on it


class UidSlots:
    """Allocates uid-range slots; keeps a mapped user namespace fd for at most ``cached``
    slots (the most recently used: freed slots are handed out again last-in first-out, so a
    create/delete cycle finds its slot's namespace made). One fd per slot ever used would cap
    the node's sandboxes at the edge's RLIMIT_NOFILE (20,000 here, which the edge can not raise
    without CAP_SYS_RESOURCE) over the ~2 fds a live sandbox holds itself."""

    def __init__(self, base: int, slots: int, cached: int = USERNS_CACHED) -> None:
        if cached < 1:
            raise ValueError("UidSlots keeps at least one user namespace fd")
        self.base = base
        self.slots = slots
        self.cached = cached
        self._free = list(range(slots - 1, -1, -1))
        self._used: set[int] = set()
        self._userns: dict[int, int] = {}  # slot -> fd, least recently used first
        self._busy: dict[int, int] = {}  # slot -> users of its fd now (never closed then)
        self._lock = threading.Lock()

    def host_uid(self, slot: int) -> int:
        return self.base + slot * RANGE

    def slot_of(self, host_uid: int) -> int:
        return (host_uid - self.base) // RANGE

    def claim(self, slot: int) -> None:
        """Mark a slot used (re-adoption after a restart)."""
        with self._lock:
            if slot in self._free:
                self._free.remove(slot)
            self._used.add(slot)

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise CapacityExceeded("no free uid ranges on this node")
            slot = self._free.pop()
            self._used.add(slot)
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            if slot in self._used:
                self._used.discard(slot)
                self._free.append(slot)

    def in_use(self) -> set[int]:
        """The slots held now (acquired or claimed, not released)."""
        with self._lock:
            return set(self._used)

    @contextlib.contextmanager
    def userns_fd(self, slot: int) -> Iterator[int]:
        """The slot's mapped user namespace fd, open for the ``with`` block (made if it is
        not cached); afterwards the cache keeps the ``cached`` most recently used."""
        with self._lock:
            fd = self._userns.pop(slot, None)
            if fd is None:
                fd = make_userns_fd(self.host_uid(slot))
            self._userns[slot] = fd  # the most recently used: last
            self._busy[slot] = self._busy.get(slot, 0) + 1
        try:
            yield fd
        finally:
            with self._lock:
                self._busy[slot] -= 1
                if not self._busy[slot]:
                    del self._busy[slot]
                self._trim()

    def _trim(self) -> None:
        over = len(self._userns) - self.cached
        for slot in [s for s in self._userns if s not in self._busy][:max(0, over)]:
            os.close(self._userns.pop(slot))

    def cached_fds(self) -> int:
        """User namespace fds held now."""
        with self._lock:
            return len(self._userns)

    def close(self) -> None:
        with self._lock:
            for fd in self._userns.values():
                os.close(fd)
            self._userns.clear()
