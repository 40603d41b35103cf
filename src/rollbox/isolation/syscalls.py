"""Thin ctypes wrappers for the syscalls Python 3.11 lacks (x86_64 numbers), and the mount
table (``/proc/self/mountinfo``) that mount(2) and umount2(2) change.

Every wrapper raises OSError with errno on failure. Nothing here keeps state.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
_prctl.restype = ctypes.c_int

SYS_open_tree = 428
SYS_move_mount = 429
SYS_openat2 = 437
SYS_mount_setattr = 442
SYS_pidfd_open = 434

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_SYNCHRONOUS = 16
MS_REMOUNT = 32
MS_DIRSYNC = 128
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24

MNT_FORCE = 1
MNT_DETACH = 2
AT_FDCWD = -100
UMOUNT_NOFOLLOW = 8

OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_RECURSIVE = 0x8000
AT_EMPTY_PATH = 0x1000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x100000

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


def _check(ret: int) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def _b(path: str | bytes | os.PathLike[str] | None) -> bytes | None:
    if path is None:
        return None
    return os.fsencode(path)


def mount(source: str | None, target: str | os.PathLike[str], fstype: str | None,
          flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)))


def umount(target: str | os.PathLike[str], flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), ctypes.c_int(flags)))


def syncfs(path: str | os.PathLike[str]) -> None:
    """Write back everything of the filesystem ``path`` is on (overlayfs: its upper's)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check(_libc.syncfs(ctypes.c_int(fd)))
    finally:
        os.close(fd)


def unescape_mountinfo(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def read_mountinfo() -> list[tuple[str, str, str]]:
    """(mount point, fstype, source) for every mount in this process's mount namespace (the
    table mount(2) and umount2(2) change)."""
    rows = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            lf, rf = left.split(), right.split()
            if len(lf) < 5 or len(rf) < 2:
                continue
            rows.append((unescape_mountinfo(lf[4]), rf[0], unescape_mountinfo(rf[1])))
    return rows


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)))


SYS_pause = 34
SIGCHLD = 17
CLONE_VM = 0x00000100
_CLONE_STACK = 16 << 10
_libc.clone.restype = ctypes.c_int
_libc.clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
# The child's whole program: glibc's syscall(SYS_pause), a plain syscall stub (no
# cancellation point, no TLS but errno, which it never sets: every signal stays blocked).
_PAUSE_FN = ctypes.cast(_libc.syscall, ctypes.c_void_p)


def clone_paused(flags: int) -> tuple[int, ctypes.Array[ctypes.c_char]]:
    """A child process made by clone(2) with ``flags`` (e.g. CLONE_NEWUSER) that shares this
    process's memory (CLONE_VM: no page tables copied, no exec) and only waits in pause(2)
    on a stack of its own, every signal blocked, until it is killed: what holds a new
    namespace while the parent sets it up (maps, an fd of it). Returns (pid, its stack): the
    caller keeps the stack alive until it has SIGKILLed and reaped the child. Safe from any
    thread (the child never runs Python code)."""
    import signal

    stack = ctypes.create_string_buffer(_CLONE_STACK)
    top = (ctypes.addressof(stack) + _CLONE_STACK - 64) & ~15
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = _libc.clone(_PAUSE_FN, top, flags | CLONE_VM | SIGCHLD, SYS_pause)
        err = ctypes.get_errno()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    if pid < 0:
        raise OSError(err, os.strerror(err))
    return pid, stack


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """prctl(PR_SET_CHILD_SUBREAPER, 1): orphans below this process (a container init after
    ``runc run -d``, QEMU after its jailer exec'd, a killed edge's agents) become its children
    instead of init's, which on some hosts never reaps, so this process can reap them. Kept
    across exec, not across fork. (fncall's in-sandbox worker declares its own: it runs from
    its source in the image's Python and imports nothing of rollbox.)"""
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0))


def setns(fd: int, nstype: int = 0) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)))


def open_tree(dirfd: int, path: str | os.PathLike[str], flags: int) -> int:
    return _check(_syscall(SYS_open_tree, ctypes.c_int(dirfd), _b(path), ctypes.c_uint(flags)))


def move_mount(from_dirfd: int, from_path: str, to_dirfd: int, to_path: str | os.PathLike[str],
               flags: int) -> None:
    _check(_syscall(SYS_move_mount, ctypes.c_int(from_dirfd), _b(from_path),
                    ctypes.c_int(to_dirfd), _b(to_path), ctypes.c_uint(flags)))


def mount_setattr(dirfd: int, path: str, flags: int, attr_set: int, attr_clr: int = 0,
                  propagation: int = 0, userns_fd: int = 0) -> None:
    attr = struct.pack("<QQQQ", attr_set, attr_clr, propagation, userns_fd)
    buf = ctypes.create_string_buffer(attr, len(attr))
    _check(_syscall(SYS_mount_setattr, ctypes.c_int(dirfd), _b(path), ctypes.c_uint(flags),
                    buf, ctypes.c_size_t(len(attr))))


def openat2(dirfd: int, path: str | bytes, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): open ``path`` relative to ``dirfd`` under the ``resolve`` restrictions."""
    how = struct.pack("<QQQ", flags | os.O_CLOEXEC, mode, resolve)
    buf = ctypes.create_string_buffer(how, len(how))
    return _check(_syscall(SYS_openat2, ctypes.c_int(dirfd), _b(path), buf,
                           ctypes.c_size_t(len(how))))


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    """prctl(2) with integer (or address) arguments; OSError with errno on failure."""
    return _check(_prctl(option, arg2, arg3, arg4, arg5))


def pidfd_open(pid: int) -> int:
    return _check(_syscall(SYS_pidfd_open, ctypes.c_int(pid), ctypes.c_uint(0)))


def statfs_type(path: str | os.PathLike[str]) -> int:
    """f_type of the filesystem holding path (statfs(2); the magic is the first field)."""
    buf = ctypes.create_string_buffer(120)
    _check(_libc.statfs(_b(path), buf))
    return int.from_bytes(buf.raw[:8], "little")


@contextmanager
def flocked(path: str | os.PathLike[str], shared: bool = False) -> Iterator[None]:
    """Hold an flock on the lock file ``path`` (made if missing, root-only) for the block:
    exclusive, or shared with other holders of ``shared``. For state other processes of the
    node (CLI, another edge) change too; threads of this process need their own lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
