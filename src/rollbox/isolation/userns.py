"""Uid ranges for sandboxes and user namespaces that carry their mappings.

Each sandbox gets a slot: host uids/gids ``[base + slot*65536, +65536)``, with sandbox root at
the first one (an unprivileged host uid). A user namespace with that mapping is created once per
slot and kept as an fd: it is what idmapped layer mounts are made with (root-owned image files
appear owned by the sandbox's mapped root, without rewriting the image).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

from rollbox.errors import CapacityExceeded
from rollbox.isolation import syscalls

RANGE = 65536


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
    """Allocates uid-range slots; keeps one mapped user namespace fd per slot ever used."""

    def __init__(self, base: int, slots: int) -> None:
        self.base = base
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))
        self._used: set[int] = set()
        self._userns: dict[int, int] = {}
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

    def userns_fd(self, slot: int) -> int:
        with self._lock:
            fd = self._userns.get(slot)
            if fd is None:
                fd = make_userns_fd(self.host_uid(slot))
                self._userns[slot] = fd
            return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._userns.values():
                os.close(fd)
            self._userns.clear()
