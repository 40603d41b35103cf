"""Spare QEMUs of microVM templates: jailed QEMU processes started before any create asks,
with a template's exact argv and ``-incoming defer``, QMP connected and guest RAM faulted in,
so a restore from that template starts at its state load.

A spare is everything of a restore that depends neither on the sandbox nor on the saved guest:
a uid slot, the template's disk cloned as saved (the spare's own subvolume: QEMU opens its
disks when it starts, even under ``-incoming``), a jail dir with its sockets, cgroups with the
template's limits, QEMU started in the jail, its QMP connected, its guest RAM faulted in
(``ram.py``: the template's data pages written, the rest read). Never: the saved state (loaded
when a create claims the spare: every restore still loads a state into a fresh QEMU that never
ran a guest), a network (a spec with a network policy restores without a spare: its netns and
tap exist before its QEMU starts), anything of a sandbox or its owner.

Claim (a create restoring from template T, no network, :meth:`Spares.claim`): the backend
renames the spare's disk subvolume and jail dir to the sandbox id (the cgroups keep their name:
``jail.py``), sets its CPU quota to what the create asked, and the restore goes on from the
state load (``backend.py``) with the sandbox's CPU class (``isolation.qos``: a batch sandbox's
spare stays in the idle class). A spare whose QEMU is gone is torn down, never claimed.

Fork (:meth:`Spares.claim_like`): a microVM fork's children take ready spares whose QEMU has
the child's exact machine and layers (``backend.py`` fork: the fork's disk cloned into the
spare's ``rw.img`` by FICLONE, the fork's state loaded into it), at most ``vm_fork_spares``.
A template whose VM was forked (:meth:`forked`) keeps ``max(vm_template_spares,
vm_fork_spares)`` spares from then on (until it goes idle), and the bound over all templates is
at least ``vm_fork_spares`` (templates never forked stay within ``vm_template_spares_max``).

Policy: ``vm_template_spares`` spares for each template creates restore from (0: none), at most
``vm_template_spares_max`` in all, the most recently used templates first. One spare is started
at a time, only when no create of the backend is in flight (a fork counts as in flight until
each of its children answered its first command), its disk's clone and RAM faults at SCHED_IDLE
and its QEMU in the batch (idle) CPU class until a create claims it (cgroup ``cpu.idle``: a
refill never slows a sandbox), and only
while the sandboxes' parent memory cgroup (host RAM minus the node's reserve, set by the edge)
and host MemAvailable have room for the spare's whole memory limit. A template's spares are stopped when it is
dropped (evicted, bad, cache cleared: :meth:`forget`) or no create restored from it for
``vm_template_spare_idle_s``; all of them at :meth:`stop` (edge stop). A spare is no sandbox:
its id starts with :data:`~rollbox.backends.microvm.template.SPARE_PREFIX` (never a node id), it
is never journaled, an edge's recovery never adopts one, and the backend's start removes what a
crashed edge left of spares (process, cgroups, jail dir, disk).

Memory: a spare holds QEMU's own memory and its pre-faulted pages (about the template's saved
RAM), charged to its cgroup under the sandboxes' parent cgroup (so the node's sandbox memory
limit and admission's live MemAvailable count it); node capacity lists the spares and their
memory (``facts["template_spares"]``). Descriptors: the edge holds each spare's QMP socket, QEMU's
log file and output pipe; admission counts them against the edge's table as it counts the
sandboxes' (``MicroVMBackend.node_fds``, ``Backend.node_fds``).

Owns the spares and when they are started and stopped; does not own the jail, the disks, the
templates or the restore (``jail.py``, ``disks.py``, ``template.py``, ``backend.py``).
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rollbox.backends.cancellation import to_the_end
from rollbox.backends.microvm import qemu, qmp, ram
from rollbox.backends.microvm.jail import Jail
from rollbox.backends.microvm.template import SPARE_PREFIX, Template
from rollbox.errors import InfraError
from rollbox.isolation import cgroups, qos

if TYPE_CHECKING:
    from rollbox.backends.microvm.backend import MicroVMBackend

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_S = 30.0       # a template whose spare failed to start gets none for this long
CHECK_S = 30.0       # idle templates are looked for at least this often


@dataclass
class Recipe:
    """How to start a spare of one template (from a create that restored from it)."""
    machine: qemu.MachineSpec   # the restore's machine (``VmTemplates.restore_machine``)
    layers: tuple[str, ...]     # layer digests, lowest first
    cpus: float                 # the CFS quota it starts with
    disk_id: str                # the template's disk subvolume
    ram_file: Path | None       # a shared-RAM template's RAM file
    pages: Path | None          # the template's page map (copy templates)
    last_used: float = 0.0
    forked: bool = False        # a VM of it was forked: it keeps ``vm_fork_spares``


@dataclass
class Spare:
    id: str
    digest: str                 # its template
    slot: int
    host_uid: int
    jail: Jail
    pid: int
    machine: qemu.MachineSpec
    cpus: float
    monitor: qmp.QMP           # connected; handed to the restore (closed there)
    layers: tuple[str, ...] = ()  # the layer files its QEMU opened (digests, lowest first)


def at_idle_priority(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in this thread at idle CPU priority (SCHED_IDLE), then back: a spare's
    pre-faulting runs on CPU time no sandbox wants."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        return fn(*args)
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


class Spares:
    def __init__(self, backend: MicroVMBackend) -> None:
        s = backend.settings
        self.backend = backend
        self.per_template = max(0, s.vm_template_spares)
        self.fork_spares = max(0, s.vm_fork_spares)
        self.plain_max = max(0, s.vm_template_spares_max)
        self.max_total = max(self.plain_max, self.fork_spares)
        self.idle_s = s.vm_template_spare_idle_s
        self._ready: dict[str, list[Spare]] = {}
        self._wanted: dict[str, Recipe] = {}
        self._known: dict[str, Recipe] = {}  # every wanted template's recipe (forked() revives)
        self._retry_at: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dying: set[asyncio.Task[None]] = set()  # teardowns under way (stop waits)
        self._stopped = False
        self._starting = 0  # spares whose start is under way

    @property
    def enabled(self) -> bool:
        return (self.per_template > 0 or self.fork_spares > 0) and self.max_total > 0 \
            and not self._stopped

    def spares(self) -> list[Spare]:
        return [sp for lst in self._ready.values() for sp in lst]

    # ---- what the backend says ----------------------------------------------------------
    def want(self, tpl: Template, recipe: Recipe) -> None:
        """A create restored from ``tpl``: keep spares of it (started in the background)."""
        if not self.enabled or tpl.dropped or recipe.machine.nic:
            return
        recipe.last_used = time.monotonic()
        old = self._known.get(tpl.digest)
        recipe.forked = old is not None and old.forked
        self._wanted[tpl.digest] = self._known[tpl.digest] = recipe
        self._kick()

    def set_fork_spares(self, n: int) -> None:
        """``vm_fork_spares`` changed on a running node (``rollbox bench fork`` compares n
        against 0 in one run): forked templates keep that many from now on, extra ones stop."""
        self.fork_spares = max(0, n)
        self.max_total = max(self.plain_max, self.fork_spares)
        self._kick()

    def held(self) -> int:
        """Spares ready, being started or torn down (their descriptors are the edge's:
        ``MicroVMBackend.node_fds``)."""
        return len(self.spares()) + self._starting + len(self._dying)

    def stopping(self) -> int:
        """Spares whose teardown is under way."""
        return len(self._dying)

    def forked(self, digest: str) -> None:
        """A VM restored from the template was forked: from now on it keeps
        ``vm_fork_spares`` spares (refilled in the background as the children took them)."""
        recipe = self._known.get(digest)
        if recipe is None or not self.enabled or not self.fork_spares:
            return
        recipe.forked = True
        recipe.last_used = time.monotonic()
        self._wanted[digest] = recipe
        self._kick()

    def forget(self, digest: str) -> None:
        """The template is gone: its spares are stopped (in the background)."""
        self._known.pop(digest, None)
        if self._wanted.pop(digest, None) is not None or digest in self._ready:
            self._kick()

    def claim(self, digest: str) -> Spare | None:
        """A ready spare of the template, taken out of the pool (None: there is none); one
        whose QEMU is gone is torn down instead."""
        lst = self._ready.get(digest)
        while lst:
            spare = lst.pop()
            if spare.jail.alive(spare.pid):
                if not lst:
                    del self._ready[digest]
                self._kick()  # refilled once no create is in flight, however this one ends
                return spare
            log.warning("spare QEMU %s of template %s is gone: torn down", spare.id,
                        digest[:12])
            self._destroy_soon(spare)
        self._ready.pop(digest, None)
        return None

    def claim_like(self, machine: qemu.MachineSpec, layers: tuple[str, ...],
                   most: int) -> list[Spare]:
        """Up to ``most`` ready spares whose QEMU runs ``machine`` (the argv's shape: vCPUs,
        memory, devices, no NIC) over ``layers``, taken out of the pool (a fork's children);
        dead ones met on the way are torn down."""
        taken: list[Spare] = []
        for digest in list(self._ready):
            lst = self._ready[digest]
            for spare in list(lst):
                if len(taken) >= most:
                    break
                if spare.machine != machine or spare.layers != layers:
                    continue
                lst.remove(spare)
                if spare.jail.alive(spare.pid):
                    taken.append(spare)
                else:
                    log.warning("spare QEMU %s of template %s is gone: torn down", spare.id,
                                digest[:12])
                    self._destroy_soon(spare)
            if not lst:
                del self._ready[digest]
        if taken:
            self._kick()  # refilled once no create or fork is in flight
        return taken

    def give_up(self, spare: Spare) -> asyncio.Task[None]:
        """A claimed spare that was not used (its fork failed before it): torn down."""
        return self._destroy_soon(spare)

    def facts(self) -> dict[str, int]:
        ready = self.spares()
        mib = 0
        for sp in ready:
            used = cgroups.memory_bytes(sp.jail.cgroup_parent, sp.jail.cgroup_name)
            mib += (used or 0) >> 20
        return {"ready": len(ready), "memory_mib": mib, "per_template": self.per_template,
                "fork": self.fork_spares, "max": self.max_total}

    async def stop(self) -> None:
        """Stop every spare and start no more (edge stop; a create after this restores
        without spares)."""
        self._stopped = True
        self._wanted.clear()
        self._known.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})
            self._task = None
        ready = self.spares()
        self._ready.clear()
        await asyncio.gather(*(self._destroy(sp) for sp in ready), *self._dying,
                             return_exceptions=True)

    # ---- the background work ------------------------------------------------------------
    def _kick(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a cache load in a worker thread: no spare runs then
            return
        if self._stopped:
            return
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()
            try:
                await self._reconcile()
            except Exception as exc:  # noqa: BLE001 - logged; tried again at the next wake
                log.warning("template spares: %s", exc)
            if not self._wanted and not self._ready:
                return
            try:
                async with asyncio.timeout(max(1.0, min(CHECK_S, self.idle_s))):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _targets(self) -> dict[str, int]:
        """Spares each wanted template should have (most recently used first)."""
        now = time.monotonic()
        for digest, r in list(self._wanted.items()):
            if now - r.last_used > self.idle_s:
                log.info("template %s: no restore for %.0f s, its spares stop", digest[:12],
                         self.idle_s)
                r.forked = False  # a restore later wants the per-template count again
                del self._wanted[digest]
        left = self.max_total
        plain = self.plain_max  # templates never forked stay within vm_template_spares_max
        targets = {}
        for digest, r in sorted(self._wanted.items(), key=lambda kv: -kv[1].last_used):
            if r.forked:
                targets[digest] = min(max(self.per_template, self.fork_spares), left)
            else:
                targets[digest] = min(self.per_template, left, plain)
                plain -= targets[digest]
            left -= targets[digest]
        return targets

    async def _reconcile(self) -> None:
        targets = self._targets()
        for digest, lst in list(self._ready.items()):  # fewer first, then more
            while len(lst) > targets.get(digest, 0):
                await asyncio.shield(self._destroy_soon(lst.pop(0)))
            if not lst:
                self._ready.pop(digest, None)
        for digest, want in targets.items():
            while len(self._ready.get(digest, ())) < want:
                recipe = self._wanted.get(digest)
                if recipe is None or self._stopped \
                        or time.monotonic() < self._retry_at.get(digest, 0):
                    break
                await self.backend.creates_idle()
                if self._wanted.get(digest) is not recipe or not self._room(recipe):
                    return
                spare = await self._start(digest, recipe)
                if spare is None:
                    self._retry_at[digest] = time.monotonic() + RETRY_S
                    break
                if self._wanted.get(digest) is not recipe or self._stopped:
                    await asyncio.shield(self._destroy_soon(spare))
                    return
                self._ready.setdefault(digest, []).append(spare)

    def _room(self, recipe: Recipe) -> bool:
        """Whether memory has room for one more spare's whole limit: in the sandboxes' parent
        cgroup (the edge limits it to host RAM minus the node's reserve) and in host
        MemAvailable above ``memory_reserve_mib`` when that is set."""
        b = self.backend
        need = b.limits_for(recipe.machine, recipe.cpus).memory_bytes
        parent = b.settings.cgroup_parent
        limit, used = cgroups.memory_limit(parent), cgroups.memory_usage(parent)
        if limit is not None and limit - (used or 0) < need:
            return False
        try:
            with open("/proc/meminfo", "rb") as f:
                avail = next(int(line.split()[1]) << 10 for line in f
                             if line.startswith(b"MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return False
        return avail - need >= (b.settings.memory_reserve_mib or 0) << 20

    async def _start(self, digest: str, recipe: Recipe) -> Spare | None:
        """One spare of the template (None: it did not start, logged, nothing left)."""
        b = self.backend
        spare_id = f"{SPARE_PREFIX}{digest[:12]}{secrets.token_hex(3)}"
        machine = replace(recipe.machine, incoming=True)
        slot = b.slots.acquire()
        host_uid = b.slots.host_uid(slot)
        jail = Jail(b.run_root, b.settings.cgroup_parent, spare_id)
        monitor: qmp.QMP | None = None
        pid: int | None = None
        self._starting += 1
        try:
            layer_files = await b.disks.layer_files(list(recipe.layers))
            # each step that makes something on the host to its end (a stop cancels a start
            # under way: the teardown then sees all it made)
            rw = await to_the_end(asyncio.to_thread(at_idle_priority, b.disks.clone_rw,
                                                    recipe.disk_id, spare_id, host_uid))
            binds = b.binds_for(machine, layer_files, rw, clone_ram=recipe.ram_file)
            pid = await b.spawn_qemu(jail, machine, binds, host_uid, recipe.cpus,
                                     cpu=qos.CLASSES["batch"])
            monitor = await to_the_end(qmp.QMP.connect(jail.socket_path("qmp"),
                                                       b.settings.vm_boot_timeout_s),
                                       dispose=qmp.QMP.close)
            pages = ram.read_page_map(recipe.pages, machine.memory_mib << 20) \
                if recipe.pages is not None else None
            if machine.ram != qemu.RAM_CLONE:  # a clone's RAM is the template's file
                await to_the_end(asyncio.to_thread(at_idle_priority, ram.prefault, pid,
                                                   machine.memory_mib << 20, pages))
        except BaseException as exc:
            if isinstance(exc, Exception):  # any failure: no spare, retried later
                log.warning("spare QEMU of template %s not started: %s", digest[:12], exc)
            await asyncio.shield(self._track(self._teardown(spare_id, jail, slot, pid,
                                                            monitor)))
            if not isinstance(exc, Exception):
                raise
            return None
        finally:
            self._starting -= 1
        return Spare(id=spare_id, digest=digest, slot=slot, host_uid=host_uid, jail=jail,
                     pid=pid, machine=recipe.machine, cpus=recipe.cpus, monitor=monitor,
                     layers=recipe.layers)

    async def _teardown(self, spare_id: str, jail: Jail, slot: int, pid: int | None,
                        monitor: qmp.QMP | None) -> None:
        if monitor is not None:
            monitor.close()
        try:
            await self.backend.teardown(spare_id, jail, slot, pid or jail.read_pid())
        except InfraError as exc:  # logged by the teardown; the slot stays out
            log.error("spare QEMU %s: %s", spare_id, exc)

    async def _destroy(self, spare: Spare) -> None:
        await self._teardown(spare.id, spare.jail, spare.slot, spare.pid, spare.monitor)

    def _destroy_soon(self, spare: Spare) -> asyncio.Task[None]:
        return self._track(self._destroy(spare))

    def _track(self, teardown: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A teardown as a task of its own (a cancelled caller does not cut it short; stop
        waits for it)."""
        task = asyncio.ensure_future(teardown)
        self._dying.add(task)
        task.add_done_callback(self._dying.discard)
        return task
