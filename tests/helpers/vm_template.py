"""A microVM backend on a test node's settings, and the test session's one template node
(tests/conftest.py ``vm_template_node``): the default tier builds one template per session; the
spare QEMUs' waits and leak check (``ready_spares``, ``spare_traces``)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TypeVar

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm.template import SPARE_PREFIX
from rollbox.backends.microvm.backend import MicroVMBackend
from rollbox.backends.microvm.spares import Spare
from rollbox.config import Settings
from rollbox.isolation import cgroups
from rollbox.images.store import ImageStore
from rollbox.isolation.userns import UidSlots
from rollbox.models import Resources

READY_S = 120.0  # a spare's start on a loaded 2-core host
TEMPLATE_IMAGE = "python:3.11"  # Python's random seeding is part of what clones must not share
T = TypeVar("T")


def template_spec(settings: Settings, image: str = TEMPLATE_IMAGE, memory_mib: int = 256,
                  disk_mib: int = 64) -> ResolvedSpec:
    img = ImageStore(settings.images_dir).resolve(image)
    return ResolvedSpec(image=image, layers=tuple(img.layers), env=dict(img.config.get("env") or {}),
                        resources=Resources(cpus=1, memory_mib=memory_mib, disk_mib=disk_mib))


@asynccontextmanager
async def vm_backend(settings: Settings) -> AsyncIterator[MicroVMBackend]:
    """A started MicroVMBackend of ``settings`` (templates and disk pool of its data dir),
    stopped at the end (as an edge stop: its spare QEMUs go)."""
    slots = UidSlots(settings.uid_base, settings.uid_slots)
    pool = DiskPool(settings)
    b = MicroVMBackend(settings, slots, ImageStore(settings.images_dir), pool)
    await b.start()
    try:
        yield b
    finally:
        await b.stop()  # its templates' spare QEMUs
        b.release_node_resources()
        slots.close()


def run_apart(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to the end in a loop of its own thread (from sync session fixtures,
    whatever loop the test runs in)."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(lambda: asyncio.run(fn())).result()  # type: ignore[arg-type]


@contextmanager
def template_node(settings: Settings) -> Iterator[Settings]:
    """``settings`` (a test node's) with templates on, whose cache holds the template of
    :func:`template_spec` (built by one create, then destroyed); the cache and the pool are
    emptied at the end."""
    settings.vm_templates = True
    settings.vm_accel = "tcg"

    async def warm() -> None:
        async with vm_backend(settings) as b:
            vm = await b.create(f"{settings.node_id}-tplwarm", template_spec(settings))
            try:
                assert vm.template, "the session's template was not built"
            finally:
                await b.destroy(vm)

    async def clear() -> None:
        async with vm_backend(settings) as b:
            assert b.templates is not None
            b.templates.cache.clear()
            b.disks.pool.release()

    try:
        run_apart(warm)
        yield settings
    finally:
        run_apart(clear)


async def ready_spares(b: MicroVMBackend, n: int) -> list[Spare]:
    """The backend's ready spares once there are ``n`` (AssertionError after READY_S)."""
    deadline = time.monotonic() + READY_S
    while len(b.spares.spares()) < n:
        assert time.monotonic() < deadline, f"{len(b.spares.spares())} of {n} spares ready"
        await asyncio.sleep(0.1)
    return b.spares.spares()


def spare_traces(b: MicroVMBackend, spare_ids: list[str]) -> list[str]:
    """What is left of spares anywhere: jail dirs, cgroups, disks, processes of their QEMU."""
    left = [f"jail dir {i}" for i in b.host_sandbox_ids(SPARE_PREFIX)]
    left += [str(p) for p in cgroups.leftover(b.settings.cgroup_parent)
             if p.name.startswith(SPARE_PREFIX)]
    left += [f"disk {i}" for i in b.disks.pool.ids() if i.startswith(SPARE_PREFIX)]
    for sid in spare_ids:
        left += b.leftovers(sid)
    return left
