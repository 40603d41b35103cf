"""Guest memory: free-page reporting always on, a template's free memory zeroed, idle VMs
squeezed, deflated before they run.

Every VM has ``virtio-balloon-device,free-page-reporting=on`` (``qemu.py``): pages the guest
frees go back to the host within seconds without any action here, but only in blocks of the
reporting order (2 MiB): a page freed among used ones keeps its data and stays resident.

Before a template is saved its guest's free memory is zeroed (``zero_free_memory``: a tmpfs of
that size filled from /dev/zero by the platform's busybox, then unmounted): the pages it had
freed since boot (the initramfs archive, init sections, module buffers...) are zero pages in
the saved state, which a restore skips, instead of being loaded into every restored VM
(measured: ~8 MiB less per restored VM). The guest kernel's ``init_on_free=1`` would do the
same for every VM but zeroes all its memory at boot (+0.3 s per cold boot, every guest page
touched). The balloon is not used for it: QEMU 7.2 then saved the template's zero pages as data
(measured: +20 MiB per restored VM).

On top of that an idle VM that holds more than it would keep squeezed (``worth_squeezing``)
can be *squeezed*: the balloon's target is set to a floor (``squeeze_target``), the guest
gives up its page cache and free memory to the balloon, and QEMU's RSS drops. A squeezed VM
gets its whole memory back (*deflate on demand*) before it runs a command: the edge calls
``prepare_exec`` and the backend deflates and waits until the balloon reports the full size
(bounded; the guest's own ``deflate-on-oom`` is the fallback if the wait runs out).

Owns the balloon targets and the template's zeroing; the QMP connection, the agent channel and
the VM's lock are the backend's.
"""
from __future__ import annotations

import asyncio
import time

from rollbox.agent.tools import PlatformTools
from rollbox.backends.microvm.qmp import QMP
from rollbox.errors import InfraError

SQUEEZE_FLOOR_MIB = 96
SQUEEZE_MIN_GAIN_MIB = 32  # an idle squeeze that frees less is not done (worth_squeezing)
DEFLATE_TIMEOUT_S = 5.0


def squeeze_target(memory_mib: int) -> int:
    """Bytes a squeezed guest keeps: a quarter of its memory, at least the floor."""
    return max(SQUEEZE_FLOOR_MIB, memory_mib // 4) << 20


def worth_squeezing(qemu_anon_bytes: int, memory_mib: int) -> bool:
    """Whether an idle squeeze can give the host back at least SQUEEZE_MIN_GAIN_MIB: QEMU's
    anonymous memory (guest RAM it holds, its translation cache and heap: read on the host)
    above what the squeezed guest keeps. A VM restored from a template holds little beyond
    the pages its guest uses (its free pages were zero in the template), so squeezing it
    would only cost the deflate before its next command (measured: ~81 MiB per restored
    256 MiB VM against a 96 MiB target; a cold-booted one ~160)."""
    return qemu_anon_bytes - squeeze_target(memory_mib) >= SQUEEZE_MIN_GAIN_MIB << 20


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


# Free memory the zeroing leaves the guest: well above its watermarks (~3 MiB at 256 MiB), so
# the fill never makes it reclaim page cache or run out.
ZERO_MARGIN_MIB = 16
ZERO_MOUNT = "/run/.rollbox-zero"
ZERO_TIMEOUT_S = 120.0


def meminfo_free_mib(meminfo: bytes, memory_mib: int) -> int:
    """``MemFree`` of a guest's ``/proc/meminfo`` in MiB (guest-written: malformed reads as 0,
    i.e. nothing to zero; never more than the guest's memory)."""
    for line in meminfo.split(b"\n", 64)[:64]:
        parts = line.split()
        if parts[:1] == [b"MemFree:"]:
            if len(parts) == 3 and parts[1].isdigit() and len(parts[1]) <= 12 \
                    and parts[2] == b"kB":
                return min(int(parts[1]) >> 10, memory_mib)
            return 0
    return 0


def zero_fill_mib(free_mib: int, memory_mib: int) -> int:
    """MiB of free memory to zero: all but the margin (more for large guests: 1/32)."""
    return max(0, free_mib - max(ZERO_MARGIN_MIB, memory_mib // 32))


async def zero_free_memory(tools: PlatformTools, memory_mib: int) -> int:
    """Zero the guest's free memory (see the module docstring) through platform applets run
    in its root; returns the MiB written. InfraError if the tmpfs could not be unmounted (a
    template must not keep it)."""
    info = await tools.run(["cat", "/proc/meminfo"], max_stdout=16384)
    n = zero_fill_mib(meminfo_free_mib(info.stdout, memory_mib) if info.ok else 0, memory_mib)
    if n <= 0:
        return 0
    made = await tools.run(["mkdir", "-p", "-m", "700", ZERO_MOUNT])
    if not made.ok:
        raise InfraError(f"guest memory not zeroed: mkdir: {made.message()}")
    mounted = await tools.run(["mount", "-t", "tmpfs", "-o", f"size={n}m,mode=0700,nosuid,"
                               "nodev,noexec", "rollbox-zero", ZERO_MOUNT])
    try:
        if not mounted.ok:
            raise InfraError(f"guest memory not zeroed: mount: {mounted.message()}")
        # dd's exit is not checked: a short fill still zeroed what it wrote
        await tools.run(["dd", "if=/dev/zero", f"of={ZERO_MOUNT}/zero", "bs=1M", f"count={n}"],
                        max_stdout=4096, timeout_s=ZERO_TIMEOUT_S)
    finally:
        if mounted.ok:
            gone = await tools.run(["umount", ZERO_MOUNT])
            if not gone.ok:
                raise InfraError(f"guest memory not zeroed: umount: {gone.message()}")
        await tools.run(["rmdir", ZERO_MOUNT])
    return n
