"""A QEMU process's guest RAM seen from the host: which pages of a template's saved RAM hold
data (its page map), and pre-faulting a spare QEMU's RAM before a state is loaded into it.

Why: a copy restore (``migrate-incoming`` of a state file into a fresh QEMU) spends most of its
state load in page faults of the new QEMU's guest RAM, not in copying: every data page is a
write fault (a page allocated, charged to the memory cgroup, cleared, mapped), every zero page
a read fault (QEMU 7.2 checks that the destination page is zero, which maps the zero page).
A spare QEMU (``spares.py``) waits long before its restore, so its RAM is faulted in ahead:
the template's data pages written (zeros: a page allocated and charged as the load would),
every other page read (the shared zero page mapped: no memory). The load then finds every page
present. Measured here (TCG, busybox, 256 MiB, ~15k data pages): QEMU CPU of the state load
~60 -> ~24 ms (docs/backends/microvm.md, Templates).

What is written can never change the restored guest: an incoming migration overwrites every
page the stream has (a data page is copied, a zero page cleared unless it is zero already),
and a page it does not have (a shared-RAM template's, none here) is zero in a fresh QEMU too.
So the page map is a hint: a wrong one costs memory (bounded by the VM's memory limit, where
the pages are charged) or leaves faults to the load, never a different guest.

The page map comes from the template's build VM after its save (QEMU stopped, so its RAM is
the saved RAM): the pages present in its guest RAM (``/proc/<pid>/pagemap``) whose content is
not all zero, as QEMU's own save tests each page (``buffer_is_zero``). Guest memory is only
tested for zero, never parsed. Stored as a bitmap file in the template's dir (``template.py``).

The guest RAM mapping is found in ``/proc/<pid>/maps``: the one private anonymous read-write
(not executable: TCG's code buffer is) mapping of exactly the VM's memory size; none or more
than one and nothing is done. Access is ``process_vm_readv``/``process_vm_writev`` (the edge
is root; QEMU is the jail's unprivileged uid).

Owns the page map format and the remote access; does not know templates or spares.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

PAGE = 4096
PRESENT = 1 << 63
IOV_MAX = 1024
CHUNK_PAGES = 256   # pages read per process_vm_readv while mapping (1 MiB)
ZERO_PAGE = bytes(PAGE)


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_libc, _name)
    _fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                    ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    _fn.restype = ctypes.c_ssize_t


def guest_ram(pid: int, size: int) -> int | None:
    """Start address of QEMU ``pid``'s guest RAM mapping of ``size`` bytes; None if there is
    not exactly one candidate."""
    found = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) != 5 or fields[1] != "rw-p":  # anonymous (no path), no exec
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if hi - lo == size:
                    found.append(lo)
    except (OSError, ValueError):
        return None
    return found[0] if len(found) == 1 else None


def _vm(fn: object, pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]
        ) -> int:
    liov = (_Iovec * len(local))(*(_Iovec(a, n) for a, n in local))
    riov = (_Iovec * len(remote))(*(_Iovec(a, n) for a, n in remote))
    done = fn(pid, liov, len(local), riov, len(remote), 0)  # type: ignore[operator]
    if done < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(done)


# ---- the page map -----------------------------------------------------------------------------
def data_pages(pid: int, size: int) -> bytes | None:
    """Bitmap (bit i of byte i // 8: page i) of the pages of QEMU ``pid``'s guest RAM that are
    present and not all zero; None if its RAM is not found. QEMU must be stopped."""
    base = guest_ram(pid, size)
    if base is None:
        return None
    n = size // PAGE
    bitmap = bytearray((n + 7) // 8)
    buf = ctypes.create_string_buffer(CHUNK_PAGES * PAGE)
    view = memoryview(buf).cast("B")
    with open(f"/proc/{pid}/pagemap", "rb") as pm:
        pm.seek(base // PAGE * 8)
        entries = memoryview(pm.read(n * 8)).cast("Q")
    if len(entries) != n:
        return None
    for first in range(0, n, CHUNK_PAGES):
        count = min(CHUNK_PAGES, n - first)
        present = [i for i in range(first, first + count) if entries[i] & PRESENT]
        if not present:
            continue
        got = _vm(_libc.process_vm_readv, pid, [(ctypes.addressof(buf), count * PAGE)],
                  [(base + first * PAGE, count * PAGE)])
        if got != count * PAGE:
            return None
        for i in present:
            off = (i - first) * PAGE
            if view[off:off + PAGE] != ZERO_PAGE:
                bitmap[i >> 3] |= 1 << (i & 7)
    return bytes(bitmap)


def runs(bitmap: bytes, pages: int) -> list[tuple[int, int]]:
    """The set bits of ``bitmap`` (the first ``pages`` bits) as [first, end) page runs."""
    out: list[tuple[int, int]] = []
    start = -1
    for i in range(pages):
        if bitmap[i >> 3] >> (i & 7) & 1:
            if start < 0:
                start = i
        elif start >= 0:
            out.append((start, i))
            start = -1
    if start >= 0:
        out.append((start, pages))
    return out


def write_page_map(path: Path, bitmap: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(bitmap)
    os.replace(tmp, path)


def read_page_map(path: Path, size: int) -> bytes | None:
    """A page map for a VM of ``size`` bytes; None if there is none or it has another size."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if len(data) == (size // PAGE + 7) // 8 else None


# ---- pre-faulting a spare ---------------------------------------------------------------------
def prefault(pid: int, size: int, bitmap: bytes | None) -> bool:
    """Fault in QEMU ``pid``'s guest RAM before a state is loaded into it: the pages set in
    ``bitmap`` written (zeros: whatever was there is gone, so only for a QEMU that never ran a
    guest), every other page read. False (nothing or part done, logged) if its RAM is not found
    or the access fails; the restore is then only slower."""
    base = guest_ram(pid, size)
    if base is None:
        log.info("QEMU %d: guest RAM of %d MiB not found, not pre-faulted", pid, size >> 20)
        return False
    n = size // PAGE
    written = runs(bitmap, n) if bitmap is not None else []
    zeros = ctypes.create_string_buffer(CHUNK_PAGES * PAGE)
    one = ctypes.create_string_buffer(IOV_MAX)
    try:
        for first, end in written:
            for lo in range(first, end, CHUNK_PAGES):
                count = min(CHUNK_PAGES, end - lo)
                _vm(_libc.process_vm_writev, pid, [(ctypes.addressof(zeros), count * PAGE)],
                    [(base + lo * PAGE, count * PAGE)])
        skip = set()
        for first, end in written:
            skip.update(range(first, end))
        reads = [base + i * PAGE for i in range(n) if i not in skip]
        for lo in range(0, len(reads), IOV_MAX):  # one byte of each page: a read fault
            batch = reads[lo:lo + IOV_MAX]
            _vm(_libc.process_vm_readv, pid, [(ctypes.addressof(one), len(batch))],
                [(a, 1) for a in batch])
    except OSError as exc:
        log.info("QEMU %d: guest RAM not pre-faulted: %s", pid, exc)
        return False
    return True
