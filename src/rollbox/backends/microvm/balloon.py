"""Guest memory: free-page reporting always on, idle VMs squeezed, deflated before they run.

Every VM has ``virtio-balloon-device,free-page-reporting=on`` (``qemu.py``): pages the guest
frees go back to the host within seconds without any action here. On top of that an idle VM
can be *squeezed*: the balloon's target is set to a floor (``squeeze_target``), the guest
gives up its page cache and free memory to the balloon, and QEMU's RSS drops. A squeezed VM
gets its whole memory back (*deflate on demand*) before it runs a command: the edge calls
``prepare_exec`` and the backend deflates and waits until the balloon reports the full size
(bounded; the guest's own ``deflate-on-oom`` is the fallback if the wait runs out).

Owns the balloon targets; the QMP connection and the VM's lock are the backend's.
"""
from __future__ import annotations

import asyncio
import time

from rollbox.backends.microvm.qmp import QMP

SQUEEZE_FLOOR_MIB = 96
DEFLATE_TIMEOUT_S = 5.0


def squeeze_target(memory_mib: int) -> int:
    """Bytes a squeezed guest keeps: a quarter of its memory, at least the floor."""
    return max(SQUEEZE_FLOOR_MIB, memory_mib // 4) << 20


async def squeeze(q: QMP, memory_mib: int) -> int:
    """Inflate the balloon to leave the guest ``squeeze_target``; returns the target."""
    target = min(squeeze_target(memory_mib), memory_mib << 20)
    await q.balloon(target)
    return target


async def deflate(q: QMP, memory_mib: int, timeout_s: float = DEFLATE_TIMEOUT_S) -> bool:
    """Give the guest all its memory back; True once the balloon reports it (within 1 MiB)."""
    full = memory_mib << 20
    await q.balloon(full)
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        if await q.query_balloon() >= full - (1 << 20):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.1)
