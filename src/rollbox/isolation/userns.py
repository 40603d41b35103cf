"""Uid ranges for sandboxes and user namespaces that carry their mappings.

Each sandbox gets a slot: host uids/gids ``[base + slot*65536, +65536)``, with sandbox root at
the first one (an unprivileged host uid). A user namespace with that mapping is created once per
slot and kept as an fd: it is what idmapped layer mounts are made with (root-owned image files
appear owned by the sandbox's mapped root, without rewriting the image).
"""
from __future__ import annotations

import os
import subprocess
import threading
import time

from rollbox.errors import CapacityExceeded
from rollbox.isolation import syscalls

RANGE = 65536
# One helper process at a time: a second one forked meanwhile would inherit the first's pipe
# ends (fork keeps them, close-on-exec or not) and each would wait for the other's EOF.
_FORK_LOCK = threading.Lock()


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
    owned by one sandbox's host uids to another's (a fork's shared lower)."""
    with _FORK_LOCK:
        return _make_userns_fd(host_uid, count, inside)


def _make_userns_fd(host_uid: int, count: int, inside: int) -> int:
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only async-signal-safe work until _exit
        try:
            os.close(ready_r)
            os.close(go_w)
            syscalls.unshare(syscalls.CLONE_NEWUSER)
            os.write(ready_w, b"1")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    try:
        if os.read(ready_r, 1) != b"1":
            raise OSError("user namespace helper failed")
        return _mapped(pid, inside, host_uid, count)
    finally:
        os.close(ready_r)
        os.close(go_w)
        os.waitpid(pid, 0)


UNSHARE = "/usr/bin/unshare"


def spawn_userns_fd(host_uid: int, count: int = RANGE, inside: int = 0,
                    timeout_s: float = 10.0) -> int:
    """:func:`make_userns_fd` without forking this process: ``unshare --user cat`` is spawned
    (vfork + exec: cheap from a large process, and safe from many threads at once: its
    descriptors are closed), its user namespace mapped once it has one, then it exits on
    EOF. For the per-child namespaces of a fork (a fork of 8 made them one at a time at
    ~40 ms each under load)."""
    own = os.stat("/proc/self/ns/user").st_ino
    proc = subprocess.Popen([UNSHARE, "--user", "--", "/usr/bin/cat"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True)
    try:
        deadline = time.monotonic() + timeout_s
        delay = 0.0002
        while True:
            try:
                if os.stat(f"/proc/{proc.pid}/ns/user").st_ino != own:
                    break
            except FileNotFoundError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"user namespace helper failed (exit {proc.returncode})")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
        return _mapped(proc.pid, inside, host_uid, count)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
