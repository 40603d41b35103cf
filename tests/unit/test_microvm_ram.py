"""The page map helpers of backends/microvm/ram.py (bitmap runs, the file's size check) and
the remote access on a process of this test (a child's anonymous mapping stands in for a QEMU's
guest RAM); real QEMU in tests/integration/test_microvm_template_spares.py."""
from __future__ import annotations

import mmap
import os
import signal
from pathlib import Path

import pytest

from rollbox.backends.microvm import ram

SIZE = (8 << 20) + 3 * 4096  # a size no other mapping of the child has (stacks: 8 MiB)


def bitmap(pages: int, on: set[int]) -> bytes:
    out = bytearray((pages + 7) // 8)
    for i in on:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def test_runs_of_a_bitmap() -> None:
    assert ram.runs(bitmap(20, set()), 20) == []
    assert ram.runs(bitmap(20, {0, 1, 2, 7, 9, 10, 19}), 20) == [(0, 3), (7, 8), (9, 11),
                                                                 (19, 20)]
    assert ram.runs(bitmap(16, set(range(16))), 16) == [(0, 16)]


def test_a_page_map_of_another_size_is_not_used(tmp_path: Path) -> None:
    path = tmp_path / "pages"
    assert ram.read_page_map(path, 1 << 20) is None  # none
    ram.write_page_map(path, bitmap(256, {3}))
    assert ram.read_page_map(path, 1 << 20) == bitmap(256, {3})
    assert ram.read_page_map(path, 2 << 20) is None  # another VM size
    assert not list(tmp_path.glob("*.tmp"))


@pytest.fixture
def child() -> tuple[int, int]:
    """A forked child with one anonymous SIZE mapping (pages 1, 2 and 100 written: 'data'),
    stopped; (pid, address). Killed and reaped at the end."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for page in (1, 2, 100):
            m[page * ram.PAGE] = 7
        import ctypes
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        os.write(w, addr.to_bytes(8, "little"))
        while True:
            signal.pause()
    os.close(w)
    addr = int.from_bytes(os.read(r, 8), "little")
    os.close(r)
    yield pid, addr
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def rss_pages(pid: int, addr: int) -> int:
    with open(f"/proc/{pid}/smaps") as f:
        inside = False
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = int(fields[0].split("-")[0], 16) == addr
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024 // ram.PAGE
    raise AssertionError("mapping not found")


@pytest.mark.skipif(os.geteuid() != 0, reason="reads another process's memory")
def test_data_pages_and_prefault_on_a_real_process(child: tuple[int, int]) -> None:
    pid, addr = child
    assert ram.guest_ram(pid, SIZE) == addr
    # a size no anonymous mapping of the child has (a fork of pytest may hold one of SIZE + a
    # page by chance, e.g. a thread stack merged with its neighbour: CI saw it once)
    with open(f"/proc/{pid}/maps") as f:
        sizes = {int(hi, 16) - int(lo, 16) for lo, hi in
                 (line.split()[0].split("-") for line in f)}
    absent = next(n for n in range(SIZE + ram.PAGE, 1 << 40, ram.PAGE) if n not in sizes)
    assert ram.guest_ram(pid, absent) is None
    pages = ram.data_pages(pid, SIZE)
    assert pages is not None
    assert ram.runs(pages, SIZE // ram.PAGE) == [(1, 3), (100, 101)]
    before = rss_pages(pid, addr)
    want = bitmap(SIZE // ram.PAGE, {1, 2, 100, 500, 501})
    assert ram.prefault(pid, SIZE, want)
    # written: the map's pages are resident (500, 501 new) and zero (what was there is gone:
    # only for a QEMU whose RAM a state load overwrites next); read: the rest map the zero
    # page, no memory
    assert rss_pages(pid, addr) == before + 2
    assert ram.data_pages(pid, SIZE) == bitmap(SIZE // ram.PAGE, set())
    assert not ram.prefault(pid, absent, want)  # no such mapping: nothing done
