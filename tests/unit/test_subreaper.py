"""isolation.syscalls.become_subreaper: an orphan below the caller is re-parented to it, not
to init. Each run is in a forked child, so the test process itself never becomes a
subreaper; every process it makes is killed and reaped."""
from __future__ import annotations

import os
import signal
import time

from rollbox.isolation import syscalls


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("PPid:"):
                return int(line.split()[1])
    raise AssertionError("no PPid line")


def _orphan_adopted(subreaper: bool) -> bool:
    """A fresh child (subreaper or not) forks a middle process, which forks a sleeping
    grandchild and exits. True when the orphaned grandchild's parent is then that child."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        code = 2
        try:
            os.close(r)
            if subreaper:
                syscalls.become_subreaper()
            rg, wg = os.pipe()
            middle = os.fork()
            if middle == 0:
                grand = os.fork()
                if grand == 0:
                    time.sleep(60)
                    os._exit(0)
                os.write(wg, grand.to_bytes(4, "little"))
                os._exit(0)
            os.waitpid(middle, 0)
            grand = int.from_bytes(os.read(rg, 4), "little")
            parent = _ppid(grand)
            os.kill(grand, signal.SIGKILL)
            if parent == os.getpid():
                os.waitpid(grand, 0)
            os.write(w, b"1" if parent == os.getpid() else b"0")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        answer = os.read(r, 1)
    finally:
        os.close(r)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return answer == b"1"


def test_orphan_goes_to_the_subreaper() -> None:
    assert _orphan_adopted(subreaper=True)


def test_without_it_the_orphan_goes_elsewhere() -> None:
    """The control: the same tree without the prctl is not adopted by the child (else the
    test above would pass for nothing)."""
    assert not _orphan_adopted(subreaper=False)
