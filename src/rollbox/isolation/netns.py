"""Named network namespaces (``/run/netns/rollbox-<id>``), the sandbox's own network stack.

A new namespace has only loopback, brought up here; nothing else is connected by default
(network policy, a later part, adds links and filters). Created from a short-lived thread so
the caller's own namespace never changes (``socket_inside`` changes the calling thread's for one
socket() call only, see there).
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rollbox.isolation import syscalls

NETNS_DIR = Path("/run/netns")
PREFIX = "rollbox-"
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def netns_path(name: str) -> Path:
    return NETNS_DIR / name


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


_netns_dir_ready = False


def _ensure_netns_dir() -> None:
    """Make /run/netns a shared bind mount of itself, as iproute2 does on its first
    `ip netns add`. Done by iproute2 *after* we bound namespaces there, that bind would hide
    every one of ours beneath it: they could then be neither unmounted nor removed."""
    global _netns_dir_ready
    if _netns_dir_ready:
        return
    NETNS_DIR.mkdir(parents=True, exist_ok=True)
    target = str(NETNS_DIR)
    with open("/proc/self/mountinfo") as f:
        mounted = any(line.split()[4] == target for line in f)
    if not mounted:
        syscalls.mount(target, target, None, syscalls.MS_BIND | syscalls.MS_REC)
    syscalls.mount("none", target, None, syscalls.MS_SHARED | syscalls.MS_REC)
    _netns_dir_ready = True


def create(name: str) -> Path:
    """Create the named namespace (idempotent for an existing one)."""
    return start_create(name).result()


class PendingNetns:
    """A namespace being made on its own thread (:func:`start_create`): the caller does other
    work meanwhile and then waits for it with :meth:`result`."""

    def __init__(self, name: str, path: Path, thread: threading.Thread | None,
                 errors: list[BaseException]) -> None:
        self.name, self.path = name, path
        self._thread, self._errors = thread, errors

    def result(self) -> Path:
        """Wait for the thread; the namespace's path, or its error (the half-made namespace
        removed first)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._errors:
            delete(self.name)
            raise self._errors[0]
        return self.path


def start_create(name: str) -> PendingNetns:
    """Start making the named namespace on a thread of its own (as :func:`create`, which is
    this and then :meth:`PendingNetns.result`): a create overlaps it with its rootfs's
    mounts. The caller must call ``result()`` whatever it does meanwhile, so nothing runs on
    after it (a teardown that starts first would miss the namespace)."""
    _ensure_netns_dir()
    path = netns_path(name)
    if path.exists() and _is_mounted(path):
        return PendingNetns(name, path, None, [])
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_CREAT, 0o444)
    os.close(fd)

    def work() -> None:
        syscalls.unshare(syscalls.CLONE_NEWNET)
        syscalls.mount(f"/proc/self/task/{threading.get_native_id()}/ns/net", path, None,
                       syscalls.MS_BIND)
        _loopback_up()

    errors: list[BaseException] = []
    try:
        thread = _start_own_thread(work, f"netns-{name}", [], errors)
    except BaseException:
        delete(name)
        raise
    return PendingNetns(name, path, thread, errors)


T = TypeVar("T")


def _start_own_thread(fn: Callable[[], T], thread_name: str, result: list[T],
                      errors: list[BaseException]) -> threading.Thread:
    """fn() started on a short-lived thread (a namespace change moves only that thread); its
    result goes into ``result``, its exception into ``errors``."""

    def work() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            errors.append(exc)

    t = threading.Thread(target=work, name=thread_name)
    t.start()
    return t


def _on_own_thread(fn: Callable[[], T], thread_name: str) -> T:
    """fn() on a short-lived thread (a namespace change moves only that thread); its result,
    or its exception raised here."""
    result: list[T] = []
    errors: list[BaseException] = []
    _start_own_thread(fn, thread_name, result, errors).join()
    if errors:
        raise errors[0]
    return result[0]


def run_inside(name: str, fn: Callable[[], T]) -> T:
    """fn() on a thread inside the named namespace (the caller's own never changes)."""
    path = netns_path(name)

    def work() -> T:
        ns_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            syscalls.setns(ns_fd, syscalls.CLONE_NEWNET)
        finally:
            os.close(ns_fd)
        return fn()

    return _on_own_thread(work, f"in-{name}")


_home = threading.local()  # per thread: an fd of the namespace the thread started in


def _home_fd() -> int:
    try:
        fd: int = _home.fd
    except AttributeError:  # this thread's first socket_inside
        fd = _home.fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    return fd


def socket_inside(name: str, family: int = socket.AF_INET) -> socket.socket:
    """A new non-blocking TCP socket of the named namespace. The calling thread joins the
    namespace for the one socket() call and returns to its own before this returns (no Python
    code of anyone else runs meanwhile on this thread; a failed return ends the process: a
    thread left in a sandbox's namespace would make every later socket there). A thread is
    not made per call: this runs on the event loop's thread in ~10 us. The socket stays in
    that namespace whoever uses it: its 127.0.0.1 is the namespace's loopback. Made by the
    caller's process, it belongs to the caller's cgroup, not to the namespace's sandbox."""
    ns_fd = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        home = _home_fd()
        syscalls.setns(ns_fd, syscalls.CLONE_NEWNET)
        try:
            s = socket.socket(family,
                              socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        finally:
            try:
                syscalls.setns(home, syscalls.CLONE_NEWNET)
            except BaseException:  # noqa: BLE001 - fail closed, see above
                os.write(2, b"rollbox: could not leave a sandbox's network namespace\n")
                os._exit(70)
    finally:
        os.close(ns_fd)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _is_mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def delete(name: str) -> None:
    path = netns_path(name)
    try:
        syscalls.umount(path, syscalls.MNT_DETACH)
    except OSError:
        pass
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def list_rollbox() -> list[str]:
    if not NETNS_DIR.exists():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(PREFIX))
